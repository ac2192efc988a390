// Prepended to every kernel source (see kernels/src/cuda.rs).
//
// NVRTC compiles these sources with no include path, so the element types are
// defined here instead of taken from cuda_bf16.h / cuda_fp16.h: a 16-bit
// float is its bit pattern, converted to and from f32 around the arithmetic,
// which is always done in f32 (as the CPU backend does).
//
// Naming rule: an op `foo` on element type T is the symbol `foo_{f32,bf16,f16}`;
// FOR_FLOAT_TYPES instantiates exactly those.

typedef unsigned long long u64;

struct bf16 { unsigned short bits; };
struct f16 { unsigned short bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }

__device__ __forceinline__ float to_f32(bf16 x) {
    return __uint_as_float(((unsigned int)x.bits) << 16);
}

__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float x);

template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }

// Round to nearest, ties to even; a NaN stays a (quiet) NaN.
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    unsigned int u = __float_as_uint(x);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        r.bits = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
    return r;
}

template <> __device__ __forceinline__ f16 from_f32<f16>(float x) {
    f16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
    return r;
}

// The first index of this thread and the stride of a grid-stride loop: any
// grid covers any length, so the launcher picks the grid for occupancy alone.
__device__ __forceinline__ u64 grid_start() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 grid_stride() { return (u64)gridDim.x * blockDim.x; }

#define FOR_FLOAT_TYPES(M) M(float, f32) M(bf16, bf16) M(f16, f16)

// The sum of `v` over the block, valid in every thread. Blocks have at most
// 1024 threads (32 warps); `scratch` holds one partial per warp.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    for (int offset = 16; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const unsigned int warps = (blockDim.x + 31) / 32;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset /= 2) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}
