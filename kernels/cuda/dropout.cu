// Dropout with the mask of kernels/src/cpu/dropout.rs, bit for bit: element
// i is kept when the top 24 bits of the counter-based generator's word
// start + i (Philox-4x32-10 of kernels/src/rng.rs: counter (block, stream),
// key seed, word i & 3 of block i >> 2) are at least `threshold`
// (ceil(p * 2^24)); kept elements are scaled by `scale` (1 / (1 - p)). The
// backward is the same map on the upstream gradient.

__device__ __forceinline__ unsigned int philox_word(u64 index, u64 seed, u64 stream) {
    unsigned int c0 = (unsigned int)(index >> 2), c1 = (unsigned int)(index >> 34);
    unsigned int c2 = (unsigned int)stream, c3 = (unsigned int)(stream >> 32);
    unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
    #pragma unroll
    for (int round = 0; round < 10; round++) {
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    switch (index & 3) {
        case 0: return c0;
        case 1: return c1;
        case 2: return c2;
        default: return c3;
    }
}

#define DROPOUT(T, S)                                                                               \
    extern "C" __global__ void dropout_##S(const T* x, T* y, u64 n, u64 start, u64 seed, u64 stream, \
                                           unsigned int threshold, float scale) {                   \
        for (u64 i = grid_start(); i < n; i += grid_stride()) {                                     \
            const bool keep = (philox_word(start + i, seed, stream) >> 8) >= threshold;             \
            y[i] = from_f32<T>(keep ? to_f32(x[i]) * scale : 0.0f);                                 \
        }                                                                                           \
    }

FOR_FLOAT_TYPES(DROPOUT)
