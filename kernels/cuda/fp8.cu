// FP8 operands as the CPU makes them (kernels/src/cpu/fp8.rs): out[i] is the
// value of the E4M3 or E5M2 code nearest x[i] * scale (ties to the even
// mantissa, saturating at the format's largest value, NaN kept), unscaled,
// in the element type T. The rounding is done in double, where every step
// below is exact, as the CPU's encoder does it; the result is the same
// value bit for bit.

// The FP8 value nearest v: `mbits` mantissa bits, exponent bias `bias`,
// largest finite value `max_value`.
__device__ __forceinline__ float fp8_nearest(float v, int mbits, int bias, double max_value) {
    if (isnan(v)) return v;
    const double a = fabs((double)v);
    double r;
    if (a >= max_value) {
        r = max_value;
    } else if (a < ldexp(1.0, 1 - bias)) {
        // Subnormals: multiples of 2^(1 - bias - mbits).
        const double step = ldexp(1.0, 1 - bias - mbits);
        r = rint(a / step) * step;
    } else {
        const int e = ilogb(a);
        const double m = rint((a / ldexp(1.0, e) - 1.0) * ldexp(1.0, mbits));
        r = fmin((1.0 + ldexp(m, -mbits)) * ldexp(1.0, e), max_value);
    }
    return copysignf((float)r, v);
}

#define FP8(T, S)                                                                                   \
    extern "C" __global__ void fp8_values_e4m3_##S(const T* x, float scale, T* out, u64 n) {        \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                       \
            out[i] = from_f32<T>(fp8_nearest(to_f32(x[i]) * scale, 3, 7, 448.0));                   \
    }                                                                                               \
    extern "C" __global__ void fp8_values_e5m2_##S(const T* x, float scale, T* out, u64 n) {        \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                       \
            out[i] = from_f32<T>(fp8_nearest(to_f32(x[i]) * scale, 2, 15, 57344.0));                \
    }

FOR_FLOAT_TYPES(FP8)
