// Per-row top-k (mixture-of-experts routing, vocabulary sampling) and its
// gradient, as kernels/src/cpu/topk.rs: larger values first, equal values by
// the lower index, NaN below every number (-inf included), NaNs among
// themselves by index. Values keep the input's dtype (the selected elements,
// copied bit for bit); indices are u32 column numbers.

// No entry: ranks below every entry of a row (rows have at most u32::MAX
// elements, so no column has this index).
#define TOPK_NONE 0xffffffffu

__device__ __forceinline__ bool topk_is_nan(float v) {
    return (__float_as_uint(v) & 0x7fffffffu) > 0x7f800000u;
}

// Whether entry (a, i) ranks above entry (b, j) in the order above. Every
// entry of a row has its own rank (the index breaks every tie, +0 and -0
// included), so the best of any set is unique.
__device__ __forceinline__ bool topk_above(float a, unsigned int i, float b, unsigned int j) {
    if (i == TOPK_NONE) return false;
    if (j == TOPK_NONE) return true;
    const bool a_nan = topk_is_nan(a), b_nan = topk_is_nan(b);
    if (a_nan != b_nan) return b_nan;  // a number beats a NaN
    if (!a_nan && a != b) return a > b;
    return i < j;  // equal values, or two NaNs
}

// The best of the block's entries (v, i), valid in every thread: a warp
// butterfly, one partial per warp in `scratch_v`/`scratch_i`, and a second
// butterfly over the partials. Blocks have at most 1024 threads (32 warps).
__device__ __forceinline__ void topk_block_best(float& v, unsigned int& i, float* scratch_v, unsigned int* scratch_i) {
    for (int offset = 16; offset > 0; offset /= 2) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
        const unsigned int oi = __shfl_xor_sync(0xffffffffu, i, offset);
        if (topk_above(ov, oi, v, i)) v = ov, i = oi;
    }
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int warps = (blockDim.x + 31) / 32;
    __syncthreads();  // the partials may still be read by a previous call
    if (lane == 0) scratch_v[warp] = v, scratch_i[warp] = i;
    __syncthreads();
    v = lane < warps ? scratch_v[lane] : 0.0f;
    i = lane < warps ? scratch_i[lane] : TOPK_NONE;
    for (int offset = 16; offset > 0; offset /= 2) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
        const unsigned int oi = __shfl_xor_sync(0xffffffffu, i, offset);
        if (topk_above(ov, oi, v, i)) v = ov, i = oi;
    }
}

// values[r, :] and indices[r, :] (row-major [rows, k]) = the k best entries
// of x[r, :] (row-major [rows, row]), best first; requires 1 <= k <= row.
//
// Since every entry has its own rank, the top k are found in k rounds: round
// t picks the best entry ranked below the pick of round t - 1. One block per
// row (grid-stride over rows): in each round every thread keeps the best of
// its strided part of the row, then the block reduces those. Cost per row:
// k passes over the row (k * row / blockDim loads per thread, from L1/L2
// after the first) and k block reductions; no sort, no per-thread buffer,
// 256 bytes of shared memory. Meant for small k: MoE routing (k <= 8 of a
// few hundred experts: one or two elements per thread and round) and
// sampling (k up to ~64 of a 50k vocabulary: 64 passes of ~50 loads each).
#define TOPK(T, S)                                                                                  \
    extern "C" __global__ void topk_##S(const T* x, T* values, unsigned int* indices, u64 rows,     \
                                        u64 row, u64 k) {                                           \
        __shared__ float scratch_v[32];                                                             \
        __shared__ unsigned int scratch_i[32];                                                      \
        for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {                                        \
            const T* xr = x + r * row;                                                              \
            float last_v = 0.0f;                                                                    \
            unsigned int last_i = TOPK_NONE; /* the previous round's pick; none yet */              \
            for (u64 t = 0; t < k; t++) {                                                           \
                float v = 0.0f;                                                                     \
                unsigned int i = TOPK_NONE;                                                         \
                for (u64 j = threadIdx.x; j < row; j += blockDim.x) {                               \
                    const float c = to_f32(xr[j]);                                                  \
                    const bool left = last_i == TOPK_NONE || topk_above(last_v, last_i, c, (unsigned int)j); \
                    if (left && topk_above(c, (unsigned int)j, v, i)) v = c, i = (unsigned int)j;   \
                }                                                                                   \
                topk_block_best(v, i, scratch_v, scratch_i);                                        \
                if (threadIdx.x == 0) {                                                             \
                    values[r * k + t] = xr[i];                                                      \
                    indices[r * k + t] = i;                                                         \
                }                                                                                   \
                last_v = v, last_i = i;                                                             \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
    /* dx (row-major [rows, row], zeroed by the launcher) gets dvalues[r, j] */                     \
    /* added at column indices[r, j] (both row-major [rows, k]). One thread */                      \
    /* per (r, j): an index repeated within a row (topk never repeats one, */                       \
    /* but the op accepts it) is summed by the thread of its first */                               \
    /* occurrence, in order of j, in f32 from zero like the CPU, so the */                          \
    /* result is deterministic with no atomics. O(k) per item. Indices */                           \
    /* are checked on the host; one out of range is skipped, never written. */                      \
    extern "C" __global__ void topk_backward_##S(const unsigned int* indices, const T* dvalues,     \
                                                 T* dx, u64 rows, u64 row, u64 k) {                 \
        for (u64 n = grid_start(); n < rows * k; n += grid_stride()) {                              \
            const u64 r = n / k, j = n % k;                                                         \
            const unsigned int* ir = indices + r * k;                                               \
            const unsigned int col = ir[j];                                                         \
            bool first = col < row;                                                                 \
            for (u64 p = 0; p < j && first; p++) first = ir[p] != col;                              \
            if (!first) continue;                                                                   \
            float acc = 0.0f;                                                                       \
            for (u64 p = j; p < k; p++)                                                             \
                if (ir[p] == col) acc += to_f32(dvalues[r * k + p]);                                \
            dx[r * row + col] = from_f32<T>(acc);                                                   \
        }                                                                                           \
    }

FOR_FLOAT_TYPES(TOPK)
