// Moving elements: dtype conversion of a contiguous buffer, and the gather
// that makes a strided view contiguous.

// Conversions between any two of f32, f64, bf16, f16, i32 and u32, with the
// CPU backend's rules (runtime/core/src/backend/cpu/convert.rs) bit for bit:
// every conversion goes through f32 (rounding to nearest even at each step),
// except f64 to an integer, which truncates the f64 itself, and i32 <-> u32,
// which clamp. Float to integer truncates toward zero and saturates, NaN
// giving 0, as Rust's `as` does.
__device__ __forceinline__ float to_f32(double x) { return (float)x; }
__device__ __forceinline__ float to_f32(int x) { return (float)x; }
__device__ __forceinline__ float to_f32(unsigned int x) { return (float)x; }

template <> __device__ __forceinline__ double from_f32<double>(float x) { return (double)x; }

// Rust's saturating `as` from a float to i32 / u32 (the bounds are exact in
// both f32 and f64: 2^31 and 2^32).
template <typename F> __device__ __forceinline__ int saturating_i32(F x) {
    if (x != x) return 0;
    if (x >= (F)2147483648.0) return 2147483647;
    if (x <= (F)-2147483648.0) return (-2147483647 - 1);
    return (int)x;
}
template <typename F> __device__ __forceinline__ unsigned int saturating_u32(F x) {
    if (x != x || x <= (F)0) return 0u;
    if (x >= (F)4294967296.0) return 4294967295u;
    return (unsigned int)x;
}
template <> __device__ __forceinline__ int from_f32<int>(float x) { return saturating_i32(x); }
template <> __device__ __forceinline__ unsigned int from_f32<unsigned int>(float x) { return saturating_u32(x); }

// One element: through f32, but for the direct pairs below.
template <typename S, typename T> struct Convert {
    static __device__ __forceinline__ T one(S x) { return from_f32<T>(to_f32(x)); }
};
template <> struct Convert<double, int> {
    static __device__ __forceinline__ int one(double x) { return saturating_i32(x); }
};
template <> struct Convert<double, unsigned int> {
    static __device__ __forceinline__ unsigned int one(double x) { return saturating_u32(x); }
};
template <> struct Convert<int, unsigned int> {
    static __device__ __forceinline__ unsigned int one(int x) { return x < 0 ? 0u : (unsigned int)x; }
};
template <> struct Convert<unsigned int, int> {
    static __device__ __forceinline__ int one(unsigned int x) { return x > 2147483647u ? 2147483647 : (int)x; }
};

// out[i] = x[i] converted from S to T.
template <typename S, typename T>
__device__ __forceinline__ void cast(const S* x, T* out, u64 n) {
    for (u64 i = grid_start(); i < n; i += grid_stride()) out[i] = Convert<S, T>::one(x[i]);
}

// cast_{from}_to_{to} for every ordered pair of dtypes (a copy to the same
// dtype is the strided copy below, so those are never launched).
#define CASTS_TO(T, S)                                                                                          \
    extern "C" __global__ void cast_f32_to_##S(const float* x, T* out, u64 n) { cast(x, out, n); }            \
    extern "C" __global__ void cast_f64_to_##S(const double* x, T* out, u64 n) { cast(x, out, n); }           \
    extern "C" __global__ void cast_bf16_to_##S(const bf16* x, T* out, u64 n) { cast(x, out, n); }            \
    extern "C" __global__ void cast_f16_to_##S(const f16* x, T* out, u64 n) { cast(x, out, n); }              \
    extern "C" __global__ void cast_i32_to_##S(const int* x, T* out, u64 n) { cast(x, out, n); }              \
    extern "C" __global__ void cast_u32_to_##S(const unsigned int* x, T* out, u64 n) { cast(x, out, n); }

CASTS_TO(float, f32)
CASTS_TO(double, f64)
CASTS_TO(bf16, bf16)
CASTS_TO(f16, f16)
CASTS_TO(int, i32)
CASTS_TO(unsigned int, u32)

// dst[i] = src[offset + sum_d index_d(i) * strides[d]], i in row-major order
// of `dims`. `shape` holds dims[0..rank] then strides[0..rank], in elements.
// A copy only moves bits, so the kernels are named by element width (b16,
// b32, b64) and serve every dtype of that width.
#define STRIDED_COPY(T, W)                                                                     \
    extern "C" __global__ void strided_copy_##W(const T* src, T* dst, u64 n, const u64* shape, \
                                                unsigned int rank, u64 offset) {               \
        for (u64 i = grid_start(); i < n; i += grid_stride()) {                                \
            u64 rest = i, at = offset;                                                         \
            for (int d = (int)rank - 1; d >= 0; d--) {                                         \
                const u64 dim = shape[d];                                                      \
                at += (rest % dim) * shape[rank + d];                                          \
                rest /= dim;                                                                   \
            }                                                                                  \
            dst[i] = src[at];                                                                  \
        }                                                                                      \
    }

STRIDED_COPY(unsigned short, b16)
STRIDED_COPY(unsigned int, b32)
STRIDED_COPY(u64, b64)
