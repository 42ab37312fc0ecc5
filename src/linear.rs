//! `QLinear`: the one linear-layer type of the crate, and the swap point for weight formats.
//!
//! Every projection of the drop-in Llama is a `QLinear`: a format's packed weights
//! ([`LinearWeights`], `src/formats/`) and an optional bias, with the kernel choice made
//! once when the layer is built ([`Plan`]). Adding a format touches neither this file nor
//! the model.
//!
//! ```no_run
//! # fn main() -> candle_core::Result<()> {
//! use candle_lowbit::{QLinear, WeightFormat};
//! use candle_nn::Module;
//! # let dev = candle_core::Device::Cpu;
//! let w = candle_core::Tensor::randn(0f32, 1., (256, 512), &dev)?; // [out, in]
//! let dense = QLinear::from_weight(w, None)?;
//! let q4 = dense.quantize(WeightFormat::Q4_0)?; // candle's Q4_0 through QMatMul
//! let i4 = dense.quantize(WeightFormat::Int4)?; // asymmetric int4 groups of 128
//! let x = candle_core::Tensor::randn(0f32, 1., (3, 512), &dev)?;
//! let y = q4.forward(&x)?; // [3, 256]
//! # Ok(()) }
//! ```

use crate::formats::dense::DenseWeights;
use crate::formats::{
    Activation, Epilogue, InputEncoding, LinearWeights, Plan, QuantOptions, WeightFormat,
};
use candle_core::{DType, Module, Result, Tensor};
use std::sync::Arc;

/// A linear layer `y = x Wᵀ (+ b)` over any weight format of the crate.
///
/// Input `[.., in]`, output `[.., out]`, in the input's dtype (f32/f16/bf16).
#[derive(Debug, Clone)]
pub struct QLinear {
    w: Arc<dyn LinearWeights>,
    b: Option<Tensor>,
    plan: Arc<Plan>,
}

impl QLinear {
    /// A layer over a format's weights, with an optional bias `[out]`.
    pub fn new(w: Box<dyn LinearWeights>, b: Option<Tensor>) -> Self {
        let plan = Arc::new(w.plan());
        Self {
            w: Arc::from(w),
            b,
            plan,
        }
    }

    /// From a dense weight `[out, in]` (f32, f16 or bf16) and optional bias `[out]`.
    pub fn from_weight(w: Tensor, b: Option<Tensor>) -> Result<Self> {
        Ok(Self::new(Box::new(DenseWeights::new(w)?), b))
    }

    /// From a `candle_nn::Linear`: swap this in wherever a model builds one.
    pub fn from_linear(l: &candle_nn::Linear) -> Result<Self> {
        Self::from_weight(l.weight().clone(), l.bias().cloned())
    }

    /// Load `weight` (and `bias` if `bias`) of shape `[out, in]` from a `VarBuilder`,
    /// as `candle_nn::linear` / `linear_no_bias` would.
    pub fn load(
        in_dim: usize,
        out_dim: usize,
        bias: bool,
        vb: candle_nn::VarBuilder,
    ) -> Result<Self> {
        let w = vb.get((out_dim, in_dim), "weight")?;
        let b = if bias {
            Some(vb.get(out_dim, "bias")?)
        } else {
            None
        };
        Self::from_weight(w, b)
    }

    /// The packed weights.
    pub fn weights(&self) -> &dyn LinearWeights {
        self.w.as_ref()
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.b.as_ref()
    }

    /// The kernels this layer uses, and why a fused path is not taken where it is not.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn format(&self) -> WeightFormat {
        self.w.format()
    }

    /// `(out, in)`.
    pub fn shape(&self) -> (usize, usize) {
        self.w.shape()
    }

    /// The concrete encoding by name (e.g. `f16`, `q4_0`, `q5_0` for a q4k fallback, `int4`).
    pub fn format_name(&self) -> String {
        self.w.encoding()
    }

    /// Bytes of weight storage (codes, scales, everything the matmul reads; bias excluded).
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes()
    }

    /// Bits per weight including every byte of metadata.
    pub fn bits_per_weight(&self) -> f64 {
        let (n, k) = self.shape();
        self.weight_bytes() as f64 * 8.0 / (n * k).max(1) as f64
    }

    /// The dense weight `[out, in]` in f32 (dequantized if needed).
    pub fn dequantize(&self) -> Result<Tensor> {
        self.w.dequantize()
    }

    /// Re-encode this layer's weight in `format` from its dense values, for formats that
    /// need no calibration (a GPTQ format needs [`QLinear::quantize_with`]). `Dense` keeps
    /// a dense layer as it is and dequantizes others to f32.
    pub fn quantize(&self, format: WeightFormat) -> Result<Self> {
        self.quantize_with(format, None, &QuantOptions::default())
    }

    /// [`QLinear::quantize`] with the layer input's Hessian `XᵀX / count` `[in, in]` (f32)
    /// for formats that need one, and quantizer options.
    pub fn quantize_with(
        &self,
        format: WeightFormat,
        hessian: Option<&Tensor>,
        opts: &QuantOptions,
    ) -> Result<Self> {
        if format == WeightFormat::Dense && self.format() == WeightFormat::Dense {
            return Ok(self.clone());
        }
        let w = self.dequantize()?;
        let q = format.spec().codec.quantize(format, &w, hessian, opts)?;
        Ok(Self::new(q, self.b.clone()))
    }

    /// A layer holding its own copy of every tensor (same values, new device buffers).
    pub fn deep_copy(&self) -> Result<Self> {
        let tensors = self
            .w
            .tensors()?
            .into_iter()
            .map(|(k, t)| Ok((k, t.copy()?)))
            .collect::<Result<_>>()?;
        let w = self
            .format()
            .spec()
            .codec
            .rebuild(self.format(), self.shape(), &tensors)?;
        Ok(Self::new(w, self.b.as_ref().map(Tensor::copy).transpose()?))
    }

    /// What this projection reads (asked once, at load).
    pub fn input_encoding(&self) -> InputEncoding {
        self.w.input_encoding()
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// `f(x as [m, k])` reshaped back to `x`'s leading dims and `out` columns.
    fn rows(
        &self,
        x: &Tensor,
        out: usize,
        f: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (n, k) = self.shape();
        let xk = x.dim(candle_core::D::Minus1)?;
        if xk != k {
            candle_core::bail!(
                "QLinear: input {:?} does not end in in_dim {k} (weight [{n}, {k}])",
                x.shape()
            )
        }
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        let x2 = x.reshape((x.elem_count() / k.max(1), k))?.contiguous()?;
        f(&x2)?.reshape(dims)
    }

    /// The fused path `e` where the plan allows it and this call is in its range.
    fn fused(&self, e: Epilogue, x: &Tensor, out: usize) -> Option<Result<Tensor>> {
        if self.b.is_some() || self.plan.epilogue(e).is_err() {
            return None;
        }
        let (_, k) = self.shape();
        if x.dim(candle_core::D::Minus1).ok()? != k {
            return None;
        }
        let x2 = x.reshape((x.elem_count() / k.max(1), k)).ok()?;
        let y = self.w.forward_fused(e, &x2)?;
        let mut dims = x.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        Some(y.and_then(|y| y.reshape(dims)))
    }

    /// `forward` with f32 output (an output head's logits): where the format offers it,
    /// the f32 accumulators are written without a cast.
    pub fn forward_f32(&self, x: &Tensor) -> Result<Tensor> {
        match self.fused(Epilogue::F32Out, x, self.shape().0) {
            Some(y) => y,
            None => self.forward(x)?.to_dtype(DType::F32),
        }
    }

    /// `ops::silu_mul(&self.forward(x)?)` for a gate/up layer (weight rows: gate, then up):
    /// `[.., 2 I]` → `[.., I]`, in one launch where the format has the epilogue.
    pub fn forward_silu_mul(&self, x: &Tensor) -> Result<Tensor> {
        match self.fused(Epilogue::SiluMul, x, self.shape().0 / 2) {
            Some(y) => y,
            None => crate::ops::silu_mul(&self.forward(x)?),
        }
    }

    /// `forward` of an input in whatever encoding this layer asked for (a dense input is
    /// always taken: a quantizing format quantizes it first).
    pub fn forward_act(&self, x: &Activation) -> Result<Tensor> {
        match x {
            Activation::Dense(t) => self.forward(t),
            Activation::W4a4(a) => self.add_bias(self.w.forward_quantized(a, a.dtype)?),
            Activation::Normed { h, w, eps } => match self.normed(h, w, *eps, false) {
                Some(y) => y,
                None => self.forward(&x.to_dense()?),
            },
        }
    }

    /// Whether this layer computes the norm of an [`Activation::Normed`] input of `m` rows of
    /// `dtype` in its own kernel.
    pub fn takes_normed(&self, m: usize, dtype: DType) -> bool {
        self.b.is_none() && self.w.normed_ok(m, dtype)
    }

    /// This layer's input `rms_norm(h) · w` (eps `eps`, `h` `[.., k]`) in the form it reads:
    /// left to its own kernel ([`Activation::Normed`]) where it computes norms, else
    /// computed now in its [`InputEncoding`].
    pub fn input_norm(&self, h: &Tensor, w: &Tensor, eps: f32) -> Result<Activation> {
        let m = h.elem_count() / self.shape().1.max(1);
        if self.takes_normed(m, h.dtype()) {
            return Ok(Activation::Normed {
                h: h.clone(),
                w: w.clone(),
                eps,
            });
        }
        crate::ops::rms_norm_as(h, w, eps, self.input_encoding())
    }

    /// The kernel-side norm of `h` (see [`LinearWeights::forward_normed`]), shaped as `h`.
    fn normed(&self, h: &Tensor, w: &Tensor, eps: f32, silu: bool) -> Option<Result<Tensor>> {
        let (n, k) = self.shape();
        let m = h.elem_count() / k.max(1);
        if !self.takes_normed(m, h.dtype()) || h.dim(candle_core::D::Minus1).ok()? != k {
            return None;
        }
        let out = if silu { n / 2 } else { n };
        let y = self
            .w
            .forward_normed(&h.reshape((m, k)).ok()?, w, eps, silu)?;
        let mut dims = h.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        Some(y.and_then(|y| y.reshape(dims)))
    }

    /// `x · Wᵀ + res` — the residual stream after this projection — and the input of the
    /// projection `next`, `rms_norm(x · Wᵀ + res) · w` (eps `eps`), in the encoding `next`
    /// reads. Where this layer adds the residual in its kernel's epilogue and `next`
    /// computes the norm in its own (tiled formats at one token, sm_90 builds), the norm is
    /// left to `next` ([`Activation::Normed`]) and no add + RMSNorm kernel runs in between;
    /// otherwise this projection, then the fused add + RMSNorm.
    pub fn forward_residual_norm(
        &self,
        x: &Activation,
        res: &Tensor,
        w: &Tensor,
        eps: f32,
        next: &QLinear,
    ) -> Result<(Tensor, Activation)> {
        let (n, k) = self.shape();
        if let Activation::Dense(t) = x {
            let m = t.elem_count() / k.max(1);
            if self.b.is_none()
                && next.takes_normed(m, t.dtype())
                && t.dim(candle_core::D::Minus1)? == k
                && res.dims() == [&t.dims()[..t.rank() - 1], &[n]].concat()
            {
                if let Some(h) = self
                    .w
                    .forward_add(&t.reshape((m, k))?, &res.reshape((m, n))?)
                {
                    let h = h?.reshape(res.shape())?;
                    let xn = next.input_norm(&h, w, eps)?;
                    return Ok((h, xn));
                }
            }
        }
        let a = self.forward_act(x)?;
        crate::ops::add_rms_norm_as(&a, res, w, eps, next.input_encoding())
    }

    /// A gate/up layer's `silu(gate) · up` in the encoding the next projection reads
    /// (`next`): the fused epilogue for a dense one, the SiLU·mul fused into the W4A4
    /// activation quantizer for a W4A4 one.
    pub fn forward_silu_mul_as(&self, x: &Activation, next: &InputEncoding) -> Result<Activation> {
        match (next, x) {
            (InputEncoding::Dense, Activation::Dense(t)) => {
                Ok(Activation::Dense(self.forward_silu_mul(t)?))
            }
            (InputEncoding::Dense, Activation::Normed { h, w, eps }) => {
                match self.normed(h, w, *eps, true) {
                    Some(y) => Ok(Activation::Dense(y?)),
                    None => Ok(Activation::Dense(self.forward_silu_mul(&x.to_dense()?)?)),
                }
            }
            (InputEncoding::Dense, _) => Ok(Activation::Dense(crate::ops::silu_mul(
                &self.forward_act(x)?,
            )?)),
            (InputEncoding::W4a4(spec), _) => {
                let gu = self.forward_act(x)?;
                let src = crate::ops::ActSource::SiluMul(&gu);
                Ok(Activation::W4a4(crate::ops::w4a4_quantize(src, spec)?.1))
            }
        }
    }
}

impl Module for QLinear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = self.rows(x, self.shape().0, |x2| self.w.forward(x2))?;
        self.add_bias(y)
    }
}
