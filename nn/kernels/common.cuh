// What fused.cu and flash.cu share: the storage types' conversions (f32 arithmetic, rounded
// once on the store) and the warp reductions.
#pragma once
#ifndef CUDA_EMU
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>
#endif

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ void store(float *p, float v) { *p = v; }
__device__ __forceinline__ void store(__nv_bfloat16 *p, float v) { *p = __float2bfloat16(v); }
__device__ __forceinline__ void store(__half *p, float v) { *p = __float2half(v); }

// Unrolls the loop that follows completely (nvcc's `#pragma unroll`): for loops whose trip count
// is a constant but past nvcc's own unrolling. Nothing under kernels/emu, where speed is not
// the point.
#ifdef CUDA_EMU
#define UNROLL
#else
#define UNROLL _Pragma("unroll")
#endif

// 2^x by the special-function unit alone (ex2.approx.ftz: within 2 ulp; results below 2^-126
// flushed to zero), where exp2f adds a range check and a rescale for subnormal results, three
// instructions more. For the attention's probabilities the flush moves each by less than
// 2^-126 where a row's largest is 1: nothing a bf16 or f16 output can show (f16 rounds such
// values to zero anyway).
#ifdef CUDA_EMU
inline float exp2_approx(float x) {
    float y = std::exp2(x);
    return y < std::numeric_limits<float>::min() ? 0.0f : y;
}
#else
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#endif

struct Sum {
    __device__ __forceinline__ static float op(float a, float b) { return a + b; }
    __device__ __forceinline__ static float identity() { return 0.0f; }
};
struct Max {
    __device__ __forceinline__ static float op(float a, float b) { return fmaxf(a, b); }
    __device__ __forceinline__ static float identity() { return -INFINITY; }
};

template <typename R>
__device__ __forceinline__ float warp_reduce(float v) {
    for (int o = 16; o > 0; o /= 2) v = R::op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
