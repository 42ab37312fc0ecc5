//! `QLinear`: the one linear-layer type of the crate, and the swap point for weight formats.
//!
//! Every projection of the drop-in Llama is a `QLinear`. Today it holds either a dense
//! weight (`[out, in]` in the run dtype) or one of candle's own GGML formats through
//! `QMatMul` (the peers every later format is measured against). Later formats add
//! variants here; the model does not change.
//!
//! ```no_run
//! # fn main() -> candle_core::Result<()> {
//! use candle_lowbit::{QLinear, WeightFormat};
//! use candle_nn::Module;
//! # let dev = candle_core::Device::Cpu;
//! let w = candle_core::Tensor::randn(0f32, 1., (256, 512), &dev)?; // [out, in]
//! let dense = QLinear::from_weight(w, None);
//! let q4 = dense.quantize(WeightFormat::Q4_0)?; // candle's Q4_0 through QMatMul
//! let x = candle_core::Tensor::randn(0f32, 1., (3, 512), &dev)?;
//! let y = q4.forward(&x)?; // [3, 256]
//! # Ok(()) }
//! ```

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};

/// A weight format a `QLinear` can hold. Parse one from a CLI string with `str::parse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Unquantized, kept in the run dtype (f16 on GPU by default). CLI: `f16` or `dense`.
    Dense,
    /// candle's GGML formats, quantized from the loaded weights.
    Q8_0,
    Q4_0,
    Q4_1,
    Q4K,
    Q3K,
    Q2K,
}

impl WeightFormat {
    /// Every format, in the order of `NAMES`: the registry the benchmark iterates over.
    pub const ALL: &'static [Self] = &[Self::Dense, Self::Q8_0, Self::Q4_0, Self::Q4_1, Self::Q4K, Self::Q3K, Self::Q2K];

    /// Every CLI name, in the order `--help` lists them.
    pub const NAMES: &'static [&'static str] = &["f16", "q8_0", "q4_0", "q4_1", "q4k", "q3k", "q2k"];

    pub fn name(&self) -> &'static str {
        match self {
            Self::Dense => "f16",
            Self::Q8_0 => "q8_0",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q4K => "q4k",
            Self::Q3K => "q3k",
            Self::Q2K => "q2k",
        }
    }

    /// The GGML dtype for a matrix of rows `k` long, and whether a fallback was taken.
    ///
    /// candle's k-quants need rows that are a multiple of 256. Other widths fall back to a
    /// block-32 format as llama.cpp does: Q2K and Q3K to Q4_0, Q4K to Q5_0.
    pub fn ggml_dtype(&self, k: usize) -> Option<(GgmlDType, bool)> {
        let (want, fallback) = match self {
            Self::Dense => return None,
            Self::Q8_0 => (GgmlDType::Q8_0, GgmlDType::Q8_0),
            Self::Q4_0 => (GgmlDType::Q4_0, GgmlDType::Q4_0),
            Self::Q4_1 => (GgmlDType::Q4_1, GgmlDType::Q4_1),
            Self::Q4K => (GgmlDType::Q4K, GgmlDType::Q5_0),
            Self::Q3K => (GgmlDType::Q3K, GgmlDType::Q4_0),
            Self::Q2K => (GgmlDType::Q2K, GgmlDType::Q4_0),
        };
        if k % want.block_size() == 0 {
            Some((want, false))
        } else {
            Some((fallback, true))
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for WeightFormat {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "f16" | "dense" => Self::Dense,
            "q8_0" => Self::Q8_0,
            "q4_0" => Self::Q4_0,
            "q4_1" => Self::Q4_1,
            "q4k" | "q4_k" => Self::Q4K,
            "q3k" | "q3_k" => Self::Q3K,
            "q2k" | "q2_k" => Self::Q2K,
            _ => candle_core::bail!(
                "unknown weight format '{s}'; supported: {}",
                Self::NAMES.join(", ")
            ),
        })
    }
}

/// A linear layer `y = x Wᵀ (+ b)` over any weight format of the crate.
///
/// Input `[.., in]`, output `[.., out]`, in the input's dtype (f32/f16/bf16).
#[derive(Debug, Clone)]
pub enum QLinear {
    /// Dense weight `[out, in]` in the run dtype; optional bias `[out]`.
    Dense { w: Tensor, b: Option<Tensor> },
    /// One of candle's GGML formats (`QMatMul`); returns the input dtype.
    Ggml { w: QMatMul, dtype: GgmlDType, shape: (usize, usize), b: Option<Tensor> },
}

impl QLinear {
    /// From a weight `[out, in]` and optional bias `[out]`.
    pub fn from_weight(w: Tensor, b: Option<Tensor>) -> Self {
        Self::Dense { w, b }
    }

    /// From a `candle_nn::Linear`: swap this in wherever a model builds one.
    pub fn from_linear(l: &candle_nn::Linear) -> Self {
        Self::Dense { w: l.weight().clone(), b: l.bias().cloned() }
    }

    /// Load `weight` (and `bias` if `bias`) of shape `[out, in]` from a `VarBuilder`,
    /// as `candle_nn::linear` / `linear_no_bias` would.
    pub fn load(in_dim: usize, out_dim: usize, bias: bool, vb: candle_nn::VarBuilder) -> Result<Self> {
        let w = vb.get((out_dim, in_dim), "weight")?;
        let b = if bias { Some(vb.get(out_dim, "bias")?) } else { None };
        Ok(Self::Dense { w, b })
    }

    /// `(out, in)`.
    pub fn shape(&self) -> Result<(usize, usize)> {
        match self {
            Self::Dense { w, .. } => w.dims2(),
            Self::Ggml { shape, .. } => Ok(*shape),
        }
    }

    /// The format this layer holds, by name (e.g. `f16`, `q4_0`, `q5_0`).
    pub fn format_name(&self) -> String {
        match self {
            Self::Dense { w, .. } => format!("{:?}", w.dtype()).to_lowercase(),
            Self::Ggml { dtype, .. } => format!("{dtype:?}").to_lowercase(),
        }
    }

    /// Bytes of weight storage (codes, scales, everything the matmul reads; bias excluded).
    pub fn weight_bytes(&self) -> Result<usize> {
        Ok(match self {
            Self::Dense { w, .. } => w.elem_count() * w.dtype().size_in_bytes(),
            Self::Ggml { dtype, shape, .. } => {
                shape.0 * shape.1 / dtype.block_size() * dtype.type_size()
            }
        })
    }

    /// Bits per weight including every byte of metadata.
    pub fn bits_per_weight(&self) -> Result<f64> {
        let (n, k) = self.shape()?;
        Ok(self.weight_bytes()? as f64 * 8.0 / (n * k) as f64)
    }

    /// The dense weight `[out, in]` in f32 (dequantized if needed).
    pub fn dequantize(&self) -> Result<Tensor> {
        match self {
            Self::Dense { w, .. } => w.to_dtype(DType::F32),
            Self::Ggml { w, .. } => match w {
                QMatMul::QTensor(q) => q.dequantize(&q.device()),
                QMatMul::Tensor(t) | QMatMul::TensorF16(t) => t.to_dtype(DType::F32),
            },
        }
    }

    /// Re-encode this layer's weight in `format` (from its dense values).
    /// Returns the new layer; `Dense` keeps the current weight dtype.
    pub fn quantize(&self, format: WeightFormat) -> Result<Self> {
        let (n, k) = self.shape()?;
        let b = match self {
            Self::Dense { b, .. } | Self::Ggml { b, .. } => b.clone(),
        };
        match format.ggml_dtype(k) {
            None => match self {
                Self::Dense { .. } => Ok(self.clone()),
                Self::Ggml { .. } => Ok(Self::Dense { w: self.dequantize()?, b }),
            },
            Some((dtype, _)) => {
                let w = self.dequantize()?;
                let q = QTensor::quantize(&w, dtype)?;
                Ok(Self::Ggml { w: QMatMul::from_qtensor(q)?, dtype, shape: (n, k), b })
            }
        }
    }
}

/// Where dense layers on the GPU use the skinny-matmul kernel (`ops::gemv`) instead of
/// cuBLAS: up to `GEMV_ROWS` rows of input. Measured on the H200 (f16, full bench run of
/// 2026-12-01 07:47, BENCHMARKS.md): at m = 1, 4096x4096 9.5 µs against cuBLAS's 14.3,
/// 11008x4096 21.9 against 27.2, 4096x11008 22.4 against 29.5; at m = 2 / 4 / 8 cuBLAS won
/// against the kernel's earlier one-warp-per-row form (4096x4096: 15.0 / 15.5 / 16.1 against
/// 16.6 / 24.1 / 39.6), so those stay on cuBLAS.
pub const GEMV_ROWS: usize = 1;

fn use_gemv(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cuda()
        && x.dims2().is_ok_and(|(m, _)| m <= GEMV_ROWS)
        && crate::ops::gemv_ok(x, w)
}

/// `x [m, k] · w [n, k]ᵀ` in `out` (x's dtype or f32): the skinny-matmul kernel on the
/// GPU for decode-sized `m`, candle's matmul (cuBLAS / gemm) otherwise.
fn dense_matmul(x: &Tensor, w: &Tensor, out: DType) -> Result<Tensor> {
    if use_gemv(x, w) {
        return crate::ops::gemv(x, w, out);
    }
    x.matmul(&w.t()?)?.to_dtype(out)
}

impl QLinear {
    /// `forward` with f32 output (an output head's logits): dense weights on the GPU at
    /// decode sizes write f32 straight from the f32 accumulators, without a cast.
    pub fn forward_f32(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense { w, b: None } if use_gemv(x, w) => {
                crate::ops::gemv(x, w, DType::F32)
            }
            _ => self.forward(x)?.to_dtype(DType::F32),
        }
    }

    /// `ops::silu_mul(&self.forward(x)?)` for a gate/up layer (weight rows: gate, then up):
    /// `[.., 2 I]` → `[.., I]`. Dense weights on the GPU at decode sizes do it in one
    /// launch (`ops::gemv_silu_mul`, bit-identical to the pair).
    pub fn forward_silu_mul(&self, x: &Tensor) -> Result<Tensor> {
        if let Self::Dense { w, b: None } = self {
            let k = w.dim(1)?;
            if x.dim(candle_core::D::Minus1)? == k && w.dim(0)? % 2 == 0 {
                let x2 = x.reshape((x.elem_count() / k.max(1), k))?;
                if use_gemv(&x2, w) {
                    let mut dims = x.dims().to_vec();
                    if let Some(last) = dims.last_mut() {
                        *last = w.dim(0)? / 2;
                    }
                    return crate::ops::gemv_silu_mul(&x2, w)?.reshape(dims);
                }
            }
        }
        crate::ops::silu_mul(&self.forward(x)?)
    }
}

impl Module for QLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, k) = self.shape()?;
        let xk = x.dim(candle_core::D::Minus1)?;
        if xk != k {
            candle_core::bail!("QLinear: input {:?} does not end in in_dim {k} (weight [{n}, {k}])", x.shape())
        }
        let y = match self {
            Self::Dense { w, .. } => {
                if x.dtype() != w.dtype() {
                    candle_core::bail!("QLinear: input dtype {:?} != weight dtype {:?}", x.dtype(), w.dtype())
                }
                // One GEMM over all leading dims: [m, k] x [k, n].
                let mut out_dims = x.dims().to_vec();
                let m = x.elem_count() / k;
                if let Some(last) = out_dims.last_mut() {
                    *last = n;
                }
                dense_matmul(&x.reshape((m, k))?, w, x.dtype())?.reshape(out_dims)?
            }
            // candle's quantized matmuls take f32/f16/bf16 inputs directly (CUDA: the
            // MMVQ/MMQ paths for every format here; CPU: all three), output in that dtype.
            Self::Ggml { w, .. } => match x.dtype() {
                DType::F32 | DType::F16 | DType::BF16 => w.forward(&x.contiguous()?)?,
                dt => candle_core::bail!("QLinear: unsupported input dtype {dt:?} (f32, f16, bf16)"),
            },
        };
        match self {
            Self::Dense { b: Some(b), .. } | Self::Ggml { b: Some(b), .. } => y.broadcast_add(b),
            _ => Ok(y),
        }
    }
}
