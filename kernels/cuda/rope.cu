// Rotary position embedding ("rotate half"), as kernels/src/cpu/rope.rs: the
// two halves (u, v) of a row of head_dim values at sequence index t become
// (u cos - v sin, v cos + u sin), with sin negated for the backward (the
// inverse rotation). `table` holds cos then sin, each [seq, half], already
// looked up at each sequence index's position (built on the host, in f32 as
// the CPU's table).
//
// Rows of head_dim values run over the input in order; row r belongs to
// sequence index (r / per_position) % seq, and is rotated only when
// r % period < rotated (the packed layout leaves the value heads alone; the
// plain layout has per_position = period = rotated = 1). One item per pair.
#define ROPE(T, S)                                                                                 \
    extern "C" __global__ void rope_##S(const T* x, T* y, const float* table, u64 rows, u64 seq,   \
                                        u64 half, u64 per_position, u64 period, u64 rotated,       \
                                        float sign) {                                              \
        for (u64 i = grid_start(); i < rows * half; i += grid_stride()) {                          \
            const u64 r = i / half, k = i % half;                                                  \
            const u64 a = r * 2 * half + k, b = a + half;                                          \
            if (r % period >= rotated) {                                                           \
                y[a] = x[a];                                                                       \
                y[b] = x[b];                                                                       \
                continue;                                                                          \
            }                                                                                      \
            const u64 t = (r / per_position) % seq;                                                \
            const float c = table[t * half + k], s = sign * table[(seq + t) * half + k];           \
            const float u = to_f32(x[a]), v = to_f32(x[b]);                                        \
            y[a] = from_f32<T>(u * c - v * s);                                                     \
            y[b] = from_f32<T>(v * c + u * s);                                                     \
        }                                                                                          \
    }

FOR_FLOAT_TYPES(ROPE)
