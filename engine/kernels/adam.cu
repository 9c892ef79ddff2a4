// Adam/AdamW over a shard whose master copy, moments and gradients are in GPU memory
// (src/optim/gpu.rs launches it): src/optim/adam.rs's `update` element for element, with the
// gradient unscaled first as the engine's host path does (`g * k` in f32). The per-step
// scalars come from the same `Consts` as on the host, and build.rs compiles with -fmad=false
// (IEEE sqrt and division are nvcc's defaults), so each element gets the host's bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

struct Consts {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, inv_sqrt_bc2, eps, l2, decay,
        neg_step_size;
};

template <typename T>
__device__ void adam(float *p, const T *grad, float *m, float *v, float k, Consts c,
                     uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)blockDim.x * gridDim.x) {
        float g = to_f(grad[i]) * k;
        g = g + c.l2 * p[i];
        float m_new = c.beta1 * m[i] + c.one_minus_beta1 * g;
        float v_new = c.beta2 * v[i] + c.one_minus_beta2 * (g * g);
        float denom = sqrtf(v_new) * c.inv_sqrt_bc2 + c.eps;
        p[i] = p[i] * c.decay + c.neg_step_size * (m_new / denom);
        m[i] = m_new;
        v[i] = v_new;
    }
}

#define ADAM(T, S)                                                                         \
    extern "C" __global__ void adam_##S(float *p, const T *g, float *m, float *v, float k, \
                                        Consts c, uint64_t n) {                            \
        adam(p, g, m, v, k, c, n);                                                         \
    }

ADAM(float, f32)
ADAM(__nv_bfloat16, bf16)
ADAM(__half, f16)
