//! Uniform asymmetric integer weights: `int4`, `int3`, `int2`, each with round-to-nearest
//! or GPTQ (`int4-gptq`, `int3-gptq`, `int2-gptq`: the same layout, a better quantizer).
//! The literature's baselines and the peers the mixed-precision formats must beat.
//!
//! # Layout (version 1)
//!
//! A weight `[n, k]` is cut along k into groups of [`GROUP`] = 128 columns (the last group
//! of a row whose k is not a multiple of 128 is shorter: k = 576 has four groups of 128 and
//! one of 64). Each (row, group) has an f16 `scale` and an f16 `zero`, the value code 0
//! stands for: a code `q` in `0..2^b` means `w = q · scale + zero` (computed in f32, then
//! rounded once to the run dtype). Round to nearest takes `zero = min`, `scale = (max −
//! min) / (2^b − 1)` over the group (both rounded to f16 first) and `q = clamp(round((w −
//! zero) / scale), 0, 2^b − 1)`.
//!
//! | tensor   | dtype | shape                | content |
//! |----------|-------|----------------------|---------|
//! | `qweight`| u32   | `[n, ⌈k·b / 32⌉]`    | each row's codes as one bit string, code j in bits `b·j .. b·j + b` (LSB first), word i holding bits `32 i .. 32 i + 32`, zero-padded |
//! | `scales` | f16   | `[n, ⌈k / 128⌉]`     | |
//! | `zeros`  | f16   | `[n, ⌈k / 128⌉]`     | |
//!
//! Bits per weight, every byte counted (k a multiple of 128): `b + 32 / 128` — 4.25, 3.25
//! and 2.25.
//!
//! The forward here is the reference one (dequantize to the input dtype with
//! `ops::uniform_dequantize`, then candle's matmul); the fast kernels come with the
//! mixed 2/4/16-bit format, whose all-4-bit and all-2-bit tiles serve these formats too.

use super::{Calibration, Codec, FormatSpec, LinearWeights, Plan, QuantOptions, WeightFormat};
use crate::gptq::GroupRule;
use candle_core::{DType, Device, Result, Tensor};
use half::f16;
use std::collections::HashMap;

/// Columns per group.
pub const GROUP: usize = 128;

macro_rules! uniform_spec {
    ($name:ident, $cli:literal, $bits:literal, $gptq:literal, $cal:ident, $stores:expr, $bound:expr, $about:literal) => {
        pub static $name: FormatSpec = FormatSpec {
            name: $cli,
            aliases: &[],
            about: $about,
            error_bound: $bound,
            tolerance: 5e-3,
            calibration: Calibration::$cal,
            graph_safe: true,
            version: 1,
            stores_as: $stores,
            codec: &UniformCodec {
                bits: $bits,
                gptq: $gptq,
            },
        };
    };
}

uniform_spec!(
    INT4,
    "int4",
    4,
    false,
    None,
    None,
    0.12,
    "4-bit asymmetric groups of 128, round to nearest"
);
uniform_spec!(
    INT3,
    "int3",
    3,
    false,
    None,
    None,
    0.25,
    "3-bit asymmetric groups of 128, round to nearest"
);
uniform_spec!(
    INT2,
    "int2",
    2,
    false,
    None,
    None,
    0.6,
    "2-bit asymmetric groups of 128, round to nearest"
);
uniform_spec!(
    INT4_GPTQ,
    "int4-gptq",
    4,
    true,
    Hessian,
    Some(WeightFormat::Int4),
    0.12,
    "int4 quantized with GPTQ (needs calibration)"
);
uniform_spec!(
    INT3_GPTQ,
    "int3-gptq",
    3,
    true,
    Hessian,
    Some(WeightFormat::Int3),
    0.25,
    "int3 quantized with GPTQ (needs calibration)"
);
uniform_spec!(
    INT2_GPTQ,
    "int2-gptq",
    2,
    true,
    Hessian,
    Some(WeightFormat::Int2),
    0.6,
    "int2 quantized with GPTQ (needs calibration)"
);

/// u32 words per row of `k` codes of `bits`.
pub fn words_per_row(k: usize, bits: u32) -> usize {
    (k * bits as usize).div_ceil(32)
}

/// Groups per row of `k`.
pub fn groups(k: usize) -> usize {
    k.div_ceil(GROUP)
}

// ---------------------------------------------------------------------------------------
// CPU references: pack, unpack, dequantize.

/// Pack codes `[n, k]` (each `< 2^bits`) into `[n, words_per_row(k, bits)]` words.
pub fn pack(codes: &[u8], n: usize, k: usize, bits: u32) -> Result<Vec<u32>> {
    if codes.len() != n * k || !(1..=8).contains(&bits) {
        candle_core::bail!("pack: {} codes for [{n}, {k}] at {bits} bits", codes.len())
    }
    let wpr = words_per_row(k, bits);
    let mut out = vec![0u32; n * wpr];
    for r in 0..n {
        let row = &mut out[r * wpr..(r + 1) * wpr];
        for (j, &c) in codes[r * k..(r + 1) * k].iter().enumerate() {
            if u32::from(c) >> bits != 0 {
                candle_core::bail!("pack: code {c} at [{r}, {j}] does not fit {bits} bits")
            }
            let bit = j * bits as usize;
            let (w, o) = (bit / 32, bit % 32);
            row[w] |= u32::from(c) << o;
            if o + bits as usize > 32 {
                row[w + 1] |= u32::from(c) >> (32 - o);
            }
        }
    }
    Ok(out)
}

/// Code `j` of a packed row.
pub fn code_at(row: &[u32], j: usize, bits: u32) -> u8 {
    let bit = j * bits as usize;
    let (w, o) = (bit / 32, bit % 32);
    let mut v = row[w] >> o;
    if o + bits as usize > 32 {
        v |= row[w + 1] << (32 - o);
    }
    (v & ((1u32 << bits) - 1)) as u8
}

/// The codes `[n, k]` of packed words `[n, words_per_row(k, bits)]`.
pub fn unpack(words: &[u32], n: usize, k: usize, bits: u32) -> Vec<u8> {
    let wpr = words_per_row(k, bits);
    (0..n)
        .flat_map(|r| (0..k).map(move |j| code_at(&words[r * wpr..(r + 1) * wpr], j, bits)))
        .collect()
}

/// The weight `[n, k]` in f32: `q · scale + zero` per group (the kernels compute exactly
/// this, without a fused multiply-add, then round once to their output dtype).
pub fn dequantize(
    words: &[u32],
    scales: &[f16],
    zeros: &[f16],
    n: usize,
    k: usize,
    bits: u32,
) -> Vec<f32> {
    let (wpr, g) = (words_per_row(k, bits), groups(k));
    let mut out = Vec::with_capacity(n * k);
    for r in 0..n {
        let row = &words[r * wpr..(r + 1) * wpr];
        for j in 0..k {
            let (s, z) = (
                scales[r * g + j / GROUP].to_f32(),
                zeros[r * g + j / GROUP].to_f32(),
            );
            out.push(f32::from(code_at(row, j, bits)) * s + z);
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// The quantization rule (round to nearest within a group), for RTN and GPTQ alike.

/// Asymmetric `bits`-bit groups of [`GROUP`]: parameters `[scale, zero]` per (row, group),
/// both f16-representable. With `clip`, a group's range is the one of
/// `[f · min, f · max]`, `f` in 1.00, 0.99, …, 0.21, with the least squared error over the
/// group (the range search of GPTQ's quantizer with `mse`, on squared error); without it,
/// `[min, max]` (round to nearest as the literature's baselines take it).
#[derive(Debug, Clone, Copy)]
pub struct UniformRule {
    pub bits: u32,
    pub clip: bool,
}

/// Range factors the clipped fit tries: `1 − i / 100` for `i` in `0..CLIP_STEPS`.
pub const CLIP_STEPS: usize = 80;

impl UniformRule {
    /// Min/max groups.
    pub fn new(bits: u32) -> Self {
        Self { bits, clip: false }
    }

    /// Groups with the searched range.
    pub fn clipped(bits: u32) -> Self {
        Self { bits, clip: true }
    }

    fn maxq(&self) -> f32 {
        ((1u32 << self.bits) - 1) as f32
    }

    /// `1 / maxq` as the tensor ops multiply by it (candle's affine).
    fn inv_maxq(&self) -> f32 {
        (1.0 / self.maxq() as f64) as f32
    }

    fn scale_zero(&self, mn: f32, mx: f32) -> (f32, f32) {
        let scale = f16::from_f32((mx - mn) * self.inv_maxq()).to_f32();
        let scale = if scale > 0.0 && scale.is_finite() {
            scale
        } else {
            1.0
        };
        (scale, f16::from_f32(mn).to_f32())
    }

    fn factor(i: usize) -> f32 {
        1.0 - i as f32 / 100.0
    }

    /// `(scale, zero)` for ranges `[mn, mx]` `[.., 1, n]` as tensors.
    fn scale_zero_t(&self, mn: &Tensor, mx: &Tensor) -> Result<(Tensor, Tensor)> {
        let scale = (mx - mn)?
            .affine(self.inv_maxq() as f64, 0.0)?
            .to_dtype(DType::F16)?
            .to_dtype(DType::F32)?;
        // Where the range is 0 (or the scale underflows), scale 1: every code is 0.
        let scale = scale.gt(0f64)?.where_cond(&scale, &scale.ones_like()?)?;
        Ok((scale, mn.to_dtype(DType::F16)?.to_dtype(DType::F32)?))
    }
}

impl GroupRule for UniformRule {
    fn group_size(&self) -> usize {
        GROUP
    }

    fn params(&self) -> usize {
        2
    }

    fn fit(&self, _row: usize, _group: usize, w: &[f32], p: &mut [f32]) {
        let mn = w.iter().copied().fold(f32::INFINITY, f32::min);
        let mx = w.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let (mut s, mut z) = self.scale_zero(mn, mx);
        if self.clip {
            let mut best = f32::INFINITY;
            for i in 0..CLIP_STEPS {
                let f = Self::factor(i);
                let (si, zi) = self.scale_zero(mn * f, mx * f);
                let err: f32 = w
                    .iter()
                    .map(|&x| (x - self.quantize(0, 0, &[si, zi], x).1).powi(2))
                    .sum();
                if err < best {
                    (best, s, z) = (err, si, zi);
                }
            }
        }
        p[0] = s;
        p[1] = z;
    }

    fn quantize(&self, _row: usize, _col: usize, p: &[f32], x: f32) -> (u8, f32) {
        let q = ((x - p[1]) / p[0]).round().clamp(0.0, self.maxq());
        (q as u8, q * p[0] + p[1])
    }

    fn fit_t(&self, _group: usize, wt: &Tensor) -> Result<Tensor> {
        let (mn, mx) = (wt.min_keepdim(0)?, wt.max_keepdim(0)?);
        if !self.clip {
            let (scale, zero) = self.scale_zero_t(&mn, &mx)?;
            return Tensor::cat(&[scale, zero], 0);
        }
        // Every range factor at once: [CLIP_STEPS, 1, n] parameters, [CLIP_STEPS, c, n] codes.
        let f: Vec<f32> = (0..CLIP_STEPS).map(Self::factor).collect();
        let f = Tensor::from_vec(f, (CLIP_STEPS, 1, 1), wt.device())?;
        let (scale, zero) = self.scale_zero_t(&f.broadcast_mul(&mn)?, &f.broadcast_mul(&mx)?)?;
        let (_, v) = self.quantize_t(0, &wt.unsqueeze(0)?, &Tensor::cat(&[&scale, &zero], 1)?)?;
        let err = v.broadcast_sub(wt)?.sqr()?.sum(1)?; // [CLIP_STEPS, n]
        let best = err.argmin_keepdim(0)?; // [1, n]
        let pick = |t: &Tensor| t.squeeze(1)?.gather(&best, 0);
        Tensor::cat(&[pick(&scale)?, pick(&zero)?], 0)
    }

    /// Also over a leading batch dimension: `wt` `[b, c, n]`, `p` `[b, 2, n]`.
    fn quantize_t(&self, _col: usize, wt: &Tensor, p: &Tensor) -> Result<(Tensor, Tensor)> {
        let d = p.rank() - 2;
        let (scale, zero) = (p.narrow(d, 0, 1)?, p.narrow(d, 1, 1)?);
        let q = wt
            .broadcast_sub(&zero)?
            .broadcast_div(&scale)?
            .round()?
            .clamp(0f32, self.maxq())?;
        let v = q.broadcast_mul(&scale)?.broadcast_add(&zero)?;
        Ok((q.to_dtype(DType::U8)?, v))
    }
}

// ---------------------------------------------------------------------------------------
// The packed weights.

/// A `[n, k]` weight in `int4` / `int3` / `int2` (the layout in the module docs).
#[derive(Debug, Clone)]
pub struct UniformWeights {
    format: WeightFormat,
    bits: u32,
    shape: (usize, usize),
    /// The stored layout, or (on the GPU, for `int4` and `int2` where the shape tiles) the
    /// same weight in the tile layout of `w2416`'s kernels, which then run every forward;
    /// the stored tensors are rebuilt from the tiles when asked for (checkpoints).
    enc: Encoded,
}

#[derive(Debug, Clone)]
enum Encoded {
    Stored(Stored),
    Tiled(super::w2416::Tiles),
}

/// The stored tensors (module docs).
#[derive(Debug, Clone)]
struct Stored {
    /// u32 `[n, words_per_row(k, bits)]`.
    qweight: Tensor,
    /// f16 `[n, groups(k)]`.
    scales: Tensor,
    /// f16 `[n, groups(k)]`.
    zeros: Tensor,
}

impl UniformWeights {
    /// From codes u8 `[n, k]` and parameters f32 `[n, groups(k), 2]` (scale, zero; already
    /// f16-representable), packing the codes on their device.
    pub fn from_codes(
        format: WeightFormat,
        bits: u32,
        codes: &Tensor,
        params: &Tensor,
    ) -> Result<Self> {
        let (n, k) = codes.dims2()?;
        let g = groups(k);
        if params.dims() != [n, g, 2] {
            candle_core::bail!(
                "uniform: params {:?} for codes [{n}, {k}], expected [{n}, {g}, 2]",
                params.shape()
            )
        }
        let qweight = crate::ops::uniform_pack(codes, bits)?;
        let scales = params
            .narrow(2, 0, 1)?
            .squeeze(2)?
            .to_dtype(DType::F16)?
            .contiguous()?;
        let zeros = params
            .narrow(2, 1, 1)?
            .squeeze(2)?
            .to_dtype(DType::F16)?
            .contiguous()?;
        Self::new(format, bits, (n, k), qweight, scales, zeros)
    }

    /// From stored tensors (the layout in the module docs), checked.
    pub fn new(
        format: WeightFormat,
        bits: u32,
        (n, k): (usize, usize),
        qweight: Tensor,
        scales: Tensor,
        zeros: Tensor,
    ) -> Result<Self> {
        super::expect(
            &qweight,
            "qweight",
            &[n, words_per_row(k, bits)],
            DType::U32,
        )?;
        super::expect(&scales, "scales", &[n, groups(k)], DType::F16)?;
        super::expect(&zeros, "zeros", &[n, groups(k)], DType::F16)?;
        let cuda = qweight.device().is_cuda();
        let mut w = Self {
            format,
            bits,
            shape: (n, k),
            enc: Encoded::Stored(Stored {
                qweight,
                scales,
                zeros,
            }),
        };
        if cuda && w.tileable() {
            w.enc = Encoded::Tiled(w.to_tiles()?);
        }
        Ok(w)
    }

    /// The stored tensors (rebuilt from the tiles where the weight is tiled: codes unpacked
    /// and packed again, scales and zeros out of fragment order).
    fn stored(&self) -> Result<Stored> {
        let t = match &self.enc {
            Encoded::Stored(st) => return Ok(st.clone()),
            Encoded::Tiled(t) => t,
        };
        let (codes, scales, zeros) = t.uniform_parts()?;
        Ok(Stored {
            qweight: crate::ops::uniform_pack(&codes, self.bits)?,
            scales,
            zeros,
        })
    }

    /// Whether the tile kernels take this weight: 4 or 2 bits, rows a multiple of 32,
    /// columns of 64.
    pub fn tileable(&self) -> bool {
        matches!(self.bits, 2 | 4) && super::w2416::tileable(self.shape.0, self.shape.1)
    }

    /// The codes u8 `[n, k]`, unpacked in tensor ops on the weight's device (2 or 4 bits).
    pub fn codes(&self) -> Result<Tensor> {
        let (n, k) = self.shape;
        let st = match &self.enc {
            Encoded::Stored(st) => st,
            Encoded::Tiled(t) => return Ok(t.uniform_parts()?.0),
        };
        if !matches!(self.bits, 2 | 4) {
            candle_core::bail!(
                "{}: codes of {} bits are not unpacked here",
                self.format,
                self.bits
            )
        }
        let per = 32 / self.bits as usize;
        let dev = st.qweight.device();
        let pow: Vec<u32> = (0..per).map(|j| 1u32 << (self.bits as usize * j)).collect();
        let pow = Tensor::from_vec(pow, (1, 1, per), dev)?;
        let q = st.qweight.unsqueeze(2)?.broadcast_div(&pow)?;
        // q mod 2^bits (candle's affine on u32 takes integer factors only).
        let base = Tensor::new(&[1u32 << self.bits], dev)?.reshape((1, 1, 1))?;
        let hi = q.broadcast_div(&base)?;
        let c = (q - hi.affine(f64::from(1u32 << self.bits), 0.0)?)?;
        c.reshape((n, words_per_row(k, self.bits) * per))?
            .narrow(1, 0, k)?
            .to_dtype(DType::U8)
    }

    /// This weight in the tile layout (see [`super::w2416`]): all tiles one precision, the
    /// f16 scales and zeros per group of 128.
    pub fn to_tiles(&self) -> Result<super::w2416::Tiles> {
        use super::w2416::{pack_codes, plain_scales, tile_cols, Tiles, TILE_ROWS};
        let (n, k) = self.shape;
        if !self.tileable() {
            candle_core::bail!("{}: a [{n}, {k}] weight does not tile", self.format)
        }
        let four = vec![self.bits == 4; (n / TILE_ROWS) * tile_cols(k)];
        let mut codes = self.codes()?;
        let kp = tile_cols(k) * super::w2416::TILE_COLS;
        if kp > k {
            let pad = Tensor::zeros((n, kp - k), DType::U8, codes.device())?;
            codes = Tensor::cat(&[&codes, &pad], 1)?;
        }
        let codes = pack_codes(&codes, &four)?;
        if let Encoded::Tiled(t) = &self.enc {
            return Ok(t.clone());
        }
        let st = self.stored()?;
        let scales = plain_scales(&st.scales, &st.zeros, GROUP)?;
        Tiles::new((n, k), codes, &four, scales, None)
    }

    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// The weight `[n, k]` in `dtype` as the stored layout defines it (the kernel on the
    /// GPU, the reference on the CPU).
    pub fn dequantize_to(&self, dtype: DType) -> Result<Tensor> {
        let st = self.stored()?;
        crate::ops::uniform_dequantize(
            &st.qweight,
            &st.scales,
            &st.zeros,
            self.shape.1,
            self.bits,
            dtype,
        )
    }

    fn tiles(&self) -> Option<&super::w2416::Tiles> {
        match &self.enc {
            Encoded::Tiled(t) => Some(t),
            Encoded::Stored(_) => None,
        }
    }
}

impl LinearWeights for UniformWeights {
    fn format(&self) -> WeightFormat {
        self.format
    }

    fn shape(&self) -> (usize, usize) {
        self.shape
    }

    fn bytes(&self) -> usize {
        if let Some(t) = self.tiles() {
            return t.bytes();
        }
        let (n, k) = self.shape;
        n * (words_per_row(k, self.bits) * 4 + groups(k) * 4)
    }

    fn device(&self) -> Device {
        match &self.enc {
            Encoded::Stored(st) => st.qweight.device().clone(),
            Encoded::Tiled(t) => t.device(),
        }
    }

    fn dequantize(&self) -> Result<Tensor> {
        self.dequantize_to(DType::F32)
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(t) = self.tiles() {
            return crate::ops::tiles_forward(t, x);
        }
        match x.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => x.matmul(&self.dequantize_to(x.dtype())?.t()?),
            dt => candle_core::bail!(
                "{}: unsupported input dtype {dt:?} (f32, f16, bf16)",
                self.format
            ),
        }
    }

    fn forward_fused(&self, e: super::Epilogue, x: &Tensor) -> Option<Result<Tensor>> {
        crate::ops::tiles_fused(self.tiles()?, e, x)
    }

    fn normed_ok(&self, m: usize, dtype: DType) -> bool {
        self.tiles()
            .is_some_and(|t| crate::ops::tiles_fuse_ok(t, m, dtype))
    }

    fn forward_normed(
        &self,
        h: &Tensor,
        w: &Tensor,
        eps: f32,
        silu: bool,
    ) -> Option<Result<Tensor>> {
        crate::ops::tiles_normed(self.tiles()?, h, w, eps, silu)
    }

    fn forward_add(&self, x: &Tensor, res: &Tensor) -> Option<Result<Tensor>> {
        crate::ops::tiles_add(self.tiles()?, x, res)
    }

    fn plan(&self) -> Plan {
        if let Some(t) = self.tiles() {
            return crate::ops::tiles_plan(t, self.format);
        }
        let none =
            || Err("the reference path (dequantize + matmul) has no fused epilogue".to_string());
        Plan {
            matmul: format!(
                "{}: dequantize to the input dtype + candle matmul, every call (reference path)",
                self.format
            ),
            silu_mul: none(),
            f32_out: none(),
        }
    }

    fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let st = self.stored()?;
        Ok(vec![
            ("qweight".to_string(), st.qweight),
            ("scales".to_string(), st.scales),
            ("zeros".to_string(), st.zeros),
        ])
    }
}

/// `int{bits}` quantized by round to nearest or by GPTQ.
pub struct UniformCodec {
    pub bits: u32,
    pub gptq: bool,
}

impl Codec for UniformCodec {
    fn quantize(
        &self,
        format: WeightFormat,
        w: &Tensor,
        hessian: Option<&Tensor>,
        opts: &QuantOptions,
    ) -> Result<Box<dyn LinearWeights>> {
        // GPTQ fits its groups with the searched range, round to nearest with min/max.
        let rule = UniformRule {
            bits: self.bits,
            clip: self.gptq && opts.gptq.clip,
        };
        let q = match (self.gptq, hessian) {
            (false, _) => crate::gptq::round_to_nearest(w, &rule)?,
            (true, Some(h)) => crate::gptq::gptq(w, h, &rule, &opts.gptq)?.quantized,
            (true, None) => candle_core::bail!(
                "{format} needs calibration statistics (the layer input's Hessian) to quantize a {:?} weight; \
                 quantize the model through candle_lowbit::calib (the tools: --calib FILE)",
                w.shape()
            ),
        };
        Ok(Box::new(UniformWeights::from_codes(
            format, self.bits, &q.codes, &q.params,
        )?))
    }

    fn rebuild(
        &self,
        format: WeightFormat,
        shape: (usize, usize),
        tensors: &HashMap<String, Tensor>,
    ) -> Result<Box<dyn LinearWeights>> {
        let get = |name: &str| super::field(tensors, name, format, shape).cloned();
        Ok(Box::new(UniformWeights::new(
            format,
            self.bits,
            shape,
            get("qweight")?,
            get("scales")?,
            get("zeros")?,
        )?))
    }

    fn random(
        &self,
        format: WeightFormat,
        (n, k): (usize, usize),
        _opts: &QuantOptions,
        seed: u64,
        dev: &Device,
    ) -> Option<Result<Box<dyn LinearWeights>>> {
        let build = || -> Result<Box<dyn LinearWeights>> {
            if dev.is_cuda() {
                dev.set_seed(seed)?;
            }
            let (w, g) = (words_per_row(k, self.bits), groups(k));
            let mut q = super::w2416::random_words((n, w), dev)?;
            if !(k * self.bits as usize).is_multiple_of(32) {
                // Zero the padding bits of each row's last word (the layout asks for it).
                let keep = (k * self.bits as usize) % 32;
                let last = q.narrow(1, w - 1, 1)?;
                let base = Tensor::new(&[1u32 << keep], dev)?.reshape((1, 1))?;
                let low = (&last
                    - last
                        .broadcast_div(&base)?
                        .affine(f64::from(1u32 << keep), 0.0)?)?;
                q = Tensor::cat(&[q.narrow(1, 0, w - 1)?, low], 1)?;
            }
            let step = 1.0 / ((k as f64).sqrt() * f64::from((1u32 << self.bits) - 1));
            let scales =
                (Tensor::rand(0.5f32, 1.5f32, (n, g), dev)? * step)?.to_dtype(DType::F16)?;
            let zeros = (scales.to_dtype(DType::F32)? * (-f64::from(1u32 << (self.bits - 1))))?
                .to_dtype(DType::F16)?;
            Ok(Box::new(UniformWeights::new(
                format,
                self.bits,
                (n, k),
                q,
                scales,
                zeros,
            )?))
        };
        Some(build())
    }
}
