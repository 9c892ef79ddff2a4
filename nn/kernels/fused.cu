// The fused kernels of a layer's forward and backward on a GPU (issue 35): LayerNorm, RMSNorm,
// tanh-GELU, SwiGLU, rotary embeddings, the causal softmax, the softmax cross-entropy, bias
// gradients and rows summed by index (the embeddings' gradient), each the CPU fast path's arithmetic
// (src/kernels/fused_norm_loss.rs, ops.rs, rms_swiglu.rs, rotary.rs) in one pass over memory where the primitive chain
// takes five to twenty. src/kernels/gpu/launch.rs computes every launch and documents each
// kernel's arguments; gpu/cuda.rs launches them on candle's stream; the CPU tests run this
// same source under kernels/emu (Note [kernels on the host]).
// Why one long file: the kernels share the row helpers and reductions of common.cuh and
// shared_tiles.cuh and compile into one PTX module the launcher loads once.
//
// Storage is f32, bf16 or f16 (the _f32/_bf16/_f16 entry points); arithmetic is f32, rounded
// once on the store, as the CPU kernels do. Rows are one block each, with the block's threads
// striding over the row; a block is whole warps, at most 1024 threads.
#include "shared_tiles.cuh"

// `v` reduced over the block; every thread gets the result. The first barrier keeps a previous
// call's readers of `part` ahead of this call's writers.
template <typename R>
__device__ float block_reduce(float v) {
    __shared__ float part[32];
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    v = warp_reduce<R>(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? part[lane] : R::identity();
    return warp_reduce<R>(v);
}

// 16 bytes of T, the unit of the vectorised loads and stores (8 bf16 or f16, 4 f32): a warp
// moves 512 bytes an instruction, where one element a thread moves 64 (bf16) and needs eight
// times the loads in flight to keep the memory busy.
template <typename T>
struct alignas(16) Pack {
    static constexpr uint32_t N = 16 / sizeof(T);
    T v[N];
};

// Whether a row of n elements at p may be read and written a Pack at a time: p on a 16-byte
// boundary and n a whole number of Packs (GPT-2's padded 50304 and Llama's 128256 are).
template <typename T>
__device__ __forceinline__ bool packed(const T *p, uint32_t n) {
    return (uintptr_t)p % 16 == 0 && n % Pack<T>::N == 0;
}

// The row's mean and 1/sqrt(var + eps), two passes as the CPU's `moments`.
template <typename T>
__device__ void row_moments(const T *x, uint32_t d, float eps, float &mean, float &rstd) {
    float s = 0.0f;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) s += to_f(x[c]);
    mean = block_reduce<Sum>(s) / (float)d;
    float q = 0.0f;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
        float e = to_f(x[c]) - mean;
        q += e * e;
    }
    rstd = 1.0f / sqrtf(block_reduce<Sum>(q) / (float)d + eps);
}

// The moments of a row whose Packs are spread one a thread over the block, each thread's N
// values in v (`mine`: the thread holds one; the others add nothing): two passes over
// registers, as row_moments's over memory, the sums in the threads' order.
template <uint32_t N>
__device__ void pack_moments(const float (&v)[N], bool mine, uint32_t d, float eps, float &mean,
                             float &rstd) {
    float s = 0.0f, q = 0.0f;
    for (uint32_t k = 0; k < N; k++) s += v[k];
    mean = block_reduce<Sum>(s) / (float)d;
    for (uint32_t k = 0; mine && k < N; k++) {
        float e = v[k] - mean;
        q += e * e;
    }
    rstd = 1.0f / sqrtf(block_reduce<Sum>(q) / (float)d + eps);
}

// Pack c of row `at` of a [.., d] array into f32 values.
template <typename T>
__device__ __forceinline__ void load_pack(const T *rows, size_t at, uint32_t c,
                                          float (&v)[Pack<T>::N]) {
    Pack<T> p = reinterpret_cast<const Pack<T> *>(rows + at)[c];
    for (uint32_t k = 0; k < Pack<T>::N; k++) v[k] = to_f(p.v[k]);
}

// One element of LayerNorm's output.
__device__ __forceinline__ float layer_norm_of(float x, float mean, float rstd, float w, float b) {
    return (x - mean) * rstd * w + b;
}

// y = (x - mean) * rstd * w + b over rows of d; grid: one block per row.
template <typename T>
__device__ void layer_norm_fwd(const T *x, const T *w, const T *b, T *y, uint32_t d, float eps) {
    size_t at = (size_t)blockIdx.x * d;
    float mean, rstd;
    row_moments(x + at, d, eps, mean, rstd);
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x)
        store(&y[at + c], layer_norm_of(to_f(x[at + c]), mean, rstd, to_f(w[c]), to_f(b[c])));
}

// layer_norm_fwd with thread c holding the row's Pack c (x, w, b and y on 16-byte boundaries,
// d a whole number of Packs and at most a block's threads of them: the host checks,
// gpu/mod.rs): x is read once, into registers, where the row_moments loops read it twice more
// and every element cost its own load and address arithmetic (at GPT-2's 768 about 2,400 warp
// instructions a row, 3 warps of about 256 here, where its 4 bytes an element of memory traffic
// allow about 650 on an H200; ARCHITECTURE.md's fused kernels).
template <typename T>
__device__ void layer_norm_fwd_packs(const T *x, const T *w, const T *b, T *y, uint32_t d,
                                     float eps) {
    const uint32_t n = Pack<T>::N, c = threadIdx.x;
    const bool mine = c < d / n;
    size_t at = (size_t)blockIdx.x * d;
    float v[Pack<T>::N] = {}, mean, rstd;
    if (mine) load_pack(x, at, c, v);
    pack_moments(v, mine, d, eps, mean, rstd);
    if (!mine) return;
    float wv[Pack<T>::N], bv[Pack<T>::N];
    load_pack(w, 0, c, wv);
    load_pack(b, 0, c, bv);
    Pack<T> out;
    for (uint32_t k = 0; k < n; k++) store(&out.v[k], layer_norm_of(v[k], mean, rstd, wv[k], bv[k]));
    reinterpret_cast<Pack<T> *>(y + at)[c] = out;
}

// A block's `n` column sums, in its dynamic shared memory (launch.rs's norm_reduce sizes it),
// zeroed; each column is one thread's (c = threadIdx.x + k blockDim.x), so no barrier guards
// them. Global memory would take a read and a write-through to L2 per row and column.
__device__ float *zeroed_column_sums(uint32_t n) {
    float *sums = shared_floats(n);
    for (uint32_t c = threadIdx.x; c < n; c += blockDim.x) sums[c] = 0.0f;
    return sums;
}

// Copies a block's `n` column sums into its scratch row partial[blockIdx.x].
__device__ void store_column_sums(const float *sums, float *partial, uint32_t n) {
    for (uint32_t c = threadIdx.x; c < n; c += blockDim.x)
        partial[(size_t)blockIdx.x * n + c] = sums[c];
}

// LayerNorm's input gradient at one element: g = dy w, xhat the normalised input, and the
// row's means of g and g xhat.
__device__ __forceinline__ float layer_norm_dx(float g, float xhat, float g_mean, float gx_mean,
                                               float rstd) {
    return rstd * (g - g_mean - xhat * gx_mean);
}

// LayerNorm's backward, first pass: dx per row, and each block's share of dw and db (the rows
// blockIdx.x, + gridDim.x, ...) into partial[blockIdx.x] = [dw (d), db (d)] in f32, each column
// owned by one thread. sum_partials adds the blocks' shares.
// With xhat = (x - mean) * rstd and g = dy * w: dx = rstd * (g - mean(g) - xhat * mean(g xhat)).
template <typename T>
__device__ void layer_norm_bwd(const T *x, const T *w, const T *dy, T *dx, float *partial,
                               uint32_t rows, uint32_t d, float eps) {
    float *pw = zeroed_column_sums(2 * d), *pb = pw + d;
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        size_t at = (size_t)r * d;
        float mean, rstd;
        row_moments(x + at, d, eps, mean, rstd);
        float sg = 0.0f, sgx = 0.0f;
        for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
            float xhat = (to_f(x[at + c]) - mean) * rstd, gy = to_f(dy[at + c]);
            float g = gy * to_f(w[c]);
            sg += g;
            sgx += g * xhat;
            pw[c] += gy * xhat;
            pb[c] += gy;
        }
        float g_mean = block_reduce<Sum>(sg) / (float)d;
        float gx_mean = block_reduce<Sum>(sgx) / (float)d;
        for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
            float xhat = (to_f(x[at + c]) - mean) * rstd;
            float g = to_f(dy[at + c]) * to_f(w[c]);
            store(&dx[at + c], layer_norm_dx(g, xhat, g_mean, gx_mean, rstd));
        }
    }
    store_column_sums(pw, partial, 2 * d);
}

// layer_norm_bwd with thread c holding Pack c of each row (the conditions of
// layer_norm_fwd_packs, for x, w, dy and dx): x and dy are read once a row, into registers,
// and the thread's N columns of dw and db are sums in registers across the block's rows, where
// layer_norm_bwd keeps them in shared memory. The same scratch rows for sum_partials.
template <typename T>
__device__ void layer_norm_bwd_packs(const T *x, const T *w, const T *dy, T *dx, float *partial,
                                     uint32_t rows, uint32_t d, float eps) {
    const uint32_t n = Pack<T>::N, c = threadIdx.x;
    const bool mine = c < d / n;
    float wv[Pack<T>::N] = {}, pw[Pack<T>::N] = {}, pb[Pack<T>::N] = {};
    if (mine) load_pack(w, 0, c, wv);
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        size_t at = (size_t)r * d;
        float xv[Pack<T>::N] = {}, gy[Pack<T>::N] = {}, mean, rstd;
        if (mine) {
            load_pack(x, at, c, xv);
            load_pack(dy, at, c, gy);
        }
        pack_moments(xv, mine, d, eps, mean, rstd);
        float sg = 0.0f, sgx = 0.0f;
        for (uint32_t k = 0; mine && k < n; k++) {
            float xhat = (xv[k] - mean) * rstd, g = gy[k] * wv[k];
            sg += g;
            sgx += g * xhat;
            pw[k] += gy[k] * xhat;
            pb[k] += gy[k];
        }
        float g_mean = block_reduce<Sum>(sg) / (float)d;
        float gx_mean = block_reduce<Sum>(sgx) / (float)d;
        if (!mine) continue;
        Pack<T> out;
        for (uint32_t k = 0; k < n; k++) {
            float xhat = (xv[k] - mean) * rstd, g = gy[k] * wv[k];
            store(&out.v[k], layer_norm_dx(g, xhat, g_mean, gx_mean, rstd));
        }
        reinterpret_cast<Pack<T> *>(dx + at)[c] = out;
    }
    float *share = partial + (size_t)blockIdx.x * 2 * d;
    for (uint32_t k = 0; mine && k < n; k++) {
        share[c * n + k] = pw[k];
        share[d + c * n + k] = pb[k];
    }
}

// out[c] = the sum over `blocks` of partial[k][c], c < width: one thread a column. The second
// pass of every column reduction here (LayerNorm's dweight and dbias, a bias gradient).
template <typename T>
__device__ void sum_partials(const float *partial, T *out, uint32_t blocks, uint32_t width) {
    uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    float s = 0.0f;
    for (uint32_t k = 0; k < blocks; k++) s += partial[(size_t)k * width + c];
    store(&out[c], s);
}

// A bias gradient's first pass: each block's share of the column sums of dy [rows, k] (rows
// blockIdx.x, + gridDim.x, ...) into partial[blockIdx.x] (k f32), each column one thread's.
template <typename T>
__device__ void column_sum_pass(const T *dy, float *partial, uint32_t rows, uint32_t k) {
    float *p = partial + (size_t)blockIdx.x * k;
    for (uint32_t c = threadIdx.x; c < k; c += blockDim.x) {
        float s = 0.0f;
        for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) s += to_f(dy[(size_t)r * k + c]);
        p[c] = s;
    }
}

// column_sum_pass with each thread owning a Pack's N adjacent columns, read 16 bytes at a time
// (dy on a 16-byte boundary and k a whole number of Packs: the host checks, gpu/mod.rs). Each
// column's rows are added in the same order, so the sums are column_sum_pass's, bit for bit.
template <typename T>
__device__ void column_sum_packs(const T *dy, float *partial, uint32_t rows, uint32_t k) {
    const uint32_t n = Pack<T>::N;
    float *p = partial + (size_t)blockIdx.x * k;
    for (uint32_t c = threadIdx.x; c < k / n; c += blockDim.x) {
        float s[Pack<T>::N] = {};
        for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
            Pack<T> v = reinterpret_cast<const Pack<T> *>(dy + (size_t)r * k)[c];
            for (uint32_t j = 0; j < n; j++) s[j] += to_f(v.v[j]);
        }
        for (uint32_t j = 0; j < n; j++) p[c * n + j] = s[j];
    }
}

// One element of RMSNorm's output, and its input gradient (g = dy, n = x root, mean the row's
// mean of dy w n).
__device__ __forceinline__ float rms_norm_of(float x, float root, float w) { return w * (x * root); }
__device__ __forceinline__ float rms_norm_dx(float g, float w, float n, float mean, float root) {
    return (g * w - n * mean) * root;
}

// RMSNorm over rows of d: y = w * (x * root), root = 1 / sqrt(mean(x^2) + eps) into roots (f32,
// one a row, for the backward); grid: one block per row.
template <typename T>
__device__ void rms_norm_fwd(const T *x, const T *w, T *y, float *roots, uint32_t d, float eps) {
    size_t at = (size_t)blockIdx.x * d;
    float q = 0.0f;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
        float v = to_f(x[at + c]);
        q += v * v;
    }
    float root = 1.0f / sqrtf(block_reduce<Sum>(q) / (float)d + eps);
    if (threadIdx.x == 0) roots[blockIdx.x] = root;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x)
        store(&y[at + c], rms_norm_of(to_f(x[at + c]), root, to_f(w[c])));
}

// rms_norm_fwd a Pack a thread (layer_norm_fwd_packs's conditions, for x, w and y): x read once.
template <typename T>
__device__ void rms_norm_fwd_packs(const T *x, const T *w, T *y, float *roots, uint32_t d,
                                   float eps) {
    const uint32_t n = Pack<T>::N, c = threadIdx.x;
    const bool mine = c < d / n;
    size_t at = (size_t)blockIdx.x * d;
    float v[Pack<T>::N] = {}, q = 0.0f;  // a thread without a Pack adds zeros
    if (mine) load_pack(x, at, c, v);
    for (uint32_t k = 0; k < n; k++) q += v[k] * v[k];
    float root = 1.0f / sqrtf(block_reduce<Sum>(q) / (float)d + eps);
    if (threadIdx.x == 0) roots[blockIdx.x] = root;
    if (!mine) return;
    float wv[Pack<T>::N];
    load_pack(w, 0, c, wv);
    Pack<T> out;
    for (uint32_t k = 0; k < n; k++) store(&out.v[k], rms_norm_of(v[k], root, wv[k]));
    reinterpret_cast<Pack<T> *>(y + at)[c] = out;
}

// RMSNorm's backward, first pass (a column reduction as LayerNorm's): with n = x root,
// dx = (dy w - n mean(dy w n)) root per row; each block's share of dw = sum dy n into
// partial[blockIdx.x] (d f32).
template <typename T>
__device__ void rms_norm_bwd(const T *x, const float *roots, const T *w, const T *dy, T *dx,
                             float *partial, uint32_t rows, uint32_t d) {
    float *pw = zeroed_column_sums(d);
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        size_t at = (size_t)r * d;
        float root = roots[r], dot = 0.0f;
        for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
            float n = to_f(x[at + c]) * root, g = to_f(dy[at + c]);
            pw[c] += g * n;
            dot += g * to_f(w[c]) * n;
        }
        float mean = block_reduce<Sum>(dot) / (float)d;
        for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
            float n = to_f(x[at + c]) * root;
            store(&dx[at + c], rms_norm_dx(to_f(dy[at + c]), to_f(w[c]), n, mean, root));
        }
    }
    store_column_sums(pw, partial, d);
}

// rms_norm_bwd a Pack a thread (layer_norm_bwd_packs's conditions, for x, w, dy and dx): x and
// dy read once a row, the thread's columns of dw summed in registers.
template <typename T>
__device__ void rms_norm_bwd_packs(const T *x, const float *roots, const T *w, const T *dy,
                                   T *dx, float *partial, uint32_t rows, uint32_t d) {
    const uint32_t n = Pack<T>::N, c = threadIdx.x;
    const bool mine = c < d / n;
    float wv[Pack<T>::N] = {}, pw[Pack<T>::N] = {};
    if (mine) load_pack(w, 0, c, wv);
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x) {
        size_t at = (size_t)r * d;
        float root = roots[r], dot = 0.0f, xv[Pack<T>::N] = {}, gy[Pack<T>::N] = {};
        if (mine) {
            load_pack(x, at, c, xv);
            load_pack(dy, at, c, gy);
        }
        for (uint32_t k = 0; k < n; k++) {  // zeros where the thread has no Pack
            float nk = xv[k] * root;
            pw[k] += gy[k] * nk;
            dot += gy[k] * wv[k] * nk;
        }
        float mean = block_reduce<Sum>(dot) / (float)d;
        if (!mine) continue;
        Pack<T> out;
        for (uint32_t k = 0; k < n; k++)
            store(&out.v[k], rms_norm_dx(gy[k], wv[k], xv[k] * root, mean, root));
        reinterpret_cast<Pack<T> *>(dx + at)[c] = out;
    }
    for (uint32_t k = 0; mine && k < n; k++) partial[(size_t)blockIdx.x * d + c * n + k] = pw[k];
}

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

// The grid-stride loop's first index and stride.
__device__ __forceinline__ uint64_t grid_index() {
    return blockIdx.x * (uint64_t)blockDim.x + threadIdx.x;
}
__device__ __forceinline__ uint64_t grid_stride() { return (uint64_t)blockDim.x * gridDim.x; }

// SwiGLU of one element, silu(g) u, and its gradients at dy = d: silu'(g) = s (1 + g (1 - s)).
__device__ __forceinline__ float swiglu_of(float g, float u) { return g * sigmoid(g) * u; }
__device__ __forceinline__ void swiglu_grads(float g, float u, float d, float &dg, float &du) {
    float s = sigmoid(g);
    du = d * g * s;
    dg = d * u * s * (1.0f + g * (1.0f - s));
}

// silu(gate) * up, elementwise (grid-stride).
template <typename T>
__device__ void swiglu_fwd(const T *gate, const T *up, T *y, uint64_t n) {
    for (uint64_t i = grid_index(); i < n; i += grid_stride())
        store(&y[i], swiglu_of(to_f(gate[i]), to_f(up[i])));
}

// SwiGLU's gradients into out = [dgate (n), dup (n)].
template <typename T>
__device__ void swiglu_bwd(const T *gate, const T *up, const T *dy, T *out, uint64_t n) {
    for (uint64_t i = grid_index(); i < n; i += grid_stride()) {
        float dg, du;
        swiglu_grads(to_f(gate[i]), to_f(up[i]), to_f(dy[i]), dg, du);
        store(&out[i], dg);
        store(&out[n + i], du);
    }
}

// swiglu_fwd and swiglu_bwd a Pack at a time (every address on a 16-byte boundary and n a
// whole number of Packs: the host checks, gpu/mod.rs): the same arithmetic, the same bits.
template <typename T>
__device__ void swiglu_fwd_packs(const T *gate, const T *up, T *y, uint64_t n) {
    const uint32_t w = Pack<T>::N;
    const Pack<T> *gp = reinterpret_cast<const Pack<T> *>(gate);
    const Pack<T> *up_ = reinterpret_cast<const Pack<T> *>(up);
    Pack<T> *yp = reinterpret_cast<Pack<T> *>(y);
    for (uint64_t i = grid_index(); i < n / w; i += grid_stride()) {
        Pack<T> g = gp[i], u = up_[i], o;
        for (uint32_t k = 0; k < w; k++) store(&o.v[k], swiglu_of(to_f(g.v[k]), to_f(u.v[k])));
        yp[i] = o;
    }
}

template <typename T>
__device__ void swiglu_bwd_packs(const T *gate, const T *up, const T *dy, T *out, uint64_t n) {
    const uint32_t w = Pack<T>::N;
    const Pack<T> *gp = reinterpret_cast<const Pack<T> *>(gate);
    const Pack<T> *up_ = reinterpret_cast<const Pack<T> *>(up);
    const Pack<T> *dp = reinterpret_cast<const Pack<T> *>(dy);
    Pack<T> *dgp = reinterpret_cast<Pack<T> *>(out), *dup = reinterpret_cast<Pack<T> *>(out + n);
    for (uint64_t i = grid_index(); i < n / w; i += grid_stride()) {
        Pack<T> g = gp[i], u = up_[i], d = dp[i], dg, du;
        for (uint32_t k = 0; k < w; k++) {
            float a, b;
            swiglu_grads(to_f(g.v[k]), to_f(u.v[k]), to_f(d.v[k]), a, b);
            store(&dg.v[k], a);
            store(&du.v[k], b);
        }
        dgp[i] = dg;
        dup[i] = du;
    }
}

// Rows summed by index (an embedding table's gradient): out [rows, width], row r the sum of
// src's rows at the positions holding index r, in position order (`order[first[r]..
// first[r + 1]]`, the host's stable grouping of the indices), zero where r holds none; f32
// sums rounded once, no atomics (the same bits every run). grid: one block per output row.
template <typename T>
__device__ void sum_rows_by_index(const T *src, const uint32_t *order, const uint32_t *first,
                                  T *out, uint32_t width) {
    uint32_t r = blockIdx.x, a = first[r], e = first[r + 1];
    size_t at = (size_t)r * width;
    for (uint32_t c = threadIdx.x; c < width; c += blockDim.x) {
        float s = 0.0f;
        for (uint32_t i = a; i < e; ++i) s += to_f(src[(size_t)order[i] * width + c]);
        store(&out[at + c], s);
    }
}

// One rotated element: v c - other s where `minus`, else v c + other s (the same bits: -p is
// exact). The one formula of both rotary kernels, so they give the same bits.
__device__ __forceinline__ float rotated(float v, float c, float other, float s, bool minus) {
    float p = other * s;
    return v * c + (minus ? -p : p);
}

// Rotary embeddings in the split-halves convention, x [.., t, hd] with tables [t, hd]:
// x cos + rotate_half(x) sin, or with `transpose` its backward, dy cos + rotate_half^T(dy sin).
template <typename T>
__device__ void rotary(const T *x, const T *cos_t, const T *sin_t, T *y, uint64_t n, uint32_t t,
                       uint32_t hd, uint32_t transpose) {
    uint32_t half = hd / 2;
    for (uint64_t e = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; e < n;
         e += (uint64_t)blockDim.x * gridDim.x) {
        uint32_t i = (uint32_t)(e % hd);
        uint64_t row = e - i, tab = ((e / hd) % t) * hd;
        float c = to_f(cos_t[tab + i]), v = to_f(x[e]), o;
        if (i < half) {
            float other = to_f(x[row + i + half]);
            o = rotated(v, c, other, to_f(sin_t[tab + i + (transpose ? half : 0)]), !transpose);
        } else {
            float other = to_f(x[row + i - half]);
            o = rotated(v, c, other, to_f(sin_t[tab + i - (transpose ? half : 0)]), transpose);
        }
        store(&y[e], o);
    }
}

// rotary a pair of Packs a thread: Pack c of a row's first half and the Pack at the same place
// of its second half, which rotate into each other (x, y and the tables on 16-byte boundaries,
// hd / 2 a whole number of Packs and rows x pairs within u32: the host checks, gpu/mod.rs).
// Each element is `rotated` as in `rotary`, so both give the same bits; the row and its table
// row come from two 32-bit divisions a pair of Packs, where `rotary` takes two 64-bit ones an
// element (rotary moves an element a thread and was bound by issue, not by memory).
// TRANSPOSE is a template argument so that each loop is one direction (the compiler kept the
// choice inside the loop, 18 instructions a pair more).
template <typename T, bool TRANSPOSE>
__device__ void rotary_packs(const T *x, const T *cos_t, const T *sin_t, T *y, uint32_t pairs,
                             uint32_t t, uint32_t hd) {
    const uint32_t w = Pack<T>::N, half = hd / 2, per_row = half / w;
    for (uint64_t i = grid_index(); i < pairs; i += grid_stride()) {
        uint32_t row = (uint32_t)i / per_row, c = (uint32_t)i % per_row * w;
        size_t at = (size_t)row * hd + c, tab = (size_t)(row % t) * hd + c;
        auto load = [](const T *p) { return *reinterpret_cast<const Pack<T> *>(p); };
        Pack<T> a = load(x + at), b = load(x + at + half), ya, yb;
        Pack<T> ca = load(cos_t + tab), cb = load(cos_t + tab + half);
        Pack<T> sa = load(sin_t + tab), sb = load(sin_t + tab + half);
        for (uint32_t k = 0; k < w; k++) {
            float va = to_f(a.v[k]), vb = to_f(b.v[k]);
            float s_a = to_f((TRANSPOSE ? sb : sa).v[k]), s_b = to_f((TRANSPOSE ? sa : sb).v[k]);
            store(&ya.v[k], rotated(va, to_f(ca.v[k]), vb, s_a, !TRANSPOSE));
            store(&yb.v[k], rotated(vb, to_f(cb.v[k]), va, s_b, TRANSPOSE));
        }
        *reinterpret_cast<Pack<T> *>(y + at) = ya;
        *reinterpret_cast<Pack<T> *>(y + at + half) = yb;
    }
}

#define SQRT_2_OVER_PI 0.7978846f
#define GELU_C 0.044715f

// tanh-GELU and its backward, elementwise over n (grid-stride).
template <typename T>
__device__ void gelu_fwd(const T *x, T *y, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)blockDim.x * gridDim.x) {
        float v = to_f(x[i]);
        store(&y[i], 0.5f * v * (1.0f + tanhf(SQRT_2_OVER_PI * (v + GELU_C * v * v * v))));
    }
}

template <typename T>
__device__ void gelu_bwd(const T *x, const T *dy, T *dx, uint64_t n) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)blockDim.x * gridDim.x) {
        float v = to_f(x[i]), g = to_f(dy[i]);
        float t = tanhf(SQRT_2_OVER_PI * (v + GELU_C * v * v * v));
        float du = SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_C * v * v);
        store(&dx[i], g * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du));
    }
}

// Softmax of the scaled scores [.., t, t]: row r sees columns 0..=r % t, later ones get 0.
template <typename T>
__device__ void causal_softmax_fwd(const T *x, T *y, uint32_t t, float scale) {
    size_t at = (size_t)blockIdx.x * t;
    uint32_t seen = blockIdx.x % t + 1;
    float m = -INFINITY;
    for (uint32_t c = threadIdx.x; c < seen; c += blockDim.x) m = fmaxf(m, to_f(x[at + c]) * scale);
    m = block_reduce<Max>(m);
    float s = 0.0f;
    for (uint32_t c = threadIdx.x; c < seen; c += blockDim.x) s += expf(to_f(x[at + c]) * scale - m);
    float inv = 1.0f / block_reduce<Sum>(s);
    for (uint32_t c = threadIdx.x; c < t; c += blockDim.x)
        store(&y[at + c], c < seen ? expf(to_f(x[at + c]) * scale - m) * inv : 0.0f);
}

// The softmax's backward from its output: dx = scale * y * (dy - sum(dy * y)) per row of n.
template <typename T>
__device__ void softmax_bwd(const T *y, const T *dy, T *dx, uint32_t n, float scale) {
    size_t at = (size_t)blockIdx.x * n;
    float s = 0.0f;
    for (uint32_t c = threadIdx.x; c < n; c += blockDim.x) s += to_f(y[at + c]) * to_f(dy[at + c]);
    float dot = block_reduce<Sum>(s);
    for (uint32_t c = threadIdx.x; c < n; c += blockDim.x)
        store(&dx[at + c], scale * to_f(y[at + c]) * (to_f(dy[at + c]) - dot));
}

// A row's maximum and the sum of exp(x - max) over its elements, gathered in one pass (the
// online softmax of Milakov and Gimelshein): a larger element rescales the sum so far.
struct MaxSum {
    float max, sum;
};

__device__ __forceinline__ MaxSum add_element(MaxSum a, float x) {
    if (x > a.max) return {x, a.sum * expf(a.max - x) + 1.0f};
    return {a.max, a.sum + (x == -INFINITY ? 0.0f : expf(x - a.max))};
}

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
    float m = fmaxf(a.max, b.max);
    if (m == -INFINITY) return {m, 0.0f};
    return {m, a.sum * expf(a.max - m) + b.sum * expf(b.max - m)};
}

// A run of elements xs[0..n) added at once: one rescale of the sum for the run's maximum and
// one exponential an element, where add_element may take two.
__device__ __forceinline__ MaxSum add_run(MaxSum a, const float *xs, uint32_t n) {
    float m = a.max;
    for (uint32_t k = 0; k < n; k++) m = fmaxf(m, xs[k]);
    if (m == -INFINITY) return a;
    float s = a.sum * expf(a.max - m);  // 0 while a is empty (a.max = -inf)
    for (uint32_t k = 0; k < n; k++) s += expf(xs[k] - m);  // 0 for a -inf element
    return {m, s};
}

__device__ MaxSum warp_max_sum(MaxSum v) {
    for (int o = 16; o > 0; o /= 2)
        v = combine(v, {__shfl_xor_sync(0xffffffffu, v.max, o),
                        __shfl_xor_sync(0xffffffffu, v.sum, o)});
    return v;
}

// The log-sum-exp of a row of v (any storage type) over the block; every thread gets it.
template <typename T>
__device__ float row_log_sum_exp(const T *x, uint32_t v) {
    __shared__ MaxSum part[32];
    MaxSum t = {-INFINITY, 0.0f};
    if (packed(x, v)) {
        const uint32_t n = Pack<T>::N;
        const Pack<T> *packs = reinterpret_cast<const Pack<T> *>(x);
        for (uint32_t c = threadIdx.x; c < v / n; c += blockDim.x) {
            Pack<T> p = packs[c];
            float xs[Pack<T>::N];
            for (uint32_t k = 0; k < n; k++) xs[k] = to_f(p.v[k]);
            t = add_run(t, xs, n);
        }
    } else {
        for (uint32_t c = threadIdx.x; c < v; c += blockDim.x) t = add_element(t, to_f(x[c]));
    }
    unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    t = warp_max_sum(t);
    __syncthreads();  // a previous call's readers of `part` are done
    if (lane == 0) part[warp] = t;
    __syncthreads();
    t = lane < blockDim.x / 32 ? part[lane] : MaxSum{-INFINITY, 0.0f};
    t = warp_max_sum(t);
    return t.max + logf(t.sum);
}

// Cross-entropy of logits [rows, v] (any storage type) against u32 targets, one block a row,
// in one pass over the row: its loss, lse - x[target], into row_loss (NaN for a target outside
// the vocabulary: the host learns of it from the loss, with no sync here), and its log-sum-exp
// into lse (f32), from which cross_entropy_grad recomputes the softmax (llm.c's fused
// classifier keeps the same).
template <typename T>
__device__ void cross_entropy_lse(const T *logits, const uint32_t *targets, float *row_loss,
                                  float *lse, uint32_t v) {
    size_t at = (size_t)blockIdx.x * v;
    float l = row_log_sum_exp(logits + at, v);
    if (threadIdx.x == 0) {
        uint32_t t = targets[blockIdx.x];
        row_loss[blockIdx.x] = t < v ? l - to_f(logits[at + t]) : NAN;
        lse[blockIdx.x] = l;
    }
}

// The f32 logits' softmax [rows, v] into probs and each row's loss, one block a row: the CPU
// path's tape (cross_entropy_with_probs), whose backward then computes no exponential.
__device__ void cross_entropy_fwd(const float *logits, const uint32_t *targets, float *probs,
                                  float *row_loss, uint32_t v) {
    size_t at = (size_t)blockIdx.x * v;
    float l = row_log_sum_exp(logits + at, v);
    for (uint32_t c = threadIdx.x; c < v; c += blockDim.x) probs[at + c] = expf(logits[at + c] - l);
    if (threadIdx.x == 0) {
        uint32_t t = targets[blockIdx.x];
        row_loss[blockIdx.x] = t < v ? l - logits[at + t] : NAN;
    }
}

// One logit's gradient: (softmax - onehot) * scale from the logit x and its row's log-sum-exp.
__device__ __forceinline__ float logit_grad(float x, float lse, float scale, bool target) {
    return expf(x - lse) * scale - (target ? scale : 0.0f);
}

// The cross-entropy's gradient straight from the logits, one block a row, without the softmax
// in memory (llm.c's fused classifier): (exp(x - lse) - onehot(target)) * scale, with each
// row's log-sum-exp from `lse` (cross_entropy_lse's), or computed here where lse is null.
template <typename T>
__device__ void cross_entropy_grad(const T *logits, const float *lse, const uint32_t *targets,
                                   T *dlogits, uint32_t v, float scale) {
    size_t at = (size_t)blockIdx.x * v;
    uint32_t t = targets[blockIdx.x];
    float l = lse ? lse[blockIdx.x] : row_log_sum_exp(logits + at, v);
    if (packed(logits + at, v) && packed(dlogits + at, v)) {
        const uint32_t n = Pack<T>::N;
        const Pack<T> *in = reinterpret_cast<const Pack<T> *>(logits + at);
        Pack<T> *out = reinterpret_cast<Pack<T> *>(dlogits + at);
        for (uint32_t c = threadIdx.x; c < v / n; c += blockDim.x) {
            Pack<T> p = in[c], d;
            for (uint32_t k = 0; k < n; k++)
                store(&d.v[k], logit_grad(to_f(p.v[k]), l, scale, c * n + k == t));
            out[c] = d;
        }
        return;
    }
    for (uint32_t c = threadIdx.x; c < v; c += blockDim.x)
        store(&dlogits[at + c], logit_grad(to_f(logits[at + c]), l, scale, c == t));
}

// The mean of n row losses into *mean: one block, the sum in f32 lanes then across them.
__device__ void mean_of_rows(const float *row_loss, float *mean, uint32_t n) {
    float s = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) s += row_loss[i];
    s = block_reduce<Sum>(s);
    if (threadIdx.x == 0) *mean = n > 0 ? s / (float)n : 0.0f;
}

// The cross-entropy's gradient from the softmax: (probs - onehot(target)) * scale, one block a
// row of v, into T.
template <typename T>
__device__ void cross_entropy_bwd(const float *probs, const uint32_t *targets, T *dlogits,
                                  uint32_t v, float scale) {
    size_t at = (size_t)blockIdx.x * v;
    uint32_t t = targets[blockIdx.x];
    for (uint32_t c = threadIdx.x; c < v; c += blockDim.x)
        store(&dlogits[at + c], probs[at + c] * scale - (c == t ? scale : 0.0f));
}

#define FUSED(T, S)                                                                            \
    extern "C" __global__ void layer_norm_fwd_##S(const T *x, const T *w, const T *b, T *y,    \
                                                  uint32_t d, float eps) {                     \
        layer_norm_fwd(x, w, b, y, d, eps);                                                    \
    }                                                                                          \
    extern "C" __global__ void layer_norm_bwd_##S(const T *x, const T *w, const T *dy, T *dx,  \
                                                  float *partial, uint32_t rows, uint32_t d,   \
                                                  float eps) {                                 \
        layer_norm_bwd(x, w, dy, dx, partial, rows, d, eps);                                   \
    }                                                                                          \
    extern "C" __global__ void layer_norm_fwd_packs_##S(const T *x, const T *w, const T *b,    \
                                                        T *y, uint32_t d, float eps) {         \
        layer_norm_fwd_packs(x, w, b, y, d, eps);                                              \
    }                                                                                          \
    extern "C" __global__ void layer_norm_bwd_packs_##S(const T *x, const T *w, const T *dy,   \
                                                        T *dx, float *partial, uint32_t rows,  \
                                                        uint32_t d, float eps) {               \
        layer_norm_bwd_packs(x, w, dy, dx, partial, rows, d, eps);                             \
    }                                                                                          \
    extern "C" __global__ void rms_norm_fwd_packs_##S(const T *x, const T *w, T *y,            \
                                                      float *roots, uint32_t d, float eps) {   \
        rms_norm_fwd_packs(x, w, y, roots, d, eps);                                            \
    }                                                                                          \
    extern "C" __global__ void rms_norm_bwd_packs_##S(const T *x, const float *roots,          \
                                                      const T *w, const T *dy, T *dx,          \
                                                      float *partial, uint32_t rows,           \
                                                      uint32_t d) {                            \
        rms_norm_bwd_packs(x, roots, w, dy, dx, partial, rows, d);                             \
    }                                                                                          \
    extern "C" __global__ void sum_partials_##S(const float *partial, T *out, uint32_t blocks,  \
                                                uint32_t width) {                              \
        sum_partials(partial, out, blocks, width);                                             \
    }                                                                                          \
    extern "C" __global__ void column_sum_pass_##S(const T *dy, float *partial, uint32_t rows, \
                                                   uint32_t k) {                               \
        column_sum_pass(dy, partial, rows, k);                                                 \
    }                                                                                          \
    extern "C" __global__ void column_sum_packs_##S(const T *dy, float *partial, uint32_t rows,\
                                                    uint32_t k) {                              \
        column_sum_packs(dy, partial, rows, k);                                                \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_grad_##S(const T *logits, const float *lse,       \
                                                      const uint32_t *targets, T *dlogits,     \
                                                      uint32_t v, float scale) {               \
        cross_entropy_grad(logits, lse, targets, dlogits, v, scale);                           \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_lse_##S(const T *logits, const uint32_t *targets,  \
                                                     float *row_loss, float *lse, uint32_t v) { \
        cross_entropy_lse(logits, targets, row_loss, lse, v);                                  \
    }                                                                                          \
    extern "C" __global__ void rms_norm_fwd_##S(const T *x, const T *w, T *y, float *roots,     \
                                                uint32_t d, float eps) {                       \
        rms_norm_fwd(x, w, y, roots, d, eps);                                                  \
    }                                                                                          \
    extern "C" __global__ void rms_norm_bwd_##S(const T *x, const float *roots, const T *w,    \
                                                const T *dy, T *dx, float *partial,            \
                                                uint32_t rows, uint32_t d) {                   \
        rms_norm_bwd(x, roots, w, dy, dx, partial, rows, d);                                   \
    }                                                                                          \
    extern "C" __global__ void swiglu_fwd_##S(const T *g, const T *u, T *y, uint64_t n) {      \
        swiglu_fwd(g, u, y, n);                                                                \
    }                                                                                          \
    extern "C" __global__ void swiglu_bwd_##S(const T *g, const T *u, const T *dy, T *out,     \
                                              uint64_t n) {                                    \
        swiglu_bwd(g, u, dy, out, n);                                                          \
    }                                                                                          \
    extern "C" __global__ void swiglu_fwd_packs_##S(const T *g, const T *u, T *y, uint64_t n) {\
        swiglu_fwd_packs(g, u, y, n);                                                          \
    }                                                                                          \
    extern "C" __global__ void swiglu_bwd_packs_##S(const T *g, const T *u, const T *dy,       \
                                                    T *out, uint64_t n) {                      \
        swiglu_bwd_packs(g, u, dy, out, n);                                                    \
    }                                                                                          \
    extern "C" __global__ void rotary_##S(const T *x, const T *c, const T *s, T *y, uint64_t n, \
                                          uint32_t t, uint32_t hd, uint32_t transpose) {       \
        rotary(x, c, s, y, n, t, hd, transpose);                                               \
    }                                                                                          \
    extern "C" __global__ void rotary_packs_##S(const T *x, const T *c, const T *s, T *y,      \
                                                uint32_t pairs, uint32_t t, uint32_t hd,       \
                                                uint32_t transpose) {                          \
        if (transpose)                                                                         \
            rotary_packs<T, true>(x, c, s, y, pairs, t, hd);                                   \
        else                                                                                   \
            rotary_packs<T, false>(x, c, s, y, pairs, t, hd);                                  \
    }                                                                                          \
    extern "C" __global__ void sum_rows_by_index_##S(const T *src, const uint32_t *order,      \
                                                     const uint32_t *first, T *out,            \
                                                     uint32_t width) {                         \
        sum_rows_by_index(src, order, first, out, width);                                      \
    }                                                                                          \
    extern "C" __global__ void gelu_fwd_##S(const T *x, T *y, uint64_t n) { gelu_fwd(x, y, n); } \
    extern "C" __global__ void gelu_bwd_##S(const T *x, const T *dy, T *dx, uint64_t n) {      \
        gelu_bwd(x, dy, dx, n);                                                                \
    }                                                                                          \
    extern "C" __global__ void causal_softmax_fwd_##S(const T *x, T *y, uint32_t t,            \
                                                      float scale) {                           \
        causal_softmax_fwd(x, y, t, scale);                                                    \
    }                                                                                          \
    extern "C" __global__ void softmax_bwd_##S(const T *y, const T *dy, T *dx, uint32_t n,     \
                                               float scale) {                                  \
        softmax_bwd(y, dy, dx, n, scale);                                                      \
    }                                                                                          \
    extern "C" __global__ void cross_entropy_bwd_##S(const float *probs, const uint32_t *targets, \
                                                     T *dlogits, uint32_t v, float scale) {    \
        cross_entropy_bwd(probs, targets, dlogits, v, scale);                                  \
    }

FUSED(float, f32)
FUSED(__nv_bfloat16, bf16)
FUSED(__half, f16)

extern "C" __global__ void cross_entropy_fwd_f32(const float *logits, const uint32_t *targets,
                                                 float *probs, float *row_loss, uint32_t v) {
    cross_entropy_fwd(logits, targets, probs, row_loss, v);
}
extern "C" __global__ void mean_of_rows_f32(const float *row_loss, float *mean, uint32_t n) {
    mean_of_rows(row_loss, mean, n);
}
