// Tiles in shared memory: the block's dynamic shared memory (the launch's shared_mem_bytes, which
// may pass the 48 KiB of static shared memory, sized by launch.rs) and the asynchronous copies that fill it from
// global memory (cp.async, sm_80 and later) while the warps compute on another tile. A thread's
// copies land when it waits for their group; the other threads see them after a barrier that
// follows every thread's wait. Under kernels/emu the copies land as late as PTX allows
// (cuda_emu.h), so a read before the wait shows.
#pragma once
#include "common.cuh"

#ifdef CUDA_EMU
inline char *dynamic_shared() { return cuda_emu::dynamic_shared(); }
inline uint32_t dynamic_shared_bytes() { return cuda_emu::dynamic_shared_bytes(); }
[[noreturn]] inline void trap(const char *why) { cuda_emu::trap(why); }
template <int BYTES>
inline void copy_async(void *dst, const void *src, bool valid) {
    cuda_emu::copy_async(dst, src, BYTES, valid ? BYTES : 0);
}
inline void commit_copies() { cuda_emu::commit_copies(); }
template <int N>
inline void wait_copies() {
    cuda_emu::wait_copies(N);
}
#else
__device__ __forceinline__ char *dynamic_shared() {
    extern __shared__ __align__(16) char shared_bytes[];
    return shared_bytes;
}
__device__ __forceinline__ uint32_t dynamic_shared_bytes() {
    uint32_t n;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}
__device__ __forceinline__ void trap(const char *) { __trap(); }
// BYTES of global memory at src (aligned to BYTES) to shared memory at dst where `valid`, BYTES
// zeros where not, without a branch: the copy's src-size is BYTES or 0, and the bytes past it
// are zero-filled. Where not valid src is not read, but callers still pass an address inside
// the tensor. 16 bypass L1 (.cg), 4 and 8 go through it (.ca, the only form for them).
template <int BYTES>
__device__ __forceinline__ void copy_async(void *dst, const void *src, bool valid) {
    static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async copies 4, 8 or 16 bytes");
    uint32_t to = (uint32_t)__cvta_generic_to_shared(dst), from_bytes = valid ? BYTES : 0;
    if constexpr (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src),
                     "r"(from_bytes)
                     : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(to), "l"(src),
                     "n"(BYTES), "r"(from_bytes)
                     : "memory");
}
// Closes the calling thread's copies issued since the last commit into a group.
__device__ __forceinline__ void commit_copies() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most the newest N of the calling thread's groups are still in flight.
template <int N>
__device__ __forceinline__ void wait_copies() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

// The block's dynamic shared memory as a `Tiles`: a launch that gave less than its size
// (launch.rs computes it) stops the kernel rather than let it write past the end.
template <typename Tiles>
__device__ Tiles &shared_tiles() {
    if (dynamic_shared_bytes() < sizeof(Tiles)) trap("dynamic shared memory smaller than the tiles");
    return *reinterpret_cast<Tiles *>(dynamic_shared());
}

// The block's dynamic shared memory as n floats, trapping where the launch gave fewer.
__device__ __forceinline__ float *shared_floats(size_t n) {
    if (dynamic_shared_bytes() < n * sizeof(float)) trap("dynamic shared memory smaller than its floats");
    return reinterpret_cast<float *>(dynamic_shared());
}
