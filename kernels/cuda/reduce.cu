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

FOR_FLOAT_TYPES(ROW_SUM)
