// Quantized matrix products for decode, as kernels/src/cpu/quant/ computes
// them: y[r, j] = sum_k x[r, k] * dequant(W)[j, k] (+ bias[j]), W [n, k] a
// linear layer's weight, x [m, k] and y [m, n] in the op's dtype T.
//
// Formats (the CPU's, byte for byte):
// - int8: codes q in -127..127 row-major, one f32 scale per row;
// - int4: two codes per byte, stored as q + 8; a row is k / group groups of
//   group / 2 bytes, byte b of a group holding weight b of the group in its
//   low nibble and weight b + group / 2 in its high nibble; one f32 scale per
//   group, [n, k / group];
// - W8A8: the int8 weight, and x quantized per row first (quantize_rows:
//   sx = max|x_r| / 127, codes roundf(x / sx)); i8 * i8 products summed
//   exactly in i32 (dp4a), then scaled by sx * s.
//
// GEMV-style, for few rows of x: one warp per output channel (grid-stride
// over the channels), its lanes striding over the channel's codes with one
// partial sum per row of x, QROWS rows at a time, then a warp reduction per
// row. Each code is read once per QROWS rows of x, four bytes per load where
// the layout allows (int8 and W8A8: k a multiple of 4; int4: groups of a
// multiple of 8 weights), byte by byte otherwise. Any block size of whole
// warps works; the runtime launches 256 threads.

#define QROWS 8

#if defined(__CUDACC_RTC__) || defined(__CUDACC__)
// The four signed bytes of a times those of b, summed, plus c (sm_61 on).
__device__ __forceinline__ int dot4_i8(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Wrapping adds in unsigned arithmetic are the i32 adds: the sum is exact
// while it fits i32 (the runtime bounds k).
__device__ __forceinline__ int warp_sum_i32(int v) {
    unsigned int u = (unsigned int)v;
    for (int o = 16; o > 0; o /= 2) u += __shfl_xor_sync(0xffffffffu, u, o);
    return (int)u;
}

// Byte i (0..3) of a little-endian word as a signed code.
__device__ __forceinline__ float code_i8(unsigned int w, int i) { return (float)(signed char)(w >> (8 * i)); }

// The code in the nibble at bit `shift` of a word: the stored value minus 8.
__device__ __forceinline__ float code_i4(unsigned int w, int shift) { return (float)((int)((w >> shift) & 15u) - 8); }

// The warp's index among all warps of the grid, and how many there are.
__device__ __forceinline__ u64 global_warp() { return ((u64)blockIdx.x * blockDim.x + threadIdx.x) / 32; }
__device__ __forceinline__ u64 warp_count() { return ((u64)gridDim.x * blockDim.x) / 32; }

// y[r0 + r, j] for the rows < rows of this chunk: each row's partials summed
// over the warp, scaled, the bias added, written by lane 0. `rows` is the
// same in every lane, so every lane joins every shuffle.
template <typename T>
__device__ __forceinline__ void store_rows(float* acc, u64 rows, float scale, float b, T* y, u64 r0, u64 n, u64 j) {
#pragma unroll
    for (int r = 0; r < QROWS; r++) {
        if ((u64)r < rows) {
            const float v = warp_sum(acc[r]);
            if (threadIdx.x % 32 == 0) y[(r0 + r) * n + j] = from_f32<T>(v * scale + b);
        }
    }
}

#define QUANT_MATMUL_INT8(T, S)                                                                          \
    extern "C" __global__ void quant_matmul_int8_##S(const T* x, const signed char* q,                   \
                                                     const float* scales, const T* bias, T* y, u64 m,    \
                                                     u64 n, u64 k) {                                     \
        const unsigned int lane = threadIdx.x % 32;                                                      \
        for (u64 j = global_warp(); j < n; j += warp_count()) {                                          \
            const signed char* row = q + j * k;                                                          \
            const float b = bias ? to_f32(bias[j]) : 0.0f;                                               \
            for (u64 r0 = 0; r0 < m; r0 += QROWS) {                                                      \
                const u64 rows = m - r0 < QROWS ? m - r0 : QROWS;                                        \
                float acc[QROWS];                                                                        \
                for (int r = 0; r < QROWS; r++) acc[r] = 0.0f;                                           \
                if (k % 4 == 0) {                                                                        \
                    for (u64 c = 4 * lane; c < k; c += 128) {                                            \
                        const unsigned int w = *(const unsigned int*)(row + c);                          \
                        const float q0 = code_i8(w, 0), q1 = code_i8(w, 1);                              \
                        const float q2 = code_i8(w, 2), q3 = code_i8(w, 3);                              \
                        _Pragma("unroll") for (int r = 0; r < QROWS; r++) {                              \
                            if ((u64)r < rows) {                                                         \
                                const T* xr = x + (r0 + r) * k + c;                                      \
                                acc[r] += to_f32(xr[0]) * q0 + to_f32(xr[1]) * q1 + to_f32(xr[2]) * q2 + \
                                          to_f32(xr[3]) * q3;                                            \
                            }                                                                            \
                        }                                                                                \
                    }                                                                                    \
                } else {                                                                                 \
                    for (u64 c = lane; c < k; c += 32) {                                                 \
                        const float qc = (float)row[c];                                                  \
                        _Pragma("unroll") for (int r = 0; r < QROWS; r++) {                              \
                            if ((u64)r < rows) acc[r] += to_f32(x[(r0 + r) * k + c]) * qc;               \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
                store_rows<T>(acc, rows, scales[j], b, y, r0, n, j);                                     \
            }                                                                                            \
        }                                                                                                \
    }

// int4: four bytes hold weights c..c+3 of a group (low nibbles) and
// c+half..c+half+3 (high nibbles); every group's scale multiplies its codes.
#define QUANT_MATMUL_INT4(T, S)                                                                          \
    extern "C" __global__ void quant_matmul_int4_##S(const T* x, const unsigned char* packed,            \
                                                     const float* scales, const T* bias, T* y, u64 m,    \
                                                     u64 n, u64 k, u64 group) {                          \
        const unsigned int lane = threadIdx.x % 32;                                                      \
        const u64 half = group / 2, groups = k / group, bytes = k / 2;                                   \
        for (u64 j = global_warp(); j < n; j += warp_count()) {                                          \
            const unsigned char* row = packed + j * bytes;                                               \
            const float* srow = scales + j * groups;                                                     \
            const float b = bias ? to_f32(bias[j]) : 0.0f;                                               \
            for (u64 r0 = 0; r0 < m; r0 += QROWS) {                                                      \
                const u64 rows = m - r0 < QROWS ? m - r0 : QROWS;                                        \
                float acc[QROWS];                                                                        \
                for (int r = 0; r < QROWS; r++) acc[r] = 0.0f;                                           \
                if (half % 4 == 0) {                                                                     \
                    for (u64 c = 4 * lane; c < bytes; c += 128) {                                        \
                        const unsigned int w = *(const unsigned int*)(row + c);                          \
                        const u64 g = c / half, kk = g * group + c % half;                               \
                        const float s = srow[g];                                                         \
                        float lo[4], hi[4];                                                              \
                        for (int i = 0; i < 4; i++) {                                                    \
                            lo[i] = code_i4(w, 8 * i) * s;                                               \
                            hi[i] = code_i4(w, 8 * i + 4) * s;                                           \
                        }                                                                                \
                        _Pragma("unroll") for (int r = 0; r < QROWS; r++) {                              \
                            if ((u64)r < rows) {                                                         \
                                const T* xr = x + (r0 + r) * k + kk;                                     \
                                float a = 0.0f;                                                          \
                                for (int i = 0; i < 4; i++)                                              \
                                    a += to_f32(xr[i]) * lo[i] + to_f32(xr[half + i]) * hi[i];           \
                                acc[r] += a;                                                             \
                            }                                                                            \
                        }                                                                                \
                    }                                                                                    \
                } else {                                                                                 \
                    for (u64 c = lane; c < bytes; c += 32) {                                             \
                        const unsigned int w = row[c];                                                   \
                        const u64 g = c / half, kk = g * group + c % half;                               \
                        const float lo = code_i4(w, 0) * srow[g], hi = code_i4(w, 4) * srow[g];          \
                        _Pragma("unroll") for (int r = 0; r < QROWS; r++) {                              \
                            if ((u64)r < rows) {                                                         \
                                const T* xr = x + (r0 + r) * k + kk;                                     \
                                acc[r] += to_f32(xr[0]) * lo + to_f32(xr[half]) * hi;                    \
                            }                                                                            \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
                store_rows<T>(acc, rows, 1.0f, b, y, r0, n, j);                                          \
            }                                                                                            \
        }                                                                                                \
    }

// The largest |v| over the block, valid in every thread (blocks of whole
// warps, at most 32 of them; `scratch` holds one value per warp).
__device__ __forceinline__ float block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (blockDim.x + 31) / 32 ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// W8A8's activations: one block per row of x, sx[r] = max|x_r| / 127 (NaN
// when the row holds a NaN, so its outputs are NaN as on the CPU), codes
// roundf(x / sx) in -127..127 (0 for a zero or NaN scale).
#define QUANTIZE_ROWS(T, S)                                                                              \
    extern "C" __global__ void quantize_rows_##S(const T* x, signed char* xq, float* sx, u64 m, u64 k) { \
        __shared__ float scratch[32];                                                                    \
        for (u64 r = blockIdx.x; r < m; r += gridDim.x) {                                                \
            const T* xr = x + r * k;                                                                     \
            float mx = 0.0f, nans = 0.0f;                                                                \
            for (u64 c = threadIdx.x; c < k; c += blockDim.x) {                                          \
                const float v = fabsf(to_f32(xr[c]));                                                    \
                if (v != v) nans = 1.0f;                                                                 \
                else mx = fmaxf(mx, v);                                                                  \
            }                                                                                            \
            mx = block_max(mx, scratch);                                                                 \
            nans = block_sum(nans, scratch);                                                             \
            const float s = nans > 0.0f ? __uint_as_float(0x7fc00000u) : mx / 127.0f;                    \
            for (u64 c = threadIdx.x; c < k; c += blockDim.x) {                                          \
                const float qc = s > 0.0f ? fminf(fmaxf(roundf(to_f32(xr[c]) / s), -127.0f), 127.0f)    \
                                          : 0.0f;                                                        \
                xq[r * k + c] = (signed char)(int)qc;                                                    \
            }                                                                                            \
            if (threadIdx.x == 0) sx[r] = s;                                                             \
        }                                                                                                \
    }

// W8A8's product: the codes of x and W meet four at a time in dp4a.
#define QUANT_MATMUL_W8A8(T, S)                                                                          \
    extern "C" __global__ void quant_matmul_w8a8_##S(const signed char* xq, const float* sx,             \
                                                     const signed char* q, const float* scales,          \
                                                     const T* bias, T* y, u64 m, u64 n, u64 k) {         \
        const unsigned int lane = threadIdx.x % 32;                                                      \
        for (u64 j = global_warp(); j < n; j += warp_count()) {                                          \
            const signed char* row = q + j * k;                                                          \
            const float b = bias ? to_f32(bias[j]) : 0.0f;                                               \
            for (u64 r0 = 0; r0 < m; r0 += QROWS) {                                                      \
                const u64 rows = m - r0 < QROWS ? m - r0 : QROWS;                                        \
                int acc[QROWS];                                                                          \
                for (int r = 0; r < QROWS; r++) acc[r] = 0;                                              \
                if (k % 4 == 0) {                                                                        \
                    for (u64 c = 4 * lane; c < k; c += 128) {                                            \
                        const int w = *(const int*)(row + c);                                            \
                        _Pragma("unroll") for (int r = 0; r < QROWS; r++) {                              \
                            if ((u64)r < rows) acc[r] = dot4_i8(*(const int*)(xq + (r0 + r) * k + c), w, \
                                                                acc[r]);                                 \
                        }                                                                                \
                    }                                                                                    \
                } else {                                                                                 \
                    for (u64 c = lane; c < k; c += 32) {                                                 \
                        const int qc = row[c];                                                           \
                        _Pragma("unroll") for (int r = 0; r < QROWS; r++) {                              \
                            if ((u64)r < rows) acc[r] += (int)xq[(r0 + r) * k + c] * qc;                 \
                        }                                                                                \
                    }                                                                                    \
                }                                                                                        \
                _Pragma("unroll") for (int r = 0; r < QROWS; r++) {                                      \
                    if ((u64)r < rows) {                                                                 \
                        const int v = warp_sum_i32(acc[r]);                                              \
                        if (lane == 0)                                                                   \
                            y[(r0 + r) * n + j] = from_f32<T>((float)v * (sx[r0 + r] * scales[j]) + b);  \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
    }

FOR_FLOAT_TYPES(QUANT_MATMUL_INT8)
FOR_FLOAT_TYPES(QUANT_MATMUL_INT4)
FOR_FLOAT_TYPES(QUANTIZE_ROWS)
FOR_FLOAT_TYPES(QUANT_MATMUL_W8A8)
