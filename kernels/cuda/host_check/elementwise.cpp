// Checks the logic of the element-wise kernels (elementwise.cu: GELU, SiLU,
// SwiGLU and their backwards, the bias add, axpy) and of the strided copy
// (convert.cu) on the CPU against double-precision references, under the
// host emulation of shim.h; see scripts/cuda-host-check.sh. f32 only (the
// 16-bit float conversions are the emulation's own, so they are not checked
// here; the integer ones are).
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
    // The integer conversions (convert.cu): Rust's saturating `as`, NaN to 0,
    // and the clamps between i32 and u32; each expected value is what Rust
    // gives for the input.
    {
        const double f64s[] = {NAN, INFINITY, -INFINITY, 3e9, -3e9, 2147483647.9, -2147483648.5, 4294967295.9, -0.9, 7.9};
        const int want_i32[] = {0, 2147483647, -2147483647 - 1, 2147483647, -2147483647 - 1, 2147483647, -2147483647 - 1, 2147483647, 0, 7};
        const unsigned want_u32[] = {0, 4294967295u, 0, 3000000000u, 0, 2147483647u, 0, 4294967295u, 0, 7};
        const u64 m = sizeof(f64s) / sizeof(f64s[0]);
        int got_i32[m];
        unsigned got_u32[m];
        emu_launch(1, 32, 0, [&] { cast_f64_to_i32(f64s, got_i32, m); });
        emu_launch(1, 32, 0, [&] { cast_f64_to_u32(f64s, got_u32, m); });
        for (u64 i = 0; i < m; i++) {
            if (got_i32[i] != want_i32[i]) { printf("FAIL cast_f64_to_i32(%g) = %d, want %d\n", f64s[i], got_i32[i], want_i32[i]); failures++; }
            if (got_u32[i] != want_u32[i]) { printf("FAIL cast_f64_to_u32(%g) = %u, want %u\n", f64s[i], got_u32[i], want_u32[i]); failures++; }
        }
        // Through f32: 2147483647.9 rounds to 2^31 in f32, which saturates.
        const float f32s[] = {NAN, 3e9f, -1.5f, 16777217.0f, 2147483520.0f};
        const int want_f32_i32[] = {0, 2147483647, -1, 16777216, 2147483520};
        const unsigned want_f32_u32[] = {0, 3000000000u, 0, 16777216u, 2147483520u};
        int gi[5];
        unsigned gu[5];
        emu_launch(1, 32, 0, [&] { cast_f32_to_i32(f32s, gi, 5); });
        emu_launch(1, 32, 0, [&] { cast_f32_to_u32(f32s, gu, 5); });
        for (int i = 0; i < 5; i++) {
            if (gi[i] != want_f32_i32[i] || gu[i] != want_f32_u32[i]) { printf("FAIL cast_f32_to_i32/u32(%g) = %d / %u\n", f32s[i], gi[i], gu[i]); failures++; }
        }
        const int ints[] = {-5, 0, 2147483647};
        const unsigned uints[] = {0, 7, 4294967295u};
        unsigned iu[3];
        int ui[3];
        emu_launch(1, 32, 0, [&] { cast_i32_to_u32(ints, iu, 3); });
        emu_launch(1, 32, 0, [&] { cast_u32_to_i32(uints, ui, 3); });
        if (iu[0] != 0 || iu[1] != 0 || iu[2] != 2147483647u || ui[0] != 0 || ui[1] != 7 || ui[2] != 2147483647) {
            printf("FAIL the i32 <-> u32 clamps\n");
            failures++;
        }
        // An integer to f64 goes through f32, as the CPU's does: 2^24 + 1 is
        // not an f32.
        const int big[] = {16777217};
        double wide[1];
        emu_launch(1, 32, 0, [&] { cast_i32_to_f64(big, wide, 1); });
        if (wide[0] != 16777216.0) { printf("FAIL cast_i32_to_f64(16777217) = %.1f\n", wide[0]); failures++; }
        printf("ok   the integer conversions\n");
    }
    if (failures) { printf("%d failures\n", failures); return 1; }
    printf("all element-wise and copy checks passed\n");
}
