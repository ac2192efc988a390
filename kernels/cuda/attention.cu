// Fused causal attention with grouped-query heads, FlashAttention-2 style:
// the same semantics as the CPU kernels (kernels/src/cpu/attention/), which
// are the reference. The launch geometry (grid, block, dynamic shared memory,
// argument order) is described in kernels/src/cuda/attention.rs; the two must
// change together.
//
// Semantics. Query head h reads kv head h / (q_heads / kv_heads). With
// `causal`, query i attends keys j <= i + seq_kv - seq_q (the queries are the
// last seq_q positions: a KV cache). Scores are scale * q.k; lse (f32, layout
// [batch, q_heads, seq_q]) is the log-sum-exp of a query's scores, -inf for a
// query that sees no key, whose output row is zero.
//
// Layouts. Every tensor is addressed through an AttnPlace (see
// kernels/src/cpu/attention/layout.rs): row t of head j of kv group g in batch
// b starts at base + b*batch + g*group + j*head + t*row, and a row holds
// head_dim contiguous elements. That covers separate per-head tensors and the
// fused [batch, seq, kv_heads, group + 2, head_dim] qkv buffer alike; each
// gradient shares its tensor's place.
//
// Tiles. A block has ATTN_THREADS = 256 threads and works on 64-row tiles of
// queries and keys. Thread tid owns tile rows 2*(tid/8) and 2*(tid/8) + 1, and
// of those rows the score columns tid%8 + 8c (c < 8) and the head-dim columns
// tid%8 + 8c (c < D/8); the eight threads of a row are eight consecutive lanes
// of one warp, so row maxima and sums are three shuffles. Tiles are staged in
// shared memory as f32 rows padded to D + 1 floats (conflict-free column
// walks). Products are f32 FMAs on the CUDA cores. The runtime uses these
// kernels for f32; bf16 and f16 run the tensor-core kernels of
// attention_tc.cu, which share this file's `delta` kernel.
//
// Head dims. One symbol per element type serves every head_dim <= 128: a
// head_dim <= 64 runs the D = 64 instantiation, a larger one the D = 128 one,
// with the columns past head_dim loaded as zeros and never stored.
//
// Determinism. No atomics: every output element is written by one thread, and
// every sum runs in a fixed order, so results do not vary between runs.

#define ATTN_THREADS 256
#define ATTN_ROWS 2   // tile rows per thread
#define ATTN_COLS 8   // score columns per thread (ATTN_TILE / 8)

// Dynamic shared memory bytes one block of the D instantiation needs:
// `tiles` head-dim-wide tiles plus one 64 x 65 score tile, plus `vectors`
// per-row f32 vectors of the tile.
__host__ __device__ constexpr unsigned int attn_smem_bytes(int d, int tiles, int vectors) {
    return 4u * (unsigned)(tiles * ATTN_TILE * (d + 1) + ATTN_TILE * (ATTN_TILE + 1) + vectors * ATTN_TILE);
}

// The launcher sized the block and its shared memory from the same rules
// (kernels/src/cuda/attention.rs); anything else is a launcher bug, which must
// fail loudly rather than read out of bounds.
__device__ __forceinline__ void attn_check_launch(unsigned int smem_needed) {
    unsigned int smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(smem));
    if (blockDim.x != ATTN_THREADS || smem < smem_needed) __trap();
}

// The largest of v over the eight lanes of a row.
__device__ __forceinline__ float attn_row_max(float v) {
    for (int o = 1; o < 8; o *= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum of v over the eight lanes of a row.
__device__ __forceinline__ float attn_row_sum(float v) {
    for (int o = 1; o < 8; o *= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Stages up to 64 rows of `src` (rows `row_stride` apart, `hd` elements each)
// as f32 times `mul` into dst [64][D + 1]; rows past `rows` and columns past
// `hd` become zeros.
template <typename T, int D>
__device__ __forceinline__ void attn_stage(float* dst, const T* src, u64 row_stride, long long rows, u64 hd, float mul) {
    for (int idx = threadIdx.x; idx < ATTN_TILE * D; idx += ATTN_THREADS) {
        const int r = idx / D, c = idx % D;
        float x = 0.0f;
        if (r < rows && (u64)c < hd) x = to_f32(src[(u64)r * row_stride + c]) * mul;
        dst[r * (D + 1) + c] = x;
    }
}

// acc[i][c] = sum_d a[row(i)][d] * b[col(c)][d] for this thread's rows of the
// tile `a` and score columns of the tile `b` (both [64][D + 1]).
template <int D>
__device__ __forceinline__ void attn_scores(float (&acc)[ATTN_ROWS][ATTN_COLS], const float* a, const float* b) {
    const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
#pragma unroll
    for (int i = 0; i < ATTN_ROWS; ++i)
#pragma unroll
        for (int c = 0; c < ATTN_COLS; ++c) acc[i][c] = 0.0f;
#pragma unroll 4
    for (int d = 0; d < D; ++d) {
        float av[ATTN_ROWS], bv[ATTN_COLS];
#pragma unroll
        for (int i = 0; i < ATTN_ROWS; ++i) av[i] = a[(ATTN_ROWS * ty + i) * (D + 1) + d];
#pragma unroll
        for (int c = 0; c < ATTN_COLS; ++c) bv[c] = b[(tx + 8 * c) * (D + 1) + d];
#pragma unroll
        for (int i = 0; i < ATTN_ROWS; ++i)
#pragma unroll
            for (int c = 0; c < ATTN_COLS; ++c) acc[i][c] = fmaf(av[i], bv[c], acc[i][c]);
    }
}

// acc[i][c] += sum_j w[row(i)][j] * m[j][col(c)]: this thread's rows of the
// score tile `w` ([64][65]) times the tile `m` ([64][D + 1]), at its
// head-dim columns.
template <int D>
__device__ __forceinline__ void attn_accumulate(float (&acc)[ATTN_ROWS][D / 8], const float* w, const float* m) {
    const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
#pragma unroll 2
    for (int j = 0; j < ATTN_TILE; ++j) {
        float wv[ATTN_ROWS];
#pragma unroll
        for (int i = 0; i < ATTN_ROWS; ++i) wv[i] = w[(ATTN_ROWS * ty + i) * (ATTN_TILE + 1) + j];
#pragma unroll
        for (int c = 0; c < D / 8; ++c) {
            const float mv = m[j * (D + 1) + tx + 8 * c];
#pragma unroll
            for (int i = 0; i < ATTN_ROWS; ++i) acc[i][c] = fmaf(wv[i], mv, acc[i][c]);
        }
    }
}

// Writes this thread's rows of acc times `mul` to dst rows (row r of the tile
// at dst + offset(r)), skipping rows past `rows` and columns past hd.
template <typename T, int D, typename Offset>
__device__ __forceinline__ void attn_store(T* dst, const float (&acc)[ATTN_ROWS][D / 8], long long rows, u64 hd,
                                           float mul, Offset offset) {
    const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
#pragma unroll
    for (int i = 0; i < ATTN_ROWS; ++i) {
        const int r = ATTN_ROWS * ty + i;
        if (r >= rows) continue;
        T* row = dst + offset(r);
#pragma unroll
        for (int c = 0; c < D / 8; ++c) {
            const int col = tx + 8 * c;
            if ((u64)col < hd) row[col] = from_f32<T>(acc[i][c] * mul);
        }
    }
}

// ---------------------------------------------------------------- forward
//
// One block per (batch, query head, query tile); grid = batch * q_heads *
// ceil(seq_q / 64). Shared memory: scaled queries and the current key tile,
// then value tile (same buffer), [64][D + 1] each, and the probabilities
// [64][65]. Online softmax: a running max m and sum l per query; the output
// accumulator lives in registers and is rescaled when m grows.
template <typename T, int D>
__device__ void attn_forward(const T* q, const T* k, const T* v, T* out, float* lse, const AttnParams& p) {
    attn_check_launch(attn_smem_bytes(D, 2, 0));
    extern __shared__ float smem[];
    float* sq = smem;
    float* skv = sq + ATTN_TILE * (D + 1);
    float* sp = skv + ATTN_TILE * (D + 1);
    const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
    const u64 hd = p.head_dim;
    const AttnQueryTile tile = attn_query_tile(p);
    const u64 group = tile.group, b = tile.b, h = tile.h, g = tile.kv;
    const long long i0 = tile.i0, q_rows = tile.rows;

    attn_stage<T, D>(sq, q + attn_q_row(p.q, group, b, h, i0), p.q.row, q_rows, hd, p.scale);

    float m[ATTN_ROWS], l[ATTN_ROWS], o[ATTN_ROWS][D / 8];
#pragma unroll
    for (int i = 0; i < ATTN_ROWS; ++i) {
        m[i] = attn_neg_inf();
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < D / 8; ++c) o[i][c] = 0.0f;
    }

    const long long key_end = attn_key_end(p, i0);
    for (long long j0 = 0; j0 < key_end; j0 += ATTN_TILE) {
        const long long kv_rows = (long long)p.seq_kv - j0;
        __syncthreads();  // the previous value tile and probabilities are read
        attn_stage<T, D>(skv, k + attn_kv_row(p.k, b, g, j0), p.k.row, kv_rows, hd, 1.0f);
        __syncthreads();
        float s[ATTN_ROWS][ATTN_COLS];
        attn_scores<D>(s, sq, skv);
#pragma unroll
        for (int i = 0; i < ATTN_ROWS; ++i) {
            const long long qi = i0 + ATTN_ROWS * ty + i;
            float mx = attn_neg_inf();
#pragma unroll
            for (int c = 0; c < ATTN_COLS; ++c) {
                if (!attn_visible(p, qi, j0 + tx + 8 * c)) s[i][c] = attn_neg_inf();
                mx = fmaxf(mx, s[i][c]);
            }
            const float m_new = fmaxf(m[i], attn_row_max(mx));
            // A row that has seen no key yet keeps m = -inf, l = 0, o = 0.
            const bool none = m_new == attn_neg_inf();
            const float alpha = none ? 1.0f : expf(m[i] - m_new);
            float sum = 0.0f;
#pragma unroll
            for (int c = 0; c < ATTN_COLS; ++c) {
                const float e = none ? 0.0f : expf(s[i][c] - m_new);
                sp[(ATTN_ROWS * ty + i) * (ATTN_TILE + 1) + tx + 8 * c] = e;
                sum += e;
            }
            l[i] = l[i] * alpha + attn_row_sum(sum);
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < D / 8; ++c) o[i][c] *= alpha;
        }
        __syncthreads();  // every thread is done with the key tile
        attn_stage<T, D>(skv, v + attn_kv_row(p.v, b, g, j0), p.v.row, kv_rows, hd, 1.0f);
        __syncthreads();
        attn_accumulate<D>(o, sp, skv);
    }

#pragma unroll
    for (int i = 0; i < ATTN_ROWS; ++i) {
        const long long qi = i0 + ATTN_ROWS * ty + i;
        const bool seen = l[i] > 0.0f;
        const float inv = seen ? 1.0f / l[i] : 0.0f;
#pragma unroll
        for (int c = 0; c < D / 8; ++c) o[i][c] *= inv;
        if (tx == 0 && qi < (long long)p.seq_q)
            lse[(b * p.q_heads + h) * p.seq_q + (u64)qi] = seen ? m[i] + logf(l[i]) : attn_neg_inf();
    }
    attn_store<T, D>(out, o, q_rows, hd, 1.0f, [&](int r) { return attn_q_row(p.o, group, b, h, (u64)(i0 + r)); });
}

// ---------------------------------------------------------------- backward
//
// With P = exp(S - lse), dP = dO V^T, delta_i = rowsum(dO_i * O_i) and
// dS = P * (dP - delta): dV = P^T dO, dK = scale dS^T Q, dQ = scale dS K.
// Three launches, as the CPU's two-pass schedule, for determinism without
// atomics: delta; dK and dV, one block per (batch, kv head, kv tile) looping
// over the group's query heads and the query tiles that see the kv tile; dQ,
// one block per (batch, query head, query tile) looping over its key tiles.

// delta[b, h, i] = dout_i . out_i in f32, one warp per query row; any grid.
template <typename T>
__device__ void attn_delta(const T* out, const T* dout, float* delta, const AttnParams& p) {
    const u64 group = p.q_heads / p.kv_heads;
    const u64 rows = p.batch * p.q_heads * p.seq_q;
    const u64 lane = threadIdx.x % 32;
    const u64 warps = (u64)gridDim.x * (blockDim.x / 32);
    for (u64 r = (u64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; r < rows; r += warps) {
        const u64 bh = r / p.seq_q, t = r % p.seq_q;
        const u64 at = attn_q_row(p.o, group, bh / p.q_heads, bh % p.q_heads, t);
        float acc = 0.0f;
        for (u64 c = lane; c < p.head_dim; c += 32) acc = fmaf(to_f32(dout[at + c]), to_f32(out[at + c]), acc);
        for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) delta[r] = acc;
    }
}

// dK and dV of one kv tile. Grid = batch * kv_heads * ceil(seq_kv / 64).
// Shared memory: keys, values, scaled queries, dout [64][D + 1] each, the
// probability (then dS) tile [64][65], lse and delta of the query tile.
// Here the tile rows are keys and the score columns queries (S^T).
template <typename T, int D>
__device__ void attn_backward_dkv(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                  const float* delta, T* dk, T* dv, const AttnParams& p) {
    attn_check_launch(attn_smem_bytes(D, 4, 2));
    extern __shared__ float smem[];
    float* sk = smem;
    float* sv = sk + ATTN_TILE * (D + 1);
    float* sq = sv + ATTN_TILE * (D + 1);
    float* sdo = sq + ATTN_TILE * (D + 1);
    float* sp = sdo + ATTN_TILE * (D + 1);
    float* slse = sp + ATTN_TILE * (ATTN_TILE + 1);
    float* sdelta = slse + ATTN_TILE;
    const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
    const u64 group = p.q_heads / p.kv_heads, hd = p.head_dim;
    const u64 heads = p.batch * p.kv_heads;
    const u64 b = (blockIdx.x % heads) / p.kv_heads, g = (blockIdx.x % heads) % p.kv_heads;
    // Low kv tiles are seen by the most queries: they come first.
    const long long j0 = (long long)(blockIdx.x / heads) * ATTN_TILE;
    const long long kv_rows = (long long)p.seq_kv - j0;

    attn_stage<T, D>(sk, k + attn_kv_row(p.k, b, g, j0), p.k.row, kv_rows, hd, 1.0f);
    attn_stage<T, D>(sv, v + attn_kv_row(p.v, b, g, j0), p.v.row, kv_rows, hd, 1.0f);

    float dk_acc[ATTN_ROWS][D / 8], dv_acc[ATTN_ROWS][D / 8];
#pragma unroll
    for (int i = 0; i < ATTN_ROWS; ++i)
#pragma unroll
        for (int c = 0; c < D / 8; ++c) dk_acc[i][c] = dv_acc[i][c] = 0.0f;

    // The first query that attends key j0, rounded down to its tile.
    long long first = 0;
    if (p.causal) first = min((long long)p.seq_q, max(0ll, j0 + (long long)p.seq_q - (long long)p.seq_kv));
    first -= first % ATTN_TILE;

    for (u64 jh = 0; jh < group; ++jh) {
        const u64 h = g * group + jh;
        for (long long i0 = first; i0 < (long long)p.seq_q; i0 += ATTN_TILE) {
            const long long q_rows = (long long)p.seq_q - i0;
            __syncthreads();  // the previous query tile and dS are read
            attn_stage<T, D>(sq, q + attn_q_row(p.q, group, b, h, i0), p.q.row, q_rows, hd, p.scale);
            attn_stage<T, D>(sdo, dout + attn_q_row(p.o, group, b, h, i0), p.o.row, q_rows, hd, 1.0f);
            if (threadIdx.x < ATTN_TILE) {
                const bool in = threadIdx.x < q_rows;
                const u64 at = (b * p.q_heads + h) * p.seq_q + (u64)i0 + threadIdx.x;
                slse[threadIdx.x] = in ? lse[at] : 0.0f;
                sdelta[threadIdx.x] = in ? delta[at] : 0.0f;
            }
            __syncthreads();
            float s[ATTN_ROWS][ATTN_COLS], dp[ATTN_ROWS][ATTN_COLS];
            attn_scores<D>(s, sk, sq);
            attn_scores<D>(dp, sv, sdo);
#pragma unroll
            for (int i = 0; i < ATTN_ROWS; ++i) {
                const long long j = j0 + ATTN_ROWS * ty + i;
#pragma unroll
                for (int c = 0; c < ATTN_COLS; ++c) {
                    const int col = tx + 8 * c;
                    // A masked pair may have lse = -inf: select, never multiply.
                    const float e = attn_visible(p, i0 + col, j) ? expf(s[i][c] - slse[col]) : 0.0f;
                    sp[(ATTN_ROWS * ty + i) * (ATTN_TILE + 1) + col] = e;
                    dp[i][c] = e * (dp[i][c] - sdelta[col]);
                }
            }
            __syncthreads();
            attn_accumulate<D>(dv_acc, sp, sdo);
            __syncthreads();  // P is read; dS takes its place
#pragma unroll
            for (int i = 0; i < ATTN_ROWS; ++i)
#pragma unroll
                for (int c = 0; c < ATTN_COLS; ++c) sp[(ATTN_ROWS * ty + i) * (ATTN_TILE + 1) + tx + 8 * c] = dp[i][c];
            __syncthreads();
            // The queries are pre-scaled, so this is already scale * dS^T Q.
            attn_accumulate<D>(dk_acc, sp, sq);
        }
    }

    attn_store<T, D>(dk, dk_acc, kv_rows, hd, 1.0f, [&](int r) { return attn_kv_row(p.k, b, g, (u64)(j0 + r)); });
    attn_store<T, D>(dv, dv_acc, kv_rows, hd, 1.0f, [&](int r) { return attn_kv_row(p.v, b, g, (u64)(j0 + r)); });
}

// dQ of one query tile. Grid = batch * q_heads * ceil(seq_q / 64). Shared
// memory: scaled queries, dout, keys, values [64][D + 1] each, dS [64][65].
template <typename T, int D>
__device__ void attn_backward_dq(const T* q, const T* k, const T* v, const T* dout, const float* lse,
                                 const float* delta, T* dq, const AttnParams& p) {
    attn_check_launch(attn_smem_bytes(D, 4, 0));
    extern __shared__ float smem[];
    float* sq = smem;
    float* sdo = sq + ATTN_TILE * (D + 1);
    float* sk = sdo + ATTN_TILE * (D + 1);
    float* sv = sk + ATTN_TILE * (D + 1);
    float* sp = sv + ATTN_TILE * (D + 1);
    const int tx = threadIdx.x % 8, ty = threadIdx.x / 8;
    const u64 hd = p.head_dim;
    const AttnQueryTile tile = attn_query_tile(p);
    const u64 group = tile.group, b = tile.b, h = tile.h, g = tile.kv;
    const long long i0 = tile.i0, q_rows = tile.rows;

    attn_stage<T, D>(sq, q + attn_q_row(p.q, group, b, h, i0), p.q.row, q_rows, hd, p.scale);
    attn_stage<T, D>(sdo, dout + attn_q_row(p.o, group, b, h, i0), p.o.row, q_rows, hd, 1.0f);
    float row_lse[ATTN_ROWS], row_delta[ATTN_ROWS];
#pragma unroll
    for (int i = 0; i < ATTN_ROWS; ++i) {
        const int r = ATTN_ROWS * ty + i;
        const u64 at = (b * p.q_heads + h) * p.seq_q + (u64)i0 + r;
        row_lse[i] = r < q_rows ? lse[at] : 0.0f;
        row_delta[i] = r < q_rows ? delta[at] : 0.0f;
    }

    float dq_acc[ATTN_ROWS][D / 8];
#pragma unroll
    for (int i = 0; i < ATTN_ROWS; ++i)
#pragma unroll
        for (int c = 0; c < D / 8; ++c) dq_acc[i][c] = 0.0f;

    const long long key_end = attn_key_end(p, i0);
    for (long long j0 = 0; j0 < key_end; j0 += ATTN_TILE) {
        const long long kv_rows = (long long)p.seq_kv - j0;
        __syncthreads();  // the previous key tile and dS are read
        attn_stage<T, D>(sk, k + attn_kv_row(p.k, b, g, j0), p.k.row, kv_rows, hd, 1.0f);
        attn_stage<T, D>(sv, v + attn_kv_row(p.v, b, g, j0), p.v.row, kv_rows, hd, 1.0f);
        __syncthreads();
        float s[ATTN_ROWS][ATTN_COLS], dp[ATTN_ROWS][ATTN_COLS];
        attn_scores<D>(s, sq, sk);
        attn_scores<D>(dp, sdo, sv);
#pragma unroll
        for (int i = 0; i < ATTN_ROWS; ++i) {
            const long long qi = i0 + ATTN_ROWS * ty + i;
#pragma unroll
            for (int c = 0; c < ATTN_COLS; ++c) {
                const int col = tx + 8 * c;
                const float e = attn_visible(p, qi, j0 + col) ? expf(s[i][c] - row_lse[i]) : 0.0f;
                sp[(ATTN_ROWS * ty + i) * (ATTN_TILE + 1) + col] = e * (dp[i][c] - row_delta[i]);
            }
        }
        __syncthreads();
        attn_accumulate<D>(dq_acc, sp, sk);
    }

    attn_store<T, D>(dq, dq_acc, q_rows, hd, p.scale, [&](int r) { return attn_q_row(p.q, group, b, h, (u64)(i0 + r)); });
}

// ---------------------------------------------------------------- entry points
//
// Arguments in order (the argument struct is passed by value):
//   attention_fwd_S(q, k, v, out, lse, params)
//   attention_bwd_delta_S(out, dout, delta, params)
//   attention_bwd_dkv_S(q, k, v, dout, lse, delta, dk, dv, params)
//   attention_bwd_dq_S(q, k, v, dout, lse, delta, dq, params)
// In the fused layout q, k and v (and dq, dk, dv) are the same buffer.

#define ATTENTION(T, S)                                                                                           \
    extern "C" __global__ __launch_bounds__(ATTN_THREADS) void attention_fwd_##S(                                 \
        const T* q, const T* k, const T* v, T* out, float* lse, AttnParams p) {                                   \
        if (p.head_dim <= 64) attn_forward<T, 64>(q, k, v, out, lse, p);                                          \
        else attn_forward<T, 128>(q, k, v, out, lse, p);                                                          \
    }                                                                                                             \
    extern "C" __global__ void attention_bwd_delta_##S(const T* out, const T* dout, float* delta, AttnParams p) { \
        attn_delta<T>(out, dout, delta, p);                                                                       \
    }                                                                                                             \
    extern "C" __global__ __launch_bounds__(ATTN_THREADS) void attention_bwd_dkv_##S(                             \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dk, T* dv,    \
        AttnParams p) {                                                                                           \
        if (p.head_dim <= 64) attn_backward_dkv<T, 64>(q, k, v, dout, lse, delta, dk, dv, p);                     \
        else attn_backward_dkv<T, 128>(q, k, v, dout, lse, delta, dk, dv, p);                                     \
    }                                                                                                             \
    extern "C" __global__ __launch_bounds__(ATTN_THREADS) void attention_bwd_dq_##S(                              \
        const T* q, const T* k, const T* v, const T* dout, const float* lse, const float* delta, T* dq,           \
        AttnParams p) {                                                                                           \
        if (p.head_dim <= 64) attn_backward_dq<T, 64>(q, k, v, dout, lse, delta, dq, p);                          \
        else attn_backward_dq<T, 128>(q, k, v, dout, lse, delta, dq, p);                                          \
    }

FOR_FLOAT_TYPES(ATTENTION)
