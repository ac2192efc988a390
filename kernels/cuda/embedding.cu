// Embedding lookup and its backward, as kernels/src/cpu/embedding.rs: a
// table [rows, dim] holding the vocabulary entries start..start + rows; ids
// outside that range give zero rows (a vocabulary-parallel shard).

// out[i, :] = table[ids[i] - start, :], or zeros; one item per output element.
#define EMBEDDING(T, S)                                                                            \
    extern "C" __global__ void embedding_##S(const T* table, const unsigned int* ids, T* out,      \
                                             u64 n, u64 rows, u64 dim, u64 start) {                \
        for (u64 i = grid_start(); i < n * dim; i += grid_stride()) {                              \
            const u64 id = ids[i / dim];                                                           \
            out[i] = id >= start && id - start < rows ? table[(id - start) * dim + i % dim]        \
                                                      : from_f32<T>(0.0f);                         \
        }                                                                                          \
    }                                                                                              \
    /* dtable[r, :] = sum of dout[i, :] over the positions i of row r, in the */                   \
    /* order they occur: order[offsets[r]..offsets[r + 1]] lists them (built on */                 \
    /* the host from the ids). One block per table row, threads over columns: */                   \
    /* no atomics, the CPU's summation order, so the result is deterministic. */                   \
    extern "C" __global__ void embedding_backward_##S(const T* dout, const unsigned int* offsets,  \
                                                      const unsigned int* order, T* dtable,        \
                                                      u64 rows, u64 dim) {                         \
        for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {                                       \
            for (u64 j = threadIdx.x; j < dim; j += blockDim.x) {                                  \
                float acc = 0.0f;                                                                  \
                for (unsigned int k = offsets[r]; k < offsets[r + 1]; k++)                         \
                    acc += to_f32(dout[(u64)order[k] * dim + j]);                                  \
                dtable[r * dim + j] = from_f32<T>(acc);                                            \
            }                                                                                      \
        }                                                                                          \
    }

FOR_FLOAT_TYPES(EMBEDDING)
