// Checks the logic of the norm kernels (norm.cu: LayerNorm, RMSNorm, their
// input and parameter gradients) and of the multi-tensor AdamW step
// (adamw.cu) on the CPU against double-precision references, under the host
// emulation of shim.h; see scripts/cuda-host-check.sh. f32 only.
#include "rows.h"
#include "norm.inc"
#include "adamw.inc"

// LayerNorm (with_mean) or RMSNorm of one row and the input gradient, in double.
static void norm_reference(bool with_mean, const float* x, const float* gamma, const float* beta, const float* dy, u64 cols, double eps,
                           double* y, double* dx, double& mean_out, double& rstd_out) {
    double mean = 0, var = 0;
    if (with_mean) { for (u64 j = 0; j < cols; j++) mean += x[j]; mean /= cols; }
    for (u64 j = 0; j < cols; j++) var += (x[j] - mean) * (x[j] - mean);
    const double rstd = 1.0 / std::sqrt(var / cols + eps);
    double mg = 0, mgx = 0;
    for (u64 j = 0; j < cols; j++) {
        const double xhat = (x[j] - mean) * rstd, g = (double)dy[j] * gamma[j];
        y[j] = xhat * gamma[j] + (beta ? beta[j] : 0.0);
        mg += g; mgx += g * xhat;
    }
    mg /= cols; mgx /= cols;
    for (u64 j = 0; j < cols; j++) {
        const double xhat = (x[j] - mean) * rstd, g = (double)dy[j] * gamma[j];
        dx[j] = rstd * (g - (with_mean ? mg : 0.0) - xhat * mgx);
    }
    mean_out = mean; rstd_out = rstd;
}

int main() {
    // Rows shorter than a warp, longer than the block, and in between;
    // more rows than blocks so the grid-stride loop over rows runs.
    for (u64 cols : {7ull, 100ull, 1500ull}) {
        const u64 rows = 5;
        const float eps = 1e-5f;
        auto x = values(rows * cols, (unsigned)cols), gamma = values(cols, 3u + (unsigned)cols), beta = values(cols, 5u), dy = values(rows * cols, 11u);
        for (bool with_mean : {true, false}) {
            std::vector<double> y(rows * cols), dx(rows * cols), mean(rows), rstd(rows), dgamma(cols, 0), dbeta(cols, 0);
            for (u64 r = 0; r < rows; r++)
                norm_reference(with_mean, &x[r * cols], gamma.data(), with_mean ? beta.data() : nullptr, &dy[r * cols], cols, eps, &y[r * cols], &dx[r * cols], mean[r], rstd[r]);
            for (u64 r = 0; r < rows; r++)
                for (u64 j = 0; j < cols; j++) {
                    dgamma[j] += dy[r * cols + j] * (x[r * cols + j] - mean[r]) * rstd[r];
                    dbeta[j] += dy[r * cols + j];
                }
            std::vector<float> got_y(rows * cols), got_mean(rows), got_rstd(rows), got_dx(rows * cols), got_dgamma(cols), got_dbeta(cols);
            const unsigned t = row_threads(cols);
            char what[80];
            const char* name = with_mean ? "layernorm" : "rmsnorm";
            if (with_mean)
                emu_launch(2, t, 0, [&] { layernorm_f32(x.data(), gamma.data(), beta.data(), got_y.data(), got_mean.data(), got_rstd.data(), rows, cols, eps); });
            else
                emu_launch(2, t, 0, [&] { rmsnorm_f32(x.data(), gamma.data(), got_y.data(), got_rstd.data(), rows, cols, eps); });
            snprintf(what, 80, "%s cols %llu", name, cols); check(what, got_y, y, 1e-5);
            snprintf(what, 80, "%s rstd cols %llu", name, cols); check(what, got_rstd, rstd, 1e-5);
            if (with_mean) { snprintf(what, 80, "%s mean cols %llu", name, cols); check(what, got_mean, mean, 1e-5); }
            const float* mean_arg = with_mean ? got_mean.data() : nullptr;
            emu_launch(2, t, 0, [&] { norm_backward_f32(x.data(), gamma.data(), mean_arg, got_rstd.data(), dy.data(), got_dx.data(), rows, cols); });
            snprintf(what, 80, "%s backward cols %llu", name, cols); check(what, got_dx, dx, 1e-5);
            float* dbeta_arg = with_mean ? got_dbeta.data() : nullptr;
            emu_launch(1, 64, 0, [&] { norm_param_grad_f32(x.data(), mean_arg, got_rstd.data(), dy.data(), got_dgamma.data(), dbeta_arg, rows, cols); });
            snprintf(what, 80, "%s dgamma cols %llu", name, cols); check(what, got_dgamma, dgamma, 1e-5);
            if (with_mean) { snprintf(what, 80, "%s dbeta cols %llu", name, cols); check(what, got_dbeta, dbeta, 1e-5); }
        }
    }

    // AdamW: two tensors with their own hyper-parameters (step counts) in
    // one table, three updates each.
    {
        const u64 n[2] = {300, 70};
        const unsigned steps[2] = {1, 6};
        std::vector<float> p[2], g[2], m[2], v[2];
        std::vector<double> pw[2], mw[2], vw[2];
        for (int k = 0; k < 2; k++) {
            p[k] = values(n[k], 20u + k); m[k].assign(n[k], 0.0f); v[k].assign(n[k], 0.0f);
            pw[k].assign(p[k].begin(), p[k].end()); mw[k].assign(n[k], 0.0); vw[k].assign(n[k], 0.0);
        }
        const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1, scale = 0.5;
        for (unsigned round = 0; round < 3; round++) {
            AdamWTensor table[2];
            for (int k = 0; k < 2; k++) {
                g[k] = values(n[k], 100u * round + k);
                const unsigned step = steps[k] + round;
                const double bc1 = 1 - std::pow(b1, step), bc2 = 1 - std::pow(b2, step);
                for (u64 i = 0; i < n[k]; i++) {
                    const double gg = g[k][i] * scale;
                    mw[k][i] = b1 * mw[k][i] + (1 - b1) * gg;
                    vw[k][i] = b2 * vw[k][i] + (1 - b2) * gg * gg;
                    pw[k][i] -= lr * (mw[k][i] / bc1 / (std::sqrt(vw[k][i] / bc2) + eps) + wd * pw[k][i]);
                }
                table[k] = AdamWTensor{p[k].data(), g[k].data(), m[k].data(), v[k].data(), nullptr, n[k],
                                       AdamWHyper{(float)lr, (float)b1, (float)b2, (float)eps, (float)wd, (float)scale, (float)bc1, (float)bc2}};
            }
            // One "block row" per tensor, as the launch's grid.y does.
            for (int k = 0; k < 2; k++) emu_launch(2, 64, 0, [&] { blockIdx.y = k; adamw_f32(table); });
        }
        for (int k = 0; k < 2; k++) {
            char what[40];
            snprintf(what, 40, "adamw tensor %d param", k); check(what, p[k], pw[k], 1e-5);
            snprintf(what, 40, "adamw tensor %d m", k); check(what, m[k], mw[k], 1e-5);
            snprintf(what, 40, "adamw tensor %d v", k); check(what, v[k], vw[k], 1e-5);
        }
    }
    if (failures) { printf("%d failures\n", failures); return 1; }
    printf("all norm and adamw checks passed\n");
}
