//! The models of the end-to-end sections: shapes, random weights (no download), and one
//! interface over stock candle llama, our Llama, and stock candle quantized_llama.

use crate::quant::Prototypes;
use anyhow::{Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_lowbit::graph::{GraphDecoder, Mode};
use candle_lowbit::llama::Slot;
use candle_lowbit::{Cache, Config, KvFormat, Llama, QLinear, WeightFormat};
use candle_nn::VarBuilder;
use candle_transformers::models::{llama as stock_llama, quantized_llama};
use std::collections::HashMap;

/// Llama-2-7B's shape (32 layers, 4096 wide, 32 heads of 128, MLP 11008, vocab 32000),
/// with room for `max_pos` positions.
pub fn llama2_7b(max_pos: usize) -> Config {
    Config {
        hidden_size: 4096,
        intermediate_size: 11008,
        vocab_size: 32000,
        num_attention_heads: 32,
        num_key_value_heads: 32,
        ..tiny(32, max_pos)
    }
}

/// Llama-2-70B's shape (80 layers, 8192 wide, 64 heads of 128 over 8 KV heads, MLP 28672,
/// vocab 32000).
pub fn llama2_70b(max_pos: usize) -> Config {
    Config {
        hidden_size: 8192,
        intermediate_size: 28672,
        vocab_size: 32000,
        num_attention_heads: 64,
        num_key_value_heads: 8,
        ..tiny(80, max_pos)
    }
}

/// Tiny widths (hidden 256, 4 heads of 64, MLP 512, vocab 1024): GPU work negligible,
/// and candle's k-quants still apply (rows of 256 and 512).
pub fn tiny(layers: usize, max_pos: usize) -> Config {
    Config {
        hidden_size: 256,
        intermediate_size: 512,
        vocab_size: 1024,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        num_key_value_heads: 4,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: max_pos,
        tie_word_embeddings: false,
    }
}

/// One configuration of the end-to-end table.
#[derive(Debug, Clone, Copy)]
pub enum Spec {
    /// Stock `candle_transformers::models::llama`, f16 weights and cache.
    Stock,
    /// Our Llama: weight format × KV format.
    Ours(WeightFormat, KvFormat),
    /// Stock `candle_transformers::models::quantized_llama` on a GGUF of this format
    /// (Q4K: the strongest peer; Q4_0: the same format as our `q4_0` configuration).
    QLlama(GgmlDType),
    /// Our Llama over a real model loaded with `--model` (its blocks in this format).
    Loaded(WeightFormat),
}

impl Spec {
    /// Stock first (every ratio needs it), then ours (the registries), then the peer.
    pub fn all() -> Vec<Self> {
        let mut v = vec![Self::Stock];
        for w in WeightFormat::timed() {
            v.extend(KvFormat::ALL.iter().map(|k| Self::Ours(w, *k)));
        }
        v.extend([Self::QLlama(GgmlDType::Q4K), Self::QLlama(GgmlDType::Q4_0)]);
        v
    }

    pub fn name(&self) -> String {
        match self {
            Self::Stock => "candle-f16".into(),
            Self::Ours(w, k) => format!("ours-{}-kv{}", w.name(), k.name()),
            Self::QLlama(dt) => format!("candle-qllama-{}", ggml_name(*dt)),
            Self::Loaded(w) => format!("ours-{}", w.name()),
        }
    }
}

/// Random weights for `cfg` under HF Llama names, drawn in a fixed order from a seeded
/// generator (the same weights for stock and ours), cast to `dtype`.
pub fn random_weights(
    cfg: &Config,
    dtype: DType,
    dev: &Device,
    seed: u64,
) -> Result<HashMap<String, Tensor>> {
    let mut specs: Vec<(String, Vec<usize>, f64, f64)> = vec![];
    for (name, shape) in candle_lowbit::llama::tensor_shapes(cfg) {
        let (std, offset) = match shape.as_slice() {
            [_] => (0.1, 1.0),
            _ if name.contains("embed_tokens") => (1.0, 0.0),
            [_, cols] => (1.0 / (*cols as f64).sqrt(), 0.0),
            _ => anyhow::bail!("unexpected shape {shape:?} for {name}"),
        };
        specs.push((name, shape, std, offset));
    }
    let mut rng = CpuRng(seed | 1);
    if dev.is_cuda() {
        dev.set_seed(seed)?;
    }
    let mut m = HashMap::new();
    for (name, shape, std, offset) in specs {
        let t = if dev.is_cuda() {
            crate::util::randn(&shape, std, DType::F32, dev)?
        } else {
            rng.randn(&shape, std, dev)?
        };
        m.insert(name, (t + offset)?.to_dtype(dtype)?);
    }
    Ok(m)
}

/// A seeded normal generator for the CPU (candle's CPU `randn` cannot be seeded).
struct CpuRng(u64);

impl CpuRng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn randn(&mut self, shape: &[usize], std: f64, dev: &Device) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                let (u1, u2) = (self.uniform(), self.uniform());
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * std) as f32
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, dev)?)
    }
}

/// A loaded model and its per-sequence state.
pub enum Engine {
    Stock {
        model: Box<stock_llama::Llama>,
        cache: Option<Box<stock_llama::Cache>>,
        cfg: Config,
        dtype: DType,
        dev: Device,
    },
    Ours {
        model: Box<Llama>,
        cache: Option<Box<Cache>>,
        /// The decode steps (CUDA graph replay where possible), per batch; rebuilt with the cache.
        decoder: Option<GraphDecoder>,
        kv: KvFormat,
        cfg: Config,
        dtype: DType,
        dev: Device,
    },
    QLlama {
        model: Box<quantized_llama::ModelWeights>,
        dtype: GgmlDType,
        dev: Device,
    },
}

impl Engine {
    /// Our Llama of `cfg` in `w` without any dense weights (models too large for their f16
    /// weights: the linear layers copies of prototypes drawn directly in `w`, the embedding
    /// and norms random).
    pub fn build_direct(
        w: WeightFormat,
        kv: KvFormat,
        cfg: &Config,
        dtype: DType,
        dev: &Device,
        protos: &mut Prototypes,
    ) -> Result<Self> {
        protos.direct = true;
        let src = DirectSource {
            protos: std::cell::RefCell::new(protos),
            format: w,
            dtype,
            dev: dev.clone(),
        };
        let model = Llama::load_from(&src, cfg);
        src.protos.into_inner().direct = false;
        Ok(Self::Ours {
            model: Box::new(model?),
            cache: None,
            decoder: None,
            kv,
            cfg: cfg.clone(),
            dtype,
            dev: dev.clone(),
        })
    }

    /// Build `spec` for `cfg` with random weights (seed `seed`) on `dev`.
    pub fn build(
        spec: Spec,
        cfg: &Config,
        dtype: DType,
        dev: &Device,
        protos: &mut Prototypes,
        seed: u64,
    ) -> Result<Self> {
        Ok(match spec {
            Spec::Stock => {
                let vb =
                    VarBuilder::from_tensors(random_weights(cfg, dtype, dev, seed)?, dtype, dev);
                let model = Box::new(stock_llama::Llama::load(vb, cfg)?);
                Self::Stock {
                    model,
                    cache: None,
                    cfg: cfg.clone(),
                    dtype,
                    dev: dev.clone(),
                }
            }
            Spec::Ours(w, kv) => {
                let vb =
                    VarBuilder::from_tensors(random_weights(cfg, dtype, dev, seed)?, dtype, dev);
                let mut model = Box::new(Llama::load(vb, cfg)?);
                quantize_ours(&mut model, w, dtype, protos)?;
                Self::Ours {
                    model,
                    cache: None,
                    decoder: None,
                    kv,
                    cfg: cfg.clone(),
                    dtype,
                    dev: dev.clone(),
                }
            }
            Spec::QLlama(dt) => Self::QLlama {
                model: Box::new(qllama(cfg, dt, dev, protos)?),
                dtype: dt,
                dev: dev.clone(),
            },
            Spec::Loaded(_) => anyhow::bail!("a loaded model is built with Engine::loaded"),
        })
    }

    /// Our Llama over a model the loader built.
    pub fn loaded(model: Llama, cfg: &Config, dtype: DType, dev: &Device) -> Self {
        let kv = KvFormat::Dense;
        Self::Ours {
            model: Box::new(model),
            cache: None,
            decoder: None,
            kv,
            cfg: cfg.clone(),
            dtype,
            dev: dev.clone(),
        }
    }

    /// Positions the model can hold (quantized_llama's RoPE table stops at 4096).
    pub fn max_positions(&self) -> usize {
        match self {
            Self::Stock { cfg, .. } => cfg.max_position_embeddings,
            Self::Ours { .. } => usize::MAX,
            Self::QLlama { .. } => quantized_llama::MAX_SEQ_LEN,
        }
    }

    /// Bytes of weights, where the model says (ours only).
    pub fn weight_bytes(&self) -> Option<usize> {
        match self {
            Self::Ours { model, .. } => Some(model.weight_bytes()),
            _ => None,
        }
    }

    /// Bytes of every linear layer's weights (what a decode step must read besides the
    /// cache), counted from the model's own storage (ours) or its shapes and format.
    pub fn linear_bytes(&self, cfg: &Config) -> Result<usize> {
        let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
        let hd = h / cfg.num_attention_heads;
        let per_layer =
            h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd + h * h + 3 * h * i;
        let params = cfg.num_hidden_layers * per_layer + v * h;
        Ok(match self {
            Self::Ours { model, .. } => model.linears().iter().map(|l| l.weight_bytes()).sum(),
            Self::Stock { dtype, .. } => params * dtype.size_in_bytes(),
            Self::QLlama { dtype, .. } => params / dtype.block_size() * dtype.type_size(),
        })
    }

    /// Start a new batch of sequences that will hold up to `max_len` positions.
    pub fn reset(&mut self, max_len: usize) -> Result<()> {
        anyhow::ensure!(
            max_len <= self.max_positions(),
            "{max_len} positions exceed the model's {}",
            self.max_positions()
        );
        match self {
            Self::Stock {
                cache,
                cfg,
                dtype,
                dev,
                ..
            } => {
                *cache = None;
                *cache = Some(Box::new(stock_llama::Cache::new(true, *dtype, cfg, dev)?));
            }
            Self::Ours {
                cache,
                decoder,
                kv,
                cfg,
                dtype,
                dev,
                ..
            } => {
                // A captured graph points at the old cache's storage: drop it with the cache.
                *decoder = None;
                *cache = None;
                // Random weights have no calibration: Oaken runs with N(0, 1) thresholds
                // (speed rows only).
                let spec = candle_lowbit::KvSpec::uncalibrated(*kv, cfg.num_hidden_layers)?;
                *cache = Some(Box::new(Cache::with_spec(
                    max_len, &spec, *dtype, cfg, dev,
                )?));
            }
            Self::QLlama { model, .. } => model.clear_kv_cache(),
        }
        Ok(())
    }

    /// Bytes of one (token, KV head) row of K or V in this engine's cache.
    pub fn kv_row_bytes(&self, hd: usize) -> usize {
        match self {
            Self::Ours { kv, dtype, .. } => kv.row_bytes(hd, *dtype),
            Self::Stock { dtype, .. } => hd * dtype.size_in_bytes(),
            // candle's quantized_llama caches K and V in f32.
            Self::QLlama { .. } => hd * 4,
        }
    }

    /// Whether [`Engine::fill_random`] applies.
    pub fn fills_directly(&self) -> bool {
        matches!(self, Self::Ours { .. })
    }

    /// `reset(max_len)`, then rows `0..c` of every layer's cache for batch `b` written
    /// from random K and V (`Cache::fill_random`) instead of prefilling a prompt: ours
    /// only, for decode rows whose prefill would take minutes.
    pub fn fill_random(&mut self, max_len: usize, b: usize, c: usize) -> Result<()> {
        self.reset(max_len)?;
        match self {
            Self::Ours {
                cache: Some(cache),
                dtype,
                ..
            } => Ok(cache.fill_random(b, c, *dtype)?),
            _ => anyhow::bail!("only our engine fills its caches directly"),
        }
    }

    /// Logits `[b, vocab]` (f32) of the last position of `ids` `[b, seq]` at `pos`.
    pub fn forward(&mut self, ids: &Tensor, pos: usize) -> Result<Tensor> {
        Ok(match self {
            Self::Stock {
                model,
                cache: Some(c),
                ..
            } => model.forward(ids, pos, c)?,
            Self::Ours {
                model,
                cache: Some(c),
                ..
            } => model.forward(ids, pos, c)?,
            Self::QLlama { model, .. } => model.forward(ids, pos)?.to_dtype(DType::F32)?,
            _ => anyhow::bail!("forward before reset"),
        })
    }

    /// One decode step as a generation loop runs it: `tokens[i]` of sequence `i` at `pos`
    /// (after a prefill of `pos` tokens). Stock models: `forward` of `[b, 1]`. Ours: the
    /// graph decoder (`candle_lowbit::graph`), which replays a CUDA graph where it can.
    pub fn step(&mut self, tokens: &[u32], pos: usize) -> Result<Tensor> {
        match self {
            Self::Ours {
                model,
                cache: Some(c),
                decoder,
                dev,
                ..
            } => {
                if decoder.is_none() {
                    *decoder = Some(GraphDecoder::new(model, tokens.len(), dev)?);
                }
                let Some(d) = decoder.as_mut() else {
                    anyhow::bail!("no decoder")
                };
                Ok(d.step(model, c, tokens, pos)?)
            }
            _ => {
                let ids = Tensor::from_vec(tokens.to_vec(), (tokens.len(), 1), &self.device())?;
                self.forward(&ids, pos)
            }
        }
    }

    /// Prompt chunk for batch `b`: stock quantized_llama cannot prefill more than one
    /// token at batch > 1 (its last-position slice is not contiguous and QMatMul needs it
    /// to be), so it prefills those prompts a token at a time (untimed).
    pub fn prefill_chunk(&self, b: usize, chunk: usize) -> usize {
        match self {
            Self::QLlama { .. } if b > 1 => 1,
            _ => chunk,
        }
    }

    /// How decode steps run: `graph`, `eager` (with the reason), or `candle` (stock).
    pub fn mode(&self) -> String {
        match self {
            Self::Ours {
                decoder: Some(d), ..
            } => match d.mode() {
                Mode::Graph => "graph".into(),
                Mode::Pending => "pending".into(),
                Mode::Eager(why) => format!("eager ({why})"),
            },
            Self::Ours { .. } => "eager".into(),
            _ => "candle".into(),
        }
    }

    fn device(&self) -> Device {
        match self {
            Self::Stock { dev, .. } | Self::Ours { dev, .. } | Self::QLlama { dev, .. } => {
                dev.clone()
            }
        }
    }
}

/// Re-encode our model's linear layers in `w` (the head in `Llama::head_format(w)`) from
/// per-shape prototypes (see `quant`): every layer holds its own device copy of the same
/// values, so bytes, memory and bandwidth are a real model's; the values are not (fine for
/// speed).
fn quantize_ours(
    model: &mut Llama,
    w: WeightFormat,
    dtype: DType,
    protos: &mut Prototypes,
) -> Result<()> {
    if w == WeightFormat::Dense {
        return Ok(());
    }
    for layer in 0..model.num_layers() {
        for slot in Slot::ALL {
            let shape = model.linear(layer, slot)?.shape();
            model.set_linear(layer, slot, protos.copy_for(slot, shape, w, dtype)?)?;
        }
    }
    let (n, k) = model.lm_head().shape();
    model.set_lm_head(protos.copy(n, k, Llama::head_format(w), dtype)?)?;
    Ok(())
}

/// Weights for [`Engine::build_direct`].
struct DirectSource<'a> {
    protos: std::cell::RefCell<&'a mut Prototypes>,
    format: WeightFormat,
    dtype: DType,
    dev: Device,
}

impl candle_lowbit::llama::WeightSource for DirectSource<'_> {
    fn tensor(&self, name: &str, dims: &[usize]) -> candle_core::Result<Tensor> {
        let t = crate::util::randn(
            dims,
            if dims.len() == 1 { 0.1 } else { 1.0 },
            DType::F32,
            &self.dev,
        )
        .map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
        let t = if dims.len() == 1 { (t + 1.0)? } else { t };
        t.to_dtype(self.dtype)
    }

    fn linear(&self, parts: &[(String, usize)], in_dim: usize) -> candle_core::Result<QLinear> {
        let rows = parts.iter().map(|(_, r)| r).sum();
        let Some(slot) = parts.first().and_then(|(name, _)| Slot::of_part(name)) else {
            candle_core::bail!("bench: no layer slot holds the parts {parts:?}")
        };
        self.protos
            .borrow_mut()
            .copy_for(slot, (rows, in_dim), self.format, self.dtype)
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    }

    fn lm_head(&self, cfg: &Config, _embed: &Tensor) -> candle_core::Result<QLinear> {
        self.protos
            .borrow_mut()
            .copy(
                cfg.vocab_size,
                cfg.hidden_size,
                Llama::head_format(self.format),
                self.dtype,
            )
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    }
}

/// The row-name spelling of a GGML dtype (`q4k`, `q4_0`), as `WeightFormat` names it.
fn ggml_name(dt: GgmlDType) -> String {
    format!("{dt:?}").to_lowercase()
}

/// quantized_llama over a GGUF in `dt` written (in memory) from per-shape prototypes (the
/// same prototypes our GGML configurations use), with llama.cpp's names and metadata.
/// llama.cpp's converter permutes Q and K rows for its interleaved RoPE; random weights
/// need no permutation (speed only, not values).
fn qllama(
    cfg: &Config,
    dt: GgmlDType,
    dev: &Device,
    protos: &mut Prototypes,
) -> Result<quantized_llama::ModelWeights> {
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let hd = h / cfg.num_attention_heads;
    let kv = cfg.num_key_value_heads * hd;
    let cpu = Device::Cpu;
    let emb = protos.qtensor(v, h, dt, &cpu)?;
    let w_q = protos.qtensor(h, h, dt, &cpu)?;
    let w_kv = protos.qtensor(kv, h, dt, &cpu)?;
    let w_up = protos.qtensor(i, h, dt, &cpu)?;
    let w_down = protos.qtensor(h, i, dt, &cpu)?;
    let norm = QTensor::quantize(&Tensor::ones(h, DType::F32, &Device::Cpu)?, GgmlDType::F32)?;
    let mut names: Vec<(String, &QTensor)> = vec![
        ("token_embd.weight".into(), &emb),
        ("output_norm.weight".into(), &norm),
        ("output.weight".into(), &emb),
    ];
    for l in 0..cfg.num_hidden_layers {
        for (n, t) in [
            ("attn_q", &w_q),
            ("attn_k", &w_kv),
            ("attn_v", &w_kv),
            ("attn_output", &w_q),
            ("ffn_gate", &w_up),
            ("ffn_up", &w_up),
            ("ffn_down", &w_down),
            ("attn_norm", &norm),
            ("ffn_norm", &norm),
        ] {
            names.push((format!("blk.{l}.{n}.weight"), t));
        }
    }
    use gguf_file::Value;
    let u = |x: usize| Value::U32(x as u32);
    let md: Vec<(&str, Value)> = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.attention.head_count", u(cfg.num_attention_heads)),
        ("llama.attention.head_count_kv", u(cfg.num_key_value_heads)),
        ("llama.block_count", u(cfg.num_hidden_layers)),
        ("llama.embedding_length", u(h)),
        ("llama.feed_forward_length", u(i)),
        ("llama.context_length", u(quantized_llama::MAX_SEQ_LEN)),
        ("llama.rope.dimension_count", u(hd)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        ("llama.rope.freq_base", Value::F32(cfg.rope_theta)),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (*k, v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = names.iter().map(|(k, t)| (k.as_str(), *t)).collect();
    let mut buf = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut buf, &md_refs, &t_refs)
        .with_context(|| format!("writing the {dt:?} GGUF"))?;
    eprintln!(
        "  wrote a {:.2} GB {dt:?} GGUF in memory",
        buf.get_ref().len() as f64 / 1e9
    );
    buf.set_position(0);
    let content = gguf_file::Content::read(&mut buf).context("reading back the GGUF")?;
    Ok(quantized_llama::ModelWeights::from_gguf(
        content, &mut buf, dev,
    )?)
}
