// Attention over a paged key/value cache (serving): the CUDA side of
// kernels/src/cpu/paged.rs, whose semantics and layouts these kernels keep.
// The launch geometry is described in kernels/src/cuda/paged.rs; the two must
// change together.
//
// Layouts (contiguous, row-major, element type T):
//   qkv          [tokens, kv_heads, group + 2, head_dim]: per token and kv
//                head its `group` query heads, its key, its value;
//   k/v_cache    [slots, kv_heads, head_dim]; slot b*block_size + i is row i
//                of cache block b;
//   block_tables [seqs, table_width] u32 block indices;
//   out          [tokens, q_heads, head_dim].
// Token t sits at position positions[t] of sequence token_seq[t] and attends
// positions 0..=positions[t] of it; the key of position p lives in slot
// table[p / block_size]*block_size + p % block_size. The host checks every
// index (sequence, position within the table, block within the cache, slot)
// before a launch, so the kernels read and write only inside their buffers.
//
// Determinism and batch invariance: no atomics; every output element is
// written by one thread and every sum runs in an order fixed by the token's
// position and the constants below, never by the rest of the call (how many
// tokens, which sequences, how a prompt was chunked). A (token, head) gives
// the same bits alone or in any batch, as on the CPU.

#define PAGED_THREADS 128      // threads of an attention block: 4 warps
#define PAGED_WARPS 4
#define PAGED_TILE 32          // positions a warp takes at a time: one per lane
#define PAGED_KEY_LANES 8      // lanes that share one key's dot product
#define PAGED_MAX_HEAD_DIM 256

// ------------------------------------------------------------ cache write
//
// k_cache[slots[t], g, :] = qkv[t, g, group, :] and v_cache[slots[t], g, :] =
// qkv[t, g, group + 1, :] for every token t and kv head g: one item per
// element of a key (a grid-stride loop over tokens * kv_heads * head_dim),
// so consecutive threads copy consecutive elements of one row. The values
// are copied bit for bit. A slot at or past `num_slots` is skipped rather
// than written (the host rejects it before the launch; this keeps a launcher
// bug from writing outside the cache).
#define KV_CACHE_WRITE(T, S)                                                                          \
    extern "C" __global__ void kv_cache_write_##S(const T* qkv, const unsigned int* slots, T* k_cache, \
                                                  T* v_cache, u64 tokens, u64 kv_heads, u64 group,     \
                                                  u64 head_dim, u64 num_slots) {                       \
        const u64 n = tokens * kv_heads * head_dim;                                                   \
        for (u64 i = grid_start(); i < n; i += grid_stride()) {                                       \
            const u64 e = i % head_dim, tg = i / head_dim;                                            \
            const u64 slot = slots[tg / kv_heads];                                                    \
            if (slot >= num_slots) continue;                                                          \
            const u64 src = tg * (group + 2) * head_dim + group * head_dim + e;                       \
            const u64 dst = (slot * kv_heads + tg % kv_heads) * head_dim + e;                         \
            k_cache[dst] = qkv[src];                                                                  \
            v_cache[dst] = qkv[src + head_dim];                                                       \
        }                                                                                             \
    }

FOR_FLOAT_TYPES(KV_CACHE_WRITE)

// --------------------------------------------------------------- attention
//
// Decode-optimised, in the style of vLLM's paged attention v1.
//
// One block per (token, query head), blockIdx.x = token * q_heads + head.
// Why per query head rather than per kv head (which would read each key
// once for the whole group): the registers and shared memory a block needs
// stay fixed whatever the group (MQA puts every query head on one kv head);
// a small decode batch still fills the GPU (8 decode tokens of 32 query heads
// are 256 blocks, where 8 kv heads would give 64 for 132 SMs); and the group's
// blocks are consecutive in the grid, so they run together and read each key
// and value from L2, not HBM: the HBM traffic is the same.
//
// Inside a block, the four warps split the context: warp w takes the
// 32-position tiles w, w + 4, w + 8, ... of positions 0..=position. A tile
// is 32 positions whatever the cache's block size, so every lane has a key for
// any block size (vLLM compiles one kernel per block size and ties its thread
// groups to it; here the block size is a run-time value, 1 and 16 alike).
// Per tile, lane j first finds where position p0 + j lives (its block-table
// entry); then the scores: 8 lanes share a key (each takes every 8th feature,
// so a key row is read 8 consecutive elements at a time, and the 8 partial
// sums meet in three shuffles), 4 keys per pass, 8 passes; then an online
// softmax over the tile (the warp's running max, rescaling its accumulator
// once per tile); then the values: lane j accumulates features j, j + 32, ...
// of sum_p e_p v_p, reading each value row coalesced. Each warp ends with its
// own (max, sum, accumulator), and the block combines the four in shared
// memory in warp order.
//
// The query is staged once in shared memory as f32. Head dims up to 256: a
// head_dim up to 64 runs the D = 64 instantiation, up to 128 the D = 128 one,
// up to 256 the D = 256 one; features past head_dim are zeros and never
// stored. Prefill chunks run through the same kernel (one block per token),
// which re-reads the context per token from L2; a tiled prefill kernel is
// what would make long chunks fast.

__device__ __forceinline__ float paged_neg_inf() { return __uint_as_float(0xff800000u); }

// The block's shared memory, declared once in the entry point (so the three
// head-dim instantiations share it) and handed to the template.
struct PagedShared {
    float* q;       // [PAGED_MAX_HEAD_DIM]: the query, f32
    float* p;       // [PAGED_WARPS][PAGED_TILE]: a tile's scores, then weights
    u64* row;       // [PAGED_WARPS][PAGED_TILE]: a tile's key/value row offsets
    float* m;       // [PAGED_WARPS]: each warp's running max
    float* l;       // [PAGED_WARPS]: each warp's sum of weights
    float* acc;     // [PAGED_WARPS][PAGED_MAX_HEAD_DIM]: each warp's accumulator
};

// out[t, h, :] for the (token, query head) `pair`.
template <typename T, int D>
__device__ void paged_attend(const T* qkv, const T* k_cache, const T* v_cache, const unsigned int* positions,
                             const unsigned int* token_seq, const unsigned int* block_tables, T* out, u64 pair,
                             u64 q_heads, u64 kv_heads, u64 head_dim, u64 block_size, u64 table_width, float scale,
                             const PagedShared& sh) {
    const unsigned int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const u64 t = pair / q_heads, h = pair % q_heads;
    const u64 group = q_heads / kv_heads, g = h / group, hd = head_dim;
    const u64 n = (u64)positions[t] + 1;  // positions 0..=positions[t]
    const unsigned int* table = block_tables + (u64)token_seq[t] * table_width;
    const T* q = qkv + (t * kv_heads + g) * (group + 2) * hd + (h % group) * hd;
    const u64 row_stride = kv_heads * hd, kv_base = g * hd;

    for (unsigned int i = tid; i < D; i += PAGED_THREADS) sh.q[i] = (u64)i < hd ? to_f32(q[i]) : 0.0f;
    __syncthreads();

    float* p = sh.p + warp * PAGED_TILE;
    u64* row = sh.row + warp * PAGED_TILE;
    const unsigned int kl = lane % PAGED_KEY_LANES, kg = lane / PAGED_KEY_LANES;
    float m = paged_neg_inf();  // the warp's running max (the same in every lane)
    float l = 0.0f;             // this lane's part of the warp's sum of weights
    float acc[D / 32];          // features lane + 32c of the warp's accumulator
#pragma unroll
    for (int c = 0; c < D / 32; ++c) acc[c] = 0.0f;

    const u64 tiles = (n + PAGED_TILE - 1) / PAGED_TILE;
    for (u64 tile = warp; tile < tiles; tile += PAGED_WARPS) {
        const u64 p0 = tile * PAGED_TILE;
        const unsigned int count = (unsigned int)min((u64)PAGED_TILE, n - p0);  // >= 1
        // Where this lane's position lives: its block, then its row in the block.
        if (lane < count) {
            const u64 pos = p0 + lane;
            row[lane] = ((u64)table[pos / block_size] * block_size + pos % block_size) * row_stride + kv_base;
        }
        __syncwarp();
        // Scores: PAGED_KEY_LANES lanes per key, 32 / PAGED_KEY_LANES keys per pass.
#pragma unroll 1
        for (unsigned int j0 = 0; j0 < PAGED_TILE; j0 += 32 / PAGED_KEY_LANES) {
            const unsigned int j = j0 + kg;
            float s = 0.0f;
            if (j < count) {
                const T* k = k_cache + row[j];
#pragma unroll 8
                for (unsigned int d = kl; d < D; d += PAGED_KEY_LANES) {
                    if ((u64)d < hd) s = fmaf(sh.q[d], to_f32(k[d]), s);
                }
            }
            // Every lane shuffles (the mask names the whole warp), past the tile's end too.
            for (int o = 1; o < PAGED_KEY_LANES; o *= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (kl == 0 && j < count) p[j] = s * scale;
        }
        __syncwarp();
        // Online softmax over the tile: the new running max, the rescale of
        // what came before, and this lane's weight.
        const float s = lane < count ? p[lane] : paged_neg_inf();
        float mx = s;
        for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_new = fmaxf(m, mx);
        // m is -inf before the first tile: expf(-inf) = 0 drops the empty past.
        const float alpha = expf(m - m_new);
        const float e = lane < count ? expf(s - m_new) : 0.0f;
        m = m_new;
        l = l * alpha + e;
        p[lane] = e;  // each lane rewrites only the score it read
        __syncwarp();
#pragma unroll
        for (int c = 0; c < D / 32; ++c) acc[c] *= alpha;
        for (unsigned int j = 0; j < count; ++j) {
            const float w = p[j];
            const T* v = v_cache + row[j];
#pragma unroll
            for (int c = 0; c < D / 32; ++c) {
                const u64 d = lane + 32 * c;
                if (d < hd) acc[c] = fmaf(w, to_f32(v[d]), acc[c]);
            }
        }
        __syncwarp();  // the weights and rows are read before the next tile rewrites them
    }

    // The warp's sum of weights, then the four warps combined in warp order.
    for (int o = 16; o > 0; o /= 2) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) {
        sh.m[warp] = m;
        sh.l[warp] = l;
    }
#pragma unroll
    for (int c = 0; c < D / 32; ++c) sh.acc[warp * PAGED_MAX_HEAD_DIM + lane + 32 * c] = acc[c];
    __syncthreads();
    float big = paged_neg_inf();
    for (int w = 0; w < PAGED_WARPS; ++w) big = fmaxf(big, sh.m[w]);
    // A warp with no tile (m = -inf, l = 0, acc = 0) weighs nothing; warp 0
    // always has position 0, so `big` is a score.
    float f[PAGED_WARPS], sum = 0.0f;
#pragma unroll
    for (int w = 0; w < PAGED_WARPS; ++w) {
        f[w] = sh.m[w] == paged_neg_inf() ? 0.0f : expf(sh.m[w] - big);
        sum += f[w] * sh.l[w];
    }
    const float inv = 1.0f / sum;
    T* o = out + pair * hd;
    for (unsigned int i = tid; (u64)i < hd; i += PAGED_THREADS) {
        float x = 0.0f;
#pragma unroll
        for (int w = 0; w < PAGED_WARPS; ++w) x = fmaf(f[w], sh.acc[w * PAGED_MAX_HEAD_DIM + i], x);
        o[i] = from_f32<T>(x * inv);
    }
    __syncthreads();  // shared memory is read before the next pair of this block rewrites it
}

// out = paged attention of every (token, query head) of the call: a loop
// over the pairs token * q_heads + head, one block at a time (the launcher
// gives one block per pair). Launched with any block size but
// PAGED_THREADS, or a head_dim above PAGED_MAX_HEAD_DIM, it traps: the
// launcher checks both, so either is a launcher bug, which must fail loudly
// rather than read out of bounds.
#define PAGED_ATTENTION(T, S)                                                                                         \
    extern "C" __global__ __launch_bounds__(PAGED_THREADS) void paged_attention_##S(                                  \
        const T* qkv, const T* k_cache, const T* v_cache, const unsigned int* positions, const unsigned int* token_seq, \
        const unsigned int* block_tables, T* out, u64 tokens, u64 q_heads, u64 kv_heads, u64 head_dim, u64 block_size, \
        u64 table_width, float scale) {                                                                               \
        __shared__ float q_s[PAGED_MAX_HEAD_DIM];                                                                     \
        __shared__ float p_s[PAGED_WARPS * PAGED_TILE];                                                               \
        __shared__ u64 row_s[PAGED_WARPS * PAGED_TILE];                                                               \
        __shared__ float m_s[PAGED_WARPS];                                                                            \
        __shared__ float l_s[PAGED_WARPS];                                                                            \
        __shared__ float acc_s[PAGED_WARPS * PAGED_MAX_HEAD_DIM];                                                     \
        if (blockDim.x != PAGED_THREADS || head_dim > PAGED_MAX_HEAD_DIM) __trap();                                   \
        const PagedShared sh = {q_s, p_s, row_s, m_s, l_s, acc_s};                                                    \
        for (u64 pair = blockIdx.x; pair < tokens * q_heads; pair += gridDim.x) {                                     \
            if (head_dim <= 64)                                                                                       \
                paged_attend<T, 64>(qkv, k_cache, v_cache, positions, token_seq, block_tables, out, pair, q_heads,    \
                                    kv_heads, head_dim, block_size, table_width, scale, sh);                          \
            else if (head_dim <= 128)                                                                                 \
                paged_attend<T, 128>(qkv, k_cache, v_cache, positions, token_seq, block_tables, out, pair, q_heads,   \
                                     kv_heads, head_dim, block_size, table_width, scale, sh);                         \
            else                                                                                                      \
                paged_attend<T, 256>(qkv, k_cache, v_cache, positions, token_seq, block_tables, out, pair, q_heads,   \
                                     kv_heads, head_dim, block_size, table_width, scale, sh);                         \
        }                                                                                                             \
    }

FOR_FLOAT_TYPES(PAGED_ATTENTION)
