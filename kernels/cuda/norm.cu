// LayerNorm and RMSNorm forward over the last dimension of a row-major
// [rows, cols] input: one block per row (grid-stride over rows), statistics
// in f32. The mean is taken first and the variance of the centred values
// second (two passes over the row), which avoids the cancellation of
// E[x^2] - E[x]^2. mean and rstd (1 / sqrt(var + eps)) are saved per row
// for the backward. blockDim.x is a multiple of 32, at most 1024.

#define LAYERNORM(T, S)                                                                              \
    extern "C" __global__ void layernorm_##S(const T* x, const T* gamma, const T* beta, T* y,         \
                                             float* mean_out, float* rstd_out, u64 rows, u64 cols,    \
                                             float eps) {                                            \
        __shared__ float scratch[32];                                                                \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                                   \
            const T* xr = x + row * cols;                                                            \
            float acc = 0.0f;                                                                        \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) acc += to_f32(xr[j]);               \
            const float mean = block_sum(acc, scratch) / (float)cols;                                \
            acc = 0.0f;                                                                              \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {                                   \
                const float d = to_f32(xr[j]) - mean;                                                \
                acc += d * d;                                                                        \
            }                                                                                        \
            const float rstd = rsqrtf(block_sum(acc, scratch) / (float)cols + eps);                  \
            T* yr = y + row * cols;                                                                  \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {                                   \
                const float n = (to_f32(xr[j]) - mean) * rstd;                                       \
                yr[j] = from_f32<T>(n * to_f32(gamma[j]) + to_f32(beta[j]));                         \
            }                                                                                        \
            if (threadIdx.x == 0) {                                                                  \
                mean_out[row] = mean;                                                                \
                rstd_out[row] = rstd;                                                                \
            }                                                                                        \
        }                                                                                            \
    }

// y = x / sqrt(mean(x^2) + eps) * gamma.
#define RMSNORM(T, S)                                                                                 \
    extern "C" __global__ void rmsnorm_##S(const T* x, const T* gamma, T* y, float* rstd_out,         \
                                           u64 rows, u64 cols, float eps) {                           \
        __shared__ float scratch[32];                                                                 \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                                    \
            const T* xr = x + row * cols;                                                             \
            float acc = 0.0f;                                                                         \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {                                    \
                const float v = to_f32(xr[j]);                                                        \
                acc += v * v;                                                                         \
            }                                                                                         \
            const float rstd = rsqrtf(block_sum(acc, scratch) / (float)cols + eps);                   \
            T* yr = y + row * cols;                                                                   \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x)                                      \
                yr[j] = from_f32<T>(to_f32(xr[j]) * rstd * to_f32(gamma[j]));                         \
            if (threadIdx.x == 0) rstd_out[row] = rstd;                                               \
        }                                                                                             \
    }

FOR_FLOAT_TYPES(LAYERNORM)
FOR_FLOAT_TYPES(RMSNORM)
