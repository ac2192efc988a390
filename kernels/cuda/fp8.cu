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

// The code bits of an FP8 value: `v` must be a value of the format (as
// fp8_values writes them, scale applied), so every step is exact. NaN is the
// format's NaN (0x7f, with v's sign); zero keeps its sign. cuBLASLt's FP8
// products read these bytes.
__device__ __forceinline__ unsigned char fp8_code(float v, int mbits, int bias) {
    const unsigned int sign = signbit(v) ? 0x80u : 0u;
    if (isnan(v)) return (unsigned char)(sign | 0x7fu);
    const double a = fabs((double)v);
    if (a == 0.0) return (unsigned char)sign;
    unsigned int bits;
    if (a < ldexp(1.0, 1 - bias)) {
        // Subnormal: a multiple of 2^(1 - bias - mbits), exponent field 0.
        bits = (unsigned int)(a / ldexp(1.0, 1 - bias - mbits));
    } else {
        const int e = ilogb(a);
        const unsigned int m = (unsigned int)((a / ldexp(1.0, e) - 1.0) * ldexp(1.0, mbits));
        bits = ((unsigned int)(e + bias) << mbits) | m;
    }
    return (unsigned char)(sign | bits);
}

#define FP8_CODES(T, S)                                                                              \
    extern "C" __global__ void fp8_codes_e4m3_##S(const T* x, unsigned char* out, u64 n) {           \
        for (u64 i = grid_start(); i < n; i += grid_stride()) out[i] = fp8_code(to_f32(x[i]), 3, 7); \
    }                                                                                                \
    extern "C" __global__ void fp8_codes_e5m2_##S(const T* x, unsigned char* out, u64 n) {           \
        for (u64 i = grid_start(); i < n; i += grid_stride()) out[i] = fp8_code(to_f32(x[i]), 2, 15); \
    }

FOR_FLOAT_TYPES(FP8_CODES)
