// Runs the kernels of paged_attention.cu (the KV-cache write and paged
// attention) under the host emulation of shim.h and compares them with a
// double-precision reference, in f32, bf16 and f16, on random batches:
// grouped-query heads (groups 1, 2, 4), head dims 8 to 256 (each head-dim
// instantiation, with and without padding), cache block sizes 1, 5 and 16,
// prefill chunks (from position 0 and after cached tokens) mixed with decode
// tokens in a shuffled token order, and block tables in a shuffled block
// order. Every slot no sequence owns holds NaN, and so does every slot of
// this call's tokens until the write fills it, so a read of a wrong slot, or
// of a slot the write missed, shows; outputs start as NaN, so an element the
// kernel fails to write shows too. Checked: the caches after the write, bit
// for bit; the attention output against the reference; and that a token
// attended alone gives the same bits as in the batch. Built and run by
// scripts/cuda-host-check.sh; exits non-zero on any mismatch. An argument
// (`f32`, `bf16` or `f16`) runs that element type only.
#include "rows.h"
#include "paged_attention.inc"
#include <random>

template <typename T> struct Kernels;
template <> struct Kernels<float> {
    static constexpr auto write = kv_cache_write_f32;
    static constexpr auto attend = paged_attention_f32;
    static constexpr const char* name = "f32";
};
template <> struct Kernels<bf16> {
    static constexpr auto write = kv_cache_write_bf16;
    static constexpr auto attend = paged_attention_bf16;
    static constexpr const char* name = "bf16";
};
template <> struct Kernels<f16> {
    static constexpr auto write = kv_cache_write_f16;
    static constexpr auto attend = paged_attention_f16;
    static constexpr const char* name = "f16";
};

// One call: per sequence `lens` tokens already cached and `news` tokens in
// this call; `grid` caps the attention grid (0: one block per pair). With a
// `trend`, queries are positive and cached keys grow by `trend` per
// position, so later tiles raise a warp's running max and its accumulator
// must be rescaled (with random scores the first tile's max mostly stands).
struct Shape {
    u64 q_heads, kv_heads, hd, bs;
    std::vector<u64> lens, news;
    unsigned grid;
    double trend = 0;
};

template <typename T> T round_to(double x) { return from_f32<T>((float)x); }
template <typename T> bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename T>
bool run(const Shape& c, unsigned seed, double tol) {
    std::mt19937 rng(seed);
    std::normal_distribution<double> nd(0, 1);
    const u64 seqs = c.lens.size(), group = c.q_heads / c.kv_heads, hd = c.hd, bs = c.bs;
    std::vector<u64> total(seqs);
    u64 width = 1;
    for (u64 s = 0; s < seqs; ++s) total[s] = c.lens[s] + c.news[s], width = std::max(width, (total[s] + bs - 1) / bs);
    const u64 blocks = seqs * width + 3, slots = blocks * bs;
    // Block tables in a shuffled block order: a sequence's blocks are not in slot order.
    std::vector<unsigned> order(blocks);
    for (u64 b = 0; b < blocks; ++b) order[b] = (unsigned)b;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<unsigned> tables(order.begin(), order.begin() + seqs * width);
    auto slot_of = [&](u64 s, u64 p) { return (u64)tables[s * width + p / bs] * bs + p % bs; };
    // This call's tokens, in a shuffled order (prefill chunks and decode tokens interleaved).
    std::vector<unsigned> positions, token_seq;
    for (u64 s = 0; s < seqs; ++s)
        for (u64 p = c.lens[s]; p < total[s]; ++p) positions.push_back((unsigned)p), token_seq.push_back((unsigned)s);
    const u64 tokens = positions.size();
    std::vector<u64> perm(tokens);
    for (u64 i = 0; i < tokens; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    {
        auto p2 = positions, s2 = token_seq;
        for (u64 i = 0; i < tokens; ++i) positions[i] = p2[perm[i]], token_seq[i] = s2[perm[i]];
    }
    std::vector<unsigned> slot(tokens);
    for (u64 t = 0; t < tokens; ++t) slot[t] = (unsigned)slot_of(token_seq[t], positions[t]);

    // Inputs rounded to T; the reference sees the same values.
    const u64 row = c.kv_heads * (group + 2) * hd, kv_row = c.kv_heads * hd;
    std::vector<T> qkv(tokens * row), kc(slots * kv_row, round_to<T>(NAN)), vc(slots * kv_row, round_to<T>(NAN));
    for (auto& x : qkv) x = round_to<T>(c.trend ? std::fabs(nd(rng)) : nd(rng));
    for (u64 s = 0; s < seqs; ++s)
        for (u64 p = 0; p < c.lens[s]; ++p)
            for (u64 i = 0; i < kv_row; ++i) {
                kc[slot_of(s, p) * kv_row + i] = round_to<T>(nd(rng) + c.trend * p);
                vc[slot_of(s, p) * kv_row + i] = round_to<T>(nd(rng));
            }

    // What the write must leave: each token's key and value copied into its slot.
    std::vector<T> want_k = kc, want_v = vc;
    for (u64 t = 0; t < tokens; ++t)
        for (u64 g = 0; g < c.kv_heads; ++g)
            for (u64 e = 0; e < hd; ++e) {
                const u64 src = t * row + (g * (group + 2) + group) * hd + e, dst = ((u64)slot[t] * c.kv_heads + g) * hd + e;
                want_k[dst] = qkv[src];
                want_v[dst] = qkv[src + hd];
            }

    // The write: a few blocks of 64 threads, so the grid-stride loop wraps.
    const u64 items = tokens * c.kv_heads * hd;
    emu_launch((unsigned)std::min<u64>(3, (items + 63) / 64), 64, 0,
               [&] { Kernels<T>::write(qkv.data(), slot.data(), kc.data(), vc.data(), tokens, c.kv_heads, group, hd, slots); });
    bool ok = true;
    if (!same_bits(kc, want_k) || !same_bits(vc, want_v)) {
        printf("  FAIL kv_cache_write: the caches differ from the expected copy\n");
        ok = false;
    }

    // The reference, in double, from the caches as they should be.
    const double scale = 1.0 / std::sqrt((double)hd);
    std::vector<double> want(tokens * c.q_heads * hd, 0.0);
    for (u64 t = 0; t < tokens; ++t)
        for (u64 h = 0; h < c.q_heads; ++h) {
            const u64 g = h / group, n = (u64)positions[t] + 1;
            const T* q = &qkv[t * row + (g * (group + 2) + h % group) * hd];
            std::vector<double> s(n);
            double mx = -INFINITY;
            for (u64 p = 0; p < n; ++p) {
                const u64 at = (slot_of(token_seq[t], p) * c.kv_heads + g) * hd;
                double acc = 0;
                for (u64 e = 0; e < hd; ++e) acc += (double)to_f32(q[e]) * to_f32(want_k[at + e]);
                s[p] = acc * scale;
                mx = std::max(mx, s[p]);
            }
            double z = 0;
            for (u64 p = 0; p < n; ++p) z += std::exp(s[p] - mx);
            for (u64 p = 0; p < n; ++p) {
                const u64 at = (slot_of(token_seq[t], p) * c.kv_heads + g) * hd;
                for (u64 e = 0; e < hd; ++e) want[(t * c.q_heads + h) * hd + e] += std::exp(s[p] - mx) / z * to_f32(want_v[at + e]);
            }
        }

    // The attention, on the caches the write left.
    const u64 pairs = tokens * c.q_heads;
    std::vector<T> out(pairs * hd, round_to<T>(NAN));
    const unsigned grid = c.grid ? c.grid : (unsigned)pairs;
    emu_launch(grid, PAGED_THREADS, 0, [&] {
        Kernels<T>::attend(qkv.data(), kc.data(), vc.data(), positions.data(), token_seq.data(), tables.data(), out.data(), tokens, c.q_heads,
                           c.kv_heads, hd, bs, width, (float)scale);
    });
    double err = 0, big = 1;
    for (u64 i = 0; i < want.size(); ++i) {
        const double d = std::fabs(to_f32(out[i]) - want[i]);
        err = std::isnan(d) ? INFINITY : std::max(err, d);
        big = std::max(big, std::fabs(want[i]));
    }
    if (!(err / big <= tol)) {
        printf("  FAIL paged_attention: max error %g (scale %g, tolerance %g)\n", err, big, tol);
        ok = false;
    }

    // Batch invariance: the first and the last token of the call, alone.
    for (u64 t : {(u64)0, tokens - 1}) {
        std::vector<T> solo(c.q_heads * hd, round_to<T>(NAN));
        emu_launch((unsigned)c.q_heads, PAGED_THREADS, 0, [&] {
            Kernels<T>::attend(qkv.data() + t * row, kc.data(), vc.data(), positions.data() + t, token_seq.data() + t, tables.data(), solo.data(), 1,
                               c.q_heads, c.kv_heads, hd, bs, width, (float)scale);
        });
        if (memcmp(solo.data(), out.data() + t * c.q_heads * hd, solo.size() * sizeof(T)) != 0) {
            printf("  FAIL paged_attention: token %llu alone differs from the same token in the batch\n", t);
            ok = false;
        }
    }
    printf("%s %-4s q%llu kv%llu hd%llu bs%llu tokens %llu grid %u: rel err %.2e\n", ok ? "ok  " : "FAIL", Kernels<T>::name, c.q_heads, c.kv_heads, hd, bs,
           tokens, grid, err / big);
    return ok;
}

int main(int argc, char** argv) {
    setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows as it runs
    auto want = [&](const char* name) { return argc < 2 || strcmp(argv[1], name) == 0; };
    // Small batches: the emulation runs a thread per CUDA thread, 128 per block.
    const Shape shapes[] = {
        {2, 2, 8, 1, {0, 5, 17}, {9, 1, 1}, 0},         // groups of 1, block size 1: a whole prompt and two decodes
        {4, 2, 64, 16, {40, 0, 3}, {1, 6, 1}, 8},       // groups of 2: decodes and a first prefill chunk
        {4, 1, 128, 16, {70, 33}, {1, 5}, 8},           // groups of 4: a chunk after cached tokens
        {4, 1, 64, 1, {31, 32, 33}, {1, 1, 2}, 0},      // positions at the 32-position tile edges
        {2, 1, 256, 16, {50}, {3}, 0},                  // head_dim 256
        {4, 2, 33, 5, {10, 0}, {1, 4}, 8},              // head_dim 33 (padded), block size 5
        {2, 2, 96, 16, {130}, {1}, 0},                  // 131 positions: warp 0 takes two tiles; 96 in the 128 instantiation
        {4, 2, 200, 1, {0, 66}, {3, 1}, 4},             // head_dim 200 on the 256 instantiation, block size 1
        {2, 1, 64, 16, {299}, {1}, 0, 0.002},           // 300 positions, scores growing along them: every warp rescales
    };
    int failures = 0;
    unsigned seed = 1;
    for (const Shape& s : shapes) {
        if (want("f32")) failures += !run<float>(s, seed, 2e-5);
        if (want("bf16")) failures += !run<bf16>(s, seed + 1, 8e-3);
        if (want("f16")) failures += !run<f16>(s, seed + 2, 1e-3);
        seed += 3;
    }
    return failures != 0;
}
