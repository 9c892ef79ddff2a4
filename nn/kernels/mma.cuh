// The tensor cores' m16n8k16 product (PTX mma.sync, sm_80 and later) for bf16 and f16 with f32
// accumulation, and the fragments it takes, in the PTX ISA's layout. Lane = 4 g + q
// (g = lane / 4, q = lane % 4); each 32-bit register holds two elements, the first in its low
// half:
//   A, 16 x 16:  x[0] = (g, 2q..2q+1)  x[1] = (g+8, 2q..)  x[2] = (g, 2q+8..)  x[3] = (g+8, 2q+8..)
//   B, 16 x 8:   x[0] = (2q..2q+1, g)  x[1] = (2q+8.., g)            (rows are k, columns n)
//   C, 16 x 8:   c[0], c[1] = (g, 2q..2q+1)  c[2], c[3] = (g+8, 2q..2q+1)   in f32
// A C tile's two halves over 16 columns, rounded to T, are an A fragment of those 16 as k:
// FlashAttention-2 keeps S, P and O in registers so. The fragments come from shared memory by
// ldmatrix, four 8 x 8 matrices an instruction. Under kernels/emu the product and ldmatrix run
// in cuda_emu.h with this same layout.
#pragma once
#include "common.cuh"

struct FragA {
    uint32_t x[4];
};
struct FragB {
    uint32_t x[2];
};

// d += a b.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const FragA &a, const FragB &b);

#ifdef CUDA_EMU
template <typename T>
inline void mma(float (&d)[4], const FragA &a, const FragB &b) {
    cuda_emu::mma_m16n8k16<T>(d, a.x, b.x);
}
#else
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&d)[4], const FragA &a,
                                                   const FragB &b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
}
template <>
__device__ __forceinline__ void mma<__half>(float (&d)[4], const FragA &a, const FragB &b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
}
#endif

__device__ __forceinline__ unsigned quad_row() { return (threadIdx.x % 32) / 4; }
__device__ __forceinline__ unsigned quad_col() { return (threadIdx.x % 32) % 4; }

// The bits of one 16-bit element.
template <typename T>
__device__ __forceinline__ uint32_t bits(const T &v) {
    return *reinterpret_cast<const uint16_t *>(&v);
}
// Two f32 values rounded to T, as one register.
template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    T a, b;
    store(&a, lo);
    store(&b, hi);
    return bits(a) | bits(b) << 16;
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16 (sm_75 and later): four 8 x 8 matrices of 16-bit
// elements from shared memory, lanes 8 i .. 8 i + 7 giving the addresses of matrix i's eight
// rows (16 bytes each, 16-byte aligned). Register i of lane 4 g + q then holds matrix i's
// elements (g, 2q) and (g, 2q + 1); with `trans`, (2q, g) and (2q + 1, g).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void *row);

#ifdef CUDA_EMU
template <bool TRANS>
inline void ldmatrix_x4(uint32_t (&r)[4], const void *row) {
    cuda_emu::ldmatrix_x4(r, row, TRANS);
}
#else
template <>
__device__ __forceinline__ void ldmatrix_x4<false>(uint32_t (&r)[4], const void *row) {
    uint32_t at = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}
template <>
__device__ __forceinline__ void ldmatrix_x4<true>(uint32_t (&r)[4], const void *row) {
    uint32_t at = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at));
}
#endif

// The A fragment of the 16 x 16 block at `m` of a row-major matrix of leading dimension ld (in
// shared memory, rows 16-byte aligned): its quarters (rows 0-7 and 8-15, columns 0-7 and 8-15)
// are ldmatrix's four matrices in the order of x[0..3].
template <typename T>
__device__ __forceinline__ FragA load_a(const T *m, int ld) {
    unsigned l = threadIdx.x % 32;
    FragA a;
    ldmatrix_x4<false>(a.x, m + (l % 8 + (l / 8 % 2) * 8) * ld + l / 16 * 8);
    return a;
}
// The B fragments (16 x 8) of M^T for two tiles: M's rows 0-7 and 8-15 of 16 at `m`
// (row-major, ld, shared memory): B(k, n) = M(n, k), b[t] from rows 8 t .. 8 t + 7.
template <typename T>
__device__ __forceinline__ void load_b_t2(FragB (&b)[2], const T *m, int ld) {
    unsigned l = threadIdx.x % 32;
    uint32_t r[4];
    ldmatrix_x4<false>(r, m + (l % 8 + l / 16 * 8) * ld + (l / 8 % 2) * 8);
    b[0] = {{r[0], r[1]}};
    b[1] = {{r[2], r[3]}};
}
// The B fragments (16 x 8) of M itself for two tiles: M's 16 rows (k) of columns 0-7 and
// 8-15 at `m` (row-major, ld, shared memory), b[t] from columns 8 t .. 8 t + 7.
template <typename T>
__device__ __forceinline__ void load_b2(FragB (&b)[2], const T *m, int ld) {
    unsigned l = threadIdx.x % 32;
    uint32_t r[4];
    ldmatrix_x4<true>(r, m + (l % 8 + (l / 8 % 2) * 8) * ld + l / 16 * 8);
    b[0] = {{r[0], r[1]}};
    b[1] = {{r[2], r[3]}};
}
// The A fragment of 16 columns of a 16-row f32 result held as two C tiles (columns 0-7 in
// c0, 8-15 in c1), rounded to T.
template <typename T>
__device__ __forceinline__ FragA as_a(const float (&c0)[4], const float (&c1)[4]) {
    return {{pack<T>(c0[0], c0[1]), pack<T>(c0[2], c0[3]), pack<T>(c1[0], c1[1]),
             pack<T>(c1[2], c1[3])}};
}
