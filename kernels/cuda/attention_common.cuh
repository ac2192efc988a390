// What both fused attention sources share (attention.cu on CUDA cores,
// attention_tc.cu on tensor cores): the argument structs the launcher
// mirrors in Rust, where a head's rows live, which keys a query sees, and
// which query tile a block takes. Included after common.cuh and before
// either source (kernels/src/cuda.rs).

// Queries and keys are processed in tiles of this many rows by both.
#define ATTN_TILE 64

// Where the rows of one tensor live; mirrored by `AttnPlace` in Rust.
struct AttnPlace {
    u64 base, batch, group, head, row;
};

// One attention call; mirrored by `AttnParams` in Rust (field order matters).
struct AttnParams {
    AttnPlace q, k, v, o;
    u64 batch, q_heads, kv_heads, seq_q, seq_kv, head_dim;
    float scale;
    unsigned int causal;
};

__device__ __forceinline__ float attn_neg_inf() { return __uint_as_float(0xff800000u); }

// Offset of row t of query head h (of a query-layout place).
__device__ __forceinline__ u64 attn_q_row(const AttnPlace& p, u64 group, u64 b, u64 h, u64 t) {
    return p.base + b * p.batch + (h / group) * p.group + (h % group) * p.head + t * p.row;
}

// Offset of row t of kv head g (of a key- or value-layout place).
__device__ __forceinline__ u64 attn_kv_row(const AttnPlace& p, u64 b, u64 g, u64 t) {
    return p.base + b * p.batch + g * p.group + t * p.row;
}

// Whether query i may attend key j (both in range).
__device__ __forceinline__ bool attn_visible(const AttnParams& p, long long i, long long j) {
    if (i >= (long long)p.seq_q || j >= (long long)p.seq_kv) return false;
    return !p.causal || j <= i + ((long long)p.seq_kv - (long long)p.seq_q);
}

// Keys 0..end that the queries i0..i0+64 attend (the causal frontier of the
// tile's last query).
__device__ __forceinline__ long long attn_key_end(const AttnParams& p, long long i0) {
    long long end = (long long)p.seq_kv;
    if (p.causal) {
        const long long last = min(i0 + ATTN_TILE, (long long)p.seq_q) - 1;
        end = min(end, max(0ll, last + 1 + (long long)p.seq_kv - (long long)p.seq_q));
    }
    return end;
}

// The query tile a forward or dq block works on, and where its queries
// live: tiles with the most keys first, so that the longest blocks of a
// causal launch start early.
struct AttnQueryTile {
    u64 group;       // query heads per kv head
    u64 b, h, kv;    // batch, query head, and the kv head it reads
    long long i0;    // the tile's first query
    long long rows;  // queries from i0 to the end of the sequence
};

__device__ __forceinline__ AttnQueryTile attn_query_tile(const AttnParams& p) {
    const u64 heads = p.batch * p.q_heads;
    const u64 tiles = (p.seq_q + ATTN_TILE - 1) / ATTN_TILE;
    const u64 bh = blockIdx.x % heads;
    AttnQueryTile t;
    t.group = p.q_heads / p.kv_heads;
    t.b = bh / p.q_heads;
    t.h = bh % p.q_heads;
    t.kv = t.h / t.group;
    t.i0 = (long long)(tiles - 1 - blockIdx.x / heads) * ATTN_TILE;
    t.rows = (long long)p.seq_q - t.i0;
    return t;
}
