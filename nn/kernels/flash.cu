// Causal attention on a GPU without the T x T matrix (issue 35): FlashAttention-2's forward and
// backward (Dao 2023) on the tensor cores (mma.sync m16n8k16, kernels/mma.cuh), for bf16 and f16
// storage, head sizes 32, 64 and 128, grouped-query heads and a sliding window. The CPU's
// blockwise attention (src/kernels/cpu_flash_attention.rs) is the same algorithm in f32.
//
// Forward: a block takes 16 queries per warp of one head and walks the key tiles they may see,
// staged in shared memory in two stages: the next tile is copied in (cp.async,
// kernels/shared_tiles.cuh) while the warps work on this one. Each tile's scores S = Q K^T stay
// in registers, where the four lanes of a row update its running maximum and sum;
// P = exp(S - max), rounded to the storage type, is the next product's A operand as it lies
// (O += P V), and O stays in registers in f32, rescaled when a row's maximum grows. Out: the
// output [B, T, H, hd] and each row's log-sum-exp [B, H, T] in f32.
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
// the grids: blocks of warps<HD>() warps, one block per tile of 16 rows a warp per head per
// batch; every tile, of queries or keys, has that many rows. It also sizes each kernel's dynamic
// shared memory (ForwardTiles, KeyTiles, QueryTiles below: up to 56 KiB, past the static 48).
//
// Issue: the warp schedulers issue the tensor-core products and everything else, and a
// product occupies a scheduler's tensor core about six cycles, so a tile's other instructions
// (masks, exponentials, copies, addresses) set the pace once they pass six per product. Hence:
// the mask is tested only on tiles some rows do not see whole (`Mask::all`; below a causal
// mask's diagonal no element is tested), an exponential is one FMA and ex2.approx, and the
// copies unroll at constant strides without a branch (copy_rows). scripts/flash-instructions.sh
// counts a tile's instructions from the SASS.
//
// Rounding: scores, maxima, sums and the products' accumulation are f32; P and dS are rounded
// to the storage type before they meet V, dO, Q or K on the tensor cores, as FlashAttention's.
#include "mma.cuh"
#include "shared_tiles.cuh"

namespace flash {

// exp(x) = exp2(x log2 e): the scores are scaled by log2 e once, so each exponential is one
// FMA and the ex2 unit (expf's range reduction would be several instructions more).
constexpr float LOG2E = 1.44269504088896340736f, LN2 = 0.69314718055994530942f;

// Elements added to each shared row: 16 bytes, so the eight rows an ldmatrix reads start on
// different banks, and rows stay 16-byte aligned for the copies and ldmatrix.
constexpr int PAD = 8;

// Warps per block for head size HD: 4 up to 64, 2 for 128, whose dK dV take 248 registers a
// thread (launch.rs's flash_warps). A tile has 16 rows a warp.
template <int HD>
__host__ __device__ constexpr int warps() {
    return HD <= 64 ? 4 : 2;
}
template <int HD>
__host__ __device__ constexpr int threads() {
    return 32 * warps<HD>();
}

// The kernels' loops are unrolled for their block size: a launch with another stops the kernel.
template <int HD>
__device__ void check_block() {
    if (blockDim.x != (unsigned)threads<HD>())
        trap("a flash kernel launched with another block size");
}

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
    // Whether every one of queries i0 .. i0 + rows sees every one of keys j0 .. j0 + cols: a tile
    // that needs no mask (all of a causal mask's tiles but its diagonal's, unless a window
    // ends inside them, and none past the sequence).
    __device__ bool all(uint32_t i0, uint32_t rows, uint32_t j0, uint32_t cols) const {
        return i0 + rows <= t && j0 + cols <= i0 + 1 &&
               (window == 0 || j0 + window > i0 + rows - 1);
    }
    // Whether any of queries i0 .. i0 + rows sees any of keys j0 .. j0 + cols.
    __device__ bool any(uint32_t i0, uint32_t rows, uint32_t j0, uint32_t cols) const {
        if (i0 >= t || j0 > min(i0 + rows, t) - 1) return false;
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

// Where a block works: the first row of its tile of `rows` rows (queries, or keys for dK dV),
// its head and its batch; blocks take the tiles of a head in turn, the longest rows of a causal
// mask first where `longest_first`.
struct Place {
    uint32_t row0, head, batch;
};
__device__ Place place(uint32_t t, uint32_t heads, int rows, bool longest_first) {
    uint32_t tiles = (t + rows - 1) / rows, i = blockIdx.x % tiles;
    return {(longest_first ? tiles - 1 - i : i) * rows, blockIdx.x / tiles % heads,
            blockIdx.x / tiles / heads};
}

// The strides of the output and its gradient, [B, T, heads, HD].
template <int HD>
__device__ Strides output_strides(uint32_t t, uint32_t heads) {
    return {(uint64_t)t * heads * HD, HD, (uint64_t)heads * HD};
}

// One row of a tile in shared memory: a position's HD elements and the padding.
template <typename T, int HD>
using Row = T[HD + PAD];

// A tile's rows i0 .. i0 + 16 warps<HD>() of head h of batch b from `src` into dst[..][HD + PAD],
// rows past the sequence as zeros: each thread issues 16-byte asynchronous copies at one column
// of rows STEP apart, which land at its wait_copies. Branch-free: a row past the sequence is a
// copy of zeros from the tile's first row (inside it: i0 < t), and a row's offset from that row
// is a 32-bit byte count (launch.rs checks that a tile's rows span less than 4 GiB), made once
// per kernel; per copy remain a select, a 64-bit add and the copy.
template <typename T, int HD>
__device__ void copy_rows(Row<T, HD> *dst, const T *src, Strides s, uint32_t b, uint32_t h,
                          uint32_t i0, uint32_t t) {
    constexpr int V = 16 / sizeof(T), PER_ROW = HD / V, STEP = threads<HD>() / PER_ROW;
    static_assert(threads<HD>() % PER_ROW == 0 && 16 * warps<HD>() % STEP == 0,
                  "whole rows per pass, whole passes per tile");
    int r0 = threadIdx.x / PER_ROW, c = threadIdx.x % PER_ROW * V;
    const char *row0 = reinterpret_cast<const char *>(src + s.at(b, h, i0) + c);
    UNROLL for (int p = 0; p < 16 * warps<HD>() / STEP; p++) {
        uint32_t r = r0 + p * STEP;
        bool inside = i0 + r < t;
        uint32_t at = inside ? r * (uint32_t)s.t * (uint32_t)sizeof(T) : 0;
        copy_async<16>(&dst[r][c], row0 + at, inside);
    }
}

// A tile's values i0 .. i0 + 16 warps<HD>() of a per-row f32 array (the log-sum-exp, D) of head h
// of batch b into dst, past the sequence as zeros: a 4-byte asynchronous copy by each of the
// block's first threads (a value past the sequence copied as zeros from the tile's first).
template <int HD>
__device__ void copy_row_values(float *dst, const float *src, uint32_t heads, uint32_t b,
                                uint32_t h, uint32_t i0, uint32_t t) {
    static_assert(threads<HD>() >= 16 * warps<HD>(), "a value a thread");
    unsigned x = threadIdx.x;
    if (x >= 16 * warps<HD>()) return;
    bool inside = i0 + x < t;
    copy_async<4>(&dst[x], src + ((size_t)b * heads + h) * t + i0 + (inside ? x : 0), inside);
}

// acc[n] += A Y_c^T over N / 8 tiles of 16 x 8: a, 16 columns of the warp's X; y, those 16
// columns of Y's N rows (row-major, leading dimension HD + PAD, shared memory).
template <typename T, int HD, int N>
__device__ void add_products_t(float (&acc)[N / 8][4], const FragA &a, const T *y) {
    for (int n = 0; n < N / 8; n += 2) {
        FragB bs[2];
        load_b_t2(bs, y + n * 8 * (HD + PAD), HD + PAD);
        mma<T>(acc[n], a, bs[0]);
        mma<T>(acc[n + 1], a, bs[1]);
    }
}

template <int N>
__device__ void zero(float (&acc)[N][4]) {
    for (int n = 0; n < N; n++)
        for (int e = 0; e < 4; e++) acc[n][e] = 0.0f;
}

// acc[n] = X Y^T for the warp's 16 rows of X, held as its HD / 16 A fragments, and the N rows
// of Y at y (row-major [.][HD + PAD] in shared memory): N / 8 tiles of 16 x 8.
template <typename T, int HD, int N>
__device__ void products_t(float (&acc)[N / 8][4], const FragA (&x)[HD / 16], const T *y) {
    zero(acc);
    for (int c = 0; c < HD / 16; c++) add_products_t<T, HD, N>(acc, x[c], y + c * 16);
}
// The same with X's 16 rows at x in shared memory, read a fragment at a time.
template <typename T, int HD, int N>
__device__ void products_t(float (&acc)[N / 8][4], const T *x, const T *y) {
    zero(acc);
    for (int c = 0; c < HD / 16; c++)
        add_products_t<T, HD, N>(acc, load_a(x + c * 16, HD + PAD), y + c * 16);
}

// acc[n] += P Y: P the warp's 16 x K in registers (K / 8 tiles of 16 x 8, f32, rounded to T
// here), Y's K rows at y (row-major [K][HD + PAD] in shared memory).
template <typename T, int HD, int K>
__device__ void accumulate(float (&acc)[HD / 8][4], const float (&p)[K / 8][4], const T *y) {
    for (int c = 0; c < K / 16; c++) {
        FragA a = as_a<T>(p[2 * c], p[2 * c + 1]);
        for (int n = 0; n < HD / 8; n += 2) {
            FragB bs[2];
            load_b2(bs, y + c * 16 * (HD + PAD) + n * 8, HD + PAD);
            mma<T>(acc[n], a, bs[0]);
            mma<T>(acc[n + 1], a, bs[1]);
        }
    }
}

// The warp's 16 x HD result acc times `scale` into rows r0 .. r0 + 16 of dst (strided; rows
// past the sequence skipped): each lane writes its two adjacent columns of rows g and g + 8.
template <typename T, int HD>
__device__ void write_rows(const float (&acc)[HD / 8][4], float scale, T *dst, Strides s,
                           uint32_t b, uint32_t h, uint32_t r0, uint32_t t) {
    unsigned g = quad_row(), q = quad_col();
    for (int half = 0; half < 2; half++) {
        uint32_t r = r0 + g + 8 * half;
        if (r >= t) continue;
        T *row = dst + s.at(b, h, r);
        for (int n = 0; n < HD / 8; n++) {
            store(row + n * 8 + 2 * q, acc[n][2 * half] * scale);
            store(row + n * 8 + 2 * q + 1, acc[n][2 * half + 1] * scale);
        }
    }
}

// Element e (0..3) of tile n of a lane's 16 x 8 tiles: its row (0..15) and column.
__device__ __forceinline__ unsigned tile_row(int e) { return quad_row() + (e >> 1) * 8; }
__device__ __forceinline__ unsigned tile_col(int n, int e) {
    return n * 8 + 2 * quad_col() + (e & 1);
}

// The sum, or maximum, of a row's values over its four lanes.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// One key tile of the online softmax over a warp's 16 rows (FlashAttention-2's): the tile's
// row maxima of S raise the running maxima (kept in units of log2: scores times scale2, which is
// scale log2 e and positive, so the largest score is the largest scaled one), S becomes
// P = 2^(S scale2 - max) by one FMA and the ex2 unit an element, and the running sums take P's
// row sums; alpha[r] is the factor by which row r's earlier output and sum shrink. MASKED: the
// tile holds positions some of its rows do not see (a causal mask's diagonal, a window's edge,
// rows past the sequence), set to -inf before the maximum, and a row may have seen nothing yet
// (its maximum stays -inf, its p are 0 and nothing rescales). Elsewhere no element is tested:
// every row sees every key of the tile, so its maximum is finite.
template <bool MASKED, int N>
__device__ void softmax_tile(float (&s)[N / 8][4], float (&run_max)[2], float (&run_sum)[2],
                             float (&alpha)[2], Mask m, uint32_t r0, uint32_t j0, float scale2) {
    float tile_max[2] = {-INFINITY, -INFINITY};
    for (int n = 0; n < N / 8; n++)
        for (int e = 0; e < 4; e++) {
            if (MASKED && !m.seen(r0 + tile_row(e), j0 + tile_col(n, e))) s[n][e] = -INFINITY;
            tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[n][e]);
        }
    float shift[2], sum[2] = {0.0f, 0.0f};
    for (int r = 0; r < 2; r++) {
        float new_max = fmaxf(run_max[r], quad_max(tile_max[r]) * scale2);
        bool none = MASKED && new_max == -INFINITY;
        // a first tile: run_max is -inf, alpha 0 (the output and sum are 0 still)
        alpha[r] = none ? 1.0f : exp2_approx(run_max[r] - new_max);
        run_max[r] = new_max;
        shift[r] = none ? 0.0f : -new_max;  // -inf scores then give 2^-inf = 0, not NaN
    }
    for (int n = 0; n < N / 8; n++)
        for (int e = 0; e < 4; e++) {
            s[n][e] = exp2_approx(fmaf(s[n][e], scale2, shift[e >> 1]));
            sum[e >> 1] += s[n][e];
        }
    for (int r = 0; r < 2; r++) run_sum[r] = run_sum[r] * alpha[r] + quad_sum(sum[r]);
}

// The forward's shared memory: two stages of key and value tiles, one in use while the next
// is copied in. The block's queries pass through k[1] on their way to registers.
template <typename T, int HD>
struct ForwardTiles {
    static constexpr int ROWS = 16 * warps<HD>();
    Row<T, HD> k[2][ROWS], v[2][ROWS];
};

template <typename T, int HD>
__device__ void forward(const T *q, const T *k, const T *v, T *out, float *lse, uint32_t heads,
                        uint32_t kv_heads, Mask m, Strides qs, Strides kvs, float scale) {
    check_block<HD>();
    using Tiles = ForwardTiles<T, HD>;
    constexpr int ROWS = Tiles::ROWS;
    Tiles &sm = shared_tiles<Tiles>();
    Place at = place(m.t, heads, ROWS, true);
    uint32_t h = at.head, b = at.batch, g = h / (heads / kv_heads);
    uint32_t q0 = at.row0, r0 = q0 + threadIdx.x / 32 * 16;
    uint32_t j0 = m.first_key(q0, ROWS), end = min(m.t, q0 + ROWS);  // j0 < end: q0 sees q0

    copy_rows<T, HD>(sm.k[1], q, qs, b, h, q0, m.t);
    commit_copies();
    copy_rows<T, HD>(sm.k[0], k, kvs, b, g, j0, m.t);
    copy_rows<T, HD>(sm.v[0], v, kvs, b, g, j0, m.t);
    commit_copies();
    wait_copies<1>();  // the queries (the first key tile may still be in flight)
    __syncthreads();
    FragA qf[HD / 16];
    for (int c = 0; c < HD / 16; c++) qf[c] = load_a(&sm.k[1][r0 - q0][c * 16], HD + PAD);
    float o[HD / 8][4] = {};
    // the lane's two rows, g and g + 8: running maximum (of scores times scale2) and sum
    float run_max[2] = {-INFINITY, -INFINITY}, run_sum[2] = {0.0f, 0.0f};
    float scale2 = scale * LOG2E;  // exp(x scale) = exp2(x scale2)

    for (int stage = 0; j0 < end; j0 += ROWS, stage ^= 1) {
        __syncthreads();  // every warp is done with the other stage (a tile, or the queries)
        if (j0 + ROWS < end) {
            copy_rows<T, HD>(sm.k[stage ^ 1], k, kvs, b, g, j0 + ROWS, m.t);
            copy_rows<T, HD>(sm.v[stage ^ 1], v, kvs, b, g, j0 + ROWS, m.t);
        }
        commit_copies();
        wait_copies<1>();  // this tile (the next may still be in flight)
        __syncthreads();
        if (!m.any(r0, 16, j0, ROWS)) continue;  // the same for the warp's lanes

        float s[ROWS / 8][4], alpha[2];
        products_t<T, HD, ROWS>(s, qf, &sm.k[stage][0][0]);  // S = Q K^T
        if (m.all(r0, 16, j0, ROWS))  // the same for the warp's lanes
            softmax_tile<false, ROWS>(s, run_max, run_sum, alpha, m, r0, j0, scale2);
        else
            softmax_tile<true, ROWS>(s, run_max, run_sum, alpha, m, r0, j0, scale2);
        for (int n = 0; n < HD / 8; n++)
            for (int e = 0; e < 4; e++) o[n][e] *= alpha[e >> 1];
        accumulate<T, HD, ROWS>(o, s, &sm.v[stage][0][0]);
    }

    // every row inside the sequence has seen itself: run_sum >= 1
    float inv[2] = {1.0f / run_sum[0], 1.0f / run_sum[1]};
    for (int n = 0; n < HD / 8; n++)
        for (int e = 0; e < 4; e++) o[n][e] *= inv[e >> 1];
    write_rows<T, HD>(o, 1.0f, out, output_strides<HD>(m.t, heads), b, h, r0, m.t);
    for (int r = 0; r < 2; r++) {
        uint32_t i = r0 + quad_row() + 8 * r;
        if (i < m.t && quad_col() == 0)
            lse[((size_t)b * heads + h) * m.t + i] = run_max[r] * LN2 + logf(run_sum[r]);
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

// What the backward reads of a lane's two queries in a 16 x 8 tile: their log-sum-exp times
// log2 e, and D. In dQ they are the lane's rows g and g + 8 (element e's is [e >> 1]); in dK dV,
// where the columns are queries, its columns 2q and 2q + 1 of the tile ([e & 1]).
struct QueryTerms {
    float lse2[2], d[2];
};

// dS = P * (dP - D) with P = exp(S scale - lse) = 2^(S scale2 - lse log2 e) where seen, else 0,
// over a warp's 16 x N tiles of S (rows `row0 + tile_row`, columns `col0 + tile_col`); P is left
// in `s` and dS in `dp`. TRANSPOSED: the rows are keys and the columns queries (dK dV), else the
// reverse (dQ); terms(n) gives tile n's QueryTerms. MASKED: some rows do not see some columns,
// whose P is set to 0 (a select after the exponential, which may overflow there: no branch);
// elsewhere no element is tested.
template <bool MASKED, bool TRANSPOSED, int N, typename Terms>
__device__ void probabilities_and_ds(float (&s)[N / 8][4], float (&dp)[N / 8][4], Mask m,
                                     uint32_t row0, uint32_t col0, float scale2, Terms terms) {
    for (int n = 0; n < N / 8; n++) {
        QueryTerms qt = terms(n);
        for (int e = 0; e < 4; e++) {
            int x = TRANSPOSED ? e & 1 : e >> 1;
            float p = exp2_approx(fmaf(s[n][e], scale2, -qt.lse2[x]));
            if (MASKED) {
                uint32_t r = row0 + tile_row(e), c = col0 + tile_col(n, e);
                if (!(TRANSPOSED ? m.seen(c, r) : m.seen(r, c))) p = 0.0f;
            }
            s[n][e] = p;
            dp[n][e] = p * (dp[n][e] - qt.d[x]);
        }
    }
}

// The shared memory of dK dV: the block's keys and values, and two stages of the query tiles
// they meet (queries, output gradients, and those rows' log-sum-exp and D).
template <typename T, int HD>
struct KeyTiles {
    static constexpr int ROWS = 16 * warps<HD>();
    Row<T, HD> k[ROWS], v[ROWS], q[2][ROWS], dout[2][ROWS];
    float lse[2][ROWS], d[2][ROWS];
};

// The query tiles the keys k0 .. k0 + rows meet, in order: for each query head of their group,
// the tiles from the one holding k0 to the last that sees them.
struct QueryWalk {
    uint32_t first_head, first, tiles_per_head, rows;
    __device__ uint32_t steps(uint32_t group) const { return group * tiles_per_head; }
    __device__ uint32_t head(uint32_t n) const { return first_head + n / tiles_per_head; }
    __device__ uint32_t row0(uint32_t n) const { return first + n % tiles_per_head * rows; }
};

// dK and dV of a tile of 16 keys per warp of one key head: over every query head of its group
// and every query tile that sees it, dV += P^T dO and dK += dS^T Q, with P^T = exp(K Q^T - lse)
// and dS^T = P^T * (V dO^T - D); dK is scaled once at the end. Each query tile is copied in
// while the warps work on the one before.
template <typename T, int HD>
__device__ void backward_dkdv(const T *q, const T *k, const T *v, const T *dout,
                              const float *lse, const float *d, T *dk, T *dv, uint32_t heads,
                              uint32_t kv_heads, Mask m, Strides qs, Strides kvs, float scale) {
    check_block<HD>();
    using Tiles = KeyTiles<T, HD>;
    constexpr int ROWS = Tiles::ROWS;
    Tiles &sm = shared_tiles<Tiles>();
    Place at = place(m.t, kv_heads, ROWS, false);  // the first keys, seen most, first
    uint32_t g = at.head, b = at.batch, group = heads / kv_heads;
    uint32_t k0 = at.row0, r0 = k0 + threadIdx.x / 32 * 16;
    Strides os = output_strides<HD>(m.t, heads);
    uint32_t first = k0 / ROWS * ROWS;  // < query_end: key k0 sees query k0
    QueryWalk walk{g * group, first, (m.query_end(k0, ROWS) - first + ROWS - 1) / ROWS, ROWS};
    auto copy_tile = [&](uint32_t n, int stage) {
        uint32_t h = walk.head(n), i0 = walk.row0(n);
        copy_rows<T, HD>(sm.q[stage], q, qs, b, h, i0, m.t);
        copy_rows<T, HD>(sm.dout[stage], dout, os, b, h, i0, m.t);
        copy_row_values<HD>(sm.lse[stage], lse, heads, b, h, i0, m.t);
        copy_row_values<HD>(sm.d[stage], d, heads, b, h, i0, m.t);
    };

    copy_rows<T, HD>(sm.k, k, kvs, b, g, k0, m.t);
    copy_rows<T, HD>(sm.v, v, kvs, b, g, k0, m.t);
    copy_tile(0, 0);
    commit_copies();
    float dkf[HD / 8][4] = {}, dvf[HD / 8][4] = {}, scale2 = scale * LOG2E;
    for (uint32_t n = 0, steps = walk.steps(group); n < steps; n++) {
        int stage = n & 1;
        __syncthreads();  // every warp is done with the other stage
        if (n + 1 < steps) copy_tile(n + 1, stage ^ 1);
        commit_copies();
        wait_copies<1>();  // this tile (the next may still be in flight)
        __syncthreads();
        uint32_t i0 = walk.row0(n);
        if (!m.any(i0, ROWS, r0, 16)) continue;

        float s[ROWS / 8][4], ds[ROWS / 8][4];
        products_t<T, HD, ROWS>(s, &sm.k[r0 - k0][0], &sm.q[stage][0][0]);      // S^T = K Q^T
        products_t<T, HD, ROWS>(ds, &sm.v[r0 - k0][0], &sm.dout[stage][0][0]);  // dP^T = V dO^T
        const float *lse_t = sm.lse[stage], *d_t = sm.d[stage];
        static_assert(offsetof(Tiles, lse) % 8 == 0 && offsetof(Tiles, d) % 8 == 0,
                      "the 8-byte loads below need 8-byte aligned rows");
        auto columns = [&](int n) {  // the lane's two columns of tile n: one 8-byte load each
            unsigned c = n * 8 + 2 * quad_col();
            float2 l = *reinterpret_cast<const float2 *>(&lse_t[c]);
            float2 dd = *reinterpret_cast<const float2 *>(&d_t[c]);
            return QueryTerms{{l.x * LOG2E, l.y * LOG2E}, {dd.x, dd.y}};
        };
        if (m.all(i0, ROWS, r0, 16))  // the same for the warp's lanes
            probabilities_and_ds<false, true, ROWS>(s, ds, m, r0, i0, scale2, columns);
        else
            probabilities_and_ds<true, true, ROWS>(s, ds, m, r0, i0, scale2, columns);
        accumulate<T, HD, ROWS>(dvf, s, &sm.dout[stage][0][0]);  // dV += P^T dO
        accumulate<T, HD, ROWS>(dkf, ds, &sm.q[stage][0][0]);    // dK += dS^T Q
    }
    write_rows<T, HD>(dkf, scale, dk, kvs, b, g, r0, m.t);
    write_rows<T, HD>(dvf, 1.0f, dv, kvs, b, g, r0, m.t);
}

// The shared memory of dQ: the block's queries and output gradients, and two stages of the key
// and value tiles they see.
template <typename T, int HD>
struct QueryTiles {
    static constexpr int ROWS = 16 * warps<HD>();
    Row<T, HD> q[ROWS], dout[ROWS], k[2][ROWS], v[2][ROWS];
};

// dQ of a tile of 16 queries per warp of one head: over the key tiles it sees, dQ += dS K with
// dS = exp(Q K^T - lse) * (dO V^T - D), scaled once at the end. Each key tile is copied in while
// the warps work on the one before.
template <typename T, int HD>
__device__ void backward_dq(const T *q, const T *k, const T *v, const T *dout, const float *lse,
                            const float *d, T *dq, uint32_t heads, uint32_t kv_heads, Mask m,
                            Strides qs, Strides kvs, float scale) {
    check_block<HD>();
    using Tiles = QueryTiles<T, HD>;
    constexpr int ROWS = Tiles::ROWS;
    Tiles &sm = shared_tiles<Tiles>();
    Place at = place(m.t, heads, ROWS, true);
    uint32_t h = at.head, b = at.batch, g = h / (heads / kv_heads);
    uint32_t q0 = at.row0, r0 = q0 + threadIdx.x / 32 * 16;
    Strides os = output_strides<HD>(m.t, heads);
    uint32_t j0 = m.first_key(q0, ROWS), end = min(m.t, q0 + ROWS);  // j0 < end: q0 sees q0

    copy_rows<T, HD>(sm.q, q, qs, b, h, q0, m.t);
    copy_rows<T, HD>(sm.dout, dout, os, b, h, q0, m.t);
    copy_rows<T, HD>(sm.k[0], k, kvs, b, g, j0, m.t);
    copy_rows<T, HD>(sm.v[0], v, kvs, b, g, j0, m.t);
    commit_copies();
    QueryTerms rows;  // the lane's rows g and g + 8
    for (int r = 0; r < 2; r++) {
        uint32_t i = r0 + quad_row() + 8 * r;
        size_t at = ((size_t)b * heads + h) * m.t + i;
        rows.lse2[r] = i < m.t ? lse[at] * LOG2E : 0.0f;
        rows.d[r] = i < m.t ? d[at] : 0.0f;
    }
    float scale2 = scale * LOG2E;
    float dqf[HD / 8][4] = {};

    for (int stage = 0; j0 < end; j0 += ROWS, stage ^= 1) {
        __syncthreads();  // every warp is done with the other stage
        if (j0 + ROWS < end) {
            copy_rows<T, HD>(sm.k[stage ^ 1], k, kvs, b, g, j0 + ROWS, m.t);
            copy_rows<T, HD>(sm.v[stage ^ 1], v, kvs, b, g, j0 + ROWS, m.t);
        }
        commit_copies();
        wait_copies<1>();  // this tile (the next may still be in flight)
        __syncthreads();
        if (!m.any(r0, 16, j0, ROWS)) continue;

        float s[ROWS / 8][4], ds[ROWS / 8][4];
        products_t<T, HD, ROWS>(s, &sm.q[r0 - q0][0], &sm.k[stage][0][0]);      // S = Q K^T
        products_t<T, HD, ROWS>(ds, &sm.dout[r0 - q0][0], &sm.v[stage][0][0]);  // dP = dO V^T
        auto the_rows = [&](int) { return rows; };
        if (m.all(r0, 16, j0, ROWS))  // the same for the warp's lanes
            probabilities_and_ds<false, false, ROWS>(s, ds, m, r0, j0, scale2, the_rows);
        else
            probabilities_and_ds<true, false, ROWS>(s, ds, m, r0, j0, scale2, the_rows);
        accumulate<T, HD, ROWS>(dqf, ds, &sm.k[stage][0][0]);  // dQ += dS K
    }
    write_rows<T, HD>(dqf, scale, dq, qs, b, h, r0, m.t);
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
