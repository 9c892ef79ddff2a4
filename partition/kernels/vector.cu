// ds-partition's vector kernels over flat buffers (src/buffer/gpu.rs loads them, src/vector.rs
// launches them): element for element what vector.rs's host loops compute. Each result is
// computed in f32 and rounded once to the buffer's type (round to nearest even, as the `half`
// crate rounds), and build.rs compiles with -fmad=false, so a GPU buffer ends with the bits a
// host buffer would hold. Grid-stride loops over 64-bit indices; blocks of 256 threads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_f<__half>(float x) {
    return __float2half_rn(x);
}

#define FOR_EACH(i, n)                                                                     \
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < (n);            \
         i += (uint64_t)blockDim.x * gridDim.x)

// dst += src
template <typename T> __device__ void accumulate(T *dst, const T *src, uint64_t n) {
    FOR_EACH(i, n) dst[i] = from_f<T>(to_f(dst[i]) + to_f(src[i]));
}

// buf *= k
template <typename T> __device__ void scale(T *buf, float k, uint64_t n) {
    FOR_EACH(i, n) buf[i] = from_f<T>(to_f(buf[i]) * k);
}

// dst = src rounded to T
template <typename T> __device__ void convert(T *dst, const float *src, uint64_t n) {
    FOR_EACH(i, n) dst[i] = from_f<T>(src[i]);
}

// *out += the sum of squares of g, in f64 (inf or NaN when any element is).
template <typename T> __device__ void sum_squares(const T *g, uint64_t n, double *out) {
    __shared__ double partial[256];
    double acc = 0.0;
    FOR_EACH(i, n) {
        double v = (double)to_f(g[i]);
        acc += v * v;
    }
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(out, partial[0]);
}

#define KERNELS(T, S)                                                                      \
    extern "C" __global__ void accumulate_##S(T *dst, const T *src, uint64_t n) {          \
        accumulate(dst, src, n);                                                           \
    }                                                                                      \
    extern "C" __global__ void scale_##S(T *buf, float k, uint64_t n) { scale(buf, k, n); } \
    extern "C" __global__ void convert_##S(T *dst, const float *src, uint64_t n) {         \
        convert(dst, src, n);                                                              \
    }                                                                                      \
    extern "C" __global__ void sum_squares_##S(const T *g, uint64_t n, double *out) {      \
        sum_squares(g, n, out);                                                            \
    }

KERNELS(float, f32)
KERNELS(__nv_bfloat16, bf16)
KERNELS(__half, f16)
