//! `kv4`: asymmetric INT4 per (token, KV head) with an f16 scale and minimum: Atom's and
//! COMET's KV cache, the baseline Oaken is measured against.
//!
//! One record per (token, KV head) of K or V, `hd / 2 + 4` bytes (byte layout drawn in
//! `cuda/kv_codec.cuh`): the codes, value `d` in byte `d / 2` (low nibble for even `d`),
//! then f16 `scale` and f16 `min`; `x̂ = min + code · scale`. Bits per value:
//! `4 + 32 / hd` (4.25 at hd 128, 0.27× f16; 4.5 at hd 64).
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

/// Encode one row `x` (`hd` values) into `rec` (`rec_bytes(hd)` bytes).
pub fn quantize_row(x: &[f32], rec: &mut [u8]) {
    let hd = x.len();
    let mn = x.iter().copied().fold(f32::INFINITY, f32::min);
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sh = f16::from_f32((mx - mn) / 15.0);
    let mh = f16::from_f32(mn);
    let (scale, m0) = (sh.to_f32(), mh.to_f32());
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    for (d, &v) in x.iter().enumerate() {
        set_nibble(rec, d, rint_clamp((v - m0) * inv, 0.0, 15.0));
    }
    put_f16(rec, hd / 2, sh);
    put_f16(rec, hd / 2 + 2, mh);
}

/// Decode record `rec` into `out` (`hd` values).
pub fn dequantize_row(rec: &[u8], out: &mut [f32]) {
    let hd = out.len();
    let (scale, mn) = (f16_at(rec, hd / 2), f16_at(rec, hd / 2 + 2));
    for (d, o) in out.iter_mut().enumerate() {
        *o = nibble(rec, d) as f32 * scale + mn;
    }
}
