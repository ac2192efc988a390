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
