// The CUDA C subset of nn/kernels/*.cu on the host (Note [kernels on the host] in
// nn/src/kernels/gpu/mod.rs): a kernel's source, unchanged, compiled by g++ and run by
// this header's scheduler, so the CPU tests run the very code the GPU runs, with the launch
// the engine computes.
//
// Each CUDA thread of a block is a fiber (ucontext) on the calling OS thread; the blocks of a
// grid run one after another. A fiber runs until it reaches a barrier (__syncthreads, or the
// warp barrier inside a shuffle or a tensor-core product) and hands over to the next; a
// barrier opens when every thread of its block (or warp) has reached it. Warps run one after
// another as far as each can, in order or reversed (the tests run both), so a missing
// __syncthreads shows as a wrong result, and a barrier some threads never reach is reported.
// __shared__ is a function-local static: one copy per OS thread (thread_local), shared by the
// fibers of the block running there, so tests may run in parallel. A launch's dynamic shared
// memory is a buffer of its size, filled with 0xff bytes (NaN in every float type) before each
// block, as a GPU's holds garbage.
// Asynchronous copies (cp.async) are as late as PTX allows: the destination is filled with 0xff
// when a thread issues one, and the data lands when that thread waits for its group, so reading
// a tile before the wait (or before the barrier after every thread's wait), or overwriting one
// another warp still reads, shows as NaN in the result.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static thread_local
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

namespace cuda_emu {

struct Launch;
// The launch running on this OS thread, and the current fiber's index within its block.
extern thread_local Launch *current;
extern thread_local unsigned lane_slot;

void syncthreads();
void syncwarp();
// The current thread's 8-byte exchange slot in its warp, and lane `src`'s.
uint64_t *my_slot();
uint64_t slot_of(unsigned src);
unsigned lane();
// The current warp's scratch for a matrix product: 512 floats.
float *warp_scratch();
// The launch's dynamic shared memory and its size in bytes.
char *dynamic_shared();
uint32_t dynamic_shared_bytes();
// cp.async: `bytes` at dst, the first `src_bytes` of them from src and the rest zeros, landing
// at the issuing thread's wait_copies; commit_group; wait_group n (lands all but the newest n
// committed groups of the calling thread).
void copy_async(void *dst, const void *src, unsigned bytes, unsigned src_bytes);
void commit_copies();
void wait_copies(unsigned newest_pending);
// __trap: reports `why` and aborts the process (a GPU stops the kernel with an error).
[[noreturn]] void trap(const char *why);

// Runs `body` for every thread of `grid` x `block` with `shared` bytes of dynamic shared
// memory, warps and lanes in order or `reversed`. Returns false and prints why when the kernel
// deadlocks on a barrier.
bool launch(dim3 grid, dim3 block, unsigned shared, bool reversed,
            const std::function<void()> &body);

}  // namespace cuda_emu

extern thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;
static const int warpSize = 32;

inline void __syncthreads() { cuda_emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { cuda_emu::syncwarp(); }

template <typename T>
T emu_shfl(unsigned mask, T v, unsigned src) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
    if (mask != 0xffffffffu) {
        std::fprintf(stderr, "cuda_emu: shuffles need the full warp mask\n");
        std::abort();
    }
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    *cuda_emu::my_slot() = bits;
    cuda_emu::syncwarp();
    uint64_t got = cuda_emu::slot_of(src);
    cuda_emu::syncwarp();  // every lane has read before a later shuffle writes
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    unsigned l = cuda_emu::lane();
    unsigned src = l ^ (unsigned)lane_mask;
    if ((src & ~(unsigned)(width - 1)) != (l & ~(unsigned)(width - 1))) src = l;
    return emu_shfl(mask, v, src);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    unsigned l = cuda_emu::lane();
    unsigned base = l & ~(unsigned)(width - 1);
    unsigned src = (l - base) + delta < (unsigned)width ? l + delta : l;
    return emu_shfl(mask, v, src);
}
template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    unsigned l = cuda_emu::lane();
    unsigned base = l & ~(unsigned)(width - 1);
    return emu_shfl(mask, v, base + ((unsigned)src_lane % (unsigned)width));
}

// The device math the kernels use, as the host's libm (the GPU's differ by a few ulp; the
// tests' tolerances say so).
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
template <typename T>
inline T __ldg(const T *p) { return *p; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }

// bf16 and fp16 storage types, converted with round-to-nearest-even as cuda_bf16.h and
// cuda_fp16.h do.
struct __nv_bfloat16 {
    uint16_t x;
};
inline float __bfloat162float(__nv_bfloat16 h) {
    uint32_t u = (uint32_t)h.x << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return {(uint16_t)((u >> 16) | 0x40)};  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return {(uint16_t)(u >> 16)};
}
struct __half {
    _Float16 x;
};
inline float __half2float(__half h) { return (float)h.x; }
inline __half __float2half(float f) { return {(_Float16)f}; }

// 16-byte vectors, as the kernels copy tiles with them, and CUDA's pair of floats.
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};

// PTX's mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d += a b over the warp, a 16 x 16
// and b 16 x 8 of T, d 16 x 8 in f32, each lane holding its share in the PTX ISA's fragment
// layout (kernels/mma.cuh says which). Every lane publishes its elements of a and b in the
// warp's scratch, then computes its own four of d. Products and sums are f32 in a fixed order
// (a tensor core's order, and its rounding of the partial sums, are its own: the GPU tests'
// bounds allow for them).
namespace cuda_emu {
template <typename T>
inline float half_of(uint32_t pair, unsigned hi) {
    uint16_t bits = (uint16_t)(pair >> (16 * hi));
    T v;
    std::memcpy(&v, &bits, 2);
    if constexpr (std::is_same<T, __nv_bfloat16>::value)
        return __bfloat162float(v);
    else
        return __half2float(v);
}

template <typename T>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    float *s = warp_scratch();  // a: 16 x 16 at s, b: 16 x 8 at s + 256
    unsigned g = lane() / 4, q = lane() % 4;
    for (unsigned r = 0; r < 4; r++)
        for (unsigned h = 0; h < 2; h++)
            s[(g + (r & 1) * 8) * 16 + 2 * q + h + (r >> 1) * 8] = half_of<T>(a[r], h);
    for (unsigned r = 0; r < 2; r++)
        for (unsigned h = 0; h < 2; h++) s[256 + (2 * q + h + r * 8) * 8 + g] = half_of<T>(b[r], h);
    syncwarp();
    float out[4];
    for (unsigned i = 0; i < 4; i++) {
        unsigned row = g + (i >> 1) * 8, col = 2 * q + (i & 1);
        float acc = d[i];
        for (unsigned k = 0; k < 16; k++) acc += s[row * 16 + k] * s[256 + k * 8 + col];
        out[i] = acc;
    }
    syncwarp();  // every lane has read before a later product writes
    for (unsigned i = 0; i < 4; i++) d[i] = out[i];
}

// PTX's ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: every lane publishes the row address
// it gives (lanes 8 i .. 8 i + 7: matrix i's rows), then takes its registers' elements from
// the rows that hold them: register i, elements (g, 2q) and (g, 2q + 1) of matrix i, or with
// `trans` (2q, g) and (2q + 1, g).
inline void ldmatrix_x4(uint32_t (&r)[4], const void *row, bool trans) {
    if ((uintptr_t)row % 16 != 0) trap("ldmatrix: a row address that is not 16-byte aligned");
    *my_slot() = (uint64_t)(uintptr_t)row;
    syncwarp();
    unsigned g = lane() / 4, q = lane() % 4;
    for (unsigned i = 0; i < 4; i++) {
        uint32_t e[2];
        for (unsigned h = 0; h < 2; h++) {
            unsigned at_row = trans ? 2 * q + h : g, col = trans ? g : 2 * q + h;
            auto p = reinterpret_cast<const uint16_t *>((uintptr_t)slot_of(8 * i + at_row));
            e[h] = p[col];
        }
        r[i] = e[0] | e[1] << 16;
    }
    syncwarp();  // every lane has read before a later exchange writes the slots
}
}  // namespace cuda_emu
