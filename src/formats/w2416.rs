//! `w2416`: 2-bit and 4-bit groups in one weight matrix with sparse f16 outliers
//! (arXiv 2311.16442), and the tile layout its kernels read — which the uniform `int4` /
//! `int2` formats are converted to at load, so one kernel family serves all three.
//!
//! # The format
//!
//! A weight `[n, k]` (n a multiple of [`TILE_ROWS`] = 32, k even) is cut into **tiles** of
//! 32 rows × 64 columns ([`TILE_COLS`]; where k is not a multiple of 64 the last tile column
//! holds zero weights past k). Every (row, tile) is one quantization group of 64
//! weights, asymmetric: `w = q · scale + zero`, `q` in `0..=maxq`. A tile's groups are all
//! 2-bit (`maxq` 3) or all 4-bit (`maxq` 15): the paper's memory alignment, so a warp that
//! decodes a tile never diverges. Each block of 32 rows has the same number `h4` of 4-bit
//! tiles (every block's code stream has one length: load balance, and a rectangular
//! tensor). The 4-bit tiles of a block are those whose Hessian-weighted error
//! `Σ_rows Σ_j H_jj (w_j − ŵ_j)²` drops most from 2 to 4 bits; `h4` follows from the budget
//! `--bits`.
//!
//! **Reorder** (`reorder`, on by default): before the tiles are cut, the input channels
//! (the columns) are sorted by decreasing `H_jj · max_i w_ij²` (how much the channel widens
//! its groups' ranges, weighted by what rounding costs there), and the Hessian's rows and
//! columns with them. A tile's precision is one
//! choice for 64 columns; in input order the few salient channels of a layer sit in every
//! tile, so a 4-bit tile spends most of its bits on channels that did not need them. Sorted,
//! they fill the first tiles, which the selection above makes 4-bit, and the 2-bit tiles hold
//! channels of like magnitude (narrower ranges). The kernels read the input through the
//! order (`Perm`: kernel column `j` takes input channel `order[j]`); it costs 2 bytes per
//! column, counted in the budget. A model that can renumber a layer's input channels for
//! free does so instead ([`input_order`], `Codec::input_order`): the Llama folds the down
//! projection's order into the gate/up rows (`Llama::fold_down_order`), so that layer's
//! order is the identity, is not stored, and its GEMV reads x as the SiLU·mul epilogue
//! wrote it. The layers whose input is the residual stream's norm (QKV, gate/up) or the
//! attention's heads (O) keep theirs.
//!
//! **Exclusive outliers**: in the 2-bit tiles only, the `E` weights per 32-row block with the
//! largest `H_jj (w_j − ŵ_j)²` (about `--outliers` = 0.5 % of the block's weights, `E` a
//! multiple of 32) are taken out before their group's range is fitted again, and kept as an
//! f16 correction `δ` to the value their code stands for (`w ≈ ŵ(q) + δ`).
//!
//! **Two-level scales** (`TwoLevel`): per (row, group) a u8 `sc` and an i8 `zc`; per (row,
//! 16 groups) an f16 `ds`. `scale = f16(sc · ds · (1 / maxq))` (the code stores the group's
//! range, so 2- and 4-bit groups share one scale of scales), `zero = f16(zc · scale / 8)`
//! (the zero in eighths of the group's own step: its error is at most 1/16 of a step, where
//! an absolute zero code under a super-group scale loses small groups' zeros). Each
//! weight dequantizes to `f16(q · scale + zero)`, rounded once — what the kernel's `HFMA2`
//! computes, so the CPU reference here matches the kernel's weights bit for bit.
//!
//! The uniform formats' tiles (`Plain` scales) hold f16 `(scale, zero)` per (row, group of
//! `group` = 128 columns) instead, all tiles one precision, no outliers.
//!
//! # Tensors (version 2: version 1 had no column order)
//!
//! `R = n / 32` row blocks, `G = ⌈k / 64⌉` tile columns, `S = ⌈G / 16⌉`, `H = h4`. Every tensor
//! has `n` rows first (the formats layer's rule): a 32-row block's data is spread over its
//! 32 rows, so splitting or stacking at multiples of 32 rows splits or stacks blocks.
//!
//! | tensor    | dtype | shape              | content |
//! |-----------|-------|--------------------|---------|
//! | `codes`   | u32   | `[n, 4 (G + H)]`   | per block, its tiles in column order: a 2-bit tile 128 words, a 4-bit one 256 (below) |
//! | `mask`    | u8    | `[n, ⌈G / 8⌉]`     | bit `g % 8` of byte `g / 8`: tile column `g` of the row's block is 4-bit (same in the block's 32 rows) |
//! | `scales`  | u8    | `[n, 2 G]`         | per block and tile, 64 bytes `[lg 8][nb 4][sc, zc]` for row `lg + 8 nb` |
//! | `supers`  | f16   | `[n, S]`           | per block and super-group, `[lg 8][nb 4]` |
//! | `entries` | u32   | `[n, E / 32]`      | per block, `E` outliers sorted by row then column: `col | f16 bits(δ) << 16`; unused ones `δ = 0` |
//! | `row_end` | u32   | `[n, 1]`           | one past the row's last entry within its block's list |
//! | `input.order` | u32 | `[k / 2]`        | reordered only: the input channels of columns `2 i` (low 16 bits) and `2 i + 1` (high) |
//!
//! Every column index above (tiles, outlier entries) counts kernel columns, in `input.order`'s
//! order where it is stored. `input.*` tensors describe the layer's input, not its rows:
//! layers stacked on one input (Q, K and V; gate and up) share one order.
//!
//! Inside a tile (lane `l` of the decoding warp, `lg = l / 4`, `t = l % 4`): lane `l`
//! holds the 64 weights of rows `lg + 8 nb` (nb 0..4) at columns `16 kc + 2 t + 8 hb + e`
//! (kc 0..4, hb, e 0..2): the B fragments of 16 `mma.m16n8k16` (one per n-block `nb` and
//! k-chunk `kc`). 2-bit: word `4 l + nb` holds them with `(kc, hb, e)` at bits
//! `2 (2 kc + hb) + 16 e`; 4-bit: word `128 (nb / 2) + 4 l + 2 (nb % 2) + kc / 2`, bits
//! `4 (2 (kc % 2) + hb) + 16 e`. So a lane reads one 16-byte chunk (2-bit) or two, and a
//! `shift + and + or` turns a pair of codes at bit distance 16 into an `f16x2` (`1024 + q`).
//!
//! Bits per weight, all counted (what the kernel reads): codes `2 + 2 H / G`, scales 0.25,
//! super scales `16 / (64 · 16)`, tile descriptors (u32 per tile, built at load) 1/64,
//! outliers `32 E / (32 k)` plus a u32 per row, the column order `16 / n`. At k = 4096,
//! n = 4096, 0.5 % outliers and `h4` = 0.25 G: 2.5 + 0.25 + 0.016 + 0.016 + 0.16 + 0.008 +
//! 0.004 = 2.95.
//!
//! # Decisions, and what measured them (H200, default model, full WikiText-2 test, ctx 512,
//! in-sample calibration; BENCHMARKS.md "2/4/16-bit weights")
//!
//! - **Group = tile width = 64 columns**: one 16-byte load per lane holds a 2-bit group's
//!   codes for the mma fragment layout; groups of 128 would halve the scale bytes (0.25 →
//!   0.125 bits) but were not measured yet.
//! - **4-bit share per layer** follows the budget alone (the same `h4` per 32-row block, the
//!   tiles with the largest `Σ H_jj` error drop). At 3.0 bits: 2 of 9 tiles in 576-wide rows,
//!   6 of 24 in 1536-wide ones (3 and 8 without outliers). Measured against it (2026-12-03,
//!   BENCHMARKS.md "Sharing the 4-bit budget"): spreading one budget over a block's four
//!   projections by the same Hessian-weighted error per byte is worse (w2416-gptq 3.0 bits,
//!   no outliers, full text on the H200: 48.95 against 43.17; per-layer errors in different
//!   output spaces do not compare), and hand-set shares on a CPU subset gain at most 4 %
//!   (more 4-bit tiles in `down_proj`), far from the gap to `int3-gptq`.
//! - **Outliers**: u32 entries (column, f16 δ) sorted by row with a u32 row pointer — 32
//!   bits per outlier plus 32 per row. w2416-gptq at 3.0 bits: 45.66 with 0.5 % outliers,
//!   43.95 without (their bytes cost a 4-bit tile per block); round to nearest at 2.9 bits:
//!   131.7 with, 166.6 without. Reordered (below), on a CPU subset (windows 0..8): 45.95 with
//!   0.5 %, 41.63 without; full text on the H200, reordered: 37.77 with against 35.87 without
//!   at 3.0 bits, 35.12 against 33.52 at 3.3, but 53.31 against 67.75 at 2.5 (where no 4-bit
//!   tile fits the budget at k = 576). So the default is none since 2026-12-07 (it also spares
//!   the GEMV its outlier warps' gathers); `--outliers 0.005` is the paper's setting.
//! - **Zero in eighths of the step** (not an absolute code under the super scale): bounded
//!   error for small groups next to large ones; not compared by perplexity.
//! - **Range search** of 80 shrink factors with the Hessian diagonal as weights, for both
//!   widths; the tiles' selection uses the errors after that search.
//! - **GPTQ's column order**: activation order by the Hessian diagonal times the mean
//!   squared step of the column's groups ([`crate::gptq::GroupRule::order_weight`]), so the
//!   2-bit columns go first and the 4-bit ones, quantized later, take up their error.
//!   Against the plain diagonal (3.0 bits, no outliers, this repository's CPU, 16 × 512
//!   in-sample calibration tokens, 2026-12-07): windows 0..8 52.41 → 50.91, windows 0..40
//!   47.37 → 46.61 (BENCHMARKS.md "GPTQ's column order").
//! - **Reorder by `H_jj · max_i w_ij²`** (on by default). Measured against no reorder and
//!   other keys (w2416-gptq, 3.0 bits, no outliers, this repository's CPU, 16 × 512 in-sample
//!   calibration tokens, windows 0..8; 2026-12-07, BENCHMARKS.md "Reordered input channels"):
//!   no reorder 50.91; `H_jj · max w²` **41.63**; `H_jj` 42.46; `H_jj · Σ w²` 42.68;
//!   `max |w|` alone 46.46 (these 16-window runs move by ~2 % with float summation order
//!   alone, so the three Hessian-weighted keys are not told apart; magnitude alone is
//!   clearly worse). On windows 0..40: 46.61 → **38.19**, where `int3-gptq` (3.27
//!   bits) has 40.93. The column order costs 0.015 bits/weight on this model (2.958 → 2.973).
//!   The same order makes `int3-gptq` worse (44.16 → 51.85 on windows 0..8): the gain is the
//!   mixed precision's, whole salient channels in 4-bit tiles. Full text (CPU, f32, 128 × 512
//!   calibration tokens): **36.50 at 2.973 bits against `int3-gptq` 38.21 at 3.271** (36.51
//!   at 2.966 with the down projection's order folded); on the H200 in f16, the whole table
//!   (2.5 / 3.0 / 3.3 bits, outliers, round to nearest, the uniform baselines) in BENCHMARKS.md
//!   "The table redone on an H200": **35.87 at 2.966 bits against 38.33**. Decode
//!   cost on an H100 (the GEMV reads x through the order): Llama-2-7B shape +6 %, 70B +16 %
//!   without outliers, nearly all of the 70B's in the down projection (k = 28 672: 78 µs
//!   against 47); with the down projection's order folded into the gate/up rows: 7B
//!   2.76 ms against 2.71 unordered, 70B 17.05 against 17.3 (BENCHMARKS.md "The down
//!   projection's order folded").
//! - **Scales fixed before GPTQ** (its static groups): fitting every group's scale and zero
//!   again to GPTQ's codes under the full Hessian, alternating with GPTQ, gained 3–6 % on a
//!   CPU subset (52.69 → 49.54 at best, not monotone in the rounds; BENCHMARKS.md "Scales
//!   fitted again"): not kept.

use super::WeightFormat;
use super::{Calibration, Codec, Epilogue, FormatSpec, LinearWeights, Plan, QuantOptions};
use crate::gptq::{GptqConfig, GroupRule};
use candle_core::{DType, Device, Result, Tensor};
use half::f16;
use std::collections::HashMap;

/// Rows per tile.
pub const TILE_ROWS: usize = 32;
/// Columns per tile, and per quantization group of `w2416`.
pub const TILE_COLS: usize = 64;
/// Groups per second-level scale.
pub const SUPER: usize = 16;
/// A zero code counts eighths of its group's step.
pub const ZERO_DIV: f32 = 8.0;
/// Default budget, bits per weight with every byte counted.
pub const DEFAULT_BITS: f64 = 3.0;
/// Default outlier fraction (of all weights): none. The paper's 0.5 % costs a 4-bit tile per
/// block on the default model and loses to GPTQ without them (module docs, "Outliers").
pub const DEFAULT_OUTLIERS: f64 = 0.0;
/// Range factors the fit tries: `1 − i / 100`.
const CLIP_STEPS: usize = 80;

pub static W2416: FormatSpec = FormatSpec {
    name: "w2416",
    aliases: &["2416"],
    about: "2-bit groups with 4-bit tiles and sparse f16 outliers, ~3 bits/weight (--bits, --outliers); \
            Hessian-ranked, round to nearest",
    error_bound: 0.3,
    tolerance: 5e-3,
    calibration: Calibration::Diagonal,
    graph_safe: true,
    version: 2,
    stores_as: None,
    codec: &W2416Codec { gptq: false },
};

pub static W2416_GPTQ: FormatSpec = FormatSpec {
    name: "w2416-gptq",
    aliases: &["2416-gptq"],
    about: "w2416 with GPTQ on its codes (needs calibration)",
    error_bound: 0.3,
    tolerance: 5e-3,
    calibration: Calibration::Hessian,
    graph_safe: true,
    version: 2,
    stores_as: Some(WeightFormat::W2416),
    codec: &W2416Codec { gptq: true },
};

// ---------------------------------------------------------------------------------------
// The tile layout.

/// Scales of a tiled weight.
#[derive(Debug, Clone)]
pub enum TileScales {
    /// `w2416`: u8 `[n, 2 G]` codes, f16 `[n, S]` super scales (module docs).
    TwoLevel { codes: Tensor, supers: Tensor },
    /// Uniform formats: f16 `[n, 2 ⌈k / group⌉]`, per block and scale group
    /// `[lg 8][nb 4][scale, zero]`.
    Plain { group: usize, sz: Tensor },
}

/// Sparse outliers of a tiled weight (module docs).
#[derive(Debug, Clone)]
pub struct Outliers {
    /// Entries per 32-row block (a multiple of 32).
    pub per_block: usize,
    /// u32 `[n, per_block / 32]`.
    pub entries: Tensor,
    /// u32 `[n, 1]`.
    pub row_end: Tensor,
}

/// The input-channel order of a reordered weight: kernel column `j` reads input channel
/// `order[j]` (module docs, "Reorder").
#[derive(Debug, Clone)]
pub struct Perm {
    /// u32 `[k / 2]`: the channels of columns `2 i` and `2 i + 1` in the low and high 16
    /// bits (stored; the GEMV reads it).
    pub words: Tensor,
    /// u32 `[k]`: the order, one channel per column (built at load, for gathers).
    pub idx: Tensor,
    /// u32 `[k]`: the inverse, the column of every input channel (built at load).
    pub inv: Tensor,
}

impl Perm {
    /// From `order` (a permutation of `0..k`, `k` even and at most 65536) on `dev`.
    pub fn new(order: &[u32], dev: &Device) -> Result<Self> {
        let k = order.len();
        if !k.is_multiple_of(2) || k > 1 << 16 {
            candle_core::bail!("tiles: a column order of {k} channels (even, at most 65536)")
        }
        let mut inv = vec![u32::MAX; k];
        for (j, &c) in order.iter().enumerate() {
            if (c as usize) >= k || inv[c as usize] != u32::MAX {
                candle_core::bail!(
                    "tiles: the column order of {k} channels is not a permutation (channel {c} at column {j})"
                )
            }
            inv[c as usize] = j as u32;
        }
        let words: Vec<u32> = order.chunks(2).map(|p| p[0] | (p[1] << 16)).collect();
        Ok(Self {
            words: Tensor::from_vec(words, k / 2, dev)?,
            idx: Tensor::from_vec(order.to_vec(), k, dev)?,
            inv: Tensor::from_vec(inv, k, dev)?,
        })
    }

    /// From the stored `words` u32 `[k / 2]`, checked to be a permutation of `0..k`.
    pub fn from_words(words: &Tensor, k: usize) -> Result<Self> {
        super::expect(words, "input.order", &[k / 2], DType::U32)?;
        let w = words.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
        let order: Vec<u32> = w.iter().flat_map(|&v| [v & 0xffff, v >> 16]).collect();
        Self::new(&order, words.device())
    }

    /// The order on the host.
    pub fn order(&self) -> Result<Vec<u32>> {
        self.idx.to_device(&Device::Cpu)?.to_vec1::<u32>()
    }
}

/// A weight in the tile layout the kernels read (module docs).
#[derive(Debug, Clone)]
pub struct Tiles {
    pub n: usize,
    pub k: usize,
    /// 4-bit tiles per 32-row block.
    pub h4: usize,
    /// u32 `[n, 4 (G + h4)]`.
    pub codes: Tensor,
    /// u8 `[n, ⌈G / 8⌉]`.
    pub mask: Tensor,
    /// u32 `[R, G]`: word offset of the tile in its block's stream, bit 31 set for 4-bit
    /// (built from `mask`; not stored).
    pub desc: Tensor,
    pub scales: TileScales,
    pub outliers: Option<Outliers>,
    /// The input-channel order of the columns (`None`: the input's own).
    pub perm: Option<Perm>,
}

/// Tile columns of `k` (a last tile past `k` holds zero weights: `k` = 96 has two).
pub fn tile_cols(k: usize) -> usize {
    k.div_ceil(TILE_COLS)
}

/// Super-groups of a row of `k`.
pub fn supers(k: usize) -> usize {
    tile_cols(k).div_ceil(SUPER)
}

/// Whether `[n, k]` can be tiled: rows a multiple of 32, an even number of columns.
pub fn tileable(n: usize, k: usize) -> bool {
    n > 0 && k > 0 && n.is_multiple_of(TILE_ROWS) && k.is_multiple_of(2)
}

fn check_tileable(n: usize, k: usize, what: &str) -> Result<()> {
    if !tileable(n, k) {
        candle_core::bail!(
            "{what}: a [{n}, {k}] weight cannot be tiled (rows a multiple of {TILE_ROWS}, an even number of columns)"
        )
    }
    Ok(())
}

/// `w` `[n, k]` with zero columns up to a multiple of 64 (and `h` with zero rows and
/// columns: GPTQ takes them as dead inputs).
fn pad_cols(w: &Tensor, h: Option<&Tensor>) -> Result<(Tensor, Option<Tensor>)> {
    let (n, k) = w.dims2()?;
    let kp = tile_cols(k) * TILE_COLS;
    if kp == k {
        return Ok((w.clone(), h.cloned()));
    }
    let z = Tensor::zeros((n, kp - k), w.dtype(), w.device())?;
    let w = Tensor::cat(&[w, &z], 1)?;
    let h = match h {
        Some(h) => {
            let h = h.to_dtype(DType::F32)?;
            let right = Tensor::zeros((k, kp - k), DType::F32, h.device())?;
            let top = Tensor::cat(&[&h, &right], 1)?;
            let bottom = Tensor::zeros((kp - k, kp), DType::F32, h.device())?;
            Some(Tensor::cat(&[top, bottom], 0)?)
        }
        None => None,
    };
    Ok((w, h))
}

/// `1 / maxq` in f32 (what the kernel multiplies by).
pub fn inv_maxq(four: bool) -> f32 {
    if four {
        1.0 / 15.0
    } else {
        1.0 / 3.0
    }
}

/// Second-level dequantization, as the kernel does it: `(scale, zero)` in f16.
pub fn two_level(sc: u8, zc: i8, ds: f16, four: bool) -> (f16, f16) {
    let s = f16::from_f32(f32::from(sc) * ds.to_f32() * inv_maxq(four));
    let z = f16::from_f32(f32::from(zc) * s.to_f32() * (1.0 / ZERO_DIV));
    (s, z)
}

/// `f16(q · s + z)` rounded once (the kernel's `HFMA2`).
pub fn dequant_code(q: u8, s: f16, z: f16) -> f16 {
    f16::from_f64(f64::from(q) * s.to_f64() + z.to_f64())
}

/// Tile descriptors `[R, G]` from the 4-bit flags `[R · G]` (row-block major).
pub fn descriptors(four: &[bool], r: usize, g: usize) -> Vec<u32> {
    let mut d = Vec::with_capacity(r * g);
    for b in 0..r {
        let mut off = 0u32;
        for j in 0..g {
            let f = four[b * g + j];
            d.push(off | (u32::from(f) << 31));
            off += if f { 256 } else { 128 };
        }
    }
    d
}

/// The word index inside a tile and the bit shift of code (row `rr` of the tile, column `c`
/// of the tile).
pub fn code_position(rr: usize, c: usize, four: bool) -> (usize, u32) {
    let (lg, nb) = (rr % 8, rr / 8);
    let (kc, hb, t, e) = (c / 16, (c % 16) / 8, (c % 8) / 2, c % 2);
    let lane = 4 * lg + t;
    if four {
        let word = 128 * (nb / 2) + 4 * lane + 2 * (nb % 2) + kc / 2;
        (word, (4 * (2 * (kc % 2) + hb) + 16 * e) as u32)
    } else {
        (4 * lane + nb, (2 * (2 * kc + hb) + 16 * e) as u32)
    }
}

/// Fragment order of per-(row, x) data `[n, X, P]` → `[n, X · P]` (`[R][X][lg][nb][P]`).
fn fragment_order(t: &Tensor, p: usize) -> Result<Tensor> {
    let (n, x) = (t.dim(0)?, t.dim(1)?);
    t.reshape((n / TILE_ROWS, 4, 8, x, p))?
        .permute((0, 3, 2, 1, 4))?
        .contiguous()?
        .reshape((n, x * p))
}

/// The inverse of [`fragment_order`] on the host: element (row, x, p) of `[n, X · P]` data.
fn fragment_index(row: usize, x: usize, p: usize, xs: usize, ps: usize) -> usize {
    let (b, rr) = (row / TILE_ROWS, row % TILE_ROWS);
    (((b * xs + x) * 8 + rr % 8) * 4 + rr / 8) * ps + p
}

fn pow2s(shifts: &[u32], dims: &[usize], dev: &Device) -> Result<Tensor> {
    let v: Vec<u32> = shifts.iter().map(|&s| 1u32 << s).collect();
    Tensor::from_vec(v, dims, dev)
}

/// Pack codes u8 `[n, k]` (each below `2^bits` of its tile) into the tile stream u32
/// `[n, 4 (G + h4)]`, `four` the 4-bit flags `[R · G]`. Tensor ops on the codes' device.
pub fn pack_codes(codes: &Tensor, four: &[bool]) -> Result<Tensor> {
    let (n, k) = codes.dims2()?;
    check_tileable(n, k, "pack_codes")?;
    if !k.is_multiple_of(TILE_COLS) {
        candle_core::bail!(
            "pack_codes: codes [{n}, {k}] not padded to whole tiles of {TILE_COLS} columns"
        )
    }
    let (r, g) = (n / TILE_ROWS, tile_cols(k));
    if four.len() != r * g {
        candle_core::bail!("pack_codes: {} tile flags for [{r}, {g}] tiles", four.len())
    }
    let dev = codes.device();
    let c = codes.to_dtype(DType::U32)?;
    // Both packings are built for every tile and each tile takes one; the 2-bit one of a
    // 4-bit tile is discarded, but must not overflow: codes mod 4 there.
    let four_t = Tensor::new(&[4u32], dev)?.reshape((1, 1))?;
    let c_lo = (&c - c.broadcast_div(&four_t)?.affine(4.0, 0.0)?)?;
    // 2-bit: [R, nb 4, lg 8, G, kc 4, hb 2, t 4, e 2] -> [R, G, lg, t, nb, (kc, hb, e)].
    let c2 = c_lo
        .reshape(vec![r, 4, 8, g, 4, 2, 4, 2])?
        .permute(vec![0, 3, 2, 6, 1, 4, 5, 7])?
        .reshape((r, g, 128, 16))?;
    let sh2: Vec<u32> = (0..16)
        .map(|i| {
            let (kc, hb, e) = (i / 4, (i / 2) % 2, i % 2);
            (2 * (2 * kc + hb) + 16 * e) as u32
        })
        .collect();
    let w2 = c2
        .broadcast_mul(&pow2s(&sh2, &[1, 1, 1, 16], dev)?)?
        .sum(3)?; // [R, G, 128]
                  // 4-bit: [R, nbh 2, nbl 2, lg 8, G, hh 2, kk 2, hb 2, t 4, e 2]
                  //     -> [R, G, nbh, lg, t, nbl, hh, (kk, hb, e)].
    let c4 = c
        .reshape(vec![r, 2, 2, 8, g, 2, 2, 2, 4, 2])?
        .permute(vec![0, 4, 1, 3, 8, 2, 5, 6, 7, 9])?
        .reshape((r, g, 256, 8))?;
    let sh4: Vec<u32> = (0..8)
        .map(|i| {
            let (kk, hb, e) = (i / 4, (i / 2) % 2, i % 2);
            (4 * (2 * kk + hb) + 16 * e) as u32
        })
        .collect();
    let w4 = c4
        .broadcast_mul(&pow2s(&sh4, &[1, 1, 1, 8], dev)?)?
        .sum(3)?; // [R, G, 256]
    let h4 = four.iter().filter(|&&f| f).count() / r.max(1);
    let all = Tensor::cat(&[w2.flatten_all()?, w4.flatten_all()?], 0)?;
    let base4 = r * g * 128;
    let mut idx: Vec<u32> = Vec::with_capacity(r * 128 * (g + h4));
    for b in 0..r {
        for j in 0..g {
            let t = b * g + j;
            if four[t] {
                idx.extend((0..256).map(|i| (base4 + t * 256 + i) as u32));
            } else {
                idx.extend((0..128).map(|i| (t * 128 + i) as u32));
            }
        }
    }
    if idx.len() != r * 128 * (g + h4) {
        candle_core::bail!("pack_codes: blocks hold different numbers of 4-bit tiles")
    }
    let n_idx = idx.len();
    all.index_select(&Tensor::from_vec(idx, n_idx, dev)?, 0)?
        .reshape((n, 4 * (g + h4)))
}

impl Tiles {
    /// Assemble and check; `four` the 4-bit flags `[R · G]`.
    pub fn new(
        (n, k): (usize, usize),
        codes: Tensor,
        four: &[bool],
        scales: TileScales,
        outliers: Option<Outliers>,
    ) -> Result<Self> {
        check_tileable(n, k, "tiles")?;
        let (r, g) = (n / TILE_ROWS, tile_cols(k));
        if four.len() != r * g {
            candle_core::bail!("tiles: {} tile flags for [{r}, {g}] tiles", four.len())
        }
        let h4 = four[..g].iter().filter(|&&f| f).count();
        for b in 0..r {
            let hb = four[b * g..(b + 1) * g].iter().filter(|&&f| f).count();
            if hb != h4 {
                candle_core::bail!(
                    "tiles: row block {b} has {hb} 4-bit tiles, block 0 has {h4} (every block has the same number)"
                )
            }
        }
        let dev = codes.device().clone();
        super::expect(&codes, "codes", &[n, 4 * (g + h4)], DType::U32)?;
        match &scales {
            TileScales::TwoLevel { codes: sc, supers } => {
                super::expect(sc, "scales", &[n, 2 * g], DType::U8)?;
                super::expect(supers, "supers", &[n, self::supers(k)], DType::F16)?;
            }
            TileScales::Plain { group, sz } => {
                if *group < TILE_COLS
                    || !group.is_multiple_of(TILE_COLS)
                    || !(group / TILE_COLS).is_power_of_two()
                {
                    candle_core::bail!(
                        "tiles: scale group {group} is not {TILE_COLS} times a power of two"
                    )
                }
                super::expect(sz, "scales", &[n, 2 * k.div_ceil(*group)], DType::F16)?;
            }
        }
        if let Some(o) = &outliers {
            if !o.per_block.is_multiple_of(32) {
                candle_core::bail!(
                    "tiles: {} outliers per block, not a multiple of 32",
                    o.per_block
                )
            }
            super::expect(&o.entries, "entries", &[n, o.per_block / 32], DType::U32)?;
            super::expect(&o.row_end, "row_end", &[n, 1], DType::U32)?;
        }
        let mut mask = vec![0u8; n * g.div_ceil(8)];
        for row in 0..n {
            for j in 0..g {
                if four[(row / TILE_ROWS) * g + j] {
                    mask[row * g.div_ceil(8) + j / 8] |= 1 << (j % 8);
                }
            }
        }
        let mask = Tensor::from_vec(mask, (n, g.div_ceil(8)), &dev)?;
        let desc = Tensor::from_vec(descriptors(four, r, g), (r, g), &dev)?;
        Ok(Self {
            n,
            k,
            h4,
            codes,
            mask,
            desc,
            scales,
            outliers,
            perm: None,
        })
    }

    /// These tiles with their columns in `perm`'s order of the input channels.
    pub fn with_perm(mut self, perm: Option<Perm>) -> Result<Self> {
        if let Some(p) = &perm {
            if p.idx.dims() != [self.k] {
                candle_core::bail!(
                    "tiles: a column order of {:?} channels for a [{}, {}] weight",
                    p.idx.dims(),
                    self.n,
                    self.k
                )
            }
        }
        self.perm = perm;
        Ok(self)
    }

    /// Whether the tensors that the GEMV copies in bulk (codes, scales, super scales) start
    /// on 16 bytes in their buffers (their allocations do).
    pub fn bulk_aligned(&self) -> bool {
        let at16 = |t: &Tensor| {
            (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
                && t.is_contiguous()
        };
        at16(&self.codes)
            && match &self.scales {
                TileScales::TwoLevel { codes, supers } => at16(codes) && at16(supers),
                TileScales::Plain { sz, .. } => at16(sz),
            }
    }

    /// The 4-bit flags `[R · G]` of a stored `mask` u8 `[n, ⌈G / 8⌉]`, checked to agree
    /// within each block.
    pub fn flags_of_mask(mask: &Tensor, n: usize, k: usize) -> Result<Vec<bool>> {
        check_tileable(n, k, "mask")?;
        let g = tile_cols(k);
        super::expect(mask, "mask", &[n, g.div_ceil(8)], DType::U8)?;
        let m = mask
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<u8>()?;
        let w = g.div_ceil(8);
        let mut four = vec![false; (n / TILE_ROWS) * g];
        for row in 0..n {
            let b = row / TILE_ROWS;
            for j in 0..g {
                let f = m[row * w + j / 8] >> (j % 8) & 1 == 1;
                if row % TILE_ROWS == 0 {
                    four[b * g + j] = f;
                } else if four[b * g + j] != f {
                    candle_core::bail!(
                        "mask: rows {} and {row} of one 32-row block disagree on tile {j}",
                        b * TILE_ROWS
                    )
                }
            }
        }
        Ok(four)
    }

    pub fn device(&self) -> Device {
        self.codes.device().clone()
    }

    /// Bytes a matmul reads: codes, scales, tile descriptors, outliers.
    pub fn bytes(&self) -> usize {
        let (n, k) = (self.n, self.k);
        let g = tile_cols(k);
        let mut b = n * 16 * (g + self.h4) + (n / TILE_ROWS) * g * 4;
        b += match &self.scales {
            TileScales::TwoLevel { .. } => n * (2 * g + 2 * supers(k)),
            TileScales::Plain { group, .. } => n * 4 * k.div_ceil(*group),
        };
        if let Some(o) = &self.outliers {
            b += n * 4 + (n / TILE_ROWS) * o.per_block * 4;
        }
        if self.perm.is_some() {
            b += 2 * k;
        }
        b
    }

    /// The 4-bit flags `[R · G]`.
    pub fn flags(&self) -> Result<Vec<bool>> {
        let d = self
            .desc
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<u32>()?;
        Ok(d.iter().map(|v| v >> 31 == 1).collect())
    }

    /// CPU reference: codes u8 `[n, k]`.
    pub fn unpack_ref(&self) -> Result<Vec<u8>> {
        let (n, k) = (self.n, self.k);
        let g = tile_cols(k);
        let words = self
            .codes
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<u32>()?;
        let desc = self
            .desc
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<u32>()?;
        let stream = 128 * (g + self.h4);
        let mut out = vec![0u8; n * k];
        for row in 0..n {
            let b = row / TILE_ROWS;
            for col in 0..k {
                let d = desc[b * g + col / TILE_COLS];
                let four = d >> 31 == 1;
                let base = b * stream + (d & 0x7fff_ffff) as usize;
                let (w, s) = code_position(row % TILE_ROWS, col % TILE_COLS, four);
                let mask = if four { 15 } else { 3 };
                out[row * k + col] = ((words[base + w] >> s) & mask) as u8;
            }
        }
        Ok(out)
    }

    /// CPU reference: `(scale, zero)` f16 of every (row, tile column).
    pub fn group_params_ref(&self) -> Result<Vec<(f16, f16)>> {
        let (n, k) = (self.n, self.k);
        let g = tile_cols(k);
        let four = self.flags()?;
        let mut out = Vec::with_capacity(n * g);
        match &self.scales {
            TileScales::TwoLevel { codes, supers: sup } => {
                let sc = codes
                    .flatten_all()?
                    .to_device(&Device::Cpu)?
                    .to_vec1::<u8>()?;
                let ds = sup
                    .flatten_all()?
                    .to_device(&Device::Cpu)?
                    .to_vec1::<f16>()?;
                let s = supers(k);
                for row in 0..n {
                    for j in 0..g {
                        let c = sc[fragment_index(row, j, 0, g, 2)];
                        let z = sc[fragment_index(row, j, 1, g, 2)] as i8;
                        let d = ds[fragment_index(row, j / SUPER, 0, s, 1)];
                        out.push(two_level(c, z, d, four[(row / TILE_ROWS) * g + j]));
                    }
                }
            }
            TileScales::Plain { group, sz } => {
                let v = sz
                    .flatten_all()?
                    .to_device(&Device::Cpu)?
                    .to_vec1::<f16>()?;
                let sg = k.div_ceil(*group);
                for row in 0..n {
                    for j in 0..g {
                        let x = j * TILE_COLS / group;
                        out.push((
                            v[fragment_index(row, x, 0, sg, 2)],
                            v[fragment_index(row, x, 1, sg, 2)],
                        ));
                    }
                }
            }
        }
        Ok(out)
    }

    /// CPU reference: the outliers `(row, col, δ)`.
    pub fn outliers_ref(&self) -> Result<Vec<(usize, usize, f16)>> {
        let Some(o) = &self.outliers else {
            return Ok(vec![]);
        };
        let e = o
            .entries
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<u32>()?;
        let ends = o
            .row_end
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<u32>()?;
        let mut out = vec![];
        for row in 0..self.n {
            let b = row / TILE_ROWS;
            let start = if row % TILE_ROWS == 0 {
                0
            } else {
                ends[row - 1] as usize
            };
            let end = ends[row] as usize;
            if end < start || end > o.per_block {
                candle_core::bail!(
                    "outliers: row {row} spans entries {start}..{end} of {}",
                    o.per_block
                )
            }
            for &v in &e[b * o.per_block + start..b * o.per_block + end] {
                let col = (v & 0xffff) as usize;
                if col >= self.k {
                    candle_core::bail!("outliers: row {row} has column {col} past {}", self.k)
                }
                out.push((row, col, f16::from_bits((v >> 16) as u16)));
            }
        }
        Ok(out)
    }

    /// CPU reference: the weight `[n, k]` in f32 as the kernels use it: `f16(q · s + z)`,
    /// plus `δ` where an outlier sits; columns in the kernels' order (`perm`'s, where set).
    pub fn dequantize_ref(&self) -> Result<Vec<f32>> {
        let (n, k) = (self.n, self.k);
        let g = tile_cols(k);
        let codes = self.unpack_ref()?;
        let p = self.group_params_ref()?;
        let mut w: Vec<f32> = (0..n * k)
            .map(|i| {
                let (s, z) = p[(i / k) * g + (i % k) / TILE_COLS];
                dequant_code(codes[i], s, z).to_f32()
            })
            .collect();
        for (row, col, d) in self.outliers_ref()? {
            w[row * k + col] += d.to_f32();
        }
        Ok(w)
    }

    /// The weight `[n, k]` in `dtype` (f32 or f16) with its columns in the input's order:
    /// the kernel on the GPU, the reference on the CPU (f16: the f32 values rounded once).
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let w = crate::ops::tiles_dequantize(self, dtype)?;
        match &self.perm {
            Some(p) => w.index_select(&p.inv, 1),
            None => Ok(w),
        }
    }

    /// For tiles of one precision with plain scales (a uniform format's): its codes u8
    /// `[n, k]` and f16 scales and zeros `[n, ⌈k / group⌉]`, in tensor ops on the tiles'
    /// device (the inverse of [`pack_codes`] and [`plain_scales`]).
    pub fn uniform_parts(&self) -> Result<(Tensor, Tensor, Tensor)> {
        let (n, k) = (self.n, self.k);
        let (r, g) = (n / TILE_ROWS, tile_cols(k));
        let TileScales::Plain { sz, .. } = &self.scales else {
            candle_core::bail!("tiles: two-level scales are not a uniform format's")
        };
        if self.h4 != 0 && self.h4 != g {
            candle_core::bail!("tiles: mixed precisions are not a uniform format's")
        }
        let four = self.h4 == g;
        let dev = self.codes.device();
        let (per, bits, words) = if four { (8, 4, 256) } else { (16, 2, 128) };
        let shifts: Vec<u32> = (0..per)
            .map(|i| {
                if four {
                    let (kk, hb, e) = (i / 4, (i / 2) % 2, i % 2);
                    (4 * (2 * kk + hb) + 16 * e) as u32
                } else {
                    let (kc, hb, e) = (i / 4, (i / 2) % 2, i % 2);
                    (2 * (2 * kc + hb) + 16 * e) as u32
                }
            })
            .collect();
        let w = self.codes.reshape((r, g, words, 1))?;
        let q = w.broadcast_div(&pow2s(&shifts, &[1, 1, 1, per], dev)?)?;
        let base = Tensor::new(&[1u32 << bits], dev)?.reshape((1, 1, 1, 1))?;
        let c = (&q
            - q.broadcast_div(&base)?
                .affine(f64::from(1u32 << bits), 0.0)?)?;
        let c = if four {
            // [R, G, nbh, lg, t, nbl, hh, kk, hb, e] -> [R, nbh, nbl, lg, G, hh, kk, hb, t, e]
            c.reshape(vec![r, g, 2, 8, 4, 2, 2, 2, 2, 2])?
                .permute(vec![0, 2, 5, 3, 1, 6, 7, 8, 4, 9])?
        } else {
            // [R, G, lg, t, nb, kc, hb, e] -> [R, nb, lg, G, kc, hb, t, e]
            c.reshape(vec![r, g, 8, 4, 4, 4, 2, 2])?
                .permute(vec![0, 4, 2, 1, 5, 6, 3, 7])?
        };
        let codes = c
            .contiguous()?
            .reshape((n, g * TILE_COLS))?
            .narrow(1, 0, k)?
            .to_dtype(DType::U8)?;
        let sg = sz.dim(1)? / 2;
        let p = sz
            .reshape((r, sg, 8, 4, 2))?
            .permute((0, 3, 2, 1, 4))?
            .contiguous()?
            .reshape((n, sg, 2))?;
        let scales = p.narrow(2, 0, 1)?.squeeze(2)?.contiguous()?;
        let zeros = p.narrow(2, 1, 1)?.squeeze(2)?.contiguous()?;
        Ok((codes, scales, zeros))
    }

    /// The stored tensors (module docs), by field name.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![
            ("codes".to_string(), self.codes.clone()),
            ("mask".to_string(), self.mask.clone()),
        ];
        if let TileScales::TwoLevel { codes, supers } = &self.scales {
            v.push(("scales".to_string(), codes.clone()));
            v.push(("supers".to_string(), supers.clone()));
        }
        if let Some(o) = &self.outliers {
            v.push(("entries".to_string(), o.entries.clone()));
            v.push(("row_end".to_string(), o.row_end.clone()));
        }
        if let Some(p) = &self.perm {
            v.push(("input.order".to_string(), p.words.clone()));
        }
        v
    }
}

/// Plain (uniform-format) scales in tile order from f16 `scales`, `zeros` `[n, ⌈k / group⌉]`.
pub fn plain_scales(scales: &Tensor, zeros: &Tensor, group: usize) -> Result<TileScales> {
    let sz = Tensor::stack(&[scales, zeros], 2)?;
    Ok(TileScales::Plain {
        group,
        sz: fragment_order(&sz, 2)?,
    })
}

// ---------------------------------------------------------------------------------------
// The budget.

/// `w2416` settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct W2416Config {
    /// Target bits per weight, every byte counted.
    pub bits: f64,
    /// Outlier fraction of all weights (0 = none).
    pub outliers: f64,
    /// Reorder the input channels (the columns) by their salience before the tiles are
    /// cut, so that the 4-bit tiles take the channels that need them (module docs).
    pub reorder: bool,
}

impl Default for W2416Config {
    fn default() -> Self {
        Self {
            bits: DEFAULT_BITS,
            outliers: DEFAULT_OUTLIERS,
            reorder: true,
        }
    }
}

impl W2416Config {
    /// Outliers per 32-row block of a `[n, k]` weight.
    pub fn per_block(&self, k: usize) -> usize {
        let e = self.outliers.max(0.0) * (TILE_ROWS * k) as f64;
        ((e / 32.0).round() as usize) * 32
    }

    /// 4-bit tiles per block of a `[n, k]` weight: the most whose bytes fit the budget.
    pub fn h4(&self, n: usize, k: usize) -> usize {
        let (g, e) = (tile_cols(k), self.per_block(k));
        // Bytes per 32-row block besides the 4-bit codes' extra 2 bits (the column order's
        // 2 bytes per column shared by the layer's n / 32 blocks).
        let row_end = if e > 0 { 4 } else { 0 };
        let fixed = TILE_ROWS * (16 * g + 2 * g + 2 * supers(k) + row_end) + 4 * g + 4 * e;
        let order = if self.reorder {
            (2 * k * TILE_ROWS) as f64 / n.max(1) as f64
        } else {
            0.0
        };
        let budget = self.bits * (TILE_ROWS * k) as f64 / 8.0;
        let spare = budget - fixed as f64 - order;
        if spare <= 0.0 {
            0
        } else {
            ((spare / (TILE_ROWS * 16) as f64).floor() as usize).min(g)
        }
    }
}

// ---------------------------------------------------------------------------------------
// The quantizer.

/// Best range per (row, group) of `wg` `[n, G, 64]` at `maxq`, searched over range factors
/// for the least `d`-weighted squared error, positions where `excl` is 1 left out. Returns
/// `(scale, zero, err)`, each `[n, G]` f32.
fn fit(
    wg: &Tensor,
    d: &Tensor,
    excl: Option<&Tensor>,
    maxq: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let keep = match excl {
        Some(e) => e.affine(-1.0, 1.0)?,
        None => wg.ones_like()?,
    };
    let big = 1e30f64;
    let (mn, mx) = match excl {
        Some(e) => {
            let hi = (e.affine(big, 0.0)? + wg)?;
            let lo = (wg - e.affine(big, 0.0)?)?;
            (hi.min(2)?, lo.max(2)?)
        }
        None => (wg.min(2)?, wg.max(2)?),
    };
    // A group left empty: range [0, 0].
    let empty = mn.gt(&mx)?;
    let mn = empty.where_cond(&mn.zeros_like()?, &mn)?;
    let mx = empty.where_cond(&mx.zeros_like()?, &mx)?;
    let wd = keep.broadcast_mul(d)?;
    let mut best: Option<(Tensor, Tensor, Tensor)> = None;
    for i in 0..CLIP_STEPS {
        let f = 1.0 - i as f64 / 100.0;
        let (lo, hi) = (mn.affine(f, 0.0)?, mx.affine(f, 0.0)?);
        let s = (&hi - &lo)?.affine(1.0 / maxq as f64, 0.0)?;
        let s = s.gt(1e-12)?.where_cond(&s, &s.ones_like()?)?;
        let q = wg
            .broadcast_sub(&lo.unsqueeze(2)?)?
            .broadcast_div(&s.unsqueeze(2)?)?
            .round()?
            .clamp(0f32, maxq)?;
        let v = q
            .broadcast_mul(&s.unsqueeze(2)?)?
            .broadcast_add(&lo.unsqueeze(2)?)?;
        let err = ((v - wg)?.sqr()? * &wd)?.sum(2)?;
        best = Some(match best {
            None => (s, lo, err),
            Some((bs, bz, be)) => {
                let better = err.lt(&be)?;
                (
                    better.where_cond(&s, &bs)?,
                    better.where_cond(&lo, &bz)?,
                    better.where_cond(&err, &be)?,
                )
            }
        });
    }
    match best {
        Some(b) => Ok(b),
        None => candle_core::bail!("fit: no range factors"),
    }
}

/// Indices of the `e` largest of `v` (ties by index), sorted ascending.
fn top(v: &[f32], e: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    let e = e.min(v.len());
    if e == 0 {
        return vec![];
    }
    idx.select_nth_unstable_by(e - 1, |&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    let mut t = idx[..e].to_vec();
    t.sort_unstable();
    t
}

/// What the quantizer decided before the codes: per (row, group) f16 `(scale, zero)` and
/// `maxq`, the tiles' flags, the two-level codes, and the outlier positions.
struct Decided {
    four: Vec<bool>,
    /// f32 `[n, G, 3]`: scale, zero (both f16 values), maxq.
    params: Tensor,
    sc: Tensor,
    supers: Tensor,
    /// Outlier positions per block, `(row, col)` sorted.
    outliers: Vec<Vec<(usize, usize)>>,
    per_block: usize,
}

/// `w` `[n, k]` padded to whole tiles; `kl` its real width (budget, outlier columns).
fn decide(w: &Tensor, diag: &Tensor, cfg: &W2416Config, kl: usize) -> Result<Decided> {
    let (n, k) = w.dims2()?;
    check_tileable(n, k, "w2416")?;
    let (r, g) = (n / TILE_ROWS, tile_cols(k));
    let dev = w.device().clone();
    let wf = w.to_dtype(DType::F32)?.contiguous()?;
    let wg = wf.reshape((n, g, TILE_COLS))?;
    let d = diag.to_dtype(DType::F32)?.reshape((1, g, TILE_COLS))?;
    let (s4, z4, e4) = fit(&wg, &d, None, 15.0)?;
    let (s2, z2, e2) = fit(&wg, &d, None, 3.0)?;
    // 4-bit tiles: the largest drop in error per block.
    let h4 = cfg.h4(n, kl);
    let gain = (&e2 - &e4)?
        .reshape((r, TILE_ROWS, g))?
        .sum(1)?
        .flatten_all()?
        .to_device(&Device::Cpu)?
        .to_vec1::<f32>()?;
    let mut four = vec![false; r * g];
    for b in 0..r {
        for j in top(&gain[b * g..(b + 1) * g], h4) {
            four[b * g + j] = true;
        }
    }
    let four_t = Tensor::from_vec(
        four.iter().map(|&f| u8::from(f)).collect::<Vec<_>>(),
        (r, 1, g),
        &dev,
    )?
    .broadcast_as((r, TILE_ROWS, g))?
    .reshape((n, g))?;
    // Outliers: in 2-bit tiles, the largest H-weighted errors of the 2-bit fit, per block.
    let per_block = cfg.per_block(kl).min((g - h4) * TILE_COLS * TILE_ROWS);
    let mut outliers = vec![vec![]; r];
    let mut excl_host = vec![0f32; n * k];
    if per_block > 0 {
        let q = wg
            .broadcast_sub(&z2.unsqueeze(2)?)?
            .broadcast_div(&s2.unsqueeze(2)?)?
            .round()?
            .clamp(0f32, 3f32)?;
        let v = q
            .broadcast_mul(&s2.unsqueeze(2)?)?
            .broadcast_add(&z2.unsqueeze(2)?)?;
        let two = four_t
            .affine(-1.0, 1.0)?
            .to_dtype(DType::F32)?
            .unsqueeze(2)?;
        let err = ((v - &wg)?.sqr()?.broadcast_mul(&d)?.broadcast_mul(&two)?)
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?;
        for (b, out) in outliers.iter_mut().enumerate() {
            let blk = &err[b * TILE_ROWS * k..(b + 1) * TILE_ROWS * k];
            for i in top(blk, per_block) {
                let (row, col) = (b * TILE_ROWS + i / k, i % k);
                if col >= kl {
                    continue;
                }
                out.push((row, col));
                excl_host[row * k + col] = 1.0;
            }
        }
    }
    let (s2, z2) = if per_block > 0 {
        let excl = Tensor::from_vec(excl_host, (n, g, TILE_COLS), &dev)?;
        let (s, z, _) = fit(&wg, &d, Some(&excl), 3.0)?;
        (s, z)
    } else {
        (s2, z2)
    };
    let is4 = four_t.to_dtype(DType::U8)?;
    let scale = is4.where_cond(&s4, &s2)?;
    let zero = is4.where_cond(&z4, &z2)?;
    let maxq = is4.where_cond(
        &Tensor::full(15f32, (n, g), &dev)?,
        &Tensor::full(3f32, (n, g), &dev)?,
    )?;
    let inv = is4.where_cond(
        &Tensor::full(inv_maxq(true), (n, g), &dev)?,
        &Tensor::full(inv_maxq(false), (n, g), &dev)?,
    )?;
    // Two levels: the range's code under the super-group's f16 scale, the zero in eighths
    // of the step.
    let range = (&scale * &maxq)?;
    let s = supers(k);
    let padded = if s * SUPER > g {
        Tensor::cat(
            &[
                &range,
                &Tensor::zeros((n, s * SUPER - g), DType::F32, &dev)?,
            ],
            1,
        )?
    } else {
        range.clone()
    };
    let ds = padded
        .reshape((n, s, SUPER))?
        .max(2)?
        .affine(1.0 / 255.0, 0.0)?
        .to_dtype(DType::F16)?
        .to_dtype(DType::F32)?;
    let ds = ds.gt(0f64)?.where_cond(&ds, &ds.ones_like()?)?;
    let ds_g = ds
        .unsqueeze(2)?
        .broadcast_as((n, s, SUPER))?
        .reshape((n, s * SUPER))?
        .narrow(1, 0, g)?;
    let sc = (&range / &ds_g)?.round()?.clamp(1f32, 255f32)?;
    let s_h = ((&sc * &ds_g)? * &inv)?
        .to_dtype(DType::F16)?
        .to_dtype(DType::F32)?;
    let zc = (&zero / &s_h)?
        .affine(ZERO_DIV as f64, 0.0)?
        .round()?
        .clamp(-128f32, 127f32)?;
    let z_h = (&zc * &s_h)?
        .affine(1.0 / ZERO_DIV as f64, 0.0)?
        .to_dtype(DType::F16)?
        .to_dtype(DType::F32)?;
    let params = Tensor::stack(&[&s_h, &z_h, &maxq], 2)?;
    // Codes as u8 (zc two's complement).
    let zc_u8 = zc
        .lt(0f64)?
        .where_cond(&zc.affine(1.0, 256.0)?, &zc)?
        .to_dtype(DType::U8)?;
    let sc_t = Tensor::stack(&[sc.to_dtype(DType::U8)?, zc_u8.to_dtype(DType::U8)?], 2)?;
    let sc_t = fragment_order(&sc_t, 2)?;
    let supers = fragment_order(&ds.to_dtype(DType::F16)?.unsqueeze(2)?, 1)?;
    Ok(Decided {
        four,
        params,
        sc: sc_t,
        supers,
        outliers,
        per_block,
    })
}

/// The group rule GPTQ and round to nearest run under once [`decide`] has fixed every
/// group's parameters: codes by rounding, outliers kept as they stand.
struct FixedRule {
    g: usize,
    k: usize,
    /// f32 `[n, G, 3]` on the host.
    params: Vec<f32>,
    /// `[G]` tensors `[3, n]`.
    params_t: Vec<Tensor>,
    /// Host outlier flags `[n, k]`.
    outlier: Vec<bool>,
    /// u8 `[k, n]`.
    outlier_t: Tensor,
}

impl FixedRule {
    fn new(dec: &Decided, n: usize, k: usize, dev: &Device) -> Result<Self> {
        let g = tile_cols(k);
        let params = dec
            .params
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?;
        let pt = dec.params.permute((1, 2, 0))?.contiguous()?; // [G, 3, n]
        let params_t = (0..g)
            .map(|j| pt.get(j)?.contiguous())
            .collect::<Result<Vec<_>>>()?;
        let mut outlier = vec![false; n * k];
        let mut ot = vec![0u8; n * k];
        for &(row, col) in dec.outliers.iter().flatten() {
            outlier[row * k + col] = true;
            ot[col * n + row] = 1;
        }
        Ok(Self {
            g,
            k,
            params,
            params_t,
            outlier,
            outlier_t: Tensor::from_vec(ot, (k, n), dev)?,
        })
    }
}

impl GroupRule for FixedRule {
    fn group_size(&self) -> usize {
        TILE_COLS
    }

    fn params(&self) -> usize {
        3
    }

    fn fit(&self, row: usize, group: usize, _w: &[f32], p: &mut [f32]) {
        p.copy_from_slice(&self.params[(row * self.g + group) * 3..][..3]);
    }

    fn quantize(&self, row: usize, col: usize, p: &[f32], x: f32) -> (u8, f32) {
        let q = ((x - p[1]) / p[0]).round().clamp(0.0, p[2]);
        if self.outlier[row * self.k + col] {
            return (q as u8, x);
        }
        let v = dequant_code(q as u8, f16::from_f32(p[0]), f16::from_f32(p[1]));
        (q as u8, v.to_f32())
    }

    fn fit_t(&self, group: usize, _wt: &Tensor) -> Result<Tensor> {
        Ok(self.params_t[group].clone())
    }

    fn order_weight(&self, col: usize) -> f64 {
        let gi = col / TILE_COLS;
        let n = self.params.len() / (3 * self.g);
        let sum: f64 = (0..n)
            .map(|r| (self.params[(r * self.g + gi) * 3] as f64).powi(2))
            .sum();
        sum / n.max(1) as f64
    }

    fn quantize_t(&self, col: usize, wt: &Tensor, p: &Tensor) -> Result<(Tensor, Tensor)> {
        let (s, z, mq) = (p.narrow(0, 0, 1)?, p.narrow(0, 1, 1)?, p.narrow(0, 2, 1)?);
        let q = wt
            .broadcast_sub(&z)?
            .broadcast_div(&s)?
            .round()?
            .relu()?
            .broadcast_minimum(&mq)?;
        let v = q
            .broadcast_mul(&s)?
            .broadcast_add(&z)?
            .to_dtype(DType::F16)?
            .to_dtype(DType::F32)?;
        let m = self.outlier_t.narrow(0, col, wt.dim(0)?)?;
        let v = m.where_cond(wt, &v)?;
        Ok((q.to_dtype(DType::U8)?, v))
    }
}

/// Quantize `w` `[n, k]` to `w2416` on its device. `hessian` `[k, k]`: its diagonal ranks
/// tiles and outliers (every input counts the same without it); with `gptq`, GPTQ sets the
/// codes under it.
pub fn quantize(
    w: &Tensor,
    hessian: Option<&Tensor>,
    cfg: &W2416Config,
    gptq: Option<&GptqConfig>,
) -> Result<Tiles> {
    let (n, k) = w.dims2()?;
    check_tileable(n, k, "w2416")?;
    if !(0.0..0.1).contains(&cfg.outliers) || !(2.0..=4.6).contains(&cfg.bits) {
        candle_core::bail!(
            "w2416: --bits {} (2.0..=4.6) / --outliers {} (0..0.1) out of range",
            cfg.bits,
            cfg.outliers
        )
    }
    let dev = w.device().clone();
    let diag = hessian_diag(hessian, k, &dev)?;
    // Reordered: the columns by decreasing salience, the Hessian's rows and columns with them.
    // An order that is already the identity (the columns were put in it before, e.g. a down
    // projection whose order was folded into the gate/up rows) is not stored.
    let order = match cfg.reorder {
        true => Some(column_order(w, &diag)?),
        false => None,
    };
    let perm = match order {
        Some(o) if o.iter().enumerate().any(|(i, &c)| c as usize != i) => {
            Some(Perm::new(&o, &dev)?)
        }
        _ => None,
    };
    let cfg = &W2416Config {
        reorder: perm.is_some(),
        ..*cfg
    };
    let (w, hessian, diag) = match &perm {
        Some(p) => {
            let h = match hessian {
                Some(h) => Some(h.index_select(&p.idx, 0)?.index_select(&p.idx, 1)?),
                None => None,
            };
            (w.index_select(&p.idx, 1)?, h, diag.index_select(&p.idx, 0)?)
        }
        None => (w.clone(), hessian.cloned(), diag),
    };
    // Quantized as [n, kp] with zero columns past k (the last tile's).
    let (w, hessian) = pad_cols(&w, hessian.as_ref())?;
    let hessian = hessian.as_ref();
    let kl = k;
    let k = w.dim(1)?;
    let diag = if k > kl {
        Tensor::cat(&[&diag, &Tensor::ones(k - kl, DType::F32, &dev)?], 0)?
    } else {
        diag
    };
    let dec = decide(&w, &diag, cfg, kl)?;
    let rule = FixedRule::new(&dec, n, k, &dev)?;
    let q = match (gptq, hessian) {
        (Some(c), Some(h)) => crate::gptq::gptq(&w, h, &rule, c)?.quantized,
        (Some(_), None) => candle_core::bail!(
            "w2416-gptq needs calibration statistics (the layer input's Hessian) for a [{n}, {k}] weight; \
             quantize the model through candle_lowbit::calib (the tools: --calib FILE)"
        ),
        (None, _) => crate::gptq::round_to_nearest(&w, &rule)?,
    };
    // Outliers: δ = f16(value − f16(q · s + z)).
    let outliers = if dec.per_block > 0 {
        let codes = q
            .codes
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<u8>()?;
        let vals = q
            .values
            .flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?;
        let g = tile_cols(k);
        let e = dec.per_block;
        let r = n / TILE_ROWS;
        let mut entries = vec![0u32; r * e];
        let mut row_end = vec![0u32; n];
        for (b, list) in dec.outliers.iter().enumerate() {
            let mut count = [0u32; TILE_ROWS];
            for (i, &(row, col)) in list.iter().enumerate() {
                let j = (row * g + col / TILE_COLS) * 3;
                let (s, z) = (
                    f16::from_f32(rule.params[j]),
                    f16::from_f32(rule.params[j + 1]),
                );
                let base = dequant_code(codes[row * k + col], s, z).to_f32();
                let delta = f16::from_f32(vals[row * k + col] - base);
                entries[b * e + i] = col as u32 | (u32::from(delta.to_bits()) << 16);
                count[row % TILE_ROWS] += 1;
            }
            // Unused entries (a block with fewer candidates) belong to its last row, δ = 0.
            let mut acc = 0;
            for (rr, c) in count.iter().enumerate() {
                acc += c;
                row_end[b * TILE_ROWS + rr] = if rr == TILE_ROWS - 1 { e as u32 } else { acc };
            }
        }
        Some(Outliers {
            per_block: e,
            entries: Tensor::from_vec(entries, (n, e / 32), &dev)?,
            row_end: Tensor::from_vec(row_end, (n, 1), &dev)?,
        })
    } else {
        None
    };
    let codes = pack_codes(&q.codes, &dec.four)?;
    Tiles::new(
        (n, kl),
        codes,
        &dec.four,
        TileScales::TwoLevel {
            codes: dec.sc,
            supers: dec.supers,
        },
        outliers,
    )?
    .with_perm(perm)
}

/// The Hessian's diagonal `[k]` (f32, clamped above zero), or ones without a Hessian.
fn hessian_diag(hessian: Option<&Tensor>, k: usize, dev: &Device) -> Result<Tensor> {
    let Some(h) = hessian else {
        return Tensor::ones(k, DType::F32, dev);
    };
    if h.dims() != [k, k] {
        candle_core::bail!("w2416: Hessian {:?} for a weight of {k} columns", h.shape())
    }
    let idx = Tensor::arange(0u32, k as u32, dev)?;
    let d = h
        .to_dtype(DType::F32)?
        .flatten_all()?
        .index_select(&idx.affine((k + 1) as f64, 0.0)?, 0)?;
    let mean = d.mean_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    d.clamp(mean.abs().max(1e-12) * 1e-6, f32::MAX)
}

/// The input-channel order [`quantize`] gives `w` `[n, k]` under `hessian` (`[k, k]`, or
/// none) with `cfg.reorder`, `None` without: column `j` of the tiles reads input channel
/// `order[j]`. A caller that moves the columns (and the Hessian) into this order first, and
/// the producer's output rows with them, gets weights that store no order.
pub fn input_order(
    w: &Tensor,
    hessian: Option<&Tensor>,
    cfg: &W2416Config,
) -> Result<Option<Vec<u32>>> {
    if !cfg.reorder {
        return Ok(None);
    }
    let k = w.dim(1)?;
    Ok(Some(column_order(
        w,
        &hessian_diag(hessian, k, w.device())?,
    )?))
}

/// The column order of a reordered `w` `[n, k]`: by decreasing `diag_j · max_i w_ij²` (how
/// much the channel widens the ranges of its groups, weighted by what rounding costs there),
/// ties by index.
fn column_order(w: &Tensor, diag: &Tensor) -> Result<Vec<u32>> {
    let key = (w.to_dtype(DType::F32)?.sqr()?.max(0)? * diag)?
        .to_device(&Device::Cpu)?
        .to_vec1::<f32>()?;
    let mut order: Vec<u32> = (0..key.len() as u32).collect();
    order.sort_by(|&a, &b| key[b as usize].total_cmp(&key[a as usize]).then(a.cmp(&b)));
    Ok(order)
}

/// Uniformly random u32 words of `shape` on `dev` (two 16-bit halves: f32 draws hold 24
/// bits), for packed codes of random weights.
pub fn random_words(shape: (usize, usize), dev: &Device) -> Result<Tensor> {
    let half = || Tensor::rand(0f32, 65535.99f32, shape, dev)?.to_dtype(DType::U32);
    (half()? * 65536.0)? + half()?
}

/// Random `w2416` weights of `[n, k]` drawn on `dev` (speed rows only): codes and scale
/// codes uniform, super scales around `1 / (255 √k)`, `cfg`'s 4-bit share (with
/// `cfg.reorder`, in each row block's leading columns as the quantizer puts them; else in
/// random tiles) and outliers (random positions in 2-bit tiles, small δ).
pub fn random(n: usize, k: usize, cfg: &W2416Config, seed: u64, dev: &Device) -> Result<Tiles> {
    use rand::{Rng, SeedableRng};
    check_tileable(n, k, "w2416 random")?;
    let (r, g) = (n / TILE_ROWS, tile_cols(k));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let h4 = cfg.h4(n, k);
    let mut four = vec![false; r * g];
    for b in 0..r {
        // Reordered, the salient channels come first and the 4-bit tiles with them: a row
        // block's 4-bit tiles are its leading columns, the boundary blurred over ~3 columns
        // (as the quantizer places them in real checkpoints: SmolLM2's layers, 2026-12-07);
        // else anywhere.
        let mut cols: Vec<(f64, usize)> = (0..g)
            .map(|j| {
                let u = rng.gen::<f64>();
                (if cfg.reorder { j as f64 + 3.0 * u } else { u }, j)
            })
            .collect();
        cols.sort_by(|a, b| a.0.total_cmp(&b.0));
        for &(_, j) in &cols[..h4] {
            four[b * g + j] = true;
        }
    }
    let words = random_words((n, 4 * (g + h4)), dev)?;
    let sc = Tensor::rand(0f32, 255.99f32, (n, 2 * g), dev)?.to_dtype(DType::U8)?;
    let ds = (Tensor::rand(0.5f32, 1.5f32, (n, supers(k)), dev)?
        * (1.0 / (255.0 * (k as f64).sqrt())))?
    .to_dtype(DType::F16)?;
    let e = cfg.per_block(k).min((g - h4) * TILE_COLS * TILE_ROWS);
    let outliers = if e > 0 {
        let mut entries = vec![0u32; r * e];
        let mut row_end = vec![0u32; n];
        for b in 0..r {
            let two: Vec<usize> = (0..g).filter(|&j| !four[b * g + j]).collect();
            let per_row = e / TILE_ROWS;
            for rr in 0..TILE_ROWS {
                // Distinct columns in the block's 2-bit tiles.
                let mut cols = std::collections::BTreeSet::new();
                let avail = two
                    .iter()
                    .map(|&j| TILE_COLS.min(k - j * TILE_COLS))
                    .sum::<usize>();
                while cols.len() < per_row.min(avail) {
                    let j = two[(rng.gen::<u32>() as usize) % two.len().max(1)];
                    let width = TILE_COLS.min(k - j * TILE_COLS);
                    cols.insert((j * TILE_COLS + rng.gen_range(0..width)) as u32);
                }
                for (i, c) in cols.into_iter().enumerate() {
                    let d = f16::from_f32(rng.gen_range(-0.05f32..0.05));
                    entries[b * e + rr * per_row + i] = c | (u32::from(d.to_bits()) << 16);
                }
                // Rows own per_row slots each (unused ones: δ = 0 at column 0).
                row_end[b * TILE_ROWS + rr] = ((rr + 1) * per_row) as u32;
            }
        }
        Some(Outliers {
            per_block: e,
            entries: Tensor::from_vec(entries, (n, e / 32), dev)?,
            row_end: Tensor::from_vec(row_end, (n, 1), dev)?,
        })
    } else {
        None
    };
    let perm = if cfg.reorder {
        use rand::seq::SliceRandom;
        let mut order: Vec<u32> = (0..k as u32).collect();
        order.shuffle(&mut rng);
        Some(Perm::new(&order, dev)?)
    } else {
        None
    };
    Tiles::new(
        (n, k),
        words,
        &four,
        TileScales::TwoLevel {
            codes: sc,
            supers: ds,
        },
        outliers,
    )?
    .with_perm(perm)
}

// ---------------------------------------------------------------------------------------
// Packed weights and codec.

/// A `[n, k]` weight in `w2416`.
#[derive(Debug, Clone)]
pub struct W2416Weights {
    format: WeightFormat,
    tiles: Tiles,
}

impl W2416Weights {
    pub fn new(format: WeightFormat, tiles: Tiles) -> Self {
        Self { format, tiles }
    }

    pub fn tiles(&self) -> &Tiles {
        &self.tiles
    }
}

impl LinearWeights for W2416Weights {
    fn format(&self) -> WeightFormat {
        self.format
    }

    fn shape(&self) -> (usize, usize) {
        (self.tiles.n, self.tiles.k)
    }

    fn bytes(&self) -> usize {
        self.tiles.bytes()
    }

    fn encoding(&self) -> String {
        let g = tile_cols(self.tiles.k);
        format!(
            "{} ({}/{} tiles 4-bit, {} outliers per 32 rows)",
            self.format,
            self.tiles.h4,
            g,
            self.tiles.outliers.as_ref().map_or(0, |o| o.per_block)
        )
    }

    fn device(&self) -> Device {
        self.tiles.device()
    }

    fn dequantize(&self) -> Result<Tensor> {
        self.tiles.dequantize(DType::F32)
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        crate::ops::tiles_forward(&self.tiles, x)
    }

    fn plan(&self) -> Plan {
        crate::ops::tiles_plan(&self.tiles, self.format)
    }

    fn forward_fused(&self, e: Epilogue, x: &Tensor) -> Option<Result<Tensor>> {
        crate::ops::tiles_fused(&self.tiles, e, x)
    }

    fn normed_ok(&self, m: usize, dtype: DType) -> bool {
        crate::ops::tiles_fuse_ok(&self.tiles, m, dtype)
    }

    fn forward_normed(
        &self,
        h: &Tensor,
        w: &Tensor,
        eps: f32,
        silu: bool,
    ) -> Option<Result<Tensor>> {
        crate::ops::tiles_normed(&self.tiles, h, w, eps, silu)
    }

    fn forward_add(&self, x: &Tensor, res: &Tensor) -> Option<Result<Tensor>> {
        crate::ops::tiles_add(&self.tiles, x, res)
    }

    fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.tiles.tensors())
    }
}

/// `w2416` by round to nearest or GPTQ.
pub struct W2416Codec {
    pub gptq: bool,
}

impl Codec for W2416Codec {
    fn quantize(
        &self,
        format: WeightFormat,
        w: &Tensor,
        hessian: Option<&Tensor>,
        opts: &QuantOptions,
    ) -> Result<Box<dyn LinearWeights>> {
        let gptq = self.gptq.then_some(&opts.gptq);
        let tiles = quantize(w, hessian, &opts.w2416, gptq)?;
        Ok(Box::new(W2416Weights::new(format, tiles)))
    }

    fn input_order(
        &self,
        w: &dyn LinearWeights,
        hessian: Option<&Tensor>,
        opts: &QuantOptions,
    ) -> Result<Option<Vec<u32>>> {
        match opts.w2416.reorder {
            true => input_order(&w.dequantize()?, hessian, &opts.w2416),
            false => Ok(None),
        }
    }

    fn rebuild(
        &self,
        format: WeightFormat,
        (n, k): (usize, usize),
        tensors: &HashMap<String, Tensor>,
    ) -> Result<Box<dyn LinearWeights>> {
        let get = |name: &str| super::field(tensors, name, format, (n, k)).cloned();
        let four = Tiles::flags_of_mask(&get("mask")?, n, k)?;
        let outliers = match (tensors.get("entries"), tensors.get("row_end")) {
            (Some(e), Some(r)) => Some(Outliers {
                per_block: e.dim(1)? * 32,
                entries: e.clone(),
                row_end: r.clone(),
            }),
            (None, None) => None,
            _ => candle_core::bail!(
                "{format}: a [{n}, {k}] layer has only one of 'entries' / 'row_end'"
            ),
        };
        let perm = match tensors.get("input.order") {
            Some(w) => Some(Perm::from_words(w, k)?),
            None => None,
        };
        let tiles = Tiles::new(
            (n, k),
            get("codes")?,
            &four,
            TileScales::TwoLevel {
                codes: get("scales")?,
                supers: get("supers")?,
            },
            outliers,
        )?
        .with_perm(perm)?;
        Ok(Box::new(W2416Weights::new(format, tiles)))
    }

    fn settings(&self, opts: &QuantOptions) -> serde_json::Value {
        serde_json::json!({
            "bits": opts.w2416.bits,
            "outliers": opts.w2416.outliers,
            "reorder": opts.w2416.reorder,
        })
    }

    fn random(
        &self,
        format: WeightFormat,
        (n, k): (usize, usize),
        opts: &QuantOptions,
        seed: u64,
        dev: &Device,
    ) -> Option<Result<Box<dyn LinearWeights>>> {
        Some(
            random(n, k, &opts.w2416, seed, dev)
                .map(|t| Box::new(W2416Weights::new(format, t)) as Box<dyn LinearWeights>),
        )
    }
}
