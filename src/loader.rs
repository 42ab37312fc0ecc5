//! Load a model from a [`ModelSource`] into our Llama (quantizing it at load where asked,
//! with calibration where the format needs it), or into stock candle's models (the peers
//! `--compare` runs).

use crate::calib::{CalibConfig, Progress, QuantReport};
use crate::checkpoint::{CalibInfo, Manifest};
use crate::formats::{QuantOptions, WeightFormat};
use crate::llama::{Config, Llama, LlamaEosToks};
use crate::model_files::ModelSource;
use candle_core::{DType, Device, Result, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama as stock_llama, quantized_llama};
use std::path::Path;
use tokenizers::Tokenizer;

/// Our model with everything needed to run it.
pub struct Loaded {
    pub model: Llama,
    pub config: Config,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
    pub name: String,
    /// Token ids that end generation.
    pub eos: Vec<u32>,
    /// The blocks' weight format.
    pub format: WeightFormat,
    /// The checkpoint's manifest, where the model came from one.
    pub manifest: Option<Manifest>,
    /// What quantizing at load did (none for a checkpoint or a dense run).
    pub quantized: Option<QuantReport>,
    /// The calibration text, where one was used (here, or when the checkpoint was written).
    pub calibration: Option<CalibInfo>,
}

impl Loaded {
    /// The linear layers of the blocks whose encoding is not named as the format (candle's
    /// k-quants fall back to a block-32 format for rows not a multiple of 256; W4A4 layers
    /// name their INT8 channels), by encoding.
    pub fn fallbacks(&self) -> Vec<(String, usize)> {
        let mut out: Vec<(String, usize)> = vec![];
        let layers = self.model.linears();
        for l in &layers[..layers.len().saturating_sub(1)] {
            let enc = l.format_name();
            if l.format() != WeightFormat::Dense && enc != l.format().name() {
                match out.iter_mut().find(|(e, _)| *e == enc) {
                    Some((_, c)) => *c += 1,
                    None => out.push((enc, 1)),
                }
            }
        }
        out
    }
}

/// Calibration text for formats that need it.
#[derive(Debug, Clone)]
pub struct CalibSource {
    pub path: std::path::PathBuf,
    pub config: CalibConfig,
}

/// How [`load`] builds the model.
pub struct LoadOptions<'a> {
    pub dtype: DType,
    pub device: Device,
    /// The blocks' format; `None` keeps what the source holds (dense weights, or a
    /// checkpoint's format). A checkpoint rejects a format other than its own.
    pub quant: Option<WeightFormat>,
    pub quant_options: QuantOptions,
    /// Read only when `quant` needs calibration.
    pub calib: Option<CalibSource>,
    pub progress: &'a mut dyn Progress,
}

impl<'a> LoadOptions<'a> {
    /// Dense in `dtype` on `device`, no progress shown.
    pub fn new(
        dtype: DType,
        device: &Device,
        quant: Option<WeightFormat>,
        progress: &'a mut dyn Progress,
    ) -> Self {
        Self {
            dtype,
            device: device.clone(),
            quant,
            quant_options: QuantOptions::default(),
            calib: None,
            progress,
        }
    }
}

/// The calibration windows of `src` for `tok`, and what identifies them.
pub fn calibration_windows(
    src: &CalibSource,
    tok: &Tokenizer,
) -> Result<(Vec<Vec<u32>>, CalibInfo)> {
    let p = &src.path;
    let bytes = std::fs::read(p)
        .map_err(|e| msg(format!("cannot read calibration text {}: {e}", p.display())))?;
    let text = String::from_utf8_lossy(&bytes);
    let ids = tok
        .encode(text.as_ref(), false)
        .map_err(|e| msg(format!("tokenizing {}: {e}", p.display())))?;
    let windows = crate::calib::windows(ids.get_ids(), &src.config)
        .map_err(|e| msg(format!("calibration text {}: {e}", p.display())))?;
    let info = CalibInfo {
        file: p
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
        sha256: crate::checkpoint::sha256_hex(&bytes),
        samples: src.config.samples,
        len: src.config.len,
        seed: src.config.seed,
    };
    Ok((windows, info))
}

fn msg(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

fn eos_ids(cfg: &Config, tok: &Tokenizer) -> Vec<u32> {
    let mut v = match &cfg.eos_token_id {
        Some(LlamaEosToks::Single(e)) => vec![*e],
        Some(LlamaEosToks::Multiple(es)) => es.clone(),
        None => vec![],
    };
    for s in ["<|im_end|>", "<|eot_id|>", "</s>", "<|endoftext|>"] {
        if let Some(id) = tok.token_to_id(s) {
            if !v.contains(&id) {
                v.push(id);
            }
        }
    }
    v
}

fn hf_config(dir: &Path) -> Result<Config> {
    let p = dir.join("config.json");
    let text = std::fs::read_to_string(&p).map_err(|e| msg(format!("{}: {e}", p.display())))?;
    let cfg: stock_llama::LlamaConfig = serde_json::from_str(&text)
        .map_err(|e| msg(format!("{} is not a Llama config: {e}", p.display())))?;
    Ok(cfg.into_config(false))
}

fn safetensors_files(dir: &Path) -> Result<Vec<std::path::PathBuf>> {
    let mut files: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        candle_core::bail!("model directory {} has no *.safetensors", dir.display())
    }
    Ok(files)
}

fn hf_vb(dir: &Path, dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    let files = safetensors_files(dir)?;
    // Safety: the files are memory-mapped read-only and not modified while loaded.
    unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device) }
}

fn chat_template_of(dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json.get("chat_template")?.as_str().map(str::to_string)
}

/// Load our Llama from `source` as `opts` says: a checkpoint as stored, a dense source
/// quantized at load into `opts.quant` (through calibration and GPTQ where the format
/// needs it).
pub fn load(source: &ModelSource, opts: LoadOptions) -> Result<Loaded> {
    let (dtype, device) = (opts.dtype, &opts.device);
    let (mut model, config, tokenizer, chat_template, name, manifest) = match source {
        ModelSource::Gguf(path) => {
            let g = crate::gguf::load_gguf(path, dtype, device)?;
            let vb = VarBuilder::from_tensors(g.tensors, dtype, device);
            let model = Llama::load(vb, &g.config)?;
            (model, g.config, g.tokenizer, g.chat_template, g.name, None)
        }
        ModelSource::HfDir(dir) | ModelSource::Checkpoint(dir) => {
            let config = hf_config(dir)?;
            let tok_path = dir.join("tokenizer.json");
            let tokenizer = Tokenizer::from_file(&tok_path)
                .map_err(|e| msg(format!("{}: {e}", tok_path.display())))?;
            let (model, manifest) = match source {
                ModelSource::Checkpoint(_) => {
                    let (m, man) = crate::checkpoint::load(dir, &config, dtype, device)?;
                    (m, Some(man))
                }
                _ => (Llama::load(hf_vb(dir, dtype, device)?, &config)?, None),
            };
            let name = dir
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            (
                model,
                config,
                tokenizer,
                chat_template_of(dir),
                name,
                manifest,
            )
        }
    };
    let stored = match &manifest {
        Some(m) => m.weight_format()?,
        None => WeightFormat::Dense,
    };
    let format = opts.quant.unwrap_or(stored);
    let (mut quantized, mut calibration) =
        (None, manifest.as_ref().and_then(|m| m.calibration.clone()));
    if manifest.is_some() && format != stored {
        candle_core::bail!(
            "{} holds a {stored} checkpoint; --quant {format} disagrees (leave --quant out to run it as stored)",
            source.path().display()
        )
    }
    if format != stored {
        let windows = match (&opts.calib, format.uses_calibration()) {
            (_, false) => vec![],
            (Some(src), true) => {
                let (w, info) = calibration_windows(src, &tokenizer)?;
                calibration = Some(info);
                w
            }
            (None, true) if format.needs_calibration() => {
                candle_core::bail!("{format} needs calibration text (--calib FILE)")
            }
            (None, true) => vec![],
        };
        let calib_cfg = opts
            .calib
            .as_ref()
            .map(|c| c.config.clone())
            .unwrap_or_default();
        let report = crate::calib::quantize_model(
            &mut model,
            &config,
            format,
            &opts.quant_options,
            (&windows, &calib_cfg),
            dtype,
            opts.progress,
        )?;
        quantized = Some(report);
    }
    let eos = eos_ids(&config, &tokenizer);
    Ok(Loaded {
        model,
        config,
        tokenizer,
        chat_template,
        name,
        eos,
        format,
        manifest,
        quantized,
        calibration,
    })
}

/// Stock candle on the same files: `quantized_llama` for GGUF, `llama` for a HF directory.
pub enum StockModel {
    Quantized(Box<quantized_llama::ModelWeights>),
    Llama {
        model: Box<stock_llama::Llama>,
        cache: Box<stock_llama::Cache>,
        config: Box<Config>,
        dtype: DType,
        device: Device,
    },
}

impl StockModel {
    pub fn load(source: &ModelSource, dtype: DType, device: &Device) -> Result<Self> {
        match source {
            ModelSource::Gguf(path) => {
                let mut f = std::fs::File::open(path)?;
                let ct = candle_core::quantized::gguf_file::Content::read(&mut f)
                    .map_err(|e| msg(format!("{}: {e}", path.display())))?;
                Ok(Self::Quantized(Box::new(quantized_llama::ModelWeights::from_gguf(ct, &mut f, device)?)))
            }
            ModelSource::Checkpoint(dir) => candle_core::bail!(
                "{} is a candle-lowbit checkpoint: stock candle cannot read it (compare on the model it was made from)",
                dir.display()
            ),
            ModelSource::HfDir(dir) => {
                let config = hf_config(dir)?;
                let model = stock_llama::Llama::load(hf_vb(dir, dtype, device)?, &config)?;
                let cache = stock_llama::Cache::new(true, dtype, &config, device)?;
                Ok(Self::Llama { model: Box::new(model), cache: Box::new(cache), config: Box::new(config), dtype, device: device.clone() })
            }
        }
    }

    /// Logits `[b, vocab]` (f32) of the last position.
    pub fn forward(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
        match self {
            Self::Quantized(m) => m.forward(ids, pos)?.to_dtype(DType::F32),
            Self::Llama { model, cache, .. } => model.forward(ids, pos, cache),
        }
    }

    /// Forget the KV cache.
    pub fn clear(&mut self) -> Result<()> {
        match self {
            Self::Quantized(m) => m.clear_kv_cache(),
            Self::Llama {
                cache,
                config,
                dtype,
                device,
                ..
            } => {
                **cache = stock_llama::Cache::new(true, *dtype, config, device)?;
            }
        }
        Ok(())
    }
}
