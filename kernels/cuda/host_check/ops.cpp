// Checks the logic of the row and lookup kernels (loss.cu, embedding.cu,
// rope.cu, reduce.cu's max_abs, topk.cu) on the CPU against double-precision references, under the host
// emulation of shim.h; see scripts/cuda-host-check.sh. f32 only: the element
// conversions are the prelude's, which the attention check covers.
#include "rows.h"
#include "loss.inc"
#include "embedding.inc"
#include "rope.inc"
#include "reduce.inc"
#include "topk.inc"

int main() {
    // Threads per block: the emulation runs one std::thread per CUDA thread,
    // so the rows are kept short enough to stay quick but longer than a warp.
    for (u64 cols : {5ull, 70ull, 1100ull}) {
        const u64 rows = 3;
        auto x = values(rows * cols, (unsigned)cols), dy = values(rows * cols, 7u + (unsigned)cols);
        x[1] = -1e30f;  // a very negative logit
        std::vector<float> y(rows * cols), l(rows * cols), dx(rows * cols);
        std::vector<double> sm(rows * cols), lsm(rows * cols), lse(rows), dsm(rows * cols), dlsm(rows * cols);
        for (u64 r = 0; r < rows; r++) {
            double m = -INFINITY, s = 0, sd = 0, syd = 0;
            for (u64 j = 0; j < cols; j++) m = std::max(m, (double)x[r * cols + j]);
            for (u64 j = 0; j < cols; j++) s += std::exp(x[r * cols + j] - m);
            lse[r] = m + std::log(s);
            for (u64 j = 0; j < cols; j++) {
                sm[r * cols + j] = std::exp(x[r * cols + j] - lse[r]);
                lsm[r * cols + j] = x[r * cols + j] - lse[r];
                sd += dy[r * cols + j];
                syd += sm[r * cols + j] * dy[r * cols + j];
            }
            for (u64 j = 0; j < cols; j++) {
                dsm[r * cols + j] = sm[r * cols + j] * (dy[r * cols + j] - syd);
                dlsm[r * cols + j] = dy[r * cols + j] - sm[r * cols + j] * sd;
            }
        }
        const unsigned t = row_threads(cols);
        char what[64];
        emu_launch(rows, t, 0, [&] { softmax_f32(x.data(), y.data(), rows, cols); });
        snprintf(what, 64, "softmax cols %llu", cols); check(what, y, sm, 1e-5);
        emu_launch(rows, t, 0, [&] { softmax_backward_f32(y.data(), dy.data(), dx.data(), rows, cols); });
        snprintf(what, 64, "softmax_backward cols %llu", cols); check(what, dx, dsm, 1e-5);
        emu_launch(rows, t, 0, [&] { log_softmax_f32(x.data(), l.data(), rows, cols); });
        // Element 1 (about -1e30) is checked relative to itself, the rest at
        // the scale of the others, which it would otherwise swamp.
        if (!(std::fabs(l[1] / lsm[1] - 1.0) < 1e-6)) { printf("FAIL log_softmax of -1e30 is %g\n", l[1]); failures++; }
        std::vector<float> l_rest = l;
        std::vector<double> lsm_rest = lsm;
        l_rest[1] = 0.0f, lsm_rest[1] = 0.0;
        snprintf(what, 64, "log_softmax cols %llu", cols); check(what, l_rest, lsm_rest, 1e-5);
        emu_launch(rows, t, 0, [&] { log_softmax_backward_f32(l.data(), dy.data(), dx.data(), rows, cols); });
        snprintf(what, 64, "log_softmax_backward cols %llu", cols); check(what, dx, dlsm, 1e-5);

        // Cross-entropy: row 1 ignored (target 0 is the ignore index in this check).
        std::vector<unsigned> targets = {(unsigned)(cols - 1), 0u, (unsigned)(cols / 2)};
        std::vector<float> a(rows), b(rows), grad(rows * cols), dloss = {0.5f, 0.5f, -0.25f};
        std::vector<double> loss(rows), lse_ref(rows), g(rows * cols);
        for (u64 r = 0; r < rows; r++) {
            const bool ignored = targets[r] == 0;
            loss[r] = ignored ? 0 : lse[r] - x[r * cols + targets[r]];
            lse_ref[r] = ignored ? 0 : lse[r];
            for (u64 j = 0; j < cols; j++)
                g[r * cols + j] = ignored ? 0 : dloss[r] * (sm[r * cols + j] - (j == targets[r] ? 1.0 : 0.0));
        }
        emu_launch(rows, t, 0, [&] { cross_entropy_rows_f32(x.data(), targets.data(), a.data(), b.data(), rows, cols, 0, 0, 1); });
        snprintf(what, 64, "cross_entropy loss cols %llu", cols); check(what, a, loss, 1e-5);
        snprintf(what, 64, "cross_entropy lse cols %llu", cols); check(what, b, lse_ref, 1e-5);
        std::vector<float> lsef(lse.begin(), lse.end());
        emu_launch(rows, t, 0, [&] { cross_entropy_backward_f32(x.data(), lsef.data(), dloss.data(), targets.data(), grad.data(), rows, cols, 0, 0); });
        snprintf(what, 64, "cross_entropy_backward cols %llu", cols); check(what, grad, g, 1e-5);
        // The same rows as a shard holding entries 1000.. of a larger vocabulary, no ignore index.
        std::vector<unsigned> shard_t = {1000u + (unsigned)(cols - 1), 3u, 1000u};
        std::vector<double> tl = {x[cols - 1], 0, x[2 * cols]};
        emu_launch(rows, t, 0, [&] { cross_entropy_rows_f32(x.data(), shard_t.data(), a.data(), b.data(), rows, cols, 1000, ~0ull, 0); });
        snprintf(what, 64, "vocab_shard_stats lse cols %llu", cols); check(what, a, lse, 1e-5);
        snprintf(what, 64, "vocab_shard_stats target cols %llu", cols); check(what, b, tl, 0);
    }

    // Embedding: 5 rows of 40, ids with repeats and one outside the shard 2..7.
    {
        const u64 rows = 5, dim = 40, start = 2;
        std::vector<unsigned> ids = {3, 9, 3, 6, 2, 3};
        auto table = values(rows * dim, 3), dout = values(ids.size() * dim, 4);
        std::vector<float> out(ids.size() * dim), dtable(rows * dim);
        std::vector<double> want(ids.size() * dim, 0), dwant(rows * dim, 0);
        std::vector<unsigned> offsets(rows + 1, 0), order;
        for (size_t i = 0; i < ids.size(); i++)
            if (ids[i] >= start && ids[i] - start < rows)
                for (u64 j = 0; j < dim; j++) {
                    want[i * dim + j] = table[(ids[i] - start) * dim + j];
                    dwant[(ids[i] - start) * dim + j] += dout[i * dim + j];
                }
        for (u64 r = 0; r < rows; r++) {
            for (size_t i = 0; i < ids.size(); i++) if (ids[i] - start == r && ids[i] >= start) order.push_back((unsigned)i);
            offsets[r + 1] = (unsigned)order.size();
        }
        emu_launch(2, 64, 0, [&] { embedding_f32(table.data(), ids.data(), out.data(), ids.size(), rows, dim, start); });
        check("embedding", out, want, 0);
        emu_launch(rows, row_threads(dim), 0, [&] { embedding_backward_f32(dout.data(), offsets.data(), order.data(), dtable.data(), rows, dim); });
        check("embedding_backward", dtable, dwant, 1e-6);
    }

    // RoPE, packed: 2 kv heads with 2 query heads each, head_dim 8, 3 positions.
    {
        const u64 kv = 2, group = 2, hd = 8, half = 4, seq = 3, batch = 2;
        const u64 per_position = kv * (group + 2), rows = batch * seq * per_position;
        std::vector<unsigned> pos = {5, 6, 7};
        std::vector<float> table(2 * seq * half);
        std::vector<double> c(seq * half), s(seq * half);
        for (u64 t = 0; t < seq; t++)
            for (u64 k = 0; k < half; k++) {
                double a = pos[t] * std::pow(10000.0, -2.0 * k / hd);
                c[t * half + k] = std::cos(a); s[t * half + k] = std::sin(a);
                table[t * half + k] = (float)std::cos(a); table[(seq + t) * half + k] = (float)std::sin(a);
            }
        auto x = values(rows * hd, 5);
        std::vector<float> y(rows * hd), back(rows * hd);
        std::vector<double> want(rows * hd);
        for (u64 r = 0; r < rows; r++) {
            const u64 t = (r / per_position) % seq;
            for (u64 k = 0; k < half; k++) {
                const double u = x[r * hd + k], v = x[r * hd + half + k];
                if (r % (group + 2) >= group + 1) { want[r * hd + k] = u; want[r * hd + half + k] = v; continue; }
                want[r * hd + k] = u * c[t * half + k] - v * s[t * half + k];
                want[r * hd + half + k] = v * c[t * half + k] + u * s[t * half + k];
            }
        }
        emu_launch(3, 64, 0, [&] { rope_f32(x.data(), y.data(), table.data(), rows, seq, half, per_position, group + 2, group + 1, 1.0f); });
        check("rope_packed", y, want, 1e-6);
        emu_launch(3, 64, 0, [&] { rope_f32(y.data(), back.data(), table.data(), rows, seq, half, per_position, group + 2, group + 1, -1.0f); });
        std::vector<double> xd(x.begin(), x.end());
        check("rope_packed_backward undoes it", back, xd, 1e-6);
    }
    // max_abs over more elements than the block has threads; a NaN wins.
    {
        auto x = values(3000, 9);
        x[2077] = -7.5f;
        std::vector<float> m(1);
        emu_launch(1, 1024, 0, [&] { max_abs_f32(x.data(), m.data(), x.size()); });
        check("max_abs", m, {7.5}, 0);
        x[11] = NAN;
        emu_launch(1, 1024, 0, [&] { max_abs_f32(x.data(), m.data(), x.size()); });
        if (m[0] == m[0]) { printf("FAIL max_abs with a NaN is %g\n", m[0]); failures++; } else printf("ok   max_abs of a NaN\n");
        emu_launch(1, 32, 0, [&] { max_abs_f32(x.data(), m.data(), 0); });
        check("max_abs of nothing", m, {0.0}, 0);
    }
    // Top-k: rows shorter than a warp, of a few warps, and longer than a
    // block, with few distinct values (ties everywhere), NaNs (one seeds the
    // first round), -inf, and +0 beside -0 (equal, so ordered by index).
    // Checked exactly against a full stable sort in the CPU's order, in f32
    // and bf16; the backward against the CPU's in-order f32 scatter.
    for (u64 cols : {5ull, 70ull, 1100ull}) {
        const u64 rows = 3;
        auto x = values(rows * cols, 11u + (unsigned)cols);
        for (auto& v : x) v = std::round(v * 1.5f);
        for (u64 j = 0; j < rows * cols; j += 7) x[j] = NAN;
        x[1] = -INFINITY, x[2] = -0.0f, x[3] = 0.0f;
        // A NaN with another payload, so copying the value (not a canonical NaN) shows.
        x[cols] = __uint_as_float(0x7fc01234u);
        auto rank_order = [&](const float* xr) {
            std::vector<unsigned> order(cols);
            for (unsigned j = 0; j < cols; j++) order[j] = j;
            std::stable_sort(order.begin(), order.end(), [&](unsigned a, unsigned b) {
                const float va = xr[a], vb = xr[b];
                if (std::isnan(va) || std::isnan(vb)) return !std::isnan(va) && std::isnan(vb);
                return va > vb;
            });
            return order;
        };
        for (u64 k : {1ull, 3ull, std::min<u64>(cols, 9ull), cols}) {
            if (cols > 100 && k == cols) continue;  // k rounds of 1024 emulated threads: too slow here
            std::vector<float> v(rows * k);
            std::vector<unsigned> idx(rows * k);
            std::vector<bf16> xb(rows * cols), vb(rows * k);
            std::vector<unsigned> idxb(rows * k);
            for (u64 j = 0; j < rows * cols; j++) xb[j].bits = (unsigned short)(__float_as_uint(x[j]) >> 16);
            std::vector<float> xbf(rows * cols);
            for (u64 j = 0; j < rows * cols; j++) xbf[j] = to_f32(xb[j]);
            emu_launch(2, row_threads(cols), 0, [&] { topk_f32(x.data(), v.data(), idx.data(), rows, cols, k); });
            emu_launch(2, row_threads(cols), 0, [&] { topk_bf16(xb.data(), vb.data(), idxb.data(), rows, cols, k); });
            bool ok = true;
            for (u64 r = 0; r < rows && ok; r++) {
                const auto want = rank_order(&x[r * cols]), want_b = rank_order(&xbf[r * cols]);
                for (u64 t = 0; t < k && ok; t++) {
                    const u64 o = r * k + t;
                    ok = idx[o] == want[t] && __float_as_uint(v[o]) == __float_as_uint(x[r * cols + want[t]])
                         && idxb[o] == want_b[t] && vb[o].bits == xb[r * cols + want_b[t]].bits;
                    if (!ok) printf("FAIL topk cols %llu k %llu: row %llu place %llu is (%g, %u) / bf16 %u, want index %u / %u\n",
                                    cols, k, r, t, v[o], idx[o], idxb[o], want[t], want_b[t]);
                }
            }
            if (ok) printf("ok   topk cols %llu k %llu\n", cols, k); else failures++;
        }
        // Backward: row 0 as topk gives it, row 1 with a repeated index
        // (summed in order), row 2 with an index past the row (skipped).
        const u64 k = std::min<u64>(cols, 4ull);
        std::vector<unsigned> idx(rows * k);
        std::vector<float> v(rows * k), dv = values(rows * k, 21u), dx(rows * cols, NAN);
        emu_launch(2, row_threads(cols), 0, [&] { topk_f32(x.data(), v.data(), idx.data(), rows, cols, k); });
        idx[k + k - 1] = idx[k];
        idx[2 * k] = (unsigned)cols;
        std::vector<float> want(rows * cols, 0.0f);
        for (u64 r = 0; r < rows; r++)
            for (u64 j = 0; j < k; j++)
                if (idx[r * k + j] < cols) want[r * cols + idx[r * k + j]] += dv[r * k + j];
        std::fill(dx.begin(), dx.end(), 0.0f);  // the launcher zeroes dx
        emu_launch(2, 64, 0, [&] { topk_backward_f32(idx.data(), dv.data(), dx.data(), rows, cols, k); });
        bool ok = true;
        for (u64 j = 0; j < rows * cols && ok; j++) {
            ok = __float_as_uint(dx[j]) == __float_as_uint(want[j]);
            if (!ok) printf("FAIL topk_backward cols %llu: element %llu is %g, want %g\n", cols, j, dx[j], want[j]);
        }
        if (ok) printf("ok   topk_backward cols %llu\n", cols); else failures++;
    }
    if (failures) { printf("%d failures\n", failures); return 1; }
    printf("all ops checks passed\n");
}
