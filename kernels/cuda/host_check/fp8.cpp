// Checks the FP8 kernels (fp8.cu) on the CPU under the host emulation of
// shim.h; see scripts/cuda-host-check.sh. The reference is independent of
// the kernel's arithmetic: every code's value from its bit fields (the OCP
// definitions of E4M3 and E5M2), and for each input the nearest finite one
// by brute force, ties to the even code, saturating at the largest; the
// kernel must give it bit for bit, for f32, on every neighbour pair's
// midpoint and the floats beside it, and on NaN, infinities and zeros.
#include "rows.h"
// The CUDA math functions fp8.cu calls, as the host library has them.
using std::copysignf; using std::fabs; using std::fmin; using std::ilogb; using std::isnan; using std::ldexp; using std::rint; using std::signbit;
#include "fp8.inc"

// The value of `code` in a format of `mbits` mantissa bits (E4M3: no
// infinity, S.1111.111 NaN; E5M2: IEEE-like).
static double decode(unsigned code, int mbits) {
    const int ebits = 7 - mbits, bias = (1 << (ebits - 1)) - 1, emax = (1 << ebits) - 1;
    const int e = (code & 0x7F) >> mbits, m = code & ((1 << mbits) - 1);
    const double sign = code & 0x80 ? -1.0 : 1.0;
    if (mbits == 3 && e == emax && m == 7) return NAN;
    if (mbits == 2 && e == emax) return m == 0 ? sign * INFINITY : NAN;
    const double mag = e == 0 ? std::ldexp((double)m, 1 - bias - mbits) : std::ldexp(1.0 + std::ldexp((double)m, -mbits), e - bias);
    return sign * mag;
}

// The nearest finite code's value to x: ties to the even code, beyond the largest the largest.
static float nearest(float x, int mbits) {
    if (std::isnan(x)) return x;
    double best = 0.0, best_d = INFINITY, largest = 0.0;
    unsigned best_code = 0;
    for (unsigned c = 0; c < 0x80; c++) {
        const double v = decode(c, mbits);
        if (!std::isfinite(v)) continue;
        largest = std::max(largest, v);
        const double d = std::fabs(v - std::min((double)std::fabs(x), 1e300));
        if (d < best_d || (d == best_d && c % 2 == 0 && best_code % 2 == 1)) { best = v; best_d = d; best_code = c; }
    }
    if (std::fabs(x) > largest) best = largest;
    return (float)std::copysign(best, (double)x);
}

int main() {
    for (int mbits : {3, 2}) {
        std::vector<double> codes;
        for (unsigned c = 0; c < 0x80; c++) if (std::isfinite(decode(c, mbits))) codes.push_back(decode(c, mbits));
        std::sort(codes.begin(), codes.end());
        std::vector<float> x = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-30f, 3.4e38f, (float)codes.back() * 1.01f};
        for (size_t i = 0; i + 1 < codes.size(); i++) {
            const float a = (float)codes[i], b = (float)codes[i + 1], mid = (a + b) / 2;
            for (float v : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY), a + (b - a) * 0.3f}) { x.push_back(v); x.push_back(-v); }
        }
        const u64 n = x.size();
        std::vector<float> out(n);
        emu_launch(2, 64, 0, [&] {
            if (mbits == 3) fp8_values_e4m3_f32(x.data(), 1.0f, out.data(), n);
            else fp8_values_e5m2_f32(x.data(), 1.0f, out.data(), n);
        });
        int wrong = 0;
        for (u64 i = 0; i < n; i++) {
            const float want = nearest(x[i], mbits);
            const bool same = std::isnan(want) ? std::isnan(out[i]) : __float_as_uint(out[i]) == __float_as_uint(want);
            if (!same && wrong++ < 5) fprintf(stderr, "fp8 (%d mantissa bits): %g -> %g, want %g\n", mbits, x[i], out[i], want);
        }
        // The scale multiplies before rounding: x * 4 at scale 1 is x at scale 4.
        std::vector<float> scaled(n), quad(n), out4(n);
        for (u64 i = 0; i < n; i++) quad[i] = x[i] * 4.0f;
        emu_launch(2, 64, 0, [&] {
            if (mbits == 3) { fp8_values_e4m3_f32(x.data(), 4.0f, out4.data(), n); fp8_values_e4m3_f32(quad.data(), 1.0f, scaled.data(), n); }
            else { fp8_values_e5m2_f32(x.data(), 4.0f, out4.data(), n); fp8_values_e5m2_f32(quad.data(), 1.0f, scaled.data(), n); }
        });
        for (u64 i = 0; i < n; i++)
            if (!(std::isnan(out4[i]) && std::isnan(scaled[i])) && __float_as_uint(out4[i]) != __float_as_uint(scaled[i]) && wrong++ < 5)
                fprintf(stderr, "fp8 (%d mantissa bits) scale 4: %g -> %g, want %g\n", mbits, x[i], out4[i], scaled[i]);
        // Every code's value encodes back to that code (the bytes cuBLASLt
        // reads): the finite ones and their negatives, zeros with their sign,
        // and NaN as the format's NaN.
        {
            std::vector<float> values;
            std::vector<unsigned> want;
            for (unsigned c = 0; c < 0x100; c++) {
                const double v = decode(c, mbits);
                if (std::isfinite(v)) { values.push_back((float)v); want.push_back(c); }
            }
            values.push_back(NAN);
            want.push_back(0x7f);
            std::vector<unsigned char> codes(values.size());
            emu_launch(2, 64, 0, [&] {
                if (mbits == 3) fp8_codes_e4m3_f32(values.data(), codes.data(), values.size());
                else fp8_codes_e5m2_f32(values.data(), codes.data(), values.size());
            });
            for (size_t i = 0; i < values.size(); i++)
                if (codes[i] != want[i] && wrong++ < 5) fprintf(stderr, "fp8 (%d mantissa bits) code of %g: %#x, want %#x\n", mbits, values[i], codes[i], want[i]);
        }
        printf("fp8 (%d mantissa bits): %llu values, %d wrong\n", mbits, n, wrong);
        if (wrong) failures++;
    }
    return failures ? 1 : 0;
}
