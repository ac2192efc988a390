// Runs the tensor-core attention kernels of attention_tc.cu under the host
// emulation of shim.h and shim_mma.h and compares out, lse, dq, dk and dv
// with a double-precision reference, for bf16 and f16, both layouts,
// grouped-query heads, causal and not, a KV cache (seq_q < seq_kv), queries
// that see no key, ragged tiles, head dims 64 and 128 and padded ones (one
// that is not a multiple of 4, which stages element by element). Outputs
// start as NaN, so an element a kernel fails to write is an error. `delta`
// (attention.cu's attention_bwd_delta, checked by attention.cpp) is computed
// here as that kernel does: rowsum(dout * out) in f32. Built and run by
// scripts/cuda-host-check.sh; exits non-zero on any mismatch.
#include "shim.h"
#include "shim_mma.h"
#include "attention_tc.inc"
#include "attention_case.h"

bool lse_failed = false;

// The largest error of out, dq, dk, dv relative to each tensor's largest
// magnitude; lse is held to 1e-5 (its scores are f32 products of the 16-bit
// inputs, as exact as on the CUDA cores) and sets lse_failed.
template <typename T>
double run(const Dims& d, unsigned seed, double tol) {
    return check_case<T>(d, seed, tol, 1e-5, lse_failed, [&](const Reference& ref, Operands<T>& x) {
        const AttnParams& p = ref.p;
        const unsigned w = x.w;
        emu_launch(d.batch * d.qh * x.tq, 128, atc_smem_bytes(w, 3, 0), [&] { if (w == 64) atc_forward<T, 64>(x.q.data(), x.kp, x.vp, x.o.data(), x.l.data(), p); else atc_forward<T, 128>(x.q.data(), x.kp, x.vp, x.o.data(), x.l.data(), p); });
        for (u64 b = 0; b < d.batch; ++b) for (u64 h = 0; h < d.qh; ++h) for (u64 i = 0; i < d.sq; ++i) {
            u64 at = attn_q_row(p.o, ref.r, b, h, i); float acc = 0;
            for (u64 e = 0; e < d.hd; ++e) acc = std::fma(to_f32(x.dout[at + e]), to_f32(x.o[at + e]), acc);
            x.delta[(b * d.qh + h) * d.sq + i] = acc;
        }
        emu_launch(d.batch * d.kh * x.tk, 128, atc_smem_bytes(w, 4, 2), [&] { if (w == 64) atc_backward_dkv<T, 64>(x.q.data(), x.kp, x.vp, x.dout.data(), x.l.data(), x.delta.data(), x.gk, x.gv, p); else atc_backward_dkv<T, 128>(x.q.data(), x.kp, x.vp, x.dout.data(), x.l.data(), x.delta.data(), x.gk, x.gv, p); });
        emu_launch(d.batch * d.qh * x.tq, 128, atc_smem_bytes(w, 4, 0), [&] { if (w == 64) atc_backward_dq<T, 64>(x.q.data(), x.kp, x.vp, x.dout.data(), x.l.data(), x.delta.data(), x.gq, p); else atc_backward_dq<T, 128>(x.q.data(), x.kp, x.vp, x.dout.data(), x.l.data(), x.delta.data(), x.gq, p); });
    });
}

int main() {
    Dims cases[] = {
        {1, 2, 1, 70, 70, 64, true, 0.125f, false},     // GQA, causal, ragged tile
        {1, 2, 1, 70, 70, 128, false, 0.088f, false},   // hd 128, non-causal
        {1, 2, 2, 5, 130, 32, true, 0.17f, false},      // KV cache: seq_q < seq_kv, padded head dim
        {1, 1, 1, 100, 40, 64, true, 0.125f, false},    // seq_q > seq_kv: early queries see no key
        {1, 3, 1, 40, 90, 96, false, 0.1f, false},      // non-causal, hd 96 (128 instantiation)
        {1, 2, 1, 20, 20, 30, true, 0.18f, false},      // hd 30: staged element by element
        {2, 4, 2, 67, 67, 64, true, 0.125f, true},      // fused qkv layout
        {1, 2, 1, 1, 1, 8, true, 1.0f, true},           // one position
    };
    int failures = 0;
    for (auto& d : cases) {
        double eb = run<bf16>(d, 2, 3e-2), eh = run<f16>(d, 3, 5e-3);
        bool ok = eb <= 3e-2 && eh <= 5e-3 && !lse_failed;
        lse_failed = false;
        failures += !ok;
        printf("%s tensor cores b%llu qh%llu kh%llu sq%llu skv%llu hd%llu causal%d packed%d: rel err bf16 %.2e f16 %.2e\n", ok ? "ok  " : "FAIL",
               d.batch, d.qh, d.kh, d.sq, d.skv, d.hd, d.causal, d.packed, eb, eh);
        fflush(stdout);
    }
    return failures != 0;
}
