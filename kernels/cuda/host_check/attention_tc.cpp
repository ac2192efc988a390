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
#include <random>

struct Dims { u64 batch, qh, kh, sq, skv, hd; bool causal; float scale; bool packed; };

AttnParams make_params(const Dims& d) {
    AttnParams p{};
    u64 r = d.qh / d.kh, hd = d.hd;
    if (!d.packed) {
        p.q = {0, d.qh * d.sq * hd, r * d.sq * hd, d.sq * hd, hd};
        p.k = {0, d.kh * d.skv * hd, d.skv * hd, 0, hd};
        p.v = p.k; p.o = p.q;
    } else {
        u64 slots = d.kh * (r + 2) * hd;
        p.q = {0, d.sq * slots, (r + 2) * hd, hd, slots};
        p.k = p.q; p.k.base = r * hd; p.k.head = 0;
        p.v = p.q; p.v.base = (r + 1) * hd; p.v.head = 0;
        p.o = {0, d.sq * d.qh * hd, r * hd, hd, d.qh * hd};
    }
    p.batch = d.batch; p.q_heads = d.qh; p.kv_heads = d.kh; p.seq_q = d.sq; p.seq_kv = d.skv; p.head_dim = d.hd;
    p.scale = d.scale; p.causal = d.causal;
    return p;
}

template <typename T> std::vector<T> conv(const std::vector<double>& x) { std::vector<T> r; for (double v : x) r.push_back(from_f32<T>((float)v)); return r; }
template <typename T> std::vector<double> back(const std::vector<T>& x) { std::vector<double> r; for (T v : x) r.push_back(to_f32(v)); return r; }

bool lse_failed = false;

// The largest error of out, dq, dk, dv relative to each tensor's largest
// magnitude; lse is held to 1e-5 (its scores are f32 products of the 16-bit
// inputs, as exact as on the CUDA cores) and sets lse_failed.
template <typename T>
double run(const Dims& d, unsigned seed, double tol) {
    AttnParams p = make_params(d);
    u64 r = d.qh / d.kh;
    u64 in_len = d.packed ? d.batch * d.sq * (d.qh + 2 * d.kh) * d.hd : 0;
    u64 qlen = d.batch * d.qh * d.sq * d.hd, kvlen = d.batch * d.kh * d.skv * d.hd, lse_len = d.batch * d.qh * d.sq;
    std::mt19937 rng(seed); std::normal_distribution<double> nd(0, 1);
    auto rnd = [&](u64 n) { std::vector<double> x(n); for (auto& v : x) v = nd(rng); return x; };
    std::vector<double> qd, kd, vd;
    if (d.packed) { qd = rnd(in_len); kd = qd; vd = qd; } else { qd = rnd(qlen); kd = rnd(kvlen); vd = rnd(kvlen); }
    std::vector<double> dod = rnd(qlen);
    // round inputs to T so the reference sees the same values
    qd = back(conv<T>(qd)); kd = back(conv<T>(kd)); vd = back(conv<T>(vd)); dod = back(conv<T>(dod));
    // reference in double
    std::vector<double> out(qlen, 0), lse(lse_len), dq(qd.size(), 0), dk(kd.size(), 0), dv(vd.size(), 0);
    long long off = (long long)d.skv - (long long)d.sq;
    for (u64 b = 0; b < d.batch; ++b) for (u64 h = 0; h < d.qh; ++h) {
        u64 g = h / r;
        for (u64 i = 0; i < d.sq; ++i) {
            u64 qo = attn_q_row(p.q, r, b, h, i), oo = attn_q_row(p.o, r, b, h, i);
            std::vector<double> s(d.skv); double mx = -INFINITY;
            for (u64 j = 0; j < d.skv; ++j) {
                bool vis = !d.causal || (long long)j <= (long long)i + off;
                if (!vis) { s[j] = -INFINITY; continue; }
                u64 ko = attn_kv_row(p.k, b, g, j); double acc = 0;
                for (u64 e = 0; e < d.hd; ++e) acc += qd[qo + e] * kd[ko + e];
                s[j] = acc * d.scale; mx = std::max(mx, s[j]);
            }
            if (mx == -INFINITY) { lse[(b * d.qh + h) * d.sq + i] = -INFINITY; continue; }
            double sum = 0; for (u64 j = 0; j < d.skv; ++j) sum += std::exp(s[j] - mx);
            double L = mx + std::log(sum); lse[(b * d.qh + h) * d.sq + i] = L;
            for (u64 j = 0; j < d.skv; ++j) { double pj = std::exp(s[j] - L); if (pj == 0) continue; u64 vo = attn_kv_row(p.v, b, g, j); for (u64 e = 0; e < d.hd; ++e) out[oo + e] += pj * vd[vo + e]; }
            double D = 0; for (u64 e = 0; e < d.hd; ++e) D += dod[oo + e] * out[oo + e];
            for (u64 j = 0; j < d.skv; ++j) {
                if (s[j] == -INFINITY) continue;
                double pj = std::exp(s[j] - L);
                u64 ko = attn_kv_row(p.k, b, g, j), vo = attn_kv_row(p.v, b, g, j);
                double dp = 0; for (u64 e = 0; e < d.hd; ++e) dp += dod[oo + e] * vd[vo + e];
                double ds = pj * (dp - D);
                for (u64 e = 0; e < d.hd; ++e) { dq[qo + e] += d.scale * ds * kd[ko + e]; dk[ko + e] += d.scale * ds * qd[qo + e]; dv[vo + e] += pj * dod[oo + e]; }
            }
        }
    }
    // kernels
    auto q = conv<T>(qd), k = conv<T>(kd), v = conv<T>(vd), dout = conv<T>(dod);
    std::vector<T> o(qlen, from_f32<T>(NAN)); std::vector<float> l(lse_len, NAN), delta(lse_len, NAN);
    std::vector<T> g1(q.size(), from_f32<T>(NAN)), g2(k.size(), from_f32<T>(NAN)), g3(v.size(), from_f32<T>(NAN));
    T *gq = g1.data(), *gk = d.packed ? g1.data() : g2.data(), *gv = d.packed ? g1.data() : g3.data();
    const T* kp = d.packed ? q.data() : k.data(); const T* vp = d.packed ? q.data() : v.data();
    unsigned w = d.hd <= 64 ? 64 : 128;
    unsigned tq = (d.sq + 63) / 64, tk = (d.skv + 63) / 64;
    emu_launch(d.batch * d.qh * tq, 128, atc_smem_bytes(w, 3, 0), [&] { if (w == 64) atc_forward<T, 64>(q.data(), kp, vp, o.data(), l.data(), p); else atc_forward<T, 128>(q.data(), kp, vp, o.data(), l.data(), p); });
    for (u64 b = 0; b < d.batch; ++b) for (u64 h = 0; h < d.qh; ++h) for (u64 i = 0; i < d.sq; ++i) {
        u64 at = attn_q_row(p.o, r, b, h, i); float acc = 0;
        for (u64 e = 0; e < d.hd; ++e) acc = std::fma(to_f32(dout[at + e]), to_f32(o[at + e]), acc);
        delta[(b * d.qh + h) * d.sq + i] = acc;
    }
    emu_launch(d.batch * d.kh * tk, 128, atc_smem_bytes(w, 4, 2), [&] { if (w == 64) atc_backward_dkv<T, 64>(q.data(), kp, vp, dout.data(), l.data(), delta.data(), gk, gv, p); else atc_backward_dkv<T, 128>(q.data(), kp, vp, dout.data(), l.data(), delta.data(), gk, gv, p); });
    emu_launch(d.batch * d.qh * tq, 128, atc_smem_bytes(w, 4, 0), [&] { if (w == 64) atc_backward_dq<T, 64>(q.data(), kp, vp, dout.data(), l.data(), delta.data(), gq, p); else atc_backward_dq<T, 128>(q.data(), kp, vp, dout.data(), l.data(), delta.data(), gq, p); });
    double worst = 0;
    auto cmp = [&](const char* name, const std::vector<double>& ref, const std::vector<double>& got, bool is_lse) {
        const double t = is_lse ? 1e-5 : tol;
        double e = 0, m = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
            if (std::isinf(ref[i]) && ref[i] == got[i]) continue;
            double diff = std::fabs(ref[i] - got[i]);
            if (!(diff <= e)) e = std::isnan(diff) ? INFINITY : diff;
            m = std::max(m, std::fabs(ref[i]));
        }
        double rel = e / std::max(1.0, m);
        if (!(rel <= t)) printf("  FAIL %s: max err %g (scale %g)\n", name, e, m);
        if (is_lse) lse_failed |= !(rel <= t);
        else worst = std::max(worst, std::isnan(rel) ? INFINITY : rel);
    };
    cmp("out", out, back(o), false);
    std::vector<double> ld(l.begin(), l.end()); cmp("lse", lse, ld, true);
    if (d.packed) {
        // one gradient buffer: dq at query slots, dk/dv at key/value slots
        std::vector<double> ref(q.size(), 0); for (size_t i = 0; i < ref.size(); ++i) ref[i] = dq[i] + dk[i] + dv[i];
        cmp("dqkv", ref, back(g1), false);
    } else { cmp("dq", dq, back(g1), false); cmp("dk", dk, back(g2), false); cmp("dv", dv, back(g3), false); }
    return worst;
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
