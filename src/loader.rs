//! Load a model from a [`ModelSource`] into our Llama, or into stock candle's models
//! (the peers `--compare` runs).

use crate::linear::WeightFormat;
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
    /// Linear layers that took a block-32 fallback in `--quant` (0 if none).
    pub fallbacks: usize,
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
    let cfg: stock_llama::LlamaConfig =
        serde_json::from_str(&text).map_err(|e| msg(format!("{} is not a Llama config: {e}", p.display())))?;
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

/// Load our Llama from `source`, weights in `dtype` on `device`, linear layers in `quant`.
pub fn load(source: &ModelSource, dtype: DType, device: &Device, quant: WeightFormat) -> Result<Loaded> {
    let (mut model, config, tokenizer, chat_template, name) = match source {
        ModelSource::Gguf(path) => {
            let g = crate::gguf::load_gguf(path, dtype, device)?;
            let vb = VarBuilder::from_tensors(g.tensors, dtype, device);
            let model = Llama::load(vb, &g.config)?;
            (model, g.config, g.tokenizer, g.chat_template, g.name)
        }
        ModelSource::HfDir(dir) => {
            let config = hf_config(dir)?;
            let tok_path = dir.join("tokenizer.json");
            let tokenizer =
                Tokenizer::from_file(&tok_path).map_err(|e| msg(format!("{}: {e}", tok_path.display())))?;
            let model = Llama::load(hf_vb(dir, dtype, device)?, &config)?;
            let name = dir.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            (model, config, tokenizer, chat_template_of(dir), name)
        }
    };
    let fallbacks = model.quantize(quant)?;
    let eos = eos_ids(&config, &tokenizer);
    Ok(Loaded { model, config, tokenizer, chat_template, name, eos, fallbacks })
}

/// Stock candle on the same files: `quantized_llama` for GGUF, `llama` for a HF directory.
pub enum StockModel {
    Quantized(Box<quantized_llama::ModelWeights>),
    Llama { model: Box<stock_llama::Llama>, cache: Box<stock_llama::Cache>, config: Config, dtype: DType, device: Device },
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
            ModelSource::HfDir(dir) => {
                let config = hf_config(dir)?;
                let model = stock_llama::Llama::load(hf_vb(dir, dtype, device)?, &config)?;
                let cache = stock_llama::Cache::new(true, dtype, &config, device)?;
                Ok(Self::Llama { model: Box::new(model), cache: Box::new(cache), config, dtype, device: device.clone() })
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
            Self::Llama { cache, config, dtype, device, .. } => {
                **cache = stock_llama::Cache::new(true, *dtype, config, device)?;
            }
        }
        Ok(())
    }
}
