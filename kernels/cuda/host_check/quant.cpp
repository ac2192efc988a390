// Checks the logic of the quantized-product kernels (quant.cu: int8, int4,
// W8A8 and its row quantization) on the CPU against double-precision
// references, under the host emulation of shim.h; see
// scripts/cuda-host-check.sh. f32 activations only (the dtype conversions
// are the emulation's own). The weights are quantized here in the layout of
// kernels/src/cpu/quant/ (int4: byte b of a group holds weights b and
// b + group / 2, each as q + 8).
#include "rows.h"

// dp4a as the emulation sees it: the four signed bytes of a and b, multiplied and summed, plus c.
inline int dot4_i8(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(signed char)(a >> (8 * i)) * (int)(signed char)(b >> (8 * i));
    return c;
}

#include "quant.inc"

static float code(float v, float s, float limit) { return s > 0.0f ? std::fmin(std::fmax(std::round(v / s), -limit), limit) : 0.0f; }
static float max_abs(const float* v, u64 n) { float m = 0.0f; for (u64 i = 0; i < n; i++) m = std::max(m, std::fabs(v[i])); return m; }

int main() {
    const unsigned grid = 3, block = 64;  // 6 warps: fewer than the channels, so the grid-stride loop runs
    // int8 (m, n, k): the 4-byte loop, the byte loop (k % 4 != 0), more rows than QROWS.
    for (auto [m, n, k] : {std::tuple<u64, u64, u64>{1, 37, 64}, {3, 20, 70}, {10, 9, 132}}) {
        auto w = values(n * k, (unsigned)(n + k)), x = values(m * k, (unsigned)(m + 7 * k)), b = values(n, 5u);
        std::vector<signed char> q(n * k);
        std::vector<float> s(n), y(m * n);
        for (u64 j = 0; j < n; j++) {
            s[j] = max_abs(&w[j * k], k) / 127.0f;
            for (u64 c = 0; c < k; c++) q[j * k + c] = (signed char)code(w[j * k + c], s[j], 127.0f);
        }
        std::vector<double> want(m * n), want_wo(m * n);
        for (u64 r = 0; r < m; r++)
            for (u64 j = 0; j < n; j++) {
                double acc = 0;
                for (u64 c = 0; c < k; c++) acc += (double)x[r * k + c] * q[j * k + c] * s[j];
                want[r * n + j] = acc + b[j];
                want_wo[r * n + j] = acc;
            }
        char what[64];
        emu_launch(grid, block, 0, [&] { quant_matmul_int8_f32(x.data(), q.data(), s.data(), b.data(), y.data(), m, n, k); });
        snprintf(what, 64, "quant_matmul_int8 m %llu n %llu k %llu", m, n, k); check(what, y, want, 1e-5);
        emu_launch(grid, block, 0, [&] { quant_matmul_int8_f32(x.data(), q.data(), s.data(), nullptr, y.data(), m, n, k); });
        snprintf(what, 64, "quant_matmul_int8 no bias k %llu", k); check(what, y, want_wo, 1e-5);

        // W8A8 on the same weight: the row codes exactly as the CPU makes them, then the product.
        std::vector<signed char> xq(m * k), xq_want(m * k);
        std::vector<float> sx(m);
        emu_launch(2, row_threads(k), 0, [&] { quantize_rows_f32(x.data(), xq.data(), sx.data(), m, k); });
        std::vector<double> w8(m * n);
        int wrong = 0;
        for (u64 r = 0; r < m; r++) {
            const float sr = max_abs(&x[r * k], k) / 127.0f;
            wrong += sr != sx[r];
            for (u64 c = 0; c < k; c++) wrong += (signed char)code(x[r * k + c], sr, 127.0f) != xq[r * k + c];
            for (u64 j = 0; j < n; j++) {
                long long acc = 0;
                for (u64 c = 0; c < k; c++) acc += (long long)xq[r * k + c] * q[j * k + c];
                w8[r * n + j] = (double)acc * sr * s[j] + b[j];
            }
        }
        snprintf(what, 64, "quantize_rows k %llu", k);
        if (wrong) { printf("FAIL %s: %d codes or scales differ from the CPU's\n", what, wrong); failures++; } else printf("ok   %s\n", what);
        emu_launch(grid, block, 0, [&] { quant_matmul_w8a8_f32(xq.data(), sx.data(), q.data(), s.data(), b.data(), y.data(), m, n, k); });
        snprintf(what, 64, "quant_matmul_w8a8 m %llu n %llu k %llu", m, n, k); check(what, y, w8, 1e-6);
    }

    // int4 (m, n, k, group): the 4-byte loop (groups of a multiple of 8),
    // the byte loop (group 12), more rows than QROWS.
    for (auto [m, n, k, group] : {std::tuple<u64, u64, u64, u64>{1, 11, 256, 128}, {3, 7, 48, 12}, {9, 5, 64, 32}, {2, 13, 96, 8}}) {
        auto w = values(n * k, (unsigned)(3 * n + k)), x = values(m * k, (unsigned)(m + 11 * k)), b = values(n, 9u);
        const u64 half = group / 2, groups = k / group;
        std::vector<unsigned char> packed(n * k / 2);
        std::vector<float> s(n * groups), y(m * n);
        std::vector<double> deq(n * k);
        for (u64 j = 0; j < n; j++)
            for (u64 g = 0; g < groups; g++) {
                const float* wg = &w[j * k + g * group];
                const float sc = s[j * groups + g] = max_abs(wg, group) / 7.0f;
                for (u64 i = 0; i < half; i++) {
                    const int lo = (int)code(wg[i], sc, 7.0f), hi = (int)code(wg[half + i], sc, 7.0f);
                    packed[j * k / 2 + g * half + i] = (unsigned char)((lo + 8) | ((hi + 8) << 4));
                    deq[j * k + g * group + i] = (double)lo * sc;
                    deq[j * k + g * group + half + i] = (double)hi * sc;
                }
            }
        std::vector<double> want(m * n);
        for (u64 r = 0; r < m; r++)
            for (u64 j = 0; j < n; j++) {
                double acc = b[j];
                for (u64 c = 0; c < k; c++) acc += (double)x[r * k + c] * deq[j * k + c];
                want[r * n + j] = acc;
            }
        char what[80];
        emu_launch(grid, block, 0, [&] { quant_matmul_int4_f32(x.data(), packed.data(), s.data(), b.data(), y.data(), m, n, k, group); });
        snprintf(what, 80, "quant_matmul_int4 m %llu n %llu k %llu group %llu", m, n, k, group); check(what, y, want, 1e-5);
    }

    // A NaN in a row of x: its scale is NaN and its codes zero, as on the CPU.
    {
        const u64 m = 2, k = 40;
        auto x = values(m * k, 3u);
        x[5] = NAN;
        std::vector<signed char> xq(m * k);
        std::vector<float> sx(m);
        emu_launch(1, row_threads(k), 0, [&] { quantize_rows_f32(x.data(), xq.data(), sx.data(), m, k); });
        bool ok = std::isnan(sx[0]) && !std::isnan(sx[1]);
        for (u64 c = 0; c < k; c++) ok = ok && xq[c] == 0;
        if (!ok) { printf("FAIL quantize_rows with a NaN\n"); failures++; } else printf("ok   quantize_rows with a NaN\n");
    }
    if (failures) { printf("%d failures\n", failures); return 1; }
    printf("all quant checks passed\n");
}
