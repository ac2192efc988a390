// Checks the logic of the element-wise kernels (elementwise.cu: GELU, SiLU,
// SwiGLU and their backwards, the bias add, axpy) and of the strided copy
// (convert.cu) on the CPU against double-precision references, under the
// host emulation of shim.h; see scripts/cuda-host-check.sh. f32 only (the
// dtype conversions are the emulation's own, so they are not checked here).
#include "rows.h"
#include "elementwise.inc"
#include "convert.inc"

static double gelu_ref(double x) { return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x))); }
static double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }
// The derivative of f at x, by central differences in double.
template <typename F> static double derivative(F f, double x) { const double h = 1e-6; return (f(x + h) - f(x - h)) / (2 * h); }

int main() {
    const u64 n = 1000;
    auto x = values(n, 1), y = values(n, 2), dy = values(n, 3);
    std::vector<float> out(n), out2(n);
    std::vector<double> want(n), want2(n);
    auto run = [&](auto body) { emu_launch(2, 128, 0, body); };

    run([&] { gelu_f32(x.data(), out.data(), n); });
    for (u64 i = 0; i < n; i++) want[i] = gelu_ref(x[i]);
    check("gelu", out, want, 1e-6);
    run([&] { gelu_backward_f32(x.data(), dy.data(), out.data(), n); });
    for (u64 i = 0; i < n; i++) want[i] = dy[i] * derivative(gelu_ref, x[i]);
    check("gelu_backward", out, want, 1e-5);
    auto silu_ref = [](double v) { return v * sigmoid_ref(v); };
    run([&] { silu_f32(x.data(), out.data(), n); });
    for (u64 i = 0; i < n; i++) want[i] = silu_ref(x[i]);
    check("silu", out, want, 1e-6);
    run([&] { silu_backward_f32(x.data(), dy.data(), out.data(), n); });
    for (u64 i = 0; i < n; i++) want[i] = dy[i] * derivative(silu_ref, x[i]);
    check("silu_backward", out, want, 1e-5);
    run([&] { swiglu_f32(x.data(), y.data(), out.data(), n); });
    for (u64 i = 0; i < n; i++) want[i] = silu_ref(x[i]) * y[i];
    check("swiglu", out, want, 1e-6);
    run([&] { swiglu_backward_f32(x.data(), y.data(), dy.data(), out.data(), out2.data(), n); });
    for (u64 i = 0; i < n; i++) { want[i] = dy[i] * y[i] * derivative(silu_ref, x[i]); want2[i] = dy[i] * silu_ref(x[i]); }
    check("swiglu_backward gate", out, want, 1e-5);
    check("swiglu_backward up", out2, want2, 1e-6);

    // The bias of a [n / cols, cols] matrix, and axpy in place.
    const u64 cols = 40;
    auto bias = values(cols, 4);
    run([&] { add_bias_f32(x.data(), bias.data(), out.data(), n, cols); });
    for (u64 i = 0; i < n; i++) want[i] = (double)x[i] + bias[i % cols];
    check("add_bias", out, want, 1e-7);
    out = y;
    run([&] { axpy_f32(x.data(), -0.5f, out.data(), n); });
    for (u64 i = 0; i < n; i++) want[i] = y[i] - 0.5 * x[i];
    check("axpy", out, want, 1e-7);

    // The strided copy of a view: a [4, 5, 6] buffer at offset 7, read as
    // its permutation [6, 4, 5] (dims (2, 0, 1)) and narrowed to [6, 3, 5]
    // from index 1 of the middle dim.
    {
        std::vector<unsigned> src(7 + 4 * 5 * 6);
        for (size_t i = 0; i < src.size(); i++) src[i] = (unsigned)(i * 2654435761u);
        const u64 shape[6] = {6, 3, 5, 1, 30, 6};
        const u64 offset = 7 + 1 * 30;
        std::vector<unsigned> dst(6 * 3 * 5);
        emu_launch(1, 64, 0, [&] { strided_copy_b32(src.data(), dst.data(), dst.size(), shape, 3, offset); });
        std::vector<float> got(dst.size());
        std::vector<double> expected(dst.size());
        size_t i = 0;
        for (u64 a = 0; a < 6; a++)
            for (u64 b = 0; b < 3; b++)
                for (u64 c = 0; c < 5; c++, i++) {
                    got[i] = (float)(dst[i] == src[offset + a + b * 30 + c * 6]);
                    expected[i] = 1.0;
                }
        check("strided_copy of a permuted, narrowed view", got, expected, 0);
    }
    if (failures) { printf("%d failures\n", failures); return 1; }
    printf("all element-wise and copy checks passed\n");
}
