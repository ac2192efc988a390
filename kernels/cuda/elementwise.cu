// Element-wise arithmetic and activations on flat buffers of n elements.
// GELU is the tanh form written as x * sigmoid(2u), exactly as the CPU kernels
// (kernels/src/cpu/activation.rs) compute it.

#define SQRT_2_OVER_PI 0.7978845608028654f
#define GELU_CUBIC 0.044715f

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Twice GELU's tanh argument: 2 sqrt(2/pi) (x + 0.044715 x^3).
__device__ __forceinline__ float gelu_arg2(float x) {
    return 2.0f * SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
}

__device__ __forceinline__ float gelu(float x) { return x * sigmoid(gelu_arg2(x)); }

__device__ __forceinline__ float gelu_grad(float x) {
    const float s = sigmoid(gelu_arg2(x));
    const float du2 = 2.0f * SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_CUBIC * x * x);
    return s + x * s * (1.0f - s) * du2;
}

__device__ __forceinline__ float silu_grad(float x) {
    const float s = sigmoid(x);
    return s * (1.0f + x * (1.0f - s));
}

#define ELEMENTWISE(T, S)                                                                        \
    extern "C" __global__ void add_##S(const T* a, const T* b, T* out, u64 n) {                  \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));                                   \
    }                                                                                            \
    extern "C" __global__ void sub_##S(const T* a, const T* b, T* out, u64 n) {                  \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            out[i] = from_f32<T>(to_f32(a[i]) - to_f32(b[i]));                                   \
    }                                                                                            \
    extern "C" __global__ void mul_##S(const T* a, const T* b, T* out, u64 n) {                  \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            out[i] = from_f32<T>(to_f32(a[i]) * to_f32(b[i]));                                   \
    }                                                                                            \
    extern "C" __global__ void scale_##S(const T* x, float alpha, T* out, u64 n) {               \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            out[i] = from_f32<T>(alpha * to_f32(x[i]));                                          \
    }                                                                                            \
    /* x is [n / cols, cols] row-major; bias has cols elements. */                               \
    extern "C" __global__ void add_bias_##S(const T* x, const T* bias, T* out, u64 n, u64 cols) { \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            out[i] = from_f32<T>(to_f32(x[i]) + to_f32(bias[i % cols]));                         \
    }                                                                                            \
    /* out[i] = x[0]: a scalar gradient spread over a tensor. */                               \
    extern "C" __global__ void broadcast_##S(const T* x, T* out, u64 n) {                        \
        for (u64 i = grid_start(); i < n; i += grid_stride()) out[i] = x[0];                     \
    }                                                                                            \
    /* In place: y += alpha x (gradient accumulation). */                                      \
    extern "C" __global__ void axpy_##S(const T* x, float alpha, T* y, u64 n) {                  \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            y[i] = from_f32<T>(to_f32(y[i]) + alpha * to_f32(x[i]));                             \
    }                                                                                            \
    extern "C" __global__ void gelu_##S(const T* x, T* y, u64 n) {                               \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            y[i] = from_f32<T>(gelu(to_f32(x[i])));                                              \
    }                                                                                            \
    /* From the forward's input x: dx = dy * gelu'(x). */                                        \
    extern "C" __global__ void gelu_backward_##S(const T* x, const T* dy, T* dx, u64 n) {        \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            dx[i] = from_f32<T>(to_f32(dy[i]) * gelu_grad(to_f32(x[i])));                        \
    }                                                                                            \
    extern "C" __global__ void silu_##S(const T* x, T* y, u64 n) {                               \
        for (u64 i = grid_start(); i < n; i += grid_stride()) {                                  \
            const float v = to_f32(x[i]);                                                        \
            y[i] = from_f32<T>(v * sigmoid(v));                                                  \
        }                                                                                        \
    }                                                                                            \
    /* From the forward's input x: dx = dy * s (1 + x (1 - s)), s = sigmoid(x). */               \
    extern "C" __global__ void silu_backward_##S(const T* x, const T* dy, T* dx, u64 n) {        \
        for (u64 i = grid_start(); i < n; i += grid_stride())                                    \
            dx[i] = from_f32<T>(to_f32(dy[i]) * silu_grad(to_f32(x[i])));                        \
    }

FOR_FLOAT_TYPES(ELEMENTWISE)

// SwiGLU: y = silu(gate) * up; the backward from the forward's inputs:
// dgate = dy * up * s (1 + g (1 - s)), dup = dy * g * s, s = sigmoid(g).
#define SWIGLU(T, S)                                                                              \
    extern "C" __global__ void swiglu_##S(const T* gate, const T* up, T* y, u64 n) {              \
        for (u64 i = grid_start(); i < n; i += grid_stride()) {                                   \
            const float g = to_f32(gate[i]);                                                      \
            y[i] = from_f32<T>(g * sigmoid(g) * to_f32(up[i]));                                   \
        }                                                                                         \
    }                                                                                             \
    extern "C" __global__ void swiglu_backward_##S(const T* gate, const T* up, const T* dy,       \
                                                   T* dgate, T* dup, u64 n) {                     \
        for (u64 i = grid_start(); i < n; i += grid_stride()) {                                   \
            const float g = to_f32(gate[i]), u = to_f32(up[i]), d = to_f32(dy[i]);                \
            const float s = sigmoid(g);                                                           \
            dgate[i] = from_f32<T>(d * u * (s * (1.0f + g * (1.0f - s))));                        \
            dup[i] = from_f32<T>(d * g * s);                                                      \
        }                                                                                         \
    }

FOR_FLOAT_TYPES(SWIGLU)
