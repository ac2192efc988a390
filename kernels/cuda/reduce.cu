// Row sums of a row-major [rows, cols] matrix, accumulated in f32: one block
// per row (grid-stride over rows), each thread summing a strided part of the
// row before the block-wide reduction. The launch gives blockDim.x a multiple
// of 32, at most 1024.

#define ROW_SUM(T, S)                                                                   \
    extern "C" __global__ void row_sum_##S(const T* x, float* out, u64 rows, u64 cols) { \
        __shared__ float scratch[32];                                                   \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                      \
            const T* r = x + row * cols;                                                \
            float acc = 0.0f;                                                           \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) acc += to_f32(r[j]);   \
            acc = block_sum(acc, scratch);                                              \
            if (threadIdx.x == 0) out[row] = acc;                                       \
        }                                                                               \
    }

// The same with every element squared: a squared L2 norm.
#define ROW_SUM_SQUARES(T, S)                                                                   \
    extern "C" __global__ void row_sum_squares_##S(const T* x, float* out, u64 rows, u64 cols) { \
        __shared__ float scratch[32];                                                           \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                              \
            const T* r = x + row * cols;                                                        \
            float acc = 0.0f;                                                                   \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {                              \
                const float v = to_f32(r[j]);                                                   \
                acc += v * v;                                                                   \
            }                                                                                   \
            acc = block_sum(acc, scratch);                                                      \
            if (threadIdx.x == 0) out[row] = acc;                                               \
        }                                                                                       \
    }

// Column sums of a row-major [rows, cols] matrix (a bias gradient): one
// thread per column, so neighbouring threads read neighbouring elements, each
// summing its column top to bottom in f32.
#define COL_SUM(T, S)                                                                     \
    extern "C" __global__ void col_sum_##S(const T* x, T* out, u64 rows, u64 cols) {       \
        for (u64 j = grid_start(); j < cols; j += grid_stride()) {                        \
            float acc = 0.0f;                                                             \
            for (u64 r = 0; r < rows; r++) acc += to_f32(x[r * cols + j]);                \
            out[j] = from_f32<T>(acc);                                                    \
        }                                                                                 \
    }

FOR_FLOAT_TYPES(ROW_SUM)
FOR_FLOAT_TYPES(ROW_SUM_SQUARES)
FOR_FLOAT_TYPES(COL_SUM)

// The largest |x| as f32 (0 for no elements; NaN if any element is NaN, as
// the CPU's max_abs), one block: threads take strided maxima, then a warp
// and block reduction. A NaN is counted separately, since fmaxf drops it.
#define MAX_ABS(T, S)                                                                              \
    extern "C" __global__ void max_abs_##S(const T* x, float* out, u64 n) {                        \
        __shared__ float scratch[32];                                                              \
        if (blockIdx.x != 0) return;                                                               \
        float m = 0.0f, nans = 0.0f;                                                               \
        for (u64 j = threadIdx.x; j < n; j += blockDim.x) {                                        \
            const float v = fabsf(to_f32(x[j]));                                                   \
            if (v != v) nans = 1.0f;                                                               \
            else m = fmaxf(m, v);                                                                  \
        }                                                                                          \
        for (int offset = 16; offset > 0; offset /= 2)                                             \
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));                                 \
        const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;                       \
        __syncthreads();                                                                           \
        if (lane == 0) scratch[warp] = m;                                                          \
        __syncthreads();                                                                           \
        m = lane < (blockDim.x + 31) / 32 ? scratch[lane] : 0.0f;                                  \
        for (int offset = 16; offset > 0; offset /= 2)                                             \
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, offset));                                 \
        nans = block_sum(nans, scratch);                                                           \
        if (threadIdx.x == 0) out[0] = nans > 0.0f ? __uint_as_float(0x7fc00000u) : m;             \
    }

FOR_FLOAT_TYPES(MAX_ABS)
