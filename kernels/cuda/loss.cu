// Softmax, log-softmax and cross-entropy over the last dimension of a
// row-major [rows, cols] input: one block per row (grid-stride over rows),
// all arithmetic in f32, as the CPU kernels of kernels/src/cpu/softmax.rs and
// cross_entropy.rs. blockDim.x is a multiple of 32, at most 1024.
//
// A row's log-sum-exp takes two passes: the maximum, then the sum of
// exp(x - max); a row of -inf has log-sum-exp -inf, as on the CPU.

#define NEG_INF __uint_as_float(0xff800000u)

// The maximum of `v` over the block, valid in every thread.
__device__ __forceinline__ float block_max(float v, float* scratch) {
    for (int offset = 16; offset > 0; offset /= 2) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int warps = (blockDim.x + 31) / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : NEG_INF;
    for (int offset = 16; offset > 0; offset /= 2) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// (max, sum of exp(x - max)) of one row; the sum is 0 when max is -inf.
template <typename T>
__device__ __forceinline__ float2 row_max_sum(const T* xr, u64 cols, float* scratch) {
    float m = NEG_INF;
    for (u64 j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, to_f32(xr[j]));
    m = block_max(m, scratch);
    float s = 0.0f;
    if (m != NEG_INF) {
        for (u64 j = threadIdx.x; j < cols; j += blockDim.x) s += expf(to_f32(xr[j]) - m);
    }
    return make_float2(m, block_sum(s, scratch));
}

#define SOFTMAX(T, S)                                                                          \
    extern "C" __global__ void softmax_##S(const T* x, T* y, u64 rows, u64 cols) {             \
        __shared__ float scratch[32];                                                          \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                             \
            const T* xr = x + row * cols;                                                      \
            const float2 ms = row_max_sum(xr, cols, scratch);                                  \
            const float inv = 1.0f / ms.y;                                                     \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x)                               \
                y[row * cols + j] = from_f32<T>(expf(to_f32(xr[j]) - ms.x) * inv);             \
        }                                                                                      \
    }                                                                                          \
    extern "C" __global__ void log_softmax_##S(const T* x, T* y, u64 rows, u64 cols) {         \
        __shared__ float scratch[32];                                                          \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                             \
            const T* xr = x + row * cols;                                                      \
            const float2 ms = row_max_sum(xr, cols, scratch);                                  \
            const float lse = logf(ms.y);                                                      \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x)                               \
                y[row * cols + j] = from_f32<T>((to_f32(xr[j]) - ms.x) - lse);                 \
        }                                                                                      \
    }                                                                                          \
    /* dx = y * (dy - sum(y * dy)) */                                                          \
    extern "C" __global__ void softmax_backward_##S(const T* y, const T* dy, T* dx, u64 rows,  \
                                                    u64 cols) {                                \
        __shared__ float scratch[32];                                                          \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                             \
            const u64 o = row * cols;                                                          \
            float acc = 0.0f;                                                                  \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x)                               \
                acc += to_f32(y[o + j]) * to_f32(dy[o + j]);                                   \
            const float s = block_sum(acc, scratch);                                           \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x)                               \
                dx[o + j] = from_f32<T>(to_f32(y[o + j]) * (to_f32(dy[o + j]) - s));           \
        }                                                                                      \
    }                                                                                          \
    /* dx = dy - exp(y) * sum(dy) */                                                           \
    extern "C" __global__ void log_softmax_backward_##S(const T* y, const T* dy, T* dx,        \
                                                        u64 rows, u64 cols) {                  \
        __shared__ float scratch[32];                                                          \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                             \
            const u64 o = row * cols;                                                          \
            float acc = 0.0f;                                                                  \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) acc += to_f32(dy[o + j]);     \
            const float s = block_sum(acc, scratch);                                           \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x)                               \
                dx[o + j] = from_f32<T>(to_f32(dy[o + j]) - expf(to_f32(y[o + j])) * s);       \
        }                                                                                      \
    }

// The column of `target` in a shard of `vocab` columns starting at `start`,
// or -1 when the row is ignored or its target lies in another shard.
// `ignore` above 2^32 - 1 means no ignore index.
__device__ __forceinline__ long long local_target(unsigned int t, u64 start, u64 vocab, u64 ignore) {
    if ((u64)t == ignore || (u64)t < start || (u64)t - start >= vocab) return -1;
    return (long long)((u64)t - start);
}

// Per-row statistics of logits [rows, vocab] (a whole vocabulary, or the
// shard of it starting at `start`). With `full` (cross_entropy): a = the
// row's loss lse - x[target], b = lse, both 0 on an ignored row. Without
// (vocab_shard_stats): a = this shard's lse, b = x[target] where the target
// is in this shard, else 0.
#define CROSS_ENTROPY(T, S)                                                                        \
    extern "C" __global__ void cross_entropy_rows_##S(const T* x, const unsigned int* targets,     \
                                                      float* a, float* b, u64 rows, u64 vocab,     \
                                                      u64 start, u64 ignore, unsigned int full) {  \
        __shared__ float scratch[32];                                                              \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                                 \
            const T* xr = x + row * vocab;                                                         \
            const unsigned int t = targets[row];                                                   \
            if (full && (u64)t == ignore) {                                                        \
                if (threadIdx.x == 0) a[row] = b[row] = 0.0f;                                      \
                continue;                                                                          \
            }                                                                                      \
            const float2 ms = row_max_sum(xr, vocab, scratch);                                     \
            const float lse = ms.x + logf(ms.y);                                                   \
            if (threadIdx.x == 0) {                                                                \
                const long long j = local_target(t, start, vocab, ignore);                         \
                const float tl = j >= 0 ? to_f32(xr[j]) : 0.0f;                                    \
                if (full) {                                                                        \
                    a[row] = lse - tl;                                                             \
                    b[row] = lse;                                                                  \
                } else {                                                                           \
                    a[row] = lse;                                                                  \
                    b[row] = tl;                                                                   \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* dx = dloss * (softmax(x) - onehot(target)); 0 on an ignored row. */                         \
    extern "C" __global__ void cross_entropy_backward_##S(                                         \
        const T* x, const float* lse, const float* dloss, const unsigned int* targets, T* dx,      \
        u64 rows, u64 vocab, u64 start, u64 ignore) {                                              \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                                 \
            const u64 o = row * vocab;                                                             \
            const unsigned int t = targets[row];                                                   \
            const bool ignored = (u64)t == ignore;                                                 \
            const long long jt = local_target(t, start, vocab, ignore);                            \
            const float l = lse[row], dl = dloss[row];                                             \
            for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) {                                \
                float g = 0.0f;                                                                    \
                if (!ignored) {                                                                    \
                    const float p = expf(to_f32(x[o + j]) - l);                                    \
                    g = dl * ((long long)j == jt ? p - 1.0f : p);                                  \
                }                                                                                  \
                dx[o + j] = from_f32<T>(g);                                                        \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* out[0] = sum(x) / count, one block. */                                                      \
    extern "C" __global__ void mean_##S(const T* x, T* out, u64 n, u64 count) {                    \
        __shared__ float scratch[32];                                                              \
        if (blockIdx.x != 0) return;                                                               \
        float acc = 0.0f;                                                                          \
        for (u64 j = threadIdx.x; j < n; j += blockDim.x) acc += to_f32(x[j]);                     \
        acc = block_sum(acc, scratch);                                                             \
        if (threadIdx.x == 0) out[0] = from_f32<T>(acc / (float)(count > 0 ? count : 1));          \
    }

FOR_FLOAT_TYPES(SOFTMAX)
FOR_FLOAT_TYPES(CROSS_ENTROPY)
