// One attention check case, shared by attention.cpp (CUDA-core kernels) and
// attention_tc.cpp (tensor-core kernels): the shapes, the argument struct
// the launcher would build, random inputs rounded to the element type, and
// out, lse, dq, dk and dv computed from them in double precision. Include
// after the kernel source (it uses AttnParams and the row offsets).
#pragma once
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

// A case's inputs (rounded to T, held as double) and its reference outputs.
struct Reference {
    AttnParams p;
    u64 r, qlen, kvlen, lse_len;
    std::vector<double> qd, kd, vd, dod, out, lse, dq, dk, dv;
};

template <typename T>
Reference reference(const Dims& d, unsigned seed) {
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
    return Reference{p, r, qlen, kvlen, lse_len, qd, kd, vd, dod, out, lse, dq, dk, dv};
}

// The kernels' operands for one case: the inputs in T, and outputs that
// start as NaN, so an element a kernel fails to write is an error. In the
// fused layout q, k and v are one buffer, and so are their gradients.
template <typename T>
struct Operands {
    std::vector<T> q, k, v, dout, o, g1, g2, g3;
    std::vector<float> l, delta;
    T *gq, *gk, *gv;
    const T *kp, *vp;
    unsigned w, tq, tk;  // the D instantiation, query and key tiles

    Operands(const Dims& d, const Reference& ref)
        : q(conv<T>(ref.qd)), k(conv<T>(ref.kd)), v(conv<T>(ref.vd)), dout(conv<T>(ref.dod)),
          o(ref.qlen, from_f32<T>(NAN)), g1(q.size(), from_f32<T>(NAN)), g2(k.size(), from_f32<T>(NAN)),
          g3(v.size(), from_f32<T>(NAN)), l(ref.lse_len, NAN), delta(ref.lse_len, NAN) {
        gq = g1.data(); gk = d.packed ? g1.data() : g2.data(); gv = d.packed ? g1.data() : g3.data();
        kp = d.packed ? q.data() : k.data(); vp = d.packed ? q.data() : v.data();
        w = d.hd <= 64 ? 64 : 128;
        tq = (unsigned)((d.sq + 63) / 64); tk = (unsigned)((d.skv + 63) / 64);
    }
    Operands(const Operands&) = delete;  // the pointers point into its own buffers
};

// Runs one case: `kernels(ref, ops)` launches the forward and the backward
// on `ops`; then out, dq, dk and dv are compared with the reference relative
// to each tensor's largest magnitude, and lse to `lse_tol`. Returns the
// worst relative error of out and the gradients; sets `lse_failed` when lse
// misses its tolerance. Failures are printed.
template <typename T, typename Kernels>
double check_case(const Dims& d, unsigned seed, double tol, double lse_tol, bool& lse_failed, Kernels kernels) {
    const Reference ref = reference<T>(d, seed);
    Operands<T> ops(d, ref);
    kernels(ref, ops);
    double worst = 0;
    auto cmp = [&](const char* name, const std::vector<double>& want, const std::vector<double>& got, bool is_lse) {
        const double t = is_lse ? lse_tol : tol;
        double e = 0, m = 0;
        for (size_t i = 0; i < want.size(); ++i) {
            if (std::isinf(want[i]) && want[i] == got[i]) continue;
            double diff = std::fabs(want[i] - got[i]);
            if (!(diff <= e)) e = std::isnan(diff) ? INFINITY : diff;
            m = std::max(m, std::fabs(want[i]));
        }
        double rel = e / std::max(1.0, m);
        if (!(rel <= t)) printf("  FAIL %s: max err %g (scale %g)\n", name, e, m);
        if (is_lse) lse_failed |= !(rel <= t);
        else worst = std::max(worst, std::isnan(rel) ? INFINITY : rel);
    };
    cmp("out", ref.out, back(ops.o), false);
    cmp("lse", ref.lse, std::vector<double>(ops.l.begin(), ops.l.end()), true);
    if (d.packed) {
        // one gradient buffer: dq at query slots, dk/dv at key/value slots
        std::vector<double> want(ops.q.size(), 0);
        for (size_t i = 0; i < want.size(); ++i) want[i] = ref.dq[i] + ref.dk[i] + ref.dv[i];
        cmp("dqkv", want, back(ops.g1), false);
    } else {
        cmp("dq", ref.dq, back(ops.g1), false);
        cmp("dk", ref.dk, back(ops.g2), false);
        cmp("dv", ref.dv, back(ops.g3), false);
    }
    return worst;
}
