// What the row kernels see of common.cuh under the host emulation of
// shim.h: the grid-stride loop bounds, the block reduction, and a check
// against a double-precision reference.
#pragma once
#include "shim.h"
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline u64 grid_start() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
inline u64 grid_stride() { return (u64)gridDim.x * blockDim.x; }
// common.cuh's block reduction, as the kernels see it.
inline float block_sum(float v, float* scratch) {
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int warps = (blockDim.x + 31) / 32;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

static int failures = 0;
// Agreement relative to the largest expected magnitude (at least 1e-3).
static void check(const char* what, const std::vector<float>& got, const std::vector<double>& want, double tol) {
    double scale = 1e-3;
    for (double w : want) scale = std::max(scale, std::fabs(w));
    for (size_t i = 0; i < want.size(); i++) {
        if (!(std::fabs(got[i] - want[i]) <= tol * scale)) {
            printf("FAIL %s: element %zu is %g, want %g\n", what, i, got[i], want[i]);
            failures++;
            return;
        }
    }
    printf("ok   %s\n", what);
}
// n reproducible values in [-2, 2).
static std::vector<float> values(size_t n, unsigned seed) {
    std::vector<float> v(n);
    for (auto& x : v) { seed = seed * 1664525u + 1013904223u; x = (float)((seed >> 8) % 4000) / 1000.0f - 2.0f; }
    return v;
}
// The block size the runtime's Grid::Rows picks.
static unsigned row_threads(u64 cols) { return (unsigned)((std::clamp<u64>(cols, 1, 1024) + 31) / 32 * 32); }
