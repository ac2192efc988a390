// Moving elements: dtype conversion of a contiguous buffer, and the gather
// that makes a strided view contiguous.

// out[i] = x[i] converted from S to T (through f32, rounding to nearest even).
template <typename S, typename T>
__device__ __forceinline__ void cast(const S* x, T* out, u64 n) {
    for (u64 i = grid_start(); i < n; i += grid_stride()) out[i] = from_f32<T>(to_f32(x[i]));
}

#define CAST_FROM_F32(T, S) \
    extern "C" __global__ void cast_f32_to_##S(const float* x, T* out, u64 n) { cast(x, out, n); }
#define CAST_FROM_BF16(T, S) \
    extern "C" __global__ void cast_bf16_to_##S(const bf16* x, T* out, u64 n) { cast(x, out, n); }
#define CAST_FROM_F16(T, S) \
    extern "C" __global__ void cast_f16_to_##S(const f16* x, T* out, u64 n) { cast(x, out, n); }

FOR_FLOAT_TYPES(CAST_FROM_F32)
FOR_FLOAT_TYPES(CAST_FROM_BF16)
FOR_FLOAT_TYPES(CAST_FROM_F16)

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
