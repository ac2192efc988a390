// A fused multi-tensor AdamW step: one launch updates every parameter tensor.
//
// Per element, as the CPU kernel (kernels/src/cpu/adamw.rs) does:
//   g = grad * grad_scale
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p -= lr * (m / bc1 / (sqrt(v / bc2) + eps) + wd * p)
// with the bias corrections bc1 = 1 - b1^step, bc2 = 1 - b2^step computed on
// the host. The master weights, moments and gradients are f32; the `_bf16`
// and `_f16` variants also write the updated weights, rounded, into the
// low-precision copy the forward reads, in the same pass.
//
// Launch: grid.y = number of tensors (blockIdx.y picks one), grid.x blocks
// stride over that tensor's elements. Each tensor carries its own
// hyper-parameters: the bias corrections depend on how many updates that
// tensor has had, which differs for a parameter some steps did not use.

struct AdamWHyper {
    float lr, beta1, beta2, eps, weight_decay, grad_scale, bias_correction1, bias_correction2;
};

struct AdamWTensor {
    float* param;      // f32 master weights
    const float* grad;
    float* m;
    float* v;
    void* copy;        // the low-precision weights (the _bf16 / _f16 variants), else unused
    u64 len;
    AdamWHyper h;
};

template <typename C>
__device__ __forceinline__ void adamw_tensor(const AdamWTensor& t, bool write_copy) {
    const AdamWHyper h = t.h;
    for (u64 i = grid_start(); i < t.len; i += grid_stride()) {
        const float g = t.grad[i] * h.grad_scale;
        const float m = h.beta1 * t.m[i] + (1.0f - h.beta1) * g;
        const float v = h.beta2 * t.v[i] + (1.0f - h.beta2) * g * g;
        t.m[i] = m;
        t.v[i] = v;
        const float p = t.param[i];
        const float update = (m / h.bias_correction1) / (sqrtf(v / h.bias_correction2) + h.eps) + h.weight_decay * p;
        const float next = p - h.lr * update;
        t.param[i] = next;
        if (write_copy) static_cast<C*>(t.copy)[i] = from_f32<C>(next);
    }
}

extern "C" __global__ void adamw_f32(const AdamWTensor* tensors) {
    adamw_tensor<float>(tensors[blockIdx.y], false);
}

extern "C" __global__ void adamw_bf16(const AdamWTensor* tensors) {
    adamw_tensor<bf16>(tensors[blockIdx.y], true);
}

extern "C" __global__ void adamw_f16(const AdamWTensor* tensors) {
    adamw_tensor<f16>(tensors[blockIdx.y], true);
}
