// A host emulation of the CUDA subset that attention.cu uses, so its logic
// (indexing, masking, online softmax, barriers, shuffles) can be checked
// against a reference on a machine with no GPU. One block runs at a time, as
// one std::thread per CUDA thread; __syncthreads is a block-wide barrier,
// __syncwarp a warp-wide one, and a shuffle is a store, a warp-wide barrier,
// a load and a second barrier.
// It says nothing about speed, occupancy or the memory model of a real GPU.
#include <barrier>
#include <thread>
#include <vector>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <algorithm>
using std::min; using std::max;
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)
struct dim3e { unsigned x, y, z; };
thread_local dim3e threadIdx, blockIdx;
dim3e blockDim, gridDim;
alignas(16) float smem[64 * 1024];  // the block's dynamic shared memory
unsigned emu_smem_bytes;
std::barrier<>* emu_block_barrier;
std::barrier<>* emu_warp_barrier[32];
float emu_shfl[1024];
inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_warp_barrier[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
    unsigned t = threadIdx.x, w = t / 32;
    emu_shfl[t] = v; emu_warp_barrier[w]->arrive_and_wait();
    float r = emu_shfl[(t & ~31u) | ((t % 32) ^ o)]; emu_warp_barrier[w]->arrive_and_wait();
    return r;
}
inline unsigned __shfl_xor_sync(unsigned mask, unsigned v, int o) {
    float f; memcpy(&f, &v, 4); f = __shfl_xor_sync(mask, f, o);
    unsigned r; memcpy(&r, &f, 4); return r;
}
inline void __trap() { fprintf(stderr, "trap\n"); abort(); }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
typedef unsigned long long u64;
struct bf16 { unsigned short bits; };
struct f16 { _Float16 h; };
inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) { return __uint_as_float(((unsigned)x.bits) << 16); }
inline float to_f32(f16 x) { return (float)x.h; }
template <typename T> inline T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x) { unsigned u = __float_as_uint(x); bf16 r; r.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); return r; }
template <> inline f16 from_f32<f16>(float x) { f16 r; r.h = (_Float16)x; return r; }
#define FOR_FLOAT_TYPES(M) M(float, f32) M(bf16, bf16) M(f16, f16)
inline void emu_launch(unsigned grid, unsigned block, unsigned smem_bytes, std::function<void()> body) {
    blockDim = {block, 1, 1}; gridDim = {grid, 1, 1}; emu_smem_bytes = smem_bytes;
    for (unsigned b = 0; b < grid; ++b) {
        std::barrier<> bb(block); emu_block_barrier = &bb;
        for (unsigned w = 0; w < (block + 31) / 32; ++w) emu_warp_barrier[w] = new std::barrier<>(std::min(32u, block - 32 * w));
        for (unsigned i = 0; i < smem_bytes / 4; ++i) smem[i] = NAN;  // reading before writing shows
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t) ts.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {b, 0, 0}; body(); });
        for (auto& t : ts) t.join();
        for (unsigned w = 0; w < (block + 31) / 32; ++w) delete emu_warp_barrier[w];
    }
}
