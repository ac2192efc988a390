// Runs the attention kernels of attention.cu under the host emulation of
// shim.h and compares out, lse, dq, dk and dv with a double-precision
// reference, for f32, bf16 and f16, both layouts, grouped-query heads, causal
// and not, a KV cache (seq_q < seq_kv), queries that see no key, ragged tiles
// and head dims below 64 and between 64 and 128. Outputs start as NaN, so an
// element a kernel fails to write is an error. Built and run by
// scripts/cuda-host-check.sh; exits non-zero on any mismatch.
#include "shim.h"
#include "attention.inc"
#include "attention_case.h"

bool lse_failed = false;

// The worst relative error of out, dq, dk and dv; lse is held to the same
// tolerance and sets lse_failed.
template <typename T>
double run(const Dims& d, unsigned seed, double tol) {
    return check_case<T>(d, seed, tol, tol, lse_failed, [&](const Reference& ref, Operands<T>& x) {
        const AttnParams& p = ref.p;
        const unsigned w = x.w;
        emu_launch(d.batch * d.qh * x.tq, 256, attn_smem_bytes(w, 2, 0), [&] { if (w == 64) attn_forward<T, 64>(x.q.data(), x.kp, x.vp, x.o.data(), x.l.data(), p); else attn_forward<T, 128>(x.q.data(), x.kp, x.vp, x.o.data(), x.l.data(), p); });
        unsigned rows = d.batch * d.qh * d.sq;
        emu_launch(std::max(1u, std::min(4096u, (rows + 7) / 8)), 256, 0, [&] { attn_delta<T>(x.o.data(), x.dout.data(), x.delta.data(), p); });
        emu_launch(d.batch * d.kh * x.tk, 256, attn_smem_bytes(w, 4, 2), [&] { if (w == 64) attn_backward_dkv<T, 64>(x.q.data(), x.kp, x.vp, x.dout.data(), x.l.data(), x.delta.data(), x.gk, x.gv, p); else attn_backward_dkv<T, 128>(x.q.data(), x.kp, x.vp, x.dout.data(), x.l.data(), x.delta.data(), x.gk, x.gv, p); });
        emu_launch(d.batch * d.qh * x.tq, 256, attn_smem_bytes(w, 4, 0), [&] { if (w == 64) attn_backward_dq<T, 64>(x.q.data(), x.kp, x.vp, x.dout.data(), x.l.data(), x.delta.data(), x.gq, p); else attn_backward_dq<T, 128>(x.q.data(), x.kp, x.vp, x.dout.data(), x.l.data(), x.delta.data(), x.gq, p); });
    });
}

int main() {
    Dims cases[] = {
        {1, 2, 1, 70, 70, 64, true, 0.125f, false},     // GQA, causal, ragged tile
        {2, 4, 2, 64, 64, 128, true, 0.088f, false},   // hd 128
        {1, 2, 2, 5, 130, 32, true, 0.17f, false},     // KV cache: seq_q < seq_kv, padded head dim
        {1, 1, 1, 100, 40, 64, true, 0.125f, false},   // seq_q > seq_kv: early queries see no key
        {1, 3, 1, 90, 90, 96, false, 0.1f, false},     // non-causal, hd 96 (128 instantiation)
        {2, 4, 2, 67, 67, 64, true, 0.125f, true},     // fused qkv layout
        {1, 2, 1, 1, 1, 8, true, 1.0f, true},          // one position
    };
    int failures = 0;
    for (auto& d : cases) {
        double e32 = run<float>(d, 1, 2e-5), eb = run<bf16>(d, 2, 3e-2), eh = run<f16>(d, 3, 5e-3);
        bool ok = e32 <= 2e-5 && eb <= 3e-2 && eh <= 5e-3 && !lse_failed;
        lse_failed = false;
        failures += !ok;
        printf("%s b%llu qh%llu kh%llu sq%llu skv%llu hd%llu causal%d packed%d: rel err f32 %.2e bf16 %.2e f16 %.2e\n", ok ? "ok  " : "FAIL",
               d.batch, d.qh, d.kh, d.sq, d.skv, d.hd, d.causal, d.packed, e32, eb, eh);
    }
    return failures != 0;
}
