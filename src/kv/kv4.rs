//! `kv4`: asymmetric INT4 per (token, KV head) with an f16 scale and minimum: Atom's and
//! COMET's KV cache, the baseline Oaken is measured against.
//!
//! One record per (token, KV head) of K or V, `hd / 2 + 4` bytes (byte layout drawn in
//! `cuda/kv_codec.cuh`): the codes (slot `s` in byte `s / 2`, low nibble for even `s`,
//! holding element [`slot_element`]`(kv, hd, s)`: the order the tensor-core decode
//! attention's mma fragments take, different for K and V), then f16 `scale` and f16 `min`;
//! `x̂ = min + code · scale`. Bits per value: `4 + 32 / hd` (4.25 at hd 128, 0.27× f16;
//! 4.5 at hd 64). Head dims 64 and 128.
//!
//! The functions here are the CPU references of the CUDA encoder and decoder and must stay
//! bit-identical with them: the same f32 operations in the same order.

use half::f16;

/// Bytes per record for head dim `hd`.
pub fn rec_bytes(hd: usize) -> usize {
    hd / 2 + 4
}

/// The 4-bit code of value `d` of a record.
pub(crate) fn nibble(rec: &[u8], d: usize) -> u32 {
    ((rec[d / 2] >> (4 * (d % 2))) & 15) as u32
}

pub(crate) fn set_nibble(rec: &mut [u8], d: usize, c: u32) {
    let sh = 4 * (d % 2);
    rec[d / 2] = (rec[d / 2] & !(15 << sh)) | ((c as u8 & 15) << sh);
}

pub(crate) fn f16_at(rec: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([rec[off], rec[off + 1]])).to_f32()
}

pub(crate) fn put_f16(rec: &mut [u8], off: usize, v: f16) {
    rec[off..off + 2].copy_from_slice(&v.to_bits().to_le_bytes());
}

/// `round(x)` to nearest, ties to even (CUDA's `rintf`), clamped to `[lo, hi]`.
pub(crate) fn rint_clamp(x: f32, lo: f32, hi: f32) -> u32 {
    x.round_ties_even().clamp(lo, hi) as u32
}

/// The element of a K (`kv` 0) or V (`kv` 1) row that slot `s` of its record holds
/// (`kv4_element` in `cuda/kv_codec.cuh`).
pub fn slot_element(kv: usize, hd: usize, s: usize) -> usize {
    if kv == 0 {
        let part = hd / 4;
        let (c, i, n) = (s / part, (s % part) / 8, s % 8);
        16 * (2 * i + ((n >> 1) & 1)) + 2 * c + 8 * (n & 1) + ((n >> 2) & 1)
    } else {
        let group = hd / 8;
        8 * (s % group) + s / group
    }
}

/// The slot of element `d` of a K (`kv` 0) or V (`kv` 1) row: the inverse of
/// [`slot_element`] (`kv4_slot` in `cuda/kv_codec.cuh`).
pub fn element_slot(kv: usize, hd: usize, d: usize) -> usize {
    if kv == 0 {
        let (slice, r) = (d / 16, d % 16);
        let n = (r >> 3) | (slice & 1) << 1 | (r & 1) << 2;
        ((r & 7) >> 1) * (hd / 4) + 8 * (slice / 2) + n
    } else {
        (d % 8) * (hd / 8) + d / 8
    }
}

/// Encode one row `x` (`hd` values) of K (`kv` 0) or V (`kv` 1) into `rec`
/// (`rec_bytes(hd)` bytes).
pub fn quantize_row(kv: usize, x: &[f32], rec: &mut [u8]) {
    let hd = x.len();
    let mn = x.iter().copied().fold(f32::INFINITY, f32::min);
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sh = f16::from_f32((mx - mn) / 15.0);
    let mh = f16::from_f32(mn);
    let (scale, m0) = (sh.to_f32(), mh.to_f32());
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for s in 0..hd {
        let v = x[slot_element(kv, hd, s)];
        set_nibble(rec, s, rint_clamp((v - m0) * inv, 0.0, 15.0));
    }
    put_f16(rec, hd / 2, sh);
    put_f16(rec, hd / 2 + 2, mh);
}

/// Decode record `rec` of K (`kv` 0) or V (`kv` 1) into `out` (`hd` values).
pub fn dequantize_row(kv: usize, rec: &[u8], out: &mut [f32]) {
    let hd = out.len();
    let (scale, mn) = (f16_at(rec, hd / 2), f16_at(rec, hd / 2 + 2));
    for s in 0..hd {
        out[slot_element(kv, hd, s)] = nibble(rec, s) as f32 * scale + mn;
    }
}
