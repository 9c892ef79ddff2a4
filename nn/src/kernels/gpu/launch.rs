//! The launch arithmetic of kernels/fused.cu and flash.cu: how many blocks of how many threads
//! each kernel runs with, with how much dynamic shared memory, and the sizes that follow from
//! them. Plain integers, so the CPU tests check them
//! (and run them, under the emulator) without a GPU.

use candle_core::Result;

/// A one-dimensional launch: `grid` blocks of `block` threads, with `shared` bytes of dynamic
/// shared memory a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub grid: u32,
    pub block: u32,
    pub shared: u32,
}

/// The most threads a block may have on every GPU since compute capability 2.0.
const MAX_BLOCK: u32 = 1024;
/// CUDA's limit on a grid's x dimension.
const MAX_GRID: usize = (1 << 31) - 1;
/// Threads per block of the elementwise kernels, and their grid's cap (they stride over the
/// rest): 65,536 blocks of 256 keep every SM of an H100 busy many times over.
const ELEMENTWISE_BLOCK: u32 = 256;
const ELEMENTWISE_GRID: usize = 1 << 16;
/// Blocks of a column reduction's first pass (LayerNorm's dweight and dbias, a bias
/// gradient): each keeps its share in a scratch row, so the count trades parallelism against
/// that scratch and the second pass's work; 512 is about four blocks per SM on an H100.
const COLUMN_REDUCE_BLOCKS: usize = 512;

/// Threads per block for a row of `width` elements: about four elements a thread, whole warps,
/// a power of two from 32 to 1024 (the reductions halve it).
pub fn row_block(width: usize) -> u32 {
    let want = width.div_ceil(4).clamp(32, MAX_BLOCK as usize);
    want.next_power_of_two() as u32
}

/// Threads per block for `packs` Packs of a row (fused.cu), a thread each: whole warps, at
/// most a block's 1024 (then a thread takes several). No block reduction halves them, so any
/// number of warps will do.
pub fn thread_per_pack(packs: usize) -> u32 {
    packs.next_multiple_of(32).clamp(32, MAX_BLOCK as usize) as u32
}

/// One block per row: `rows` rows of `width`.
pub fn per_row(rows: usize, width: usize) -> Result<Launch> {
    if rows > MAX_GRID {
        candle_core::bail!("fused kernel: {rows} rows exceed a grid's {MAX_GRID} blocks");
    }
    if width > u32::MAX as usize {
        candle_core::bail!("fused kernel: rows of {width} elements exceed u32");
    }
    Ok(Launch {
        grid: rows as u32,
        block: row_block(width),
        shared: 0,
    })
}

/// Threads per block for a row of `packs` Packs held one a thread (fused.cu's row kernels
/// that keep a thread's Pack in registers); None where a row has more Packs than a block
/// has threads.
pub fn pack_a_thread(packs: usize) -> Option<u32> {
    (packs <= MAX_BLOCK as usize).then(|| thread_per_pack(packs))
}

/// A grid-stride loop over `n` elements.
pub fn elementwise(n: usize) -> Launch {
    Launch {
        grid: n
            .div_ceil(ELEMENTWISE_BLOCK as usize)
            .clamp(1, ELEMENTWISE_GRID) as u32,
        block: ELEMENTWISE_BLOCK,
        shared: 0,
    }
}

/// A reduction over `rows` rows of `width` into `columns` f32 sums, in two passes: `pass`,
/// whose blocks stride over the rows, each adding its share into its own scratch row; then
/// `sum`, a thread a column, adding the `pass.grid` rows of `scratch` (pass.grid x columns).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColumnReduce {
    pub pass: Launch,
    pub scratch: usize,
    pub sum: Launch,
}

pub fn column_reduce(rows: usize, width: usize, columns: usize) -> Result<ColumnReduce> {
    let pass = per_row(rows.clamp(1, COLUMN_REDUCE_BLOCKS), width)?;
    Ok(ColumnReduce {
        pass,
        scratch: pass.grid as usize * columns,
        sum: Launch {
            grid: columns.div_ceil(ELEMENTWISE_BLOCK as usize).max(1) as u32,
            block: ELEMENTWISE_BLOCK,
            shared: 0,
        },
    })
}

/// Dynamic shared memory a block may opt into on every GPU the kernels build for (sm_80:
/// 163 KiB; sm_90: 227 KiB).
const MAX_SHARED: usize = 163 * 1024;

/// A norm's backward (LayerNorm's dweight and dbias, RMSNorm's dweight) over `rows` rows of
/// `width`: a column reduction whose first pass keeps its `columns` sums in dynamic shared
/// memory (fused.cu's zeroed_column_sums).
pub fn norm_reduce(rows: usize, width: usize, columns: usize) -> Result<ColumnReduce> {
    let shared = columns * std::mem::size_of::<f32>();
    if shared > MAX_SHARED {
        candle_core::bail!(
            "fused norm backward: rows of {width} need {shared} bytes of shared memory, more \
             than a block has ({MAX_SHARED})"
        );
    }
    let mut r = column_reduce(rows, width, columns)?;
    r.pass.shared = shared as u32;
    Ok(r)
}

/// The mean of `n` row losses: one block.
pub fn mean_of_rows(n: usize) -> Launch {
    Launch {
        grid: 1,
        block: row_block(n),
        shared: 0,
    }
}

/// Head sizes kernels/flash.cu is built for (its FLASH_HD instances).
pub const FLASH_HEAD_DIMS: [usize; 3] = [32, 64, 128];

/// Warps per block of the flash kernels for head size `hd`, each taking 16 rows of a tile:
/// flash.cu's warps<HD>(), 4 up to 64, 2 for 128 (whose dK and dV take 248 registers a
/// thread).
pub fn flash_warps(hd: usize) -> u32 {
    if hd <= 64 {
        4
    } else {
        2
    }
}

/// The flash kernels that walk tiles, each with its own shared memory (flash.cu's
/// ForwardTiles, KeyTiles and QueryTiles).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernel {
    Forward,
    /// dK and dV, a block per key tile.
    KeysBackward,
    /// dQ, a block per query tile.
    QueriesBackward,
}

/// Elements flash.cu adds to each shared row (its PAD).
const FLASH_PAD: usize = 8;

/// The shared memory of `kernel` for head size `hd` and `elem` bytes an element: tiles of
/// 16 x flash_warps(hd) padded rows, as flash.cu's structs lay them out (the kernels stop
/// with a trap when given less; the emulator tests run every kernel at every head size).
pub fn flash_shared_bytes(kernel: FlashKernel, hd: usize, elem: usize) -> u32 {
    let rows = 16 * flash_warps(hd) as usize;
    let tile = rows * (hd + FLASH_PAD) * elem;
    let bytes = match kernel {
        // two stages of keys and values
        FlashKernel::Forward => 4 * tile,
        // the block's keys and values, two stages of queries and output gradients, and of
        // their rows' log-sum-exp and D (f32)
        FlashKernel::KeysBackward => 6 * tile + 2 * 2 * rows * 4,
        // the block's queries and output gradients, two stages of keys and values
        FlashKernel::QueriesBackward => 6 * tile,
    };
    bytes as u32
}

/// Whether a tile of rows `stride` elements of `elem` bytes apart spans less than 4 GiB:
/// flash.cu's copy_rows finds each row from the tile's first by a 32-bit byte offset.
pub fn flash_tile_addressable(hd: usize, elem: usize, stride: usize) -> bool {
    let rows = 16 * flash_warps(hd) as usize;
    rows.checked_mul(stride)
        .and_then(|e| e.checked_mul(elem))
        .is_some_and(|bytes| bytes <= u32::MAX as usize)
}

/// `kernel` over `batch` x `heads` heads of `t` rows (queries for the forward and dQ, keys
/// for dK dV) of `hd` elements of `elem` bytes: one block per 16 x flash_warps(hd) rows of
/// each.
pub fn flash_tiles(
    kernel: FlashKernel,
    [batch, heads, t]: [usize; 3],
    hd: usize,
    elem: usize,
) -> Result<Launch> {
    let warps = flash_warps(hd);
    let blocks = batch * heads * t.div_ceil(16 * warps as usize);
    if blocks > MAX_GRID {
        candle_core::bail!("flash attention: {blocks} tiles exceed a grid's {MAX_GRID} blocks");
    }
    Ok(Launch {
        grid: blocks as u32,
        block: 32 * warps,
        shared: flash_shared_bytes(kernel, hd, elem),
    })
}

/// flash_bwd_dot over `rows` output rows: a warp a row, eight a block.
pub fn flash_dot(rows: usize) -> Result<Launch> {
    let blocks = rows.div_ceil(8);
    if blocks > MAX_GRID {
        candle_core::bail!("flash attention: {rows} rows exceed a grid");
    }
    Ok(Launch {
        grid: blocks as u32,
        block: 256,
        shared: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_blocks_are_whole_warps_and_powers_of_two() {
        for (width, threads) in [
            (1, 32),
            (128, 32),
            (129, 64),
            (768, 256),
            (1024, 256),
            (4096, 1024),
            (50_257, 1024),
        ] {
            assert_eq!(row_block(width), threads, "width {width}");
        }
        for width in 1..5000 {
            let b = row_block(width);
            assert!(
                b.is_power_of_two() && b.is_multiple_of(32) && b <= MAX_BLOCK,
                "{width}: {b}"
            );
            assert!(
                b as usize * 4 >= width.min(4096),
                "{width}: {b} threads too few"
            );
        }
    }

    #[test]
    fn elementwise_grids_cover_or_stride() {
        assert_eq!(elementwise(0).grid, 1);
        assert_eq!(elementwise(256).grid, 1);
        assert_eq!(elementwise(257).grid, 2);
        // GPT-2's MLP activation at micro-batch 16: 16 x 1024 x 3072 elements, strided.
        assert_eq!(
            elementwise(16 * 1024 * 3072).grid as usize,
            ELEMENTWISE_GRID
        );
    }

    #[test]
    fn column_reductions_size_their_scratch_by_their_grid() {
        // LayerNorm's backward at GPT-2's batch: dweight and dbias, 2 x 768 columns
        let r = column_reduce(16 * 1024, 768, 1536).unwrap();
        assert_eq!(r.pass.grid as usize, COLUMN_REDUCE_BLOCKS);
        assert_eq!(r.scratch, COLUMN_REDUCE_BLOCKS * 1536);
        assert_eq!(r.sum.grid as usize * r.sum.block as usize, 1536);
        let few = column_reduce(3, 10, 20).unwrap();
        assert_eq!((few.pass.grid, few.scratch), (3, 60));
        assert!(few.sum.grid as usize * few.sum.block as usize >= 20);
    }

    #[test]
    fn flash_grids_take_a_block_per_tile_per_head() {
        // GPT-2 at micro-batch 16: 12 heads of 64, 1024 positions, 64 rows a block
        let fwd = FlashKernel::Forward;
        let at = flash_tiles(fwd, [16, 12, 1024], 64, 2).unwrap();
        assert_eq!((at.grid, at.block), (16 * 12 * 16, 128));
        // head size 128: two warps, 32 rows a block; a partial last tile counts
        let at = flash_tiles(fwd, [1, 8, 33], 128, 2).unwrap();
        assert_eq!((at.grid, at.block), (8 * 2, 64));
        assert_eq!(flash_dot(17).unwrap().grid, 3);
        let e = flash_tiles(fwd, [1 << 20, 64, 1 << 16], 64, 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("exceed a grid"), "{e}");
    }

    #[test]
    fn flash_tiles_span_less_than_4_gib() {
        // GPT-2's fused q|k|v rows (3 x 768 bf16 apart) and Llama 3.1 405B's output rows
        // (128 heads of 128) are far inside; a tile of 64 rows 2^25 bf16 apart spans 4 GiB
        assert!(flash_tile_addressable(64, 2, 3 * 768));
        assert!(flash_tile_addressable(128, 2, 128 * 128));
        assert!(flash_tile_addressable(64, 2, (1 << 25) - 1));
        assert!(!flash_tile_addressable(64, 2, 1 << 25));
        // two warps at head size 128: 32 rows a tile
        assert!(flash_tile_addressable(128, 2, 1 << 25));
        assert!(
            !flash_tile_addressable(64, 2, usize::MAX / 2),
            "no overflow"
        );
    }

    #[test]
    fn packed_rows_take_a_thread_a_pack_in_whole_warps() {
        // GPT-2's bias gradients in bf16 (8 a Pack): 768 and 3072 columns
        assert_eq!(thread_per_pack(768 / 8), 96);
        assert_eq!(thread_per_pack(3072 / 8), 384);
        assert_eq!(thread_per_pack(5), 32);
        assert_eq!(thread_per_pack(33), 64);
        assert_eq!(thread_per_pack(100_000), MAX_BLOCK);
        assert_eq!(pack_a_thread(768 / 8), Some(96));
        assert_eq!(pack_a_thread(1024), Some(1024));
        assert_eq!(
            pack_a_thread(1025),
            None,
            "a thread a Pack: no block that large"
        );
    }

    #[test]
    fn norm_backward_keeps_its_column_sums_in_shared_memory() {
        // LayerNorm at GPT-2's width: dweight and dbias, 2 x 768 f32
        let r = norm_reduce(16 * 1024, 768, 2 * 768).unwrap();
        assert_eq!(r.pass.shared as usize, 2 * 768 * 4);
        assert_eq!(r.pass.grid as usize, COLUMN_REDUCE_BLOCKS);
        // Llama 3.1 405B's 16,384 fit; a width past the shared memory is an error
        assert!(norm_reduce(8, 16_384, 2 * 16_384).is_ok());
        let e = norm_reduce(8, 30_000, 2 * 30_000).unwrap_err().to_string();
        assert!(e.contains("shared memory"), "{e}");
    }

    #[test]
    fn flash_shared_memory_fits_an_sm80_block() {
        // every kernel at every head size within the 163 KiB an A100 block may opt into (H100:
        // 227 KiB), and the forward's two stages of 64 x (64 + 8) bf16 keys and values
        let kernels = [
            FlashKernel::Forward,
            FlashKernel::KeysBackward,
            FlashKernel::QueriesBackward,
        ];
        for k in kernels {
            for hd in FLASH_HEAD_DIMS {
                let bytes = flash_shared_bytes(k, hd, 2);
                assert!(bytes as usize <= MAX_SHARED, "{k:?} hd {hd}: {bytes}");
            }
        }
        assert_eq!(
            flash_shared_bytes(FlashKernel::Forward, 64, 2),
            2 * 2 * 64 * 72 * 2
        );
    }

    #[test]
    fn too_many_rows_is_an_error_not_a_truncated_grid() {
        let e = per_row(MAX_GRID + 1, 8).unwrap_err().to_string();
        assert!(e.contains("exceed a grid"), "{e}");
    }
}
