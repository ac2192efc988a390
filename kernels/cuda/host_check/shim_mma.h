// A host emulation of the device-only functions of attention_tc.cu (on top
// of shim.h): the shared array, the shared-memory size register, the 16-bit
// packing and the warp-wide mma.sync.m16n8k16 with f32 accumulators.
//
// The mma is emulated as the warp-collective instruction it is: every lane
// deposits its fragment registers, a warp barrier, then each lane rebuilds the
// whole 16 x 16 A, 16 x 8 B and 16 x 8 C from all 32 deposits with the
// fragment layout exactly as the PTX ISA states it ("Matrix Fragments for
// mma.m16n8k16 with floating point type", element by element: a0..a7,
// b0..b3, c0..c3, elements numbered low half first), computes its own four
// outputs in double and rounds them to f32, and a second barrier lets the
// next instruction reuse the deposits. The layout here is written from the
// ISA's formulas, not from the kernels, so a kernel that loads its fragments
// in another layout computes the wrong product and fails the check.
#pragma once
#include <cstdint>

inline unsigned short* atc_shared() { return reinterpret_cast<unsigned short*>(smem); }
inline unsigned int atc_dynamic_smem_size() { return emu_smem_bytes; }

template <typename T> inline unsigned short emu_bits(T x) { unsigned short b; memcpy(&b, &x, 2); return b; }

// cvt.rn.{bf16,f16}x2.f32: two values rounded to nearest even, `lo` in the low half.
template <typename T> inline unsigned int atc_pack(float lo, float hi) {
    return (unsigned int)emu_bits(from_f32<T>(lo)) | ((unsigned int)emu_bits(from_f32<T>(hi)) << 16);
}

// The value of a 16-bit element of type T.
template <typename T> inline double emu_value(unsigned int bits16);
template <> inline double emu_value<bf16>(unsigned int bits16) { return __uint_as_float((bits16 & 0xffffu) << 16); }
template <> inline double emu_value<f16>(unsigned int bits16) { unsigned short b = (unsigned short)bits16; _Float16 h; memcpy(&h, &b, 2); return (double)h; }

struct EmuMmaLane { unsigned int a[4], b[2]; float c[4]; };
EmuMmaLane emu_mma_lanes[1024];

template <typename T>
inline void atc_mma(float (&d)[4], const unsigned int (&a)[4], unsigned int b0, unsigned int b1) {
    const unsigned tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    emu_mma_lanes[tid] = {{a[0], a[1], a[2], a[3]}, {b0, b1}, {d[0], d[1], d[2], d[3]}};
    emu_warp_barrier[warp]->arrive_and_wait();
    double A[16][16], B[16][8], C[16][8];
    int seen_a[16][16] = {}, seen_b[16][8] = {}, seen_c[16][8] = {};
    for (unsigned l = 0; l < 32; ++l) {
        const EmuMmaLane& in = emu_mma_lanes[warp * 32 + l];
        const int groupID = (int)(l >> 2), threadID_in_group = (int)(l % 4);
        // A: four .f16x2/.bf16x2 registers holding a0..a7, two per register.
        for (int i = 0; i < 8; ++i) {
            const unsigned int bits = in.a[i / 2] >> (16 * (i % 2));
            const int row = (i < 2 || (4 <= i && i < 6)) ? groupID : groupID + 8;
            const int col = i < 4 ? threadID_in_group * 2 + (i & 1) : threadID_in_group * 2 + (i & 1) + 8;
            A[row][col] = emu_value<T>(bits);
            ++seen_a[row][col];
        }
        // B: two registers holding b0..b3.
        for (int i = 0; i < 4; ++i) {
            const unsigned int bits = (i < 2 ? in.b[0] : in.b[1]) >> (16 * (i % 2));
            const int row = i < 2 ? threadID_in_group * 2 + (i & 1) : threadID_in_group * 2 + (i & 1) + 8;
            const int col = groupID;
            B[row][col] = emu_value<T>(bits);
            ++seen_b[row][col];
        }
        // C: four f32 registers c0..c3.
        for (int i = 0; i < 4; ++i) {
            const int row = i < 2 ? groupID : groupID + 8;
            const int col = threadID_in_group * 2 + (i & 1);
            C[row][col] = in.c[i];
            ++seen_c[row][col];
        }
    }
    for (int r = 0; r < 16; ++r)
        for (int c = 0; c < 16; ++c)
            if (seen_a[r][c] != 1 || (c < 8 && (seen_b[r][c] != 1 || seen_c[r][c] != 1))) {
                fprintf(stderr, "mma emulation: the fragment layout does not cover the matrices once\n");
                abort();
            }
    emu_warp_barrier[warp]->arrive_and_wait();  // every lane has read the deposits
    const int groupID = (int)(lane >> 2), threadID_in_group = (int)(lane % 4);
    for (int i = 0; i < 4; ++i) {
        const int row = i < 2 ? groupID : groupID + 8;
        const int col = threadID_in_group * 2 + (i & 1);
        double acc = C[row][col];
        for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
        d[i] = (float)acc;
    }
}
