//! The W4A4 ops (formats and CPU references: `src/formats/w4a4.rs`; kernels:
//! `cuda/w4a4.cu`).
//!
//! - [`w4a4_quantize`]: activations into codes and scales for a W4A4 projection, fused with
//!   the op before it ([`ActSource`]: add + RMSNorm, RMSNorm, SiLU·mul, or nothing) and the
//!   layer's channel permutation. One launch.
//! - [`w4a4_matmul`]: the INT8-MMA GEMM over those codes. One launch: a skinny kernel for
//!   `m <=` [`W4A4_SKINNY_MAX_M`], tiles above ([`W4a4Kernel`]: wgmma on sm_90a builds,
//!   `mma.sync` elsewhere).
//!
//! On the CPU both run the format module's references.

use super::contiguous_slice;
use super::decode::{cpu_f32, cpu_storage_as};
use super::kv_quant::round_to;
use crate::formats::w4a4::{
    blocks, matmul_ref, quantize_activations, scales_block_major, scales_token_major, ActSpec,
    QuantAct, W4a4Weights,
};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use std::sync::Arc;

/// Largest `m` the skinny GEMM takes (above it, a tiled one): measured on the H200, two or
/// four m16 tiles in the skinny kernel lost to the tiled one (11008 x 4096: m = 32 82 µs
/// against 64 at m = 64 tiled).
pub const W4A4_SKINNY_MAX_M: usize = 16;

/// The GPU kernel that runs a W4A4 GEMM ([`w4a4_matmul`] picks one with
/// [`W4a4Kernel::choose`]; [`w4a4_matmul_with`] takes it from the caller, for tests and the
/// bench). The CPU runs the format's reference whatever the choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum W4a4Kernel {
    /// One m16 tile, weights straight from global memory: `m <=` [`W4A4_SKINNY_MAX_M`].
    Skinny,
    /// `mma.sync` 128 × 128 tiles: any m, any sm_80+ build.
    Mma,
    /// `wgmma` over 128 weight rows × 64 tokens, `ctas_per_sm` (1: two sets of sums per
    /// thread, 8 stages; 2: one set, 4 stages) resident per SM: builds for sm_90a.
    Wgmma { ctas_per_sm: usize },
    /// Warp-specialized: TMA loads and mbarriers feed two `wgmma` warpgroups that take
    /// turns on the tensor cores, 128 weight rows × 128 tokens per CTA: builds for sm_90a.
    Tma,
}

impl W4a4Kernel {
    /// Whether this build's kernels can run `self` for `m` tokens.
    pub fn available(self, m: usize) -> bool {
        match self {
            Self::Skinny => m <= W4A4_SKINNY_MAX_M,
            Self::Mma => true,
            Self::Wgmma { ctas_per_sm } => {
                (ctas_per_sm == 1 || ctas_per_sm == 2) && crate::kernels::wgmma_built()
            }
            Self::Tma => crate::kernels::wgmma_built(),
        }
    }

    /// The kernel for `m` tokens and `n` weight rows: skinny up to
    /// [`W4A4_SKINNY_MAX_M`]; above, where the build has wgmma, the warp-specialized GEMM
    /// from [`W4A4_TMA_MIN_M`] tokens and the warpgroup GEMM below (one CTA per SM while
    /// its 64-token tiles do not outnumber the H200's 132 SMs, two beyond: measured at
    /// Llama-2-7B shapes); `mma.sync` tiles otherwise.
    pub fn choose(m: usize, n: usize) -> Self {
        if m <= W4A4_SKINNY_MAX_M {
            Self::Skinny
        } else if crate::kernels::wgmma_built() && tma_wanted(m) {
            Self::Tma
        } else if crate::kernels::wgmma_built() {
            Self::Wgmma {
                ctas_per_sm: if wgmma_tiles(m, n) <= H200_SMS { 1 } else { 2 },
            }
        } else {
            Self::Mma
        }
    }
}

/// Fewest tokens the warp-specialized GEMM ([`W4a4Kernel::Tma`]) takes by default.
/// Measured on the H200 at Llama-2-7B shapes (BENCHMARKS.md, 2026-12-04): 1.27–1.33× the
/// warpgroup GEMM at m = 2048 on all three, mixed at 256 (0.84× on 4096², 1.09× and 1.14×
/// on the others) and at 128; 1024 lies between and was not measured.
pub const W4A4_TMA_MIN_M: usize = 1024;

/// Whether [`W4a4Kernel::choose`] takes the warp-specialized GEMM for `m` tokens: `m >=`
/// [`W4A4_TMA_MIN_M`] unless the environment says `CANDLE_LOWBIT_W4A4_TMA=1` (every `m`
/// above the skinny kernel's) or `=0` (none); the variable is read once per process.
fn tma_wanted(m: usize) -> bool {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let mode = *MODE.get_or_init(
        || match std::env::var("CANDLE_LOWBIT_W4A4_TMA").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        },
    );
    mode.unwrap_or(m >= W4A4_TMA_MIN_M)
}

/// CTAs of a warp-specialized grid before split-k: 128 weight rows × 128 tokens each.
#[cfg(feature = "cuda")]
pub(super) fn tma_tiles(m: usize, n: usize) -> usize {
    n.div_ceil(128) * m.div_ceil(128)
}

/// SMs of the H200 (the wgmma variant and split-k choices were measured there).
pub(super) const H200_SMS: usize = 132;

/// CTAs of a wgmma grid before split-k: 128 weight rows × 64 tokens each.
pub(super) fn wgmma_tiles(m: usize, n: usize) -> usize {
    n.div_ceil(128) * m.div_ceil(64)
}

/// What [`w4a4_quantize`] quantizes: each `[.., k]` in f32/f16/bf16 (one dtype), `w` `[k]`.
#[derive(Debug, Clone, Copy)]
pub enum ActSource<'a> {
    /// `x` as it is.
    Plain(&'a Tensor),
    /// `rmsnorm(x) · w`.
    RmsNorm {
        x: &'a Tensor,
        w: &'a Tensor,
        eps: f32,
    },
    /// `s = x + res` (rounded to the dtype, returned), then `rmsnorm(s) · w`.
    AddRmsNorm {
        x: &'a Tensor,
        res: &'a Tensor,
        w: &'a Tensor,
        eps: f32,
    },
    /// `silu(gate) · up` of `gu` `[.., 2 k]` (gate then up), as `ops::silu_mul` rounds it.
    SiluMul(&'a Tensor),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    Plain = 0,
    RmsNorm = 1,
    AddRmsNorm = 2,
    SiluMul = 3,
}

/// The raw bytes of a contiguous tensor (u8, u32 or a float dtype), on the CPU.
pub fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?.to_device(&candle_core::Device::Cpu)?;
    let (st, l) = t.storage_and_layout();
    match &*st {
        candle_core::Storage::Cpu(s) => cpu_bytes(s, l),
        _ => candle_core::bail!("tensor_bytes: the tensor did not come to the CPU"),
    }
}

/// Quantize `src` for a projection reading `spec`. Returns the residual sum (for
/// [`ActSource::AddRmsNorm`], shaped like `x`) and the codes.
pub fn w4a4_quantize(src: ActSource, spec: &Arc<ActSpec>) -> Result<(Option<Tensor>, QuantAct)> {
    let k = spec.k;
    let (mode, x, res, w, eps) = match src {
        ActSource::Plain(x) => (Mode::Plain, x, x, x, 0.0),
        ActSource::RmsNorm { x, w, eps } => (Mode::RmsNorm, x, x, w, eps),
        ActSource::AddRmsNorm { x, res, w, eps } => (Mode::AddRmsNorm, x, res, w, eps),
        ActSource::SiluMul(gu) => (Mode::SiluMul, gu, gu, gu, 0.0),
    };
    let width = if mode == Mode::SiluMul { 2 * k } else { k };
    let xk = x.dim(candle_core::D::Minus1)?;
    if xk != width || !matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!(
            "w4a4_quantize: input {:?} {:?} for a layer of in_dim {k} ({mode:?} wants [.., {width}] f32/f16/bf16)",
            x.shape(),
            x.dtype()
        )
    }
    if mode == Mode::AddRmsNorm && (res.shape() != x.shape() || res.dtype() != x.dtype()) {
        candle_core::bail!(
            "w4a4_quantize: res {:?} {:?} does not match x {:?} {:?}",
            res.shape(),
            res.dtype(),
            x.shape(),
            x.dtype()
        )
    }
    if matches!(mode, Mode::RmsNorm | Mode::AddRmsNorm)
        && (w.dims() != [k] || w.dtype() != x.dtype())
    {
        candle_core::bail!(
            "w4a4_quantize: norm weight {:?} {:?}, want [{k}] {:?}",
            w.shape(),
            w.dtype(),
            x.dtype()
        )
    }
    let m = x.elem_count() / width;
    let mut dims = x.dims().to_vec();
    if let Some(d) = dims.last_mut() {
        *d = k;
    }
    let op = Quantize {
        spec: spec.clone(),
        mode,
        m,
        eps,
    };
    let x2 = x.reshape((m, width))?.contiguous()?;
    let out = x2.apply_op3_no_bwd(
        &res.flatten_all()?.contiguous()?,
        &w.flatten_all()?.contiguous()?,
        &op,
    )?;
    let sum_elems = if mode == Mode::AddRmsNorm { m * k } else { 0 };
    let sum = match sum_elems {
        0 => None,
        n => Some(out.narrow(0, 0, n)?.reshape(dims.clone())?),
    };
    let rest = out.dim(0)? - sum_elems;
    let act = QuantAct {
        buf: out.narrow(0, sum_elems, rest)?,
        m,
        dims,
        dtype: x.dtype(),
        spec: spec.clone(),
    };
    Ok((sum, act))
}

pub(super) struct Quantize {
    pub(super) spec: Arc<ActSpec>,
    pub(super) mode: Mode,
    pub(super) m: usize,
    pub(super) eps: f32,
}

impl Quantize {
    /// Elements of the flat output: the sum (add mode) then the codes and scales.
    pub(super) fn out_len(&self, dt: DType) -> (usize, usize) {
        let k = self.spec.k;
        let sum = if self.mode == Mode::AddRmsNorm {
            self.m * k
        } else {
            0
        };
        let bytes = QuantAct::bytes(self.m, k);
        (sum, sum + bytes.div_ceil(dt.size_in_bytes()))
    }

    /// The CPU reference: values in the input's channel order (rounded as the kernels
    /// round them), and the residual sum.
    fn values(&self, x: &[f32], res: &[f32], w: &[f32], dt: DType) -> (Vec<f32>, Vec<f32>) {
        let (m, k) = (self.m, self.spec.k);
        let mut v = vec![0f32; m * k];
        let mut sum = vec![];
        for i in 0..m {
            let row = &mut v[i * k..(i + 1) * k];
            match self.mode {
                Mode::Plain => row.copy_from_slice(&x[i * k..(i + 1) * k]),
                Mode::SiluMul => {
                    for c in 0..k {
                        let (g, u) = (x[i * 2 * k + c], x[i * 2 * k + k + c]);
                        let sg = round_to(g / (1. + (-g).exp()), dt);
                        row[c] = round_to(sg * u, dt);
                    }
                }
                Mode::RmsNorm | Mode::AddRmsNorm => {
                    let s: Vec<f32> = (0..k)
                        .map(|c| match self.mode {
                            Mode::AddRmsNorm => round_to(x[i * k + c] + res[i * k + c], dt),
                            _ => x[i * k + c],
                        })
                        .collect();
                    let ss: f32 = s.iter().map(|v| v * v).sum();
                    let inv = 1.0 / (ss / k as f32 + self.eps).sqrt();
                    for c in 0..k {
                        row[c] = round_to(s[c] * inv * w[c], dt);
                    }
                    if self.mode == Mode::AddRmsNorm {
                        sum.extend_from_slice(&s);
                    }
                }
            }
        }
        (v, sum)
    }
}

/// A flat CPU storage of `dt` holding `vals` (each rounded to `dt`) then `bytes`
/// (reinterpreted, zero-padded to whole elements).
fn storage_of(dt: DType, vals: &[f32], bytes: &[u8]) -> Result<CpuStorage> {
    let size = dt.size_in_bytes();
    let mut b = bytes.to_vec();
    b.resize(bytes.len().div_ceil(size) * size, 0);
    Ok(match dt {
        DType::F32 => CpuStorage::F32(
            vals.iter()
                .copied()
                .chain(
                    b.chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                )
                .collect(),
        ),
        DType::F16 => CpuStorage::F16(
            vals.iter()
                .map(|&v| half::f16::from_f32(v))
                .chain(
                    b.chunks_exact(2)
                        .map(|c| half::f16::from_le_bytes([c[0], c[1]])),
                )
                .collect(),
        ),
        DType::BF16 => CpuStorage::BF16(
            vals.iter()
                .map(|&v| half::bf16::from_f32(v))
                .chain(
                    b.chunks_exact(2)
                        .map(|c| half::bf16::from_le_bytes([c[0], c[1]])),
                )
                .collect(),
        ),
        dt => candle_core::bail!("w4a4_quantize: unsupported dtype {dt:?}"),
    })
}

impl CustomOp3 for Quantize {
    fn name(&self) -> &'static str {
        "w4a4-quantize"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dt = s1.dtype();
        let x = cpu_f32(s1, l1)?;
        let res = cpu_f32(s2, l2)?;
        let w = cpu_f32(s3, l3)?;
        let (v, sum) = self.values(&x, &res, &w, dt);
        let (m, k) = (self.m, self.spec.k);
        let perm = self.spec.perm_vec()?;
        let mut ordered = vec![0f32; m * k];
        for i in 0..m {
            for j in 0..k {
                ordered[i * k + j] = v[i * k + perm[j] as usize];
            }
        }
        let (codes, scales) = quantize_activations(&ordered, m, &self.spec);
        let mut bytes: Vec<u8> = codes.iter().map(|&c| c as u8).collect();
        bytes.extend(scales_block_major(&scales, m, self.spec.blocks()));
        let (_, len) = self.out_len(dt);
        Ok((storage_of(dt, &sum, &bytes)?, Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::w4a4_cuda::quantize(self, (s1, l1), (s2, l2), (s3, l3))
    }
}

/// `a` (quantized for `w`) times `w`ᵀ: `[.., n]` in `dtype` (f32, f16, bf16).
pub fn w4a4_matmul(a: &QuantAct, w: &W4a4Weights, dtype: DType) -> Result<Tensor> {
    use crate::formats::LinearWeights;
    w4a4_matmul_with(a, w, dtype, W4a4Kernel::choose(a.m, w.shape().0))
}

/// [`w4a4_matmul`] on a given GPU kernel (an error where this build or `m` cannot run it).
pub fn w4a4_matmul_with(
    a: &QuantAct,
    w: &W4a4Weights,
    dtype: DType,
    kernel: W4a4Kernel,
) -> Result<Tensor> {
    use crate::formats::LinearWeights;
    let (n, k) = w.shape();
    if !kernel.available(a.m) {
        candle_core::bail!(
            "w4a4_matmul: kernel {kernel:?} cannot run m = {} in this build",
            a.m
        )
    }
    if a.spec.k != k || a.spec.kn != w.act().kn {
        candle_core::bail!(
            "w4a4_matmul: activations of {} channels (INT8 from {}) for a [{n}, {k}] weight (INT8 from {})",
            a.spec.k,
            a.spec.kn,
            w.act().kn
        )
    }
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("w4a4_matmul: output dtype {dtype:?} (f32, f16, bf16)")
    }
    let need = QuantAct::bytes(a.m, k);
    let have = a.buf.elem_count() * a.buf.dtype().size_in_bytes();
    if have < need || !a.buf.is_contiguous() {
        candle_core::bail!(
            "w4a4_matmul: activation buffer of {have} bytes (contiguous: {}) for [{}, {k}], want {need}",
            a.buf.is_contiguous(),
            a.m
        )
    }
    let mut dims = a.dims.clone();
    if let Some(d) = dims.last_mut() {
        *d = n;
    }
    let op = Matmul {
        w: w.clone(),
        m: a.m,
        dtype,
        kernel,
    };
    a.buf.apply_op1_no_bwd(&op)?.reshape(dims)
}

pub(super) struct Matmul {
    pub(super) w: W4a4Weights,
    pub(super) m: usize,
    pub(super) dtype: DType,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) kernel: W4a4Kernel,
}

impl CustomOp1 for Matmul {
    fn name(&self) -> &'static str {
        "w4a4-matmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        use crate::formats::LinearWeights;
        let (n, k) = self.w.shape();
        let m = self.m;
        let bytes = cpu_bytes(s, l)?;
        let a: Vec<i8> = bytes[..m * k].iter().map(|&b| b as i8).collect();
        let sa = scales_token_major(&bytes[m * k..QuantAct::bytes(m, k)], m, blocks(k));
        let (wq, sw) = self.w.codes()?;
        let y = matmul_ref(&a, &sa, &wq, &sw, (m, n, k));
        Ok((cpu_storage_as(y, self.dtype), Shape::from((m, n))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        super::w4a4_cuda::matmul(self, s, l)
    }
}

/// The bytes of a contiguous CPU storage region (u8, u32, f32, f16, bf16).
fn cpu_bytes(s: &CpuStorage, l: &Layout) -> Result<Vec<u8>> {
    Ok(match s {
        CpuStorage::U8(_) => contiguous_slice::<u8>(s, l, "act")?.to_vec(),
        CpuStorage::U32(_) => contiguous_slice::<u32>(s, l, "act")?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        CpuStorage::F32(_) => contiguous_slice::<f32>(s, l, "act")?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        CpuStorage::F16(_) => contiguous_slice::<half::f16>(s, l, "act")?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        CpuStorage::BF16(_) => contiguous_slice::<half::bf16>(s, l, "act")?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        _ => candle_core::bail!("w4a4: a buffer of dtype {:?}", s.dtype()),
    })
}
