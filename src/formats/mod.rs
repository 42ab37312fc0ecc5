//! The formats layer: every weight format a [`QLinear`](crate::QLinear) can hold.
//!
//! A format is one module here plus one line in the `registry!` below:
//!
//! - a [`FormatSpec`] (`static`): its CLI name and aliases, error bounds, whether it needs
//!   calibration statistics, whether its decode step captures into a CUDA graph, its stored
//!   layout version, and its [`Codec`] — how dense weights become packed ones
//!   ([`Codec::quantize`]) and how stored tensors become them again
//!   ([`Codec::rebuild`]);
//! - packed weights behind [`LinearWeights`]: shape, bytes, dequantize, forward, the
//!   tensors a checkpoint stores, and optional fused paths ([`Epilogue`]) that return
//!   `None` where they do not apply, decided once when the layer is built ([`Plan`]);
//! - the format's CPU references (quantize, pack, dequantize) as free functions in its
//!   module; its CustomOps in `src/ops/`, its kernels in `cuda/`.
//!
//! The model, the CLI tools and the bench read only this layer: adding a format changes
//! none of them.
//!
//! Stored tensors follow one rule that lets the model fuse projections (Q, K and V into
//! one; gate and up into one) and a checkpoint keep them under their own HF names: every
//! tensor a format stores for a `[n, k]` weight has the weight's `n` output rows as its
//! leading dimension, so stacking layers along the rows stacks each of their tensors along
//! dim 0 (and splitting does the reverse).

pub mod dense;
pub mod ggml;
pub mod uniform;
pub mod w2416;
pub mod w4a4;

use candle_core::{DType, Device, Result, Tensor};

/// Whether a format needs calibration statistics to quantize.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Calibration {
    /// Quantized from the weights alone.
    None,
    /// Uses the Hessian's diagonal where calibration ran (to rank groups and outliers), and
    /// quantizes without it otherwise (every input channel then weighs the same).
    Diagonal,
    /// GPTQ: needs each linear layer's input Hessian `XᵀX` (see [`crate::calib`]).
    Hessian,
}

/// Everything the CLI, the bench and the checkpoint code know about a format.
pub struct FormatSpec {
    /// CLI name (`--quant NAME`), also what checkpoints record.
    pub name: &'static str,
    /// Other spellings `--quant` accepts.
    pub aliases: &'static [&'static str],
    /// One line for `--help` and the docs.
    pub about: &'static str,
    /// Relative error `‖x·Ŵᵀ − x·Wᵀ‖ / ‖x·Wᵀ‖` the format stays under for Gaussian weights
    /// (std 1/√k) and inputs at k = 512 (its quantization error; tests hold it to this).
    pub error_bound: f64,
    /// Relative error of a forward against `x · dequantize()ᵀ` in f32 on the same packed
    /// weights: what the kernels are held to (f16 output rounding, activations quantized
    /// inside a kernel).
    pub tolerance: f64,
    pub calibration: Calibration,
    /// The decode step of a model in this format captures into a CUDA graph.
    pub graph_safe: bool,
    /// Version of the stored layout: checkpoints record it, and loading another fails.
    pub version: u32,
    /// The format this one stores exactly as (its quantizer differs, its bytes and kernels
    /// do not: `int4-gptq` stores as `int4`); speed rows time that one.
    pub stores_as: Option<WeightFormat>,
    pub codec: &'static dyn Codec,
}

impl std::fmt::Debug for FormatSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FormatSpec")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Options of a quantizer; each format reads the ones it uses and records them.
#[derive(Debug, Clone, Default)]
pub struct QuantOptions {
    /// GPTQ settings (formats with [`Calibration::Hessian`]).
    pub gptq: crate::gptq::GptqConfig,
    /// `w2416`'s budget and outlier fraction.
    pub w2416: w2416::W2416Config,
    /// The W4A4 formats' outliers and activation clipping.
    pub w4a4: w4a4::W4a4Config,
}

impl QuantOptions {
    /// These options for a layer whose input channels are already in the order its format
    /// would give them (the model folded it into the producer: see
    /// [`Codec::input_order`]): no order computed or drawn.
    pub fn input_in_order(&self) -> Self {
        let mut o = self.clone();
        o.w2416.reorder = false;
        o
    }
}

/// How a format turns weights into its encoding and back.
pub trait Codec: Sync {
    /// Encode a dense weight `w` `[n, k]` (any float dtype) on `w`'s device. `hessian` is
    /// the layer input's `XᵀX / count` `[k, k]` (f32) for formats that need it.
    fn quantize(
        &self,
        format: WeightFormat,
        w: &Tensor,
        hessian: Option<&Tensor>,
        opts: &QuantOptions,
    ) -> Result<Box<dyn LinearWeights>>;

    /// The input-channel order this format's quantizer would give the weights `w` `[n, k]`
    /// (in any format: a reordering format dequantizes them, the others read nothing) under
    /// `hessian` (`order[j]`: the input channel its column `j` reads), for formats that
    /// reorder (`None` for the others). A model that can move a layer's input channels into
    /// this order for free — its producer's output rows permuted with them, as the MLP's
    /// gate/up rows for its down projection — does so before quantizing, and the layer then
    /// stores no order and reads its input as it comes.
    fn input_order(
        &self,
        w: &dyn LinearWeights,
        hessian: Option<&Tensor>,
        opts: &QuantOptions,
    ) -> Result<Option<Vec<u32>>> {
        let _ = (w, hessian, opts);
        Ok(None)
    }

    /// Rebuild `[n, k]` weights from the tensors [`LinearWeights::tensors`] produced (by
    /// field name), on their device. Rejects missing fields and wrong shapes or dtypes,
    /// naming them.
    fn rebuild(
        &self,
        format: WeightFormat,
        shape: (usize, usize),
        tensors: &std::collections::HashMap<String, Tensor>,
    ) -> Result<Box<dyn LinearWeights>>;

    /// The settings of `opts` this format reads, for a checkpoint's or a tool's record
    /// (`Null` where it reads none of its own; GPTQ's are recorded by the tools).
    fn settings(&self, opts: &QuantOptions) -> serde_json::Value {
        let _ = opts;
        serde_json::Value::Null
    }

    /// Random packed weights of `shape` drawn on `dev` (codes, scales, outliers: speed
    /// measurements of models too large to quantize), where the format offers it.
    fn random(
        &self,
        format: WeightFormat,
        shape: (usize, usize),
        opts: &QuantOptions,
        seed: u64,
        dev: &Device,
    ) -> Option<Result<Box<dyn LinearWeights>>> {
        let _ = (format, shape, opts, seed, dev);
        None
    }
}

/// A fused path a format may offer at decode sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// Gate/up projection (weight rows: gate, then up) with `silu(gate) * up` applied:
    /// `[m, k]` → `[m, n / 2]` in the input's dtype.
    SiluMul,
    /// f32 output straight from the accumulators (an output head's logits).
    F32Out,
}

impl Epilogue {
    pub const ALL: [Self; 2] = [Self::SiluMul, Self::F32Out];

    pub fn name(&self) -> &'static str {
        match self {
            Self::SiluMul => "SiLU·mul epilogue",
            Self::F32Out => "f32 output",
        }
    }
}

/// The kernels a layer uses, chosen once when it is built: its matmul, and for each
/// [`Epilogue`] either `Ok` (fused at decode sizes) or the reason it is not.
#[derive(Debug, Clone)]
pub struct Plan {
    /// What runs the matmul (e.g. "skinny matmul at m = 1, cuBLAS above").
    pub matmul: String,
    pub silu_mul: std::result::Result<(), String>,
    pub f32_out: std::result::Result<(), String>,
}

impl Plan {
    pub fn epilogue(&self, e: Epilogue) -> &std::result::Result<(), String> {
        match e {
            Epilogue::SiluMul => &self.silu_mul,
            Epilogue::F32Out => &self.f32_out,
        }
    }
}

/// What a projection reads: dense activations, activations a norm or an epilogue has
/// already quantized for it (W4A4), or a norm it computes itself (`Normed`). The norms and
/// epilogues that produce them dispatch on [`InputEncoding`] inside `ops`, and
/// [`QLinear::forward_residual_norm`](crate::QLinear::forward_residual_norm) on what the next
/// projection takes, so the model keeps one code path.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Activation {
    /// `[.., k]` in the run dtype.
    Dense(Tensor),
    /// Codes and scales for a W4A4 projection (`[.., k]` logically).
    W4a4(w4a4::QuantAct),
    /// `rms_norm(h) · w` (`h` `[.., k]`, `w` `[k]`), not yet computed: the projection that
    /// reads it computes the norm in its own kernel's prologue (one token through the tiled
    /// formats' GEMV) or, where it cannot, first.
    Normed { h: Tensor, w: Tensor, eps: f32 },
}

impl Activation {
    /// The dense tensor, or an error naming the encoding this caller cannot read.
    pub fn dense(&self) -> Result<&Tensor> {
        match self {
            Self::Dense(t) => Ok(t),
            Self::W4a4(q) => candle_core::bail!(
                "expected dense activations, got W4A4 codes {:?} (a projection that reads them \
                 takes `QLinear::forward_act`)",
                q.dims
            ),
            Self::Normed { h, .. } => candle_core::bail!(
                "expected dense activations, got a norm of {:?} left to the projection (it \
                 takes `QLinear::forward_act`; `Activation::to_dense` computes it)",
                h.shape()
            ),
        }
    }

    /// The activations as a dense tensor: a pending norm is computed; W4A4 codes are an
    /// error, as in [`Activation::dense`].
    pub fn to_dense(&self) -> Result<Tensor> {
        match self {
            Self::Normed { h, w, eps } => candle_nn::ops::rms_norm(h, w, *eps),
            _ => self.dense().cloned(),
        }
    }

    /// The logical shape `[.., k]`.
    pub fn dims(&self) -> &[usize] {
        match self {
            Self::Dense(t) => t.dims(),
            Self::W4a4(q) => &q.dims,
            Self::Normed { h, .. } => h.dims(),
        }
    }

    /// The logical shape as `(b, seq, k)`.
    pub fn dims3(&self) -> Result<(usize, usize, usize)> {
        match *self.dims() {
            [b, s, k] => Ok((b, s, k)),
            ref d => candle_core::bail!("expected activations [b, seq, k], got {d:?}"),
        }
    }
}

/// The input encoding a projection asks for (the model asks once, at load).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum InputEncoding {
    Dense,
    /// Quantized by this activation quantizer (`src/formats/w4a4.rs`).
    W4a4(std::sync::Arc<w4a4::ActSpec>),
}

/// A format's packed weights for one linear layer `y = x · Wᵀ`, `W` `[n, k]`.
pub trait LinearWeights: std::fmt::Debug + Send + Sync {
    fn format(&self) -> WeightFormat;

    /// `(n, k)` = (out, in).
    fn shape(&self) -> (usize, usize);

    /// Bytes a forward reads: codes, scales, zeros, every piece of metadata.
    fn bytes(&self) -> usize;

    /// The concrete encoding, where it differs from the format's name (a `q4k` layer whose
    /// rows fell back to `q5_0`; dense weights: their dtype).
    fn encoding(&self) -> String {
        self.format().spec().name.to_string()
    }

    fn device(&self) -> Device;

    /// The weight `[n, k]` in f32 on its device.
    fn dequantize(&self) -> Result<Tensor>;

    /// `x` `[m, k]` (contiguous, f32/f16/bf16) · Wᵀ → `[m, n]` in `x`'s dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// The kernels this layer uses ([`Plan`]), decided once.
    fn plan(&self) -> Plan;

    /// The fused path `e` for `x` `[m, k]`, or `None` where it does not apply to this call
    /// (the plan rules it out, or `m` is past the fused kernel's range): the caller then
    /// runs the unfused composition.
    fn forward_fused(&self, e: Epilogue, x: &Tensor) -> Option<Result<Tensor>> {
        let _ = (e, x);
        None
    }

    /// What this projection reads.
    fn input_encoding(&self) -> InputEncoding {
        InputEncoding::Dense
    }

    /// Whether [`LinearWeights::forward_normed`] takes `m` rows of `dtype`.
    fn normed_ok(&self, m: usize, dtype: DType) -> bool {
        let _ = (m, dtype);
        false
    }

    /// `rms_norm(h) · w` (eps `eps`) · Wᵀ for `h` `[m, k]`, the norm computed in the kernel
    /// (no launch of its own), with the SiLU·mul epilogue where `silu`; `None` where
    /// [`LinearWeights::normed_ok`] does not hold.
    fn forward_normed(
        &self,
        h: &Tensor,
        w: &Tensor,
        eps: f32,
        silu: bool,
    ) -> Option<Result<Tensor>> {
        let _ = (h, w, eps, silu);
        None
    }

    /// `x · Wᵀ + res` (`res` `[m, n]`) with the residual added in the kernel's epilogue;
    /// `None` where this layer cannot for this input.
    fn forward_add(&self, x: &Tensor, res: &Tensor) -> Option<Result<Tensor>> {
        let _ = (x, res);
        None
    }

    /// `forward` of activations already quantized for this layer (formats whose
    /// [`LinearWeights::input_encoding`] is not dense), output `[m, n]` in `dtype`.
    fn forward_quantized(&self, a: &w4a4::QuantAct, dtype: DType) -> Result<Tensor> {
        let _ = dtype;
        candle_core::bail!(
            "{}: this format reads dense activations, got W4A4 codes {:?}",
            self.format(),
            a.dims
        )
    }

    /// Every tensor of the encoding by field name, each with the `n` rows along dim 0 (the
    /// checkpoint's content; [`Codec::rebuild`] reads it back) — except fields named
    /// `input.*`, which describe the layer's input and are the same for every layer
    /// stacked on it (kept whole, stored once per part).
    fn tensors(&self) -> Result<Vec<(String, Tensor)>>;
}

macro_rules! registry {
    ($($(#[$doc:meta])* $variant:ident => $spec:path,)*) => {
        /// A weight format (its [`FormatSpec`] says the rest). Parse one from a CLI string
        /// with `str::parse`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum WeightFormat {
            $($(#[$doc])* $variant,)*
        }

        impl WeightFormat {
            /// Every format, in the order `--help` and the bench list them.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)*];

            pub fn spec(self) -> &'static FormatSpec {
                match self {
                    $(Self::$variant => &$spec,)*
                }
            }
        }
    };
}

// The registry: one line per format.
registry! {
    /// Unquantized, in the run dtype (f16 on GPU by default).
    Dense => dense::SPEC,
    /// candle's GGML formats (QMatMul), quantized from the loaded weights.
    Q8_0 => ggml::Q8_0,
    Q4_0 => ggml::Q4_0,
    Q4_1 => ggml::Q4_1,
    Q4K => ggml::Q4K,
    Q3K => ggml::Q3K,
    Q2K => ggml::Q2K,
    /// Uniform asymmetric groups of 128 along k, round to nearest / GPTQ.
    Int4 => uniform::INT4,
    Int4Gptq => uniform::INT4_GPTQ,
    Int3 => uniform::INT3,
    Int3Gptq => uniform::INT3_GPTQ,
    Int2 => uniform::INT2,
    Int2Gptq => uniform::INT2_GPTQ,
    /// 2/4-bit tiles with sparse f16 outliers (arXiv 2311.16442).
    W2416 => w2416::W2416,
    W2416Gptq => w2416::W2416_GPTQ,
    /// W4A4 on INT8 tensor cores: Atom, COMET's FMPQ, and the round-to-nearest baseline.
    W4a4 => w4a4::W4A4,
    Fmpq => w4a4::FMPQ,
    W4a4Rtn => w4a4::W4A4_RTN,
}

impl WeightFormat {
    pub fn name(&self) -> &'static str {
        self.spec().name
    }

    /// Every CLI name, in the order of [`WeightFormat::ALL`].
    pub fn names() -> Vec<&'static str> {
        Self::ALL.iter().map(|f| f.name()).collect()
    }

    /// The formats whose speed the bench times: each storage once (a GPTQ variant stores
    /// exactly as its round-to-nearest twin).
    pub fn timed() -> impl Iterator<Item = Self> {
        Self::ALL
            .iter()
            .copied()
            .filter(|f| f.spec().stores_as.is_none())
    }

    /// Quantizing needs calibration statistics (GPTQ).
    pub fn needs_calibration(&self) -> bool {
        self.spec().calibration == Calibration::Hessian
    }

    /// Quantizing reads calibration statistics where they are given.
    pub fn uses_calibration(&self) -> bool {
        self.spec().calibration != Calibration::None
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
        let want = s.to_ascii_lowercase();
        Self::ALL
            .iter()
            .copied()
            .find(|f| f.spec().name == want || f.spec().aliases.contains(&want.as_str()))
            .ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "unknown weight format '{s}'; supported: {}",
                    Self::names().join(", ")
                ))
            })
    }
}

/// `tensors[name]`, or an error naming the field, the format and the layer shape.
pub(crate) fn field<'a>(
    tensors: &'a std::collections::HashMap<String, Tensor>,
    name: &str,
    format: WeightFormat,
    shape: (usize, usize),
) -> Result<&'a Tensor> {
    tensors.get(name).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "{format}: a [{}, {}] layer has no '{name}' tensor",
            shape.0, shape.1
        ))
    })
}

/// Check that a stored tensor has `dims` and `dtype`, naming the field otherwise.
pub(crate) fn expect(t: &Tensor, what: &str, dims: &[usize], dtype: DType) -> Result<()> {
    if t.dims() != dims || t.dtype() != dtype {
        candle_core::bail!(
            "tensor '{what}' is {:?} {:?}, expected {dims:?} {dtype:?}",
            t.dims(),
            t.dtype()
        )
    }
    Ok(())
}
