// Causal attention on a GPU without the T x T matrix (issue 35): FlashAttention-2's forward and
// backward (Dao 2023) on the tensor cores through wmma, for bf16 and f16 storage, head sizes 32,
// 64 and 128, grouped-query heads and a sliding window. The CPU's blockwise attention
// (src/kernels/cpu_flash_attention.rs) is the same algorithm in f32.
//
// Forward: a block takes 16 queries per warp of one head and walks the key tiles they may see.
// Each tile's scores S = Q K^T come from the tensor cores into shared memory, where each row's
// running maximum and sum are updated (two lanes a row) and P = exp(S - max) is rounded to the
// storage type for O += P V. O stays in shared memory in f32, rescaled when a row's maximum
// grows. Out: the output [B, T, H, hd] and each row's log-sum-exp [B, H, T] in f32.
// Backward, deterministic (no atomics): D = rowsum(dO * O) [B, H, T]; then one kernel per key
// tile (dK, dV, summed over the query heads that share the key head, over every query tile
// that sees it) and one per query tile (dQ), each recomputing P = exp(S - lse) from the forward's
// log-sum-exp. FlashAttention-2's single pass adds dQ with atomics: two passes cost two more
// products of the five but give the same bits on every run.
//
// Layouts: q, k and v (and their gradients) are strided [B, heads, T, hd] with unit stride
// within a head, given as element strides per batch, head and position, so the fused q|k|v
// projection [B, T, 3, H, hd] (GPT) and separate [B, H, T, hd] tensors (Llama) are read where
// they lie. The output and its gradient are [B, T, H, hd]. src/kernels/gpu/launch.rs computes
// the grids: blocks of warps<HD>() warps, one block per tile per head per batch.
//
// Rounding: scores, maxima, sums and the products' accumulation are f32; P and dS are rounded
// to the storage type before they meet V, dO, Q or K on the tensor cores, as FlashAttention's.
#include "common.cuh"
#ifndef CUDA_EMU
#include <mma.h>
#endif

using namespace nvcuda;

namespace flash {

// wmma's tile: 16 x 16 x 16.
constexpr int TILE = 16;
// Elements added to each shared row of 16-bit values: 16 bytes, so wmma's leading dimension
// stays a multiple of 8 elements and successive rows start on different banks.
constexpr int PAD = 8;
// Keys per tile of the forward and of dQ; queries per tile of dK dV.
constexpr int KEYS = 32;
constexpr int QUERIES = 32;

// Warps per block for head size HD: 4 while every kernel's shared tiles fit the 48 KiB a block
// may have without opting in, else 2 (launch.rs's flash_warps).
template <int HD>
__host__ __device__ constexpr int warps() {
    return HD <= 64 ? 4 : 2;
}

template <typename T>
using OperandA = wmma::fragment<wmma::matrix_a, TILE, TILE, TILE, T, wmma::row_major>;
template <typename T, typename L>
using OperandB = wmma::fragment<wmma::matrix_b, TILE, TILE, TILE, T, L>;
using Acc = wmma::fragment<wmma::accumulator, TILE, TILE, TILE, float>;

// Element strides of a [B, heads, T, hd] view.
struct Strides {
    uint64_t b, h, t;
    __device__ size_t at(uint32_t b_, uint32_t h_, uint32_t i) const {
        return b_ * b + h_ * h + i * t;
    }
};

// Which keys a query sees: j <= i, both inside the sequence, and with a window w > 0 only the
// last w (j > i - w), as cpu_flash_attention.rs's Mask.
struct Mask {
    uint32_t t, window;
    __device__ bool seen(uint32_t i, uint32_t j) const {
        return i < t && j <= i && (window == 0 || j + window > i);
    }
    // Whether any of queries i0 .. i0 + rows sees any of keys j0 .. j0 + cols.
    __device__ bool any(uint32_t i0, uint32_t rows, uint32_t j0, uint32_t cols) const {
        uint32_t last_i = min(i0 + rows, t) - 1;
        if (i0 >= t || j0 > last_i) return false;
        return window == 0 || j0 + cols - 1 + window > i0;
    }
    // The first key any of queries i0 .. is shown, rounded down to a tile of `cols`.
    __device__ uint32_t first_key(uint32_t i0, uint32_t cols) const {
        uint32_t j = window && i0 + 1 > window ? i0 + 1 - window : 0;
        return j / cols * cols;
    }
    // One past the last query that sees any of keys j0 .. j0 + cols.
    __device__ uint32_t query_end(uint32_t j0, uint32_t cols) const {
        return window ? min(t, j0 + cols - 1 + window) : t;
    }
};

// Rows i0 .. i0 + rows of head h of batch b from `src` into dst[rows][HD + PAD], rows past the
// sequence as zeros; the block's threads copy 16 bytes each in turn.
template <typename T, int HD>
__device__ void load_rows(T (*dst)[HD + PAD], const T *src, Strides s, uint32_t b, uint32_t h,
                          uint32_t i0, int rows, uint32_t t) {
    constexpr int V = 16 / sizeof(T), PER_ROW = HD / V;
    for (int x = threadIdx.x; x < rows * PER_ROW; x += blockDim.x) {
        int r = x / PER_ROW, c = x % PER_ROW * V;
        uint4 v = {0u, 0u, 0u, 0u};
        if (i0 + r < t) v = *reinterpret_cast<const uint4 *>(src + s.at(b, h, i0 + r) + c);
        *reinterpret_cast<uint4 *>(&dst[r][c]) = v;
    }
}

// S = X Y^T over a head's HD: X's 16 rows at x (row-major), Y's `cols` rows at y (so Y^T is
// column-major), into out[16][ldo] in f32.
template <typename T, int HD>
__device__ void scores(const T *x, const T *y, int cols, float *out, int ldo) {
    for (int n = 0; n < cols / TILE; n++) {
        Acc acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int c = 0; c < HD / TILE; c++) {
            OperandA<T> a;
            OperandB<T, wmma::col_major> bt;
            wmma::load_matrix_sync(a, x + c * TILE, HD + PAD);
            wmma::load_matrix_sync(bt, y + n * TILE * (HD + PAD) + c * TILE, HD + PAD);
            wmma::mma_sync(acc, a, bt, acc);
        }
        wmma::store_matrix_sync(out + n * TILE, acc, ldo, wmma::mem_row_major);
    }
}

// acc[n] += A[16 x K] B[K x HD], A at a (row-major, lda), B's K rows at b (row-major).
template <typename T, int HD, int K>
__device__ void accumulate(Acc (&acc)[HD / TILE], const T *a, int lda, const T *b) {
    for (int c = 0; c < K / TILE; c++) {
        OperandA<T> fa;
        wmma::load_matrix_sync(fa, a + c * TILE, lda);
        for (int n = 0; n < HD / TILE; n++) {
            OperandB<T, wmma::row_major> fb;
            wmma::load_matrix_sync(fb, b + c * TILE * (HD + PAD) + n * TILE, HD + PAD);
            wmma::mma_sync(acc[n], fa, fb, acc[n]);
        }
    }
}

// Writes the warp's 16 rows acc (16 x HD) times `scale` to dst's rows r0 .. r0 + 16 (strided,
// rows past the sequence skipped), through stage[16][16] of shared memory.
template <typename T, int HD>
__device__ void write_rows(const Acc (&acc)[HD / TILE], float *stage, float scale, T *dst,
                           Strides s, uint32_t b, uint32_t h, uint32_t r0, uint32_t t) {
    int lane = threadIdx.x % 32, row = lane / 2, c0 = lane % 2 * 8;
    for (int n = 0; n < HD / TILE; n++) {
        wmma::store_matrix_sync(stage, acc[n], TILE, wmma::mem_row_major);
        __syncwarp();
        if (r0 + row < t)
            for (int c = 0; c < 8; c++)
                store(dst + s.at(b, h, r0 + row) + n * TILE + c0 + c,
                      stage[row * TILE + c0 + c] * scale);
        __syncwarp();
    }
}

template <typename T, int HD>
__device__ void forward(const T *q, const T *k, const T *v, T *out, float *lse, uint32_t heads,
                        uint32_t kv_heads, Mask m, Strides qs, Strides kvs, float scale) {
    constexpr int W = warps<HD>(), ROWS = TILE * W;
    static_assert(ROWS <= 2 * KEYS, "the queries are staged in the key and value tile");
    // keys in rows 0 .. KEYS, values in KEYS .. 2 KEYS; at first the block's queries
    __shared__ __align__(32) T kv[2 * KEYS][HD + PAD];
    __shared__ __align__(32) float s[W][TILE][KEYS];
    __shared__ __align__(32) T p[W][TILE][KEYS + PAD];
    __shared__ __align__(32) float o[W][TILE][HD];
    uint32_t tiles = (m.t + ROWS - 1) / ROWS;
    uint32_t tile = tiles - 1 - blockIdx.x % tiles;  // the longest rows first
    uint32_t h = blockIdx.x / tiles % heads, b = blockIdx.x / tiles / heads;
    uint32_t g = h / (heads / kv_heads);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int row = lane / 2, half = lane % 2;  // two lanes a row, half the columns each
    uint32_t q0 = tile * ROWS, r0 = q0 + warp * TILE, i = r0 + row;

    load_rows<T, HD>(kv, q, qs, b, h, q0, ROWS, m.t);
    __syncthreads();
    OperandA<T> qf[HD / TILE];
    for (int c = 0; c < HD / TILE; c++)
        wmma::load_matrix_sync(qf[c], &kv[warp * TILE][c * TILE], HD + PAD);
    for (int c = half * HD / 2; c < (half + 1) * HD / 2; c++) o[warp][row][c] = 0.0f;
    float run_max = -INFINITY, run_sum = 0.0f;

    for (uint32_t j0 = m.first_key(q0, KEYS); j0 < min(m.t, q0 + ROWS); j0 += KEYS) {
        __syncthreads();  // every warp is done with the previous tile (and the queries)
        load_rows<T, HD>(kv, k, kvs, b, g, j0, KEYS, m.t);
        load_rows<T, HD>(kv + KEYS, v, kvs, b, g, j0, KEYS, m.t);
        __syncthreads();
        if (!m.any(r0, TILE, j0, KEYS)) continue;  // the same for the warp's lanes

        for (int n = 0; n < KEYS / TILE; n++) {
            Acc acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int c = 0; c < HD / TILE; c++) {
                OperandB<T, wmma::col_major> kt;
                wmma::load_matrix_sync(kt, &kv[n * TILE][c * TILE], HD + PAD);
                wmma::mma_sync(acc, qf[c], kt, acc);
            }
            wmma::store_matrix_sync(&s[warp][0][n * TILE], acc, KEYS, wmma::mem_row_major);
        }
        __syncwarp();

        float x[TILE], tile_max = -INFINITY;
        for (int c = 0; c < TILE; c++) {
            int col = half * TILE + c;
            x[c] = m.seen(i, j0 + col) ? s[warp][row][col] * scale : -INFINITY;
            tile_max = fmaxf(tile_max, x[c]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
        float new_max = fmaxf(run_max, tile_max);
        // a row that has seen nothing yet keeps max -inf: its p are 0 and nothing rescales
        bool none = new_max == -INFINITY;
        float alpha = none ? 1.0f : expf(run_max - new_max), sum = 0.0f;
        for (int c = 0; c < TILE; c++) {
            float pc = none ? 0.0f : expf(x[c] - new_max);
            sum += pc;
            store(&p[warp][row][half * TILE + c], pc);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        run_sum = run_sum * alpha + sum;
        run_max = new_max;
        for (int c = half * HD / 2; c < (half + 1) * HD / 2; c++) o[warp][row][c] *= alpha;
        __syncwarp();

        OperandA<T> pf[KEYS / TILE];
        for (int c = 0; c < KEYS / TILE; c++)
            wmma::load_matrix_sync(pf[c], &p[warp][0][c * TILE], KEYS + PAD);
        for (int n = 0; n < HD / TILE; n++) {
            Acc acc;
            wmma::load_matrix_sync(acc, &o[warp][0][n * TILE], HD, wmma::mem_row_major);
            for (int c = 0; c < KEYS / TILE; c++) {
                OperandB<T, wmma::row_major> vf;
                wmma::load_matrix_sync(vf, &kv[KEYS + c * TILE][n * TILE], HD + PAD);
                wmma::mma_sync(acc, pf[c], vf, acc);
            }
            wmma::store_matrix_sync(&o[warp][0][n * TILE], acc, HD, wmma::mem_row_major);
        }
        __syncwarp();
    }

    if (i < m.t) {  // every row inside the sequence has seen itself: run_sum >= 1
        float inv = 1.0f / run_sum;
        T *dst = out + (((size_t)b * m.t + i) * heads + h) * HD;
        for (int c = half * HD / 2; c < (half + 1) * HD / 2; c++)
            store(dst + c, o[warp][row][c] * inv);
        if (half == 0) lse[((size_t)b * heads + h) * m.t + i] = run_max + logf(run_sum);
    }
}

// D = rowsum(dO * O) per row (b, h, i) of the output [B, T, H, hd]: a warp a row, rows in the
// [B, H, T] order of the log-sum-exp.
template <typename T>
__device__ void dot(const T *out, const T *dout, float *d, uint32_t heads, uint32_t t,
                    uint32_t hd, uint64_t rows) {
    uint64_t r = (uint64_t)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    float acc = 0.0f;
    if (r < rows) {
        uint64_t i = r % t, h = r / t % heads, b = r / t / heads;
        size_t at = ((b * t + i) * heads + h) * hd;
        for (uint32_t c = threadIdx.x % 32; c < hd; c += 32)
            acc += to_f(out[at + c]) * to_f(dout[at + c]);
    }
    acc = warp_reduce<Sum>(acc);
    if (r < rows && threadIdx.x % 32 == 0) d[r] = acc;
}

// dK and dV of a tile of 16 keys per warp of one key head: over every query head of its group
// and every query tile that sees it, dV += P^T dO and dK += dS^T Q, with P^T = exp(K Q^T - lse)
// and dS^T = P^T * (V dO^T - D); dK is scaled once at the end.
template <typename T, int HD>
__device__ void backward_dkdv(const T *q, const T *k, const T *v, const T *dout,
                              const float *lse, const float *d, T *dk, T *dv, uint32_t heads,
                              uint32_t kv_heads, Mask m, Strides qs, Strides kvs, float scale) {
    constexpr int W = warps<HD>(), ROWS = TILE * W;
    __shared__ __align__(32) T ks[ROWS][HD + PAD];
    __shared__ __align__(32) T vs[ROWS][HD + PAD];
    __shared__ __align__(32) T qt[QUERIES][HD + PAD];
    __shared__ __align__(32) T dos[QUERIES][HD + PAD];
    __shared__ float lse_t[QUERIES], d_t[QUERIES];
    __shared__ __align__(32) float s[W][TILE][QUERIES];
    __shared__ __align__(32) T p[W][TILE][QUERIES + PAD];
    __shared__ __align__(32) T ds[W][TILE][QUERIES + PAD];
    uint32_t tiles = (m.t + ROWS - 1) / ROWS;
    uint32_t tile = blockIdx.x % tiles;  // the first keys, seen by the most queries, first
    uint32_t g = blockIdx.x / tiles % kv_heads, b = blockIdx.x / tiles / kv_heads;
    uint32_t group = heads / kv_heads;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int row = lane / 2, half = lane % 2;
    uint32_t k0 = tile * ROWS, r0 = k0 + warp * TILE, j = r0 + row;
    Strides os = {(uint64_t)m.t * heads * HD, HD, (uint64_t)heads * HD};

    load_rows<T, HD>(ks, k, kvs, b, g, k0, ROWS, m.t);
    load_rows<T, HD>(vs, v, kvs, b, g, k0, ROWS, m.t);
    Acc dkf[HD / TILE], dvf[HD / TILE];
    for (int n = 0; n < HD / TILE; n++) {
        wmma::fill_fragment(dkf[n], 0.0f);
        wmma::fill_fragment(dvf[n], 0.0f);
    }
    for (uint32_t h = g * group; h < (g + 1) * group; h++) {
        for (uint32_t i0 = k0 / QUERIES * QUERIES; i0 < m.query_end(k0, ROWS); i0 += QUERIES) {
            __syncthreads();  // every warp is done with the previous tile
            load_rows<T, HD>(qt, q, qs, b, h, i0, QUERIES, m.t);
            load_rows<T, HD>(dos, dout, os, b, h, i0, QUERIES, m.t);
            for (int x = threadIdx.x; x < QUERIES; x += blockDim.x) {
                bool in = i0 + x < m.t;
                size_t at = ((size_t)b * heads + h) * m.t + i0 + x;
                lse_t[x] = in ? lse[at] : 0.0f;
                d_t[x] = in ? d[at] : 0.0f;
            }
            __syncthreads();
            if (!m.any(i0, QUERIES, r0, TILE)) continue;

            scores<T, HD>(&ks[warp * TILE][0], &qt[0][0], QUERIES, &s[warp][0][0], QUERIES);
            __syncwarp();
            // the lane's 16 probabilities (those the mask hides are 0), kept for dS
            float pr[TILE];
            int c0 = half * TILE;
            for (int c = 0; c < TILE; c++) {
                bool seen = m.seen(i0 + c0 + c, j);
                pr[c] = seen ? expf(s[warp][row][c0 + c] * scale - lse_t[c0 + c]) : 0.0f;
                store(&p[warp][row][c0 + c], pr[c]);
            }
            __syncwarp();  // every lane has read s before dP^T overwrites it
            scores<T, HD>(&vs[warp * TILE][0], &dos[0][0], QUERIES, &s[warp][0][0], QUERIES);
            __syncwarp();
            for (int c = 0; c < TILE; c++)
                store(&ds[warp][row][c0 + c], pr[c] * (s[warp][row][c0 + c] - d_t[c0 + c]));
            __syncwarp();
            accumulate<T, HD, QUERIES>(dvf, &p[warp][0][0], QUERIES + PAD, &dos[0][0]);
            accumulate<T, HD, QUERIES>(dkf, &ds[warp][0][0], QUERIES + PAD, &qt[0][0]);
        }
    }
    __syncwarp();
    write_rows<T, HD>(dkf, &s[warp][0][0], scale, dk, kvs, b, g, r0, m.t);
    write_rows<T, HD>(dvf, &s[warp][0][0], 1.0f, dv, kvs, b, g, r0, m.t);
}

// dQ of a tile of 16 queries per warp of one head: over the key tiles it sees, dQ += dS K with
// dS = exp(Q K^T - lse) * (dO V^T - D), scaled once at the end.
template <typename T, int HD>
__device__ void backward_dq(const T *q, const T *k, const T *v, const T *dout, const float *lse,
                            const float *d, T *dq, uint32_t heads, uint32_t kv_heads, Mask m,
                            Strides qs, Strides kvs, float scale) {
    constexpr int W = warps<HD>(), ROWS = TILE * W;
    __shared__ __align__(32) T qt[ROWS][HD + PAD];
    __shared__ __align__(32) T dos[ROWS][HD + PAD];
    __shared__ __align__(32) T ks[KEYS][HD + PAD];
    __shared__ __align__(32) T vs[KEYS][HD + PAD];
    __shared__ __align__(32) float s[W][TILE][KEYS];
    __shared__ __align__(32) T ds[W][TILE][KEYS + PAD];
    uint32_t tiles = (m.t + ROWS - 1) / ROWS;
    uint32_t tile = tiles - 1 - blockIdx.x % tiles;  // the longest rows first
    uint32_t h = blockIdx.x / tiles % heads, b = blockIdx.x / tiles / heads;
    uint32_t g = h / (heads / kv_heads);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int row = lane / 2, half = lane % 2, c0 = half * TILE;
    uint32_t q0 = tile * ROWS, r0 = q0 + warp * TILE, i = r0 + row;
    Strides os = {(uint64_t)m.t * heads * HD, HD, (uint64_t)heads * HD};

    load_rows<T, HD>(qt, q, qs, b, h, q0, ROWS, m.t);
    load_rows<T, HD>(dos, dout, os, b, h, q0, ROWS, m.t);
    size_t at = ((size_t)b * heads + h) * m.t + i;
    float lse_i = i < m.t ? lse[at] : 0.0f, d_i = i < m.t ? d[at] : 0.0f;
    Acc dqf[HD / TILE];
    for (int n = 0; n < HD / TILE; n++) wmma::fill_fragment(dqf[n], 0.0f);

    for (uint32_t j0 = m.first_key(q0, KEYS); j0 < min(m.t, q0 + ROWS); j0 += KEYS) {
        __syncthreads();  // every warp is done with the previous tile
        load_rows<T, HD>(ks, k, kvs, b, g, j0, KEYS, m.t);
        load_rows<T, HD>(vs, v, kvs, b, g, j0, KEYS, m.t);
        __syncthreads();
        if (!m.any(r0, TILE, j0, KEYS)) continue;

        scores<T, HD>(&qt[warp * TILE][0], &ks[0][0], KEYS, &s[warp][0][0], KEYS);
        __syncwarp();
        float pr[TILE];
        for (int c = 0; c < TILE; c++)
            pr[c] = m.seen(i, j0 + c0 + c) ? expf(s[warp][row][c0 + c] * scale - lse_i) : 0.0f;
        __syncwarp();  // every lane has read s before dP overwrites it
        scores<T, HD>(&dos[warp * TILE][0], &vs[0][0], KEYS, &s[warp][0][0], KEYS);
        __syncwarp();
        for (int c = 0; c < TILE; c++)
            store(&ds[warp][row][c0 + c], pr[c] * (s[warp][row][c0 + c] - d_i));
        __syncwarp();
        accumulate<T, HD, KEYS>(dqf, &ds[warp][0][0], KEYS + PAD, &ks[0][0]);
    }
    __syncwarp();
    write_rows<T, HD>(dqf, &s[warp][0][0], scale, dq, qs, b, h, r0, m.t);
}

}  // namespace flash

#define FLASH_HD(T, S, HD)                                                                      \
    extern "C" __global__ void flash_fwd_hd##HD##_##S(                                          \
        const T *q, const T *k, const T *v, T *out, float *lse, uint32_t heads,                 \
        uint32_t kv_heads, uint32_t t, uint32_t window, uint64_t q_b, uint64_t q_h,             \
        uint64_t q_t, uint64_t kv_b, uint64_t kv_h, uint64_t kv_t, float scale) {               \
        flash::forward<T, HD>(q, k, v, out, lse, heads, kv_heads, {t, window}, {q_b, q_h, q_t}, \
                              {kv_b, kv_h, kv_t}, scale);                                       \
    }                                                                                           \
    extern "C" __global__ void flash_bwd_dkdv_hd##HD##_##S(                                     \
        const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *d,    \
        T *dk, T *dv, uint32_t heads, uint32_t kv_heads, uint32_t t, uint32_t window,           \
        uint64_t q_b, uint64_t q_h, uint64_t q_t, uint64_t kv_b, uint64_t kv_h, uint64_t kv_t,  \
        float scale) {                                                                          \
        flash::backward_dkdv<T, HD>(q, k, v, dout, lse, d, dk, dv, heads, kv_heads,             \
                                    {t, window}, {q_b, q_h, q_t}, {kv_b, kv_h, kv_t}, scale);   \
    }                                                                                           \
    extern "C" __global__ void flash_bwd_dq_hd##HD##_##S(                                       \
        const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *d,    \
        T *dq, uint32_t heads, uint32_t kv_heads, uint32_t t, uint32_t window, uint64_t q_b,    \
        uint64_t q_h, uint64_t q_t, uint64_t kv_b, uint64_t kv_h, uint64_t kv_t, float scale) { \
        flash::backward_dq<T, HD>(q, k, v, dout, lse, d, dq, heads, kv_heads, {t, window},      \
                                  {q_b, q_h, q_t}, {kv_b, kv_h, kv_t}, scale);                  \
    }

#define FLASH(T, S)                                                                            \
    FLASH_HD(T, S, 32)                                                                         \
    FLASH_HD(T, S, 64)                                                                         \
    FLASH_HD(T, S, 128)                                                                        \
    extern "C" __global__ void flash_bwd_dot_##S(const T *out, const T *dout, float *d,        \
                                                 uint32_t heads, uint32_t t, uint32_t hd,      \
                                                 uint64_t rows) {                              \
        flash::dot(out, dout, d, heads, t, hd, rows);                                          \
    }

FLASH(__nv_bfloat16, bf16)
FLASH(__half, f16)
