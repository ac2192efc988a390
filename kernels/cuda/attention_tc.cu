// Fused causal attention on the tensor cores, for bf16 and f16: the same
// semantics, argument struct and outputs as attention.cu (which keeps the f32
// kernels and the backward's `delta` kernel), with every product a warp-wide
// mma.sync.m16n8k16 on 16-bit operands with f32 accumulation. The launch
// geometry is described in kernels/src/cuda/attention_tc.rs; the two must
// change together. Needs sm_80 or newer (the bf16 mma and cvt ...bf16x2);
// the runtime runs attention.cu on older GPUs.
//
// Semantics (as attention.cu). Query head h reads kv head h / (q_heads /
// kv_heads). With `causal`, query i attends keys j <= i + seq_kv - seq_q.
// Scores are scale * q.k; lse (f32, [batch, q_heads, seq_q]) is the
// log-sum-exp of a query's scores, -inf for a query that sees no key, whose
// output row is zero. Every tensor is addressed through an AttnPlace.
//
// Numerics. Scores and every sum are f32 (the products of two 16-bit values
// are exact in f32); `scale` multiplies the f32 scores, so the queries are
// not rounded twice. Two operands are rounded to the element type before
// their product, as FlashAttention-2 does: the probabilities P for P.V and
// P^T.dO, and dS for dS.K and dS^T.Q. The row sums of the softmax use the
// unrounded f32 probabilities.
//
// Tiles. A block has ATC_THREADS = 128 threads, four warps, and works on
// 64-row tiles of queries and keys; warp w owns tile rows 16w..16w+15. Tiles
// are staged in shared memory as 16-bit rows padded to D + 8 elements: a row
// is then 4 banks (mod 32) past the previous one, so the eight rows times four
// words that one fragment load touches hit 32 distinct banks.
//
// Fragments of mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16
// with floating point type"): lane l, g = l / 4, t = l % 4; a register holds
// two 16-bit elements, the lower column (or row, for B) in its low half.
//   A (16 x 16, row major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..2t+1],
//                           a2 = A[g][2t+8..2t+9], a3 = A[g+8][2t+8..2t+9]
//   B (16 x 8, "col"):      b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C, D (16 x 8, f32):     c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1]
// So a row of a row-major tile X gives the B operand of X^T directly (one
// 32-bit shared load per register), and a B operand of X itself is gathered
// from two rows (two 16-bit loads per register). The C fragments of two
// adjacent 8-column tiles, rounded to 16 bits, are the A fragment of the
// 16 x 16 block they cover: scores become the probabilities' A operand
// without a trip through shared memory.
//
// Head dims. One symbol per element type serves every head_dim <= 128: a
// head_dim <= 64 runs the D = 64 instantiation, a larger one the D = 128
// one, with the columns past head_dim staged as zeros and never stored.
//
// Determinism. No atomics: every output element is written by one thread and
// every sum runs in a fixed order.

#define ATC_TILE ATTN_TILE
#define ATC_THREADS 128
#define ATC_PAD 8  // 16-bit elements of padding per staged row

// ---------------------------------------------------------------- device-only instructions
//
// The only inline assembly and the shared array live here; the host emulation
// (kernels/cuda/host_check/shim_mma.h) supplies its own versions of these
// functions, which is how the rest of the file runs on a CPU.
#if defined(__CUDACC_RTC__) || defined(__CUDACC__)

// The block's dynamic shared memory, 16-byte aligned.
__device__ __forceinline__ unsigned short* atc_shared() {
    extern __shared__ __align__(16) unsigned short atc_smem[];
    return atc_smem;
}

__device__ __forceinline__ unsigned int atc_dynamic_smem_size() {
    unsigned int smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem));
    return smem;
}

// Two f32 values rounded to nearest even as one register of two 16-bit
// elements, `lo` in the low half (cvt's first source goes to the high half).
template <typename T> __device__ __forceinline__ unsigned int atc_pack(float lo, float hi);

template <> __device__ __forceinline__ unsigned int atc_pack<bf16>(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <> __device__ __forceinline__ unsigned int atc_pack<f16>(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// d += A B for one 16 x 16 A, one 16 x 8 B, f32 accumulators (a warp-wide
// instruction: every lane of the warp must reach it together).
template <typename T>
__device__ __forceinline__ void atc_mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1);

template <>
__device__ __forceinline__ void atc_mma<bf16>(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void atc_mma<f16>(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif

// ---------------------------------------------------------------- helpers

// Dynamic shared memory bytes one block of the D instantiation needs:
// `tiles` staged 16-bit tiles [64][D + 8] and `vectors` f32 vectors of 64.
__host__ __device__ constexpr unsigned int atc_smem_bytes(int d, int tiles, int vectors) {
    return 2u * (unsigned)(tiles * ATC_TILE * (d + ATC_PAD)) + 4u * (unsigned)(vectors * ATC_TILE);
}

// The launcher sized the block and its shared memory from the same rules
// (kernels/src/cuda/attention_tc.rs); anything else is a launcher bug, which
// must fail loudly rather than read out of bounds.
__device__ __forceinline__ void atc_check_launch(unsigned int smem_needed) {
    if (blockDim.x != ATC_THREADS || atc_dynamic_smem_size() < smem_needed) __trap();
}

// Stages up to 64 rows of `src` (rows `row_stride` elements apart, `hd`
// elements each) as their 16-bit patterns into dst [64][D + 8]; rows past
// `rows` and columns past `hd` become zeros. Four elements per step: one
// 8-byte load where the row allows it (hd a multiple of 4 and an aligned
// row: every 64- and 128-wide head), else four 2-byte loads.
template <typename T, int D>
__device__ __forceinline__ void atc_stage(unsigned short* dst, const T* src, u64 row_stride, long long rows, u64 hd) {
    const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
    for (int idx = threadIdx.x; idx < ATC_TILE * (D / 4); idx += ATC_THREADS) {
        const int r = idx / (D / 4), c = 4 * (idx % (D / 4));
        unsigned long long x = 0;
        if (r < rows && (u64)c < hd) {
            const unsigned short* at = s + (u64)r * row_stride + c;
            if (hd % 4 == 0 && (reinterpret_cast<u64>(at) & 7) == 0) {
                x = *reinterpret_cast<const unsigned long long*>(at);
            } else {
                for (int e = 0; e < 4; ++e)
                    if ((u64)(c + e) < hd) x |= (unsigned long long)at[e] << (16 * e);
            }
        }
        *reinterpret_cast<unsigned long long*>(dst + r * (D + ATC_PAD) + c) = x;
    }
}

// The 32-bit word of tile `s` ([64][D + 8]) at row r, columns c and c + 1.
template <int D>
__device__ __forceinline__ unsigned int atc_word(const unsigned short* s, int r, int c) {
    return *reinterpret_cast<const unsigned int*>(s + r * (D + ATC_PAD) + c);
}

// The two 16-bit elements of tile `s` at rows r and r + 1 of column c, the
// first in the low half: the B operand of the tile itself (not transposed).
template <int D>
__device__ __forceinline__ unsigned int atc_gather(const unsigned short* s, int r, int c) {
    return (unsigned int)s[r * (D + ATC_PAD) + c] | ((unsigned int)s[(r + 1) * (D + ATC_PAD) + c] << 16);
}

// The A fragment of rows r0..r0+15, columns k0..k0+15 of a staged tile.
template <int D>
__device__ __forceinline__ void atc_load_a(unsigned int (&a)[4], const unsigned short* s, int r0, int k0) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    a[0] = atc_word<D>(s, r0 + g, k0 + 2 * t);
    a[1] = atc_word<D>(s, r0 + g + 8, k0 + 2 * t);
    a[2] = atc_word<D>(s, r0 + g, k0 + 2 * t + 8);
    a[3] = atc_word<D>(s, r0 + g + 8, k0 + 2 * t + 8);
}

// The A fragment of a 16 x 16 block whose two 8-column halves are the f32 C
// fragments lo and hi, rounded to T.
template <typename T>
__device__ __forceinline__ void atc_c_to_a(unsigned int (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
    a[0] = atc_pack<T>(lo[0], lo[1]);
    a[1] = atc_pack<T>(lo[2], lo[3]);
    a[2] = atc_pack<T>(hi[0], hi[1]);
    a[3] = atc_pack<T>(hi[2], hi[3]);
}

// acc[n] += A X[k0..k0+15][8n..8n+7] for every 8-column tile n of the
// staged tile x (keys or queries as rows, head-dim columns): the product of
// a 16 x 16 A with 16 rows of x.
template <typename T, int D>
__device__ __forceinline__ void atc_times_rows(float (&acc)[D / 8][4], const unsigned int (&a)[4], const unsigned short* x, int k0) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
        atc_mma<T>(acc[n], a, atc_gather<D>(x, k0 + 2 * t, 8 * n + g), atc_gather<D>(x, k0 + 2 * t + 8, 8 * n + g));
}

// acc[n] += X[r0..r0+15] Y[c0 + 8n..c0 + 8n + 7]^T for n < N: scores of 16
// rows of the staged tile x against N * 8 rows of the staged tile y, over
// all D columns.
template <typename T, int D, int N>
__device__ __forceinline__ void atc_scores(float (&acc)[N][4], const unsigned short* x, int r0, const unsigned short* y, int c0) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[n][c] = 0.0f;
#pragma unroll
    for (int k0 = 0; k0 < D; k0 += 16) {
        unsigned int a[4];
        atc_load_a<D>(a, x, r0, k0);
#pragma unroll
        for (int n = 0; n < N; ++n)
            atc_mma<T>(acc[n], a, atc_word<D>(y, c0 + 8 * n + g, k0 + 2 * t), atc_word<D>(y, c0 + 8 * n + g, k0 + 2 * t + 8));
    }
}

// Writes the C fragments acc (tile rows r0..r0+15, head-dim columns) times
// `mul` to dst rows (row r of the tile at dst + offset(r)), skipping rows
// past `rows` and columns past hd.
template <typename T, int D, typename Offset>
__device__ __forceinline__ void atc_store(T* dst, const float (&acc)[D / 8][4], int r0, long long rows, u64 hd, float mul, Offset offset) {
    const int lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = r0 + g + 8 * half;
        if (r >= rows) continue;
        T* row = dst + offset(r);
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = 8 * n + 2 * t + e;
                if ((u64)col < hd) row[col] = from_f32<T>(acc[n][2 * half + e] * mul);
            }
    }
}

// ---------------------------------------------------------------- forward
//
// One block per (batch, query head, query tile); grid = batch * q_heads *
// ceil(seq_q / 64). Shared memory: queries, keys, values [64][D + 8] 16-bit
// each. Warp w owns queries 16w..16w+15 of the tile; a lane holds rows g and
// g + 8 of them. Per 64-key tile a warp does D/16 * 8 mma for S = Q K^T and
// 4 * D/8 for O += P V: the scores stay in registers (8 C fragments), the
// online softmax runs on them (row max and sum over the four lanes of a row:
// two shuffles), and they turn into P's A fragments in place.
template <typename T, int D>
__device__ void atc_forward(const T* q, const T* k, const T* v, T* out, float* lse, const AttnParams& p) {
    atc_check_launch(atc_smem_bytes(D, 3, 0));
    unsigned short* sq = atc_shared();
    unsigned short* sk = sq + ATC_TILE * (D + ATC_PAD);
    unsigned short* sv = sk + ATC_TILE * (D + ATC_PAD);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * warp;
    const u64 hd = p.head_dim;
    const AttnQueryTile tile = attn_query_tile(p);
    const u64 group = tile.group, b = tile.b, h = tile.h, kvh = tile.kv;
    const long long i0 = tile.i0, q_rows = tile.rows;

    atc_stage<T, D>(sq, q + attn_q_row(p.q, group, b, h, i0), p.q.row, q_rows, hd);

    float m[2], l[2], o[D / 8][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        m[i] = attn_neg_inf();
        l[i] = 0.0f;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[n][c] = 0.0f;

    const long long key_end = attn_key_end(p, i0);
    for (long long j0 = 0; j0 < key_end; j0 += ATC_TILE) {
        const long long kv_rows = (long long)p.seq_kv - j0;
        __syncthreads();  // the previous key and value tiles are read
        atc_stage<T, D>(sk, k + attn_kv_row(p.k, b, kvh, j0), p.k.row, kv_rows, hd);
        atc_stage<T, D>(sv, v + attn_kv_row(p.v, b, kvh, j0), p.v.row, kv_rows, hd);
        __syncthreads();

        float s[ATC_TILE / 8][4];
        atc_scores<T, D, ATC_TILE / 8>(s, sq, r0, sk, 0);
        float mx[2] = {attn_neg_inf(), attn_neg_inf()};
#pragma unroll
        for (int n = 0; n < ATC_TILE / 8; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const long long qi = i0 + r0 + g + 8 * (c >> 1), kj = j0 + 8 * n + 2 * t + (c & 1);
                s[n][c] = attn_visible(p, qi, kj) ? s[n][c] * p.scale : attn_neg_inf();
                mx[c >> 1] = fmaxf(mx[c >> 1], s[n][c]);
            }
        float alpha[2], m_new[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            m_new[i] = fmaxf(m[i], mx[i]);
            // A row that has seen no key yet keeps m = -inf, l = 0, o = 0.
            alpha[i] = m_new[i] == attn_neg_inf() ? 1.0f : expf(m[i] - m_new[i]);
        }
#pragma unroll
        for (int n = 0; n < ATC_TILE / 8; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int i = c >> 1;
                const float e = m_new[i] == attn_neg_inf() ? 0.0f : expf(s[n][c] - m_new[i]);
                s[n][c] = e;
                sum[i] += e;
            }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 1);
            sum[i] += __shfl_xor_sync(0xffffffffu, sum[i], 2);
            l[i] = l[i] * alpha[i] + sum[i];
            m[i] = m_new[i];
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) o[n][c] *= alpha[c >> 1];
#pragma unroll
        for (int kk = 0; kk < ATC_TILE / 16; ++kk) {
            unsigned int a[4];
            atc_c_to_a<T>(a, s[2 * kk], s[2 * kk + 1]);
            atc_times_rows<T, D>(o, a, sv, 16 * kk);
        }
    }

    float inv[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const long long qi = i0 + r0 + g + 8 * i;
        const bool seen = l[i] > 0.0f;
        inv[i] = seen ? 1.0f / l[i] : 0.0f;
        if (t == 0 && qi < (long long)p.seq_q)
            lse[(b * p.q_heads + h) * p.seq_q + (u64)qi] = seen ? m[i] + logf(l[i]) : attn_neg_inf();
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[n][c] *= inv[c >> 1];
    atc_store<T, D>(out, o, r0, q_rows, hd, 1.0f, [&](int r) { return attn_q_row(p.o, group, b, h, (u64)(i0 + r)); });
}

// ---------------------------------------------------------------- backward
//
// With P = exp(S - lse), dP = dO V^T, delta_i = rowsum(dO_i * O_i) (computed
// by attention.cu's attention_bwd_delta) and dS = P * (dP - delta):
// dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K. Both kernels walk the
// 64 x 64 score tile in 16-column strips, so that the scores of a strip
// (2 C fragments each of S and dP) become the A operand of the next product
// at once and the accumulators (D/8 C fragments per output) are the only
// large register arrays.

// dK and dV of one kv tile. Grid = batch * kv_heads * ceil(seq_kv / 64).
// Shared memory: keys, values, queries, dout [64][D + 8] 16-bit each, then
// lse and delta of the query tile (f32). Warp w owns keys 16w..16w+15 of the
// tile; the score tile is S^T (keys as rows, queries as columns). Per query
// tile a warp does 4 * (D/16 * 4 + D/8 * 2) mma.
template <typename T, int D>
__device__ void atc_backward_dkv(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                 const float* delta, T* dk, T* dv, const AttnParams& p) {
    atc_check_launch(atc_smem_bytes(D, 4, 2));
    unsigned short* sk = atc_shared();
    unsigned short* sv = sk + ATC_TILE * (D + ATC_PAD);
    unsigned short* sq = sv + ATC_TILE * (D + ATC_PAD);
    unsigned short* sdo = sq + ATC_TILE * (D + ATC_PAD);
    float* slse = reinterpret_cast<float*>(sdo + ATC_TILE * (D + ATC_PAD));
    float* sdelta = slse + ATC_TILE;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * warp;
    const u64 group = p.q_heads / p.kv_heads, hd = p.head_dim;
    const u64 heads = p.batch * p.kv_heads;
    const u64 b = (blockIdx.x % heads) / p.kv_heads, kvh = (blockIdx.x % heads) % p.kv_heads;
    // Low kv tiles are seen by the most queries: they come first.
    const long long j0 = (long long)(blockIdx.x / heads) * ATC_TILE;
    const long long kv_rows = (long long)p.seq_kv - j0;

    atc_stage<T, D>(sk, k + attn_kv_row(p.k, b, kvh, j0), p.k.row, kv_rows, hd);
    atc_stage<T, D>(sv, v + attn_kv_row(p.v, b, kvh, j0), p.v.row, kv_rows, hd);

    float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) dk_acc[n][c] = dv_acc[n][c] = 0.0f;

    // The first query that attends key j0, rounded down to its tile.
    long long first = 0;
    if (p.causal) first = min((long long)p.seq_q, max(0ll, j0 + (long long)p.seq_q - (long long)p.seq_kv));
    first -= first % ATC_TILE;

    for (u64 jh = 0; jh < group; ++jh) {
        const u64 h = kvh * group + jh;
        for (long long i0 = first; i0 < (long long)p.seq_q; i0 += ATC_TILE) {
            const long long q_rows = (long long)p.seq_q - i0;
            __syncthreads();  // the previous query tile is read
            atc_stage<T, D>(sq, q + attn_q_row(p.q, group, b, h, i0), p.q.row, q_rows, hd);
            atc_stage<T, D>(sdo, dout + attn_q_row(p.o, group, b, h, i0), p.o.row, q_rows, hd);
            if (threadIdx.x < ATC_TILE) {
                const bool in = threadIdx.x < q_rows;
                const u64 at = (b * p.q_heads + h) * p.seq_q + (u64)i0 + threadIdx.x;
                slse[threadIdx.x] = in ? lse[at] : 0.0f;
                sdelta[threadIdx.x] = in ? delta[at] : 0.0f;
            }
            __syncthreads();
#pragma unroll 1
            for (int c0 = 0; c0 < ATC_TILE; c0 += 16) {
                float s[2][4], dp[2][4];
                atc_scores<T, D, 2>(s, sk, r0, sq, c0);
                atc_scores<T, D, 2>(dp, sv, r0, sdo, c0);
#pragma unroll
                for (int n = 0; n < 2; ++n)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int col = c0 + 8 * n + 2 * t + (c & 1);
                        const long long kj = j0 + r0 + g + 8 * (c >> 1);
                        // A masked pair may have lse = -inf: select, never multiply.
                        const float e = attn_visible(p, i0 + col, kj) ? expf(s[n][c] * p.scale - slse[col]) : 0.0f;
                        s[n][c] = e;
                        dp[n][c] = e * (dp[n][c] - sdelta[col]);
                    }
                unsigned int a[4];
                atc_c_to_a<T>(a, s[0], s[1]);
                atc_times_rows<T, D>(dv_acc, a, sdo, c0);
                atc_c_to_a<T>(a, dp[0], dp[1]);
                atc_times_rows<T, D>(dk_acc, a, sq, c0);
            }
        }
    }

    atc_store<T, D>(dk, dk_acc, r0, kv_rows, hd, p.scale, [&](int r) { return attn_kv_row(p.k, b, kvh, (u64)(j0 + r)); });
    atc_store<T, D>(dv, dv_acc, r0, kv_rows, hd, 1.0f, [&](int r) { return attn_kv_row(p.v, b, kvh, (u64)(j0 + r)); });
}

// dQ of one query tile. Grid = batch * q_heads * ceil(seq_q / 64). Shared
// memory: queries, dout, keys, values [64][D + 8] 16-bit each. Warp w owns
// queries 16w..16w+15; their lse and delta stay in registers. Per key tile a
// warp does 4 * (D/16 * 4 + D/8) mma.
template <typename T, int D>
__device__ void atc_backward_dq(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                const float* delta, T* dq, const AttnParams& p) {
    atc_check_launch(atc_smem_bytes(D, 4, 0));
    unsigned short* sq = atc_shared();
    unsigned short* sdo = sq + ATC_TILE * (D + ATC_PAD);
    unsigned short* sk = sdo + ATC_TILE * (D + ATC_PAD);
    unsigned short* sv = sk + ATC_TILE * (D + ATC_PAD);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * warp;
    const u64 hd = p.head_dim;
    const AttnQueryTile tile = attn_query_tile(p);
    const u64 group = tile.group, b = tile.b, h = tile.h, kvh = tile.kv;
    const long long i0 = tile.i0, q_rows = tile.rows;

    atc_stage<T, D>(sq, q + attn_q_row(p.q, group, b, h, i0), p.q.row, q_rows, hd);
    atc_stage<T, D>(sdo, dout + attn_q_row(p.o, group, b, h, i0), p.o.row, q_rows, hd);
    float row_lse[2], row_delta[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = r0 + g + 8 * i;
        const u64 at = (b * p.q_heads + h) * p.seq_q + (u64)i0 + r;
        row_lse[i] = r < q_rows ? lse[at] : 0.0f;
        row_delta[i] = r < q_rows ? delta[at] : 0.0f;
    }

    float dq_acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) dq_acc[n][c] = 0.0f;

    const long long key_end = attn_key_end(p, i0);
    for (long long j0 = 0; j0 < key_end; j0 += ATC_TILE) {
        const long long kv_rows = (long long)p.seq_kv - j0;
        __syncthreads();  // the previous key and value tiles are read
        atc_stage<T, D>(sk, k + attn_kv_row(p.k, b, kvh, j0), p.k.row, kv_rows, hd);
        atc_stage<T, D>(sv, v + attn_kv_row(p.v, b, kvh, j0), p.v.row, kv_rows, hd);
        __syncthreads();
#pragma unroll 1
        for (int c0 = 0; c0 < ATC_TILE; c0 += 16) {
            float s[2][4], dp[2][4];
            atc_scores<T, D, 2>(s, sq, r0, sk, c0);
            atc_scores<T, D, 2>(dp, sdo, r0, sv, c0);
#pragma unroll
            for (int n = 0; n < 2; ++n)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int i = c >> 1;
                    const long long qi = i0 + r0 + g + 8 * i, kj = j0 + c0 + 8 * n + 2 * t + (c & 1);
                    const float e = attn_visible(p, qi, kj) ? expf(s[n][c] * p.scale - row_lse[i]) : 0.0f;
                    s[n][c] = e * (dp[n][c] - row_delta[i]);
                }
            unsigned int a[4];
            atc_c_to_a<T>(a, s[0], s[1]);
            atc_times_rows<T, D>(dq_acc, a, sk, c0);
        }
    }

    atc_store<T, D>(dq, dq_acc, r0, q_rows, hd, p.scale, [&](int r) { return attn_q_row(p.q, group, b, h, (u64)(i0 + r)); });
}

// ---------------------------------------------------------------- entry points
//
// Arguments in order (the argument struct is passed by value):
//   attention_tc_fwd_S(q, k, v, out, lse, params)
//   attention_tc_bwd_dkv_S(q, k, v, dout, lse, delta, dk, dv, params)
//   attention_tc_bwd_dq_S(q, k, v, dout, lse, delta, dq, params)
// with `delta` from attention.cu's attention_bwd_delta_S. In the fused
// layout q, k and v (and dq, dk, dv) are the same buffer.

// The forward asks for three blocks per SM (at most 170 registers a
// thread; it fits in 167 without spilling, against 196 unconstrained): twelve
// warps to hide the staging of the next tiles. The backward kernels fit two
// (dK/dV, 236 registers) and four (dQ, 128) blocks as they are.
#define ATTENTION_TC(T, S)                                                                                        \
    extern "C" __global__ __launch_bounds__(ATC_THREADS, 3) void attention_tc_fwd_##S(                            \
        const T* q, const T* k, const T* v, T* out, float* lse, AttnParams p) {                                   \
        if (p.head_dim <= 64) atc_forward<T, 64>(q, k, v, out, lse, p);                                           \
        else atc_forward<T, 128>(q, k, v, out, lse, p);                                                           \
    }                                                                                                             \
    extern "C" __global__ __launch_bounds__(ATC_THREADS) void attention_tc_bwd_dkv_##S(                           \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dk, T* dv,    \
        AttnParams p) {                                                                                           \
        if (p.head_dim <= 64) atc_backward_dkv<T, 64>(q, k, v, dout, lse, delta, dk, dv, p);                      \
        else atc_backward_dkv<T, 128>(q, k, v, dout, lse, delta, dk, dv, p);                                      \
    }                                                                                                             \
    extern "C" __global__ __launch_bounds__(ATC_THREADS) void attention_tc_bwd_dq_##S(                            \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dq,           \
        AttnParams p) {                                                                                           \
        if (p.head_dim <= 64) atc_backward_dq<T, 64>(q, k, v, dout, lse, delta, dq, p);                           \
        else atc_backward_dq<T, 128>(q, k, v, dout, lse, delta, dq, p);                                           \
    }

ATTENTION_TC(bf16, bf16)
ATTENTION_TC(f16, f16)
