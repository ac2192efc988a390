// Folds a partial attention of the same queries over other keys into a
// running one (ring attention, kernels/src/cpu/attention/merge.rs): per row
// r of `head_dim` values, with l = log(e^{lse_a[r]} + e^{lse_b[r]}),
// out = e^{lse_a - l}·out_a + e^{lse_b - l}·out_b and lse = l. A row whose
// partial saw no key (lse_b = -inf) keeps its running values. One thread per
// output element; the row's first thread also writes its lse.

#define ATTENTION_MERGE(T, S)                                                                                       \
    extern "C" __global__ void attention_merge_##S(const T* out_a, const float* lse_a, const T* out_b,            \
                                                   const float* lse_b, T* out, float* lse, u64 rows, u64 head_dim) { \
        for (u64 i = grid_start(); i < rows * head_dim; i += grid_stride()) {                                       \
            const u64 r = i / head_dim;                                                                             \
            const float la = lse_a[r], lb = lse_b[r];                                                               \
            float value = to_f32(out_a[i]), l = la;                                                                 \
            if (lb != __uint_as_float(0xff800000u)) { /* -inf: the partial saw no key */                       \
                const float m = fmaxf(la, lb), wa = expf(la - m), wb = expf(lb - m), sum = wa + wb;                  \
                value = (wa / sum) * value + (wb / sum) * to_f32(out_b[i]);                                         \
                l = m + logf(sum);                                                                                  \
            }                                                                                                       \
            out[i] = from_f32<T>(value);                                                                            \
            if (i % head_dim == 0) lse[r] = l;                                                                      \
        }                                                                                                           \
    }

FOR_FLOAT_TYPES(ATTENTION_MERGE)
