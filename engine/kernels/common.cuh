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
