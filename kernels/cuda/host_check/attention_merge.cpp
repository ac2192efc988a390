// Checks the ring-attention merge (attention_merge.cu) on the CPU under the
// host emulation of shim.h; see scripts/cuda-host-check.sh. The reference
// is the definition, independent of the kernel's arithmetic: softmax over
// the union of two key sets, from explicit per-key scores in double. Rows
// whose partial saw no key (lse_b = -inf) must keep their running values,
// one that had none before takes the partial's, and one with neither stays
// empty (its lse -inf, its values untouched, no NaN).
#include "rows.h"
using std::fmaxf;  // expf and logf are in the global namespace
#include "attention_merge.inc"

int main() {
    const u64 rows = 37, d = 5, keys_a = 3, keys_b = 4;
    auto s = values(rows * (keys_a + keys_b), 1), v = values(rows * (keys_a + keys_b) * d, 2);
    // Partial attention of each row over keys [from, to): its output and log-sum-exp.
    auto partial = [&](u64 from, u64 to, std::vector<float>& out, std::vector<float>& lse) {
        for (u64 r = 0; r < rows; r++) {
            double z = 0;
            for (u64 k = from; k < to; k++) z += std::exp((double)s[r * 7 + k]);
            lse[r] = (float)std::log(z);
            for (u64 j = 0; j < d; j++) {
                double acc = 0;
                for (u64 k = from; k < to; k++) acc += std::exp((double)s[r * 7 + k]) / z * v[(r * 7 + k) * d + j];
                out[r * d + j] = (float)acc;
            }
        }
    };
    std::vector<float> oa(rows * d), la(rows), ob(rows * d), lb(rows), out(rows * d), lse(rows);
    partial(0, keys_a, oa, la);
    partial(keys_a, keys_a + keys_b, ob, lb);
    lb[4] = -INFINITY;  // a row whose partial saw no key
    la[5] = -INFINITY;  // a row that had seen no key before
    la[6] = lb[6] = -INFINITY;  // a row that has seen none at all
    emu_launch(3, 32, 0, [&] { attention_merge_f32(oa.data(), la.data(), ob.data(), lb.data(), out.data(), lse.data(), rows, d); });
    std::vector<double> want(rows * d), want_lse(rows);
    for (u64 r = 0; r < rows; r++) {
        const u64 from = r == 5 ? keys_a : 0, to = r == 4 ? keys_a : keys_a + keys_b;
        double z = 0;
        for (u64 k = from; k < to; k++) z += std::exp((double)s[r * 7 + k]);
        want_lse[r] = std::log(z);
        for (u64 j = 0; j < d; j++) {
            double acc = 0;
            for (u64 k = from; k < to; k++) acc += std::exp((double)s[r * 7 + k]) / z * v[(r * 7 + k) * d + j];
            want[r * d + j] = acc;
        }
    }
    // The empty row: compared on its own (−∞ − −∞ is NaN), then left out.
    bool empty_ok = lse[6] == -INFINITY;
    for (u64 j = 0; j < d; j++) empty_ok &= out[6 * d + j] == oa[6 * d + j];
    printf("%s attention_merge empty row\n", empty_ok ? "ok  " : "FAIL");
    failures += !empty_ok;
    lse[6] = 0; want_lse[6] = 0;
    for (u64 j = 0; j < d; j++) out[6 * d + j] = 0, want[6 * d + j] = 0;
    check("attention_merge out", out, want, 1e-5);
    check("attention_merge lse", lse, want_lse, 1e-5);
    return failures ? 1 : 0;
}
