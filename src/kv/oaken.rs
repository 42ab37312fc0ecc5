//! `oaken`: Oaken's online-offline hybrid KV quantization (ISCA 2025): offline
//! thresholds per layer and per K / V from calibration quantiles, online classification
//! of every value by comparisons only into outer / middle / inner groups, group-shift, and
//! a fused dense-and-sparse encoding (every value has a 4-bit slot in a dense array; an
//! outer or inner value also has a one-byte sparse entry with its position, group bit and
//! extra bit).
//!
//! Record per (token, KV head) of K or V, `hd / 2 + 8 · ceil(hd / 64) + 8` bytes; the
//! layout and the decoding rules are drawn in `cuda/kv_codec.cuh`. The dense codes lie in
//! kv4's slot order ([`super::kv4::slot_element`]), so the tensor-core decode attention
//! takes them as it takes kv4's; segments and sparse entries count elements. Bits per value,
//! everything counted: 5.5 at hd 128 (0.344× f16), 6.0 at hd 64 — whatever the number
//! of outliers, since each 64-value segment reserves 8 entries.
//!
//! Decisions (where the paper or the authors' code leave them open):
//! - Middle and outer ranges are per row (the paper's online min / max); the inner range
//!   is the offline interval `(inner_lo, inner_hi)` (5 bits over an interval the
//!   thresholds already bound: a per-row range would add bytes for little).
//! - Middle codes carry no side bit: the row stores `zc`, the first code of the positive
//!   side (the first level at or above 0, leaving each side present in the row a level),
//!   so a value just past an inner threshold never decodes on the other side of the gap.
//! - Outer values take the sparse entries first, then inner ones, in index order; a
//!   segment with more outliers than its 8 entries demotes the rest to middle (outer ones
//!   keep their value: the row's middle range widens; inner ones become the middle level
//!   at their side's threshold, an error of at most `inner_hi − inner_lo + step`).
//! - K is encoded after RoPE (the cache holds rotated keys, so the decode attention reads
//!   them without rotating every key per step); thresholds for K come from the post-RoPE
//!   quantiles. Measured (default model, WikiText-2, ctx 512 / 2048, H200, the paper's
//!   fractions 0.04 / 0.06): perplexity 26.23 / 19.04 after RoPE against 26.36 / 19.05
//!   before (f16 cache 25.51 / 18.47; kv4 28.35 / 20.36 after, 28.42 / 20.48 before).
//! - Fractions (outer / inner) by measurement, same text and contexts: 0.04 / 0.06 (the
//!   paper's) 26.23 / 19.04; 0.10 / 0.10: 26.65 / 19.31; 0.06 / 0.02: 26.08 / 18.90;
//!   0.08 / 0.04: 26.03 / 18.85 (+2.0 % / +2.1 %), the default (BENCHMARKS.md). Less
//!   outer helps ctx 512 and hurts 2048 (0.06 / 0.04: 26.00 / 18.87; 0.07 / 0.04: 26.01 /
//!   18.87); thresholds from 32 × 2048 calibration tokens instead of 128 × 512 did not help.
//! - Fractions per layer and per K / V (the default since 2026-12-05): calibration keeps
//!   about 16 384 sampled rows per layer and takes, for K and for V, the fractions of
//!   [`search_grid`] whose thresholds give the least squared error through this codec
//!   ([`sq_error`]); summed over layers that error ranks the single settings as
//!   perplexity does. Measured on this repository's CPU (windows 0..40 at ctx 512, 16 × 512
//!   calibration tokens, in-sample): one setting 0.08 / 0.04 26.18 (+2.2 %), searched
//!   26.06 (+1.7 %); f16 cache 25.62 (BENCHMARKS.md).
//! - The decode attention reads oaken rows on kv4's tensor-core kernel (head dims 64 and
//!   128): the dense codes as middle values, the middle group's jump over the inner
//!   interval as a second mma over the masks `code >= zc`, and the sparse entries as
//!   per-key score corrections (K) and output corrections (V); `cuda/decode_attention.cu`.
//!
//! These functions are the CPU references of the CUDA encoder and decoder and are
//! bit-identical with them.

use super::kv4::{element_slot, f16_at, nibble, put_f16, rint_clamp, set_nibble};
use half::f16;

/// Values per sparse segment and entries reserved per segment (KV_SEG, KV_SEG_CAP).
pub const SEGMENT: usize = 64;
pub const SEGMENT_ENTRIES: usize = 8;

/// Outer and inner group sizes as fractions of all values. Default 8 % outer, 4 % inner
/// (quantiles 0.04 / 0.48 / 0.52 / 0.96), the best single setting measured on the default
/// model (the calibration's default searches per layer instead: [`search_grid`]); the
/// paper's 4 % / 6 % is `--oaken-search false --oaken-outer 0.04 --oaken-inner 0.06`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OakenFractions {
    pub outer: f64,
    pub inner: f64,
}

impl Default for OakenFractions {
    fn default() -> Self {
        Self {
            outer: 0.08,
            inner: 0.04,
        }
    }
}

impl OakenFractions {
    /// The four quantile fractions `[outer_lo, inner_lo, inner_hi, outer_hi]`.
    pub fn quantiles(&self) -> candle_core::Result<[f64; 4]> {
        let (o, i) = (self.outer, self.inner);
        if !(o > 0.0 && i > 0.0 && o + i < 1.0) {
            candle_core::bail!(
                "oaken fractions: outer {o} and inner {i} must be positive with a sum below 1"
            )
        }
        Ok([o / 2.0, 0.5 - i / 2.0, 0.5 + i / 2.0, 1.0 - o / 2.0])
    }
}

/// The fractions the calibration's search tries per layer and per K / V (outer 0.05 …
/// 0.10 by 0.01, each with inner 0.01 … 0.06 by 0.01): the grid around the best global
/// fractions measured on the default model.
pub fn search_grid() -> Vec<OakenFractions> {
    let mut g = Vec::with_capacity(36);
    for o in 5..=10 {
        for i in 1..=6 {
            g.push(OakenFractions {
                outer: o as f64 / 100.0,
                inner: i as f64 / 100.0,
            });
        }
    }
    g
}

/// Thresholds of one of K / V of a layer: `outer_lo < inner_lo < inner_hi < outer_hi`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Thresholds {
    pub outer_lo: f32,
    pub inner_lo: f32,
    pub inner_hi: f32,
    pub outer_hi: f32,
}

impl Thresholds {
    /// Checked thresholds from the four quantiles `[outer_lo, inner_lo, inner_hi, outer_hi]`.
    pub fn new(q: [f32; 4]) -> candle_core::Result<Self> {
        let ok = q.iter().all(|x| x.is_finite()) && q[0] < q[1] && q[1] < q[2] && q[2] < q[3];
        if !ok {
            candle_core::bail!(
                "oaken thresholds {q:?} must be finite and strictly increasing (outer_lo < inner_lo < inner_hi < outer_hi)"
            )
        }
        Ok(Self {
            outer_lo: q[0],
            inner_lo: q[1],
            inner_hi: q[2],
            outer_hi: q[3],
        })
    }

    /// The layout the kernels take (`KvThr` in `cuda/kv_codec.cuh`), with the derived
    /// inner step, its inverse and the inner midpoint computed once here in f32.
    pub fn params(&self) -> KvThr {
        let w = self.inner_hi - self.inner_lo;
        KvThr {
            outer_lo: self.outer_lo,
            inner_lo: self.inner_lo,
            inner_hi: self.inner_hi,
            outer_hi: self.outer_hi,
            inner_step: w / 31.0,
            inner_inv: 31.0 / w,
            inner_mid: self.inner_lo + 0.5 * w,
            pad: 0.0,
        }
    }
}

/// `KvThr` of `cuda/kv_codec.cuh` (also passed, zeroed, for encodings without thresholds).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvThr {
    pub outer_lo: f32,
    pub inner_lo: f32,
    pub inner_hi: f32,
    pub outer_hi: f32,
    pub inner_step: f32,
    pub inner_inv: f32,
    pub inner_mid: f32,
    pub pad: f32,
}

/// One layer's thresholds for K (post-RoPE) and V.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OakenLayer {
    pub k: Thresholds,
    pub v: Thresholds,
}

impl OakenLayer {
    /// Thresholds from per-layer calibration quantiles at [`OakenFractions::quantiles`]
    /// (`k` post- or pre-RoPE, as the cache stores K).
    ///
    /// Quantiles that tie (a layer whose values are mostly exact zeros: the inner quantiles
    /// both 0) are pulled apart by a thousandth of the outer span, so every group keeps a
    /// non-empty range; a span of zero (all values equal) is still an error.
    pub fn from_quantiles(k: &[f64], v: &[f64]) -> candle_core::Result<Self> {
        let four = |q: &[f64], what: &str| -> candle_core::Result<Thresholds> {
            match q {
                [a, b, c, d] => {
                    let mut t = [*a as f32, *b as f32, *c as f32, *d as f32];
                    let eps = 1e-3 * (t[3] - t[0]);
                    if eps > 0.0 {
                        for i in 1..4 {
                            t[i] = t[i].max(t[i - 1] + eps);
                        }
                    }
                    Thresholds::new(t)
                }
                _ => candle_core::bail!(
                    "oaken: {what} has {} calibration quantiles, expected 4",
                    q.len()
                ),
            }
        };
        Ok(Self {
            k: four(k, "K")?,
            v: four(v, "V")?,
        })
    }

    /// Thresholds for values distributed as N(0, sigma²) at `fractions` (for benchmark
    /// models with random weights, where no calibration exists).
    pub fn gaussian(sigma: f32, fractions: OakenFractions) -> candle_core::Result<Self> {
        let q = fractions.quantiles()?;
        let t = Thresholds::new(q.map(|p| sigma * normal_quantile(p) as f32))?;
        Ok(Self { k: t, v: t })
    }
}

/// Oaken's calibration as a checkpoint stores it: the fractions, which K the thresholds
/// are for, and one entry per layer.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OakenCalibration {
    pub fractions: OakenFractions,
    /// `"post-rope"`: the cache holds rotated keys.
    pub k_rope: String,
    pub layers: Vec<OakenLayer>,
    /// The fractions each layer's K and V thresholds were taken at (where a search chose
    /// them per layer; empty in checkpoints written before the search).
    #[serde(default)]
    pub picked: Vec<[OakenFractions; 2]>,
}

impl OakenCalibration {
    /// How the thresholds were chosen, for the tools' load lines: "outer O / inner I", or
    /// the range of the fractions a search picked.
    pub fn describe(&self) -> String {
        if self.picked.is_empty() {
            return format!(
                "outer {} / inner {}",
                self.fractions.outer, self.fractions.inner
            );
        }
        let all = self.picked.iter().flatten();
        let range = |f: fn(&OakenFractions) -> f64| {
            let v: Vec<f64> = all.clone().map(f).collect();
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{lo}–{hi}")
        };
        format!(
            "fractions searched per layer and K / V: outer {}, inner {}",
            range(|f| f.outer),
            range(|f| f.inner)
        )
    }
}

/// The standard normal quantile (Acklam's rational approximation, |error| < 1.2e-9).
fn normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.383_577_518_672_69e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

pub fn segments(hd: usize) -> usize {
    hd.div_ceil(SEGMENT)
}

fn segment_len(hd: usize) -> usize {
    hd.min(SEGMENT)
}

/// Bytes per record for head dim `hd`.
pub fn rec_bytes(hd: usize) -> usize {
    hd / 2 + SEGMENT_ENTRIES * segments(hd) + 8
}

/// A value's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Group {
    Outer,
    Middle,
    Inner,
}

/// The group of `x` under `t`: by comparisons only (outer includes its thresholds, inner
/// excludes its own).
pub fn group(x: f32, t: &Thresholds) -> Group {
    if x >= t.outer_hi || x <= t.outer_lo {
        Group::Outer
    } else if x > t.inner_lo && x < t.inner_hi {
        Group::Inner
    } else {
        Group::Middle
    }
}

/// Encode one row `x` (`hd` values, hd in 32, 64, 128) of K (`kv` 0) or V (`kv` 1) into
/// `rec` with thresholds `t`.
pub fn quantize_row(kv: usize, x: &[f32], rec: &mut [u8], t: &KvThr) {
    let hd = x.len();
    let (sl, nseg) = (segment_len(hd), segments(hd));
    let th = Thresholds {
        outer_lo: t.outer_lo,
        inner_lo: t.inner_lo,
        inner_hi: t.inner_hi,
        outer_hi: t.outer_hi,
    };
    let groups: Vec<Group> = x.iter().map(|&v| group(v, &th)).collect();
    // Sparse ranks per segment: outer values in index order, then inner ones.
    let mut rank = vec![usize::MAX; hd];
    let mut counts = vec![0usize; nseg];
    for (seg, count) in counts.iter_mut().enumerate() {
        let range = seg * sl..((seg + 1) * sl).min(hd);
        let mut r = 0;
        for want in [Group::Outer, Group::Inner] {
            for d in range.clone() {
                if groups[d] == want {
                    rank[d] = r;
                    r += 1;
                }
            }
        }
        *count = r.min(SEGMENT_ENTRIES);
    }
    let sel = |d: usize| rank[d] < SEGMENT_ENTRIES;
    // Middle values (and demoted outliers): side and shifted value.
    let side_s = |d: usize| -> (bool, f32) {
        let v = x[d];
        if groups[d] == Group::Inner {
            (v >= t.inner_mid, 0.0)
        } else {
            let pos = v >= t.inner_hi;
            (pos, v - if pos { t.inner_hi } else { t.inner_lo })
        }
    };
    let outer_mag = |v: f32| {
        if v >= t.outer_hi {
            v - t.outer_hi
        } else {
            t.outer_lo - v
        }
    };
    let (mut lo, mut hi, mut omax) = (0f32, 0f32, 0f32);
    for d in 0..hd {
        if sel(d) {
            if groups[d] == Group::Outer {
                omax = omax.max(outer_mag(x[d]));
            }
        } else {
            let s = side_s(d).1;
            lo = lo.min(s);
            hi = hi.max(s);
        }
    }
    let stb = f16::from_f32((hi - lo) / 15.0);
    let mnb = f16::from_f32(lo);
    let osb = f16::from_f32(omax / 15.0);
    let (step, mn, os) = (stb.to_f32(), mnb.to_f32(), osb.to_f32());
    let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
    let oinv = if os > 0.0 { 1.0 / os } else { 0.0 };
    let mut zc = (0..16u32)
        .find(|&q| q as f32 * step + mn >= 0.0)
        .unwrap_or(16);
    let sides: Vec<bool> = (0..hd).filter(|&d| !sel(d)).map(|d| side_s(d).0).collect();
    if sides.iter().any(|&p| !p) {
        zc = zc.max(1);
    }
    if sides.iter().any(|&p| p) {
        zc = zc.min(15);
    }
    let ent_off = hd / 2;
    rec[ent_off..ent_off + SEGMENT_ENTRIES * nseg].fill(0);
    for d in 0..hd {
        if !sel(d) {
            let (pos, s) = side_s(d);
            let q = rint_clamp((s - mn) * inv, 0.0, 15.0);
            let q = if pos {
                q.max(zc).min(15)
            } else {
                q.min(zc.saturating_sub(1))
            };
            set_nibble(rec, element_slot(kv, hd, d), q);
            continue;
        }
        let v = x[d];
        let (code, extra, inner) = if groups[d] == Group::Outer {
            let c = (outer_mag(v) * oinv).round_ties_even().min(15.0) as u32;
            (c, (v < t.outer_hi) as u8, 0u8)
        } else {
            let q5 = rint_clamp((v - t.inner_lo) * t.inner_inv, 0.0, 31.0);
            (q5 & 15, (q5 >> 4) as u8, 1u8)
        };
        set_nibble(rec, element_slot(kv, hd, d), code);
        let (seg, p) = (d / sl, d % sl);
        rec[ent_off + seg * SEGMENT_ENTRIES + rank[d]] = p as u8 | inner << 6 | extra << 7;
    }
    let meta = ent_off + SEGMENT_ENTRIES * nseg;
    put_f16(rec, meta, stb);
    put_f16(rec, meta + 2, mnb);
    put_f16(rec, meta + 4, osb);
    rec[meta + 6] = counts[0] as u8 | (counts.get(1).copied().unwrap_or(0) as u8) << 4;
    rec[meta + 7] = zc as u8;
}

/// Σ (x − decode(encode(x)))² over `rows` (consecutive `hd`-value rows of K, `kv` 0, or
/// V, `kv` 1) under thresholds `t`.
pub fn sq_error(kv: usize, rows: &[f32], hd: usize, t: &Thresholds) -> f64 {
    let p = t.params();
    let mut rec = vec![0u8; rec_bytes(hd)];
    let mut out = vec![0f32; hd];
    rows.chunks_exact(hd)
        .map(|x| {
            quantize_row(kv, x, &mut rec, &p);
            dequantize_row(kv, &rec, &mut out, &p);
            x.iter()
                .zip(&out)
                .map(|(a, b)| ((a - b) as f64).powi(2))
                .sum::<f64>()
        })
        .sum()
}

/// Decode record `rec` of K (`kv` 0) or V (`kv` 1) into `out` (`hd` values) with
/// thresholds `t`.
pub fn dequantize_row(kv: usize, rec: &[u8], out: &mut [f32], t: &KvThr) {
    let hd = out.len();
    let (sl, nseg) = (segment_len(hd), segments(hd));
    let meta = hd / 2 + SEGMENT_ENTRIES * nseg;
    let (mstep, mmin, oscale) = (
        f16_at(rec, meta),
        f16_at(rec, meta + 2),
        f16_at(rec, meta + 4),
    );
    let zc = rec[meta + 7] as u32;
    for (d, o) in out.iter_mut().enumerate() {
        let c = nibble(rec, element_slot(kv, hd, d));
        let s = c as f32 * mstep + mmin;
        *o = s + if c >= zc { t.inner_hi } else { t.inner_lo };
    }
    for seg in 0..nseg {
        let cnt = (rec[meta + 6] >> (4 * seg) & 15) as usize;
        for k in 0..cnt.min(SEGMENT_ENTRIES) {
            let e = rec[hd / 2 + seg * SEGMENT_ENTRIES + k];
            let d = seg * sl + (e & 63) as usize;
            if d >= hd {
                continue;
            }
            let (c, extra) = (nibble(rec, element_slot(kv, hd, d)), (e >> 7) as u32);
            out[d] = if e >> 6 & 1 == 1 {
                (c | extra << 4) as f32 * t.inner_step + t.inner_lo
            } else {
                let m = c as f32 * oscale;
                if extra == 1 {
                    t.outer_lo - m
                } else {
                    t.outer_hi + m
                }
            };
        }
    }
}
