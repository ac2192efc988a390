// LayerNorm and RMSNorm forward over the last dimension of a row-major
// [rows, cols] input: one block per row (grid-stride over rows), statistics
// in f32. The mean is taken first and the variance of the centred values
// second (two passes over the row), which avoids the cancellation of
// E[x^2] - E[x]^2. mean and rstd (1 / sqrt(var + eps)) are saved per row
// for the backward; a null beta means no bias. blockDim.x is a multiple of 32, at most 1024.

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
                yr[j] = from_f32<T>(n * to_f32(gamma[j]) + (beta ? to_f32(beta[j]) : 0.0f));          \
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

// The backward of both norms for x, one block per row. With xhat the
// normalised input (x - mean) rstd (x rstd for RMSNorm, whose mean is null)
// and g = dy gamma:
//   LayerNorm: dx = rstd (g - mean(g) - xhat mean(g xhat))
//   RMSNorm:   dx = rstd (g - xhat mean(g xhat))
#define NORM_BACKWARD(T, S)                                                                          \
    extern "C" __global__ void norm_backward_##S(const T* x, const T* gamma, const float* mean,       \
                                                 const float* rstd, const T* dy, T* dx, u64 rows,     \
                                                 u64 cols) {                                          \
        __shared__ float scratch[32];                                                                \
        for (u64 row = blockIdx.x; row < rows; row += gridDim.x) {                                   \
            const T* xr = x + row * cols;                                                            \
            const T* dyr = dy + row * cols;                                                          \
            const float mu = mean ? mean[row] : 0.0f;                                                \
            const float rs = rstd[row];                                                              \
            float sum_g = 0.0f, sum_gx = 0.0f;                                                       \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {                                   \
                const float g = to_f32(dyr[j]) * to_f32(gamma[j]);                                   \
                sum_g += g;                                                                          \
                sum_gx += g * (to_f32(xr[j]) - mu) * rs;                                             \
            }                                                                                        \
            const float mean_g = mean ? block_sum(sum_g, scratch) / (float)cols : 0.0f;              \
            const float mean_gx = block_sum(sum_gx, scratch) / (float)cols;                          \
            T* dxr = dx + row * cols;                                                                \
            for (u64 j = threadIdx.x; j < cols; j += blockDim.x) {                                   \
                const float g = to_f32(dyr[j]) * to_f32(gamma[j]);                                   \
                const float xhat = (to_f32(xr[j]) - mu) * rs;                                        \
                dxr[j] = from_f32<T>(rs * (g - mean_g - xhat * mean_gx));                            \
            }                                                                                        \
        }                                                                                            \
    }

// The gain and bias gradients of both norms: dgamma = sum over rows of
// dy xhat, dbeta (when not null) = sum over rows of dy. One thread per column,
// each summing its column top to bottom in f32.
#define NORM_PARAM_GRAD(T, S)                                                                       \
    extern "C" __global__ void norm_param_grad_##S(const T* x, const float* mean, const float* rstd, \
                                                   const T* dy, T* dgamma, T* dbeta, u64 rows,       \
                                                   u64 cols) {                                       \
        for (u64 j = grid_start(); j < cols; j += grid_stride()) {                                  \
            float g = 0.0f, b = 0.0f;                                                               \
            for (u64 r = 0; r < rows; r++) {                                                        \
                const float d = to_f32(dy[r * cols + j]);                                           \
                const float mu = mean ? mean[r] : 0.0f;                                             \
                g += d * ((to_f32(x[r * cols + j]) - mu) * rstd[r]);                                \
                b += d;                                                                             \
            }                                                                                       \
            dgamma[j] = from_f32<T>(g);                                                             \
            if (dbeta) dbeta[j] = from_f32<T>(b);                                                   \
        }                                                                                           \
    }

FOR_FLOAT_TYPES(LAYERNORM)
FOR_FLOAT_TYPES(NORM_BACKWARD)
FOR_FLOAT_TYPES(NORM_PARAM_GRAD)
FOR_FLOAT_TYPES(RMSNORM)
