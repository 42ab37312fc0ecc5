//! The drop-in Llama: the public shape of `candle_transformers::models::llama`
//! (`Config` from a HF `config.json`, a `Cache`, `Llama::load(vb, &cfg)`,
//! `forward(&input_ids, index_pos, &mut cache) -> logits`), with two swap points:
//! every linear layer is a [`QLinear`] and every layer's cache a [`KvCache`].
//!
//! Differences from stock candle that a user can rely on:
//! - the KV cache is preallocated and written in place (no `Tensor::cat` per step);
//! - residual adds are fused into the next RMSNorm (`ops::add_rms_norm`); Q, K and V are
//!   one projection, gate and up another;
//! - batches of prompts of different lengths work: left-pad them and call
//!   [`Cache::set_left_padding`]; masks and RoPE positions then skip the padding.

use crate::kv_cache::{causal_mask, KvCache, KvFormat};
use crate::linear::{QLinear, WeightFormat};
use crate::ops::{add_rms_norm, embed_gather, Heads, StepPositions};
use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use candle_nn::VarBuilder;

pub use candle_transformers::models::llama::{Config, Llama3RopeConfig, Llama3RopeType, LlamaConfig, LlamaEosToks};

/// Inverse RoPE frequencies for `head_dim`, with Llama-3 scaling where configured
/// (the same formula as `candle_transformers::models::llama`).
fn inv_freqs(cfg: &Config, head_dim: usize) -> Vec<f32> {
    let base: Vec<f32> =
        (0..head_dim).step_by(2).map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / head_dim as f32)).collect();
    let Some(rs) = cfg.rope_scaling.as_ref().filter(|r| matches!(r.rope_type, Llama3RopeType::Llama3)) else {
        return base;
    };
    let orig = rs.original_max_position_embeddings as f32;
    let (low_wl, high_wl) = (orig / rs.low_freq_factor, orig / rs.high_freq_factor);
    base.into_iter()
        .map(|freq| {
            let wavelen = 2. * std::f32::consts::PI / freq;
            if wavelen < high_wl {
                freq
            } else if wavelen > low_wl {
                freq / rs.factor
            } else {
                let smooth = (orig / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor);
                (1. - smooth) * freq / rs.factor + smooth * freq
            }
        })
        .collect()
}

/// Every tensor a HF Llama checkpoint holds for `cfg` (name, shape), in load order:
/// the layout `Llama::load` reads. Tests and benches build random models from it.
pub fn tensor_shapes(cfg: &Config) -> Vec<(String, Vec<usize>)> {
    let (h, i, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size);
    let hd = h / cfg.num_attention_heads.max(1);
    let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        for (n, shape) in [
            ("input_layernorm", vec![h]),
            ("self_attn.q_proj", vec![q, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, q]),
            ("post_attention_layernorm", vec![h]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
        ] {
            out.push((format!("{p}.{n}.weight"), shape));
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    out
}

/// Per-model state across calls: the KV caches, RoPE tables and the left padding.
#[derive(Debug, Clone)]
pub struct Cache {
    kvs: Vec<KvCache>,
    /// RoPE tables in the run dtype (for candle's `rope` on prefill queries)...
    cos: Tensor,
    sin: Tensor,
    /// ...and in f32 for the fused kernels, `[max_len, hd/2]`.
    cos32: Tensor,
    sin32: Tensor,
    pads: Vec<usize>,
    /// `pads` on the device (u32 `[b]`), rebuilt when the batch or padding changes.
    pads_dev: Option<Tensor>,
    max_len: usize,
    device: Device,
    /// Bumped whenever storage a captured graph points at may have changed.
    pub(crate) generation: u64,
}

impl Cache {
    /// A dense cache holding up to `cfg.max_position_embeddings` tokens per sequence.
    pub fn new(dtype: DType, cfg: &Config, device: &Device) -> Result<Self> {
        Self::with_capacity(cfg.max_position_embeddings, KvFormat::Dense, dtype, cfg, device)
    }

    /// A cache of `max_len` tokens per sequence in KV format `format`. Storage is
    /// allocated on the first forward call, for its batch size.
    pub fn with_capacity(max_len: usize, format: KvFormat, dtype: DType, cfg: &Config, device: &Device) -> Result<Self> {
        if cfg.num_attention_heads == 0 || cfg.hidden_size % cfg.num_attention_heads != 0 {
            candle_core::bail!("config: hidden_size {} not divisible by {} heads", cfg.hidden_size, cfg.num_attention_heads)
        }
        let hd = cfg.hidden_size / cfg.num_attention_heads;
        let freqs = inv_freqs(cfg, hd);
        let n_pos = max_len.max(1);
        let t = Tensor::arange(0u32, n_pos as u32, device)?.to_dtype(DType::F32)?.reshape((n_pos, 1))?;
        let idx_theta = t.matmul(&Tensor::new(freqs.as_slice(), device)?.reshape((1, hd / 2))?)?;
        let heads = Heads { nh: cfg.num_attention_heads, nkv: cfg.num_key_value_heads, hd };
        let kvs = (0..cfg.num_hidden_layers).map(|_| KvCache::new(format, heads, max_len, dtype, device)).collect();
        let (cos32, sin32) = (idx_theta.cos()?, idx_theta.sin()?);
        Ok(Self {
            kvs,
            cos: cos32.to_dtype(dtype)?,
            sin: sin32.to_dtype(dtype)?,
            cos32,
            sin32,
            pads: vec![],
            pads_dev: None,
            max_len,
            device: device.clone(),
            generation: 0,
        })
    }

    /// Tokens each sequence can hold.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Left padding per sequence for the next prefill (from position 0); empty = none.
    pub fn set_left_padding(&mut self, pads: &[usize]) {
        self.pads = pads.to_vec();
        self.pads_dev = None;
    }

    /// Device bytes held by all layers' caches.
    pub fn bytes(&self) -> usize {
        self.kvs.iter().map(KvCache::bytes).sum()
    }

    /// Forget everything (the next forward must start at position 0).
    pub fn clear(&mut self) {
        self.kvs.iter_mut().for_each(KvCache::clear);
        self.pads.clear();
        self.pads_dev = None;
        self.generation += 1;
    }

    /// Positions for a step at device position `pos` (u32 `[1]`) over batch `pads.len()`,
    /// with the device copy of the padding (rebuilt only when it changes).
    fn step_positions(&mut self, pads: &[usize], pos: Tensor) -> Result<StepPositions> {
        let stale = self.pads_dev.as_ref().is_none_or(|t| t.elem_count() != pads.len());
        if stale {
            let v: Vec<u32> = pads.iter().map(|&p| p as u32).collect();
            self.pads_dev = Some(Tensor::new(v, &self.device)?);
            self.generation += 1;
        }
        let Some(pads_dev) = self.pads_dev.clone() else { candle_core::bail!("pads not set") };
        Ok(StepPositions { cos: self.cos32.clone(), sin: self.sin32.clone(), pos, pads: pads_dev })
    }

    /// Check that this cache fits a model of `layers` layers and `end` tokens.
    pub(crate) fn check(&self, layers: usize, end: usize) -> Result<()> {
        if end > self.max_len {
            candle_core::bail!("forward: positions up to {end} exceed the context of {} tokens", self.max_len)
        }
        if self.kvs.len() != layers {
            candle_core::bail!("cache has {} layers, model {layers}", self.kvs.len())
        }
        Ok(())
    }

    /// The batch size the caches hold (0 before the first forward).
    pub fn batch(&self) -> usize {
        self.kvs.first().map(KvCache::batch).unwrap_or(0)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    fn pads_for(&self, b: usize) -> Result<Vec<usize>> {
        match self.pads.len() {
            0 => Ok(vec![0; b]),
            n if n == b => Ok(self.pads.clone()),
            n => candle_core::bail!("left padding given for {n} sequences but the batch has {b}"),
        }
    }

    /// `(cos, sin)` for queries at `pos..pos+seq`: `[seq, hd/2]` without padding,
    /// `[b, seq, hd/2]` with it.
    fn rope_tables(&self, pads: &[usize], pos: usize, seq: usize) -> Result<(Tensor, Tensor)> {
        if pads.iter().all(|&p| p == 0) {
            return Ok((self.cos.narrow(0, pos, seq)?, self.sin.narrow(0, pos, seq)?));
        }
        let ids: Vec<u32> =
            pads.iter().flat_map(|&pad| (pos..pos + seq).map(move |p| p.saturating_sub(pad) as u32)).collect();
        let ids = Tensor::new(ids, &self.device)?;
        let hd2 = self.cos.dim(1)?;
        let cos = self.cos.index_select(&ids, 0)?.reshape((pads.len(), seq, hd2))?;
        let sin = self.sin.index_select(&ids, 0)?.reshape((pads.len(), seq, hd2))?;
        Ok((cos, sin))
    }
}

#[derive(Debug, Clone)]
struct Attention {
    qkv: QLinear,
    o: QLinear,
    n_h: usize,
    n_kv: usize,
    hd: usize,
}

struct StepCtx<'a> {
    pos: usize,
    /// Device positions and f32 tables for the fused ops.
    dev: &'a StepPositions,
    /// Run-dtype tables for the prefill queries, `[seq, hd/2]` or `[b, seq, hd/2]`.
    cos: &'a Tensor,
    sin: &'a Tensor,
    mask: Option<&'a Tensor>,
}

impl Attention {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, n_h, n_kv) = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads);
        let hd = h / n_h;
        let w = |name: &str, rows: usize| vb.pp(name).get((rows, h), "weight");
        let qkv = Tensor::cat(&[w("q_proj", n_h * hd)?, w("k_proj", n_kv * hd)?, w("v_proj", n_kv * hd)?], 0)?;
        let o = QLinear::load(n_h * hd, h, false, vb.pp("o_proj"))?;
        Ok(Self { qkv: QLinear::from_weight(qkv, None), o, n_h, n_kv, hd })
    }

    fn heads(&self) -> Heads {
        Heads { nh: self.n_h, nkv: self.n_kv, hd: self.hd }
    }

    /// One token per sequence: the fused append + decode attention (one launch on CUDA).
    /// Prompts: the fused append (RoPE on K, K and V into the cache), then candle ops over
    /// the cache.
    fn forward(&self, x: &Tensor, kv: &mut KvCache, ctx: &StepCtx) -> Result<Tensor> {
        let (b, seq, _) = x.dims3()?;
        let (n_h, hd) = (self.n_h, self.hd);
        let qkv = self.qkv.forward(x)?;
        let y = if seq == 1 && self.heads().fused_ok() {
            kv.append_attend_decode(&qkv, ctx.pos, ctx.dev)?
        } else {
            kv.append(&qkv, ctx.pos, ctx.dev)?;
            let q = qkv.narrow(2, 0, n_h * hd)?.reshape((b, seq, n_h, hd))?.transpose(1, 2)?.contiguous()?;
            let q = candle_nn::rotary_emb::rope(&q, ctx.cos, ctx.sin)?;
            let y = kv.attend(&q, ctx.pos + seq, ctx.mask)?;
            y.transpose(1, 2)?.reshape((b, seq, n_h * hd))?
        };
        self.o.forward(&y)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    /// Gate and up in one weight `[2 I, H]` (gate rows first).
    gate_up: QLinear,
    down: QLinear,
}

impl Mlp {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let gate = vb.pp("gate_proj").get((i, h), "weight")?;
        let up = vb.pp("up_proj").get((i, h), "weight")?;
        let gate_up = QLinear::from_weight(Tensor::cat(&[gate, up], 0)?, None);
        let down = QLinear::load(i, h, false, vb.pp("down_proj"))?;
        Ok(Self { gate_up, down })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.down.forward(&self.gate_up.forward_silu_mul(x)?)
    }
}

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Tensor,
    attn: Attention,
    mlp_norm: Tensor,
    mlp: Mlp,
}

/// The model. `forward` returns f32 logits of the last position, `[b, vocab]`.
#[derive(Debug, Clone)]
pub struct Llama {
    embed: Tensor,
    blocks: Vec<Block>,
    norm: Tensor,
    lm_head: QLinear,
    eps: f32,
    hidden: usize,
}

impl Llama {
    /// Load from a `VarBuilder` over HF Llama tensor names (`model.layers.N.self_attn.q_proj`...),
    /// dense weights in the VarBuilder's dtype.
    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let h = cfg.hidden_size;
        if cfg.num_key_value_heads == 0 || cfg.num_attention_heads % cfg.num_key_value_heads != 0 {
            candle_core::bail!(
                "config: {} attention heads not a multiple of {} kv heads",
                cfg.num_attention_heads,
                cfg.num_key_value_heads
            )
        }
        let embed = vb.pp("model.embed_tokens").get((cfg.vocab_size, h), "weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            QLinear::from_weight(embed.clone(), None)
        } else {
            QLinear::load(h, cfg.vocab_size, false, vb.pp("lm_head"))?
        };
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let vb = vb.pp(format!("model.layers.{i}"));
                Ok(Block {
                    attn_norm: vb.pp("input_layernorm").get(h, "weight")?,
                    attn: Attention::load(vb.pp("self_attn"), cfg)?,
                    mlp_norm: vb.pp("post_attention_layernorm").get(h, "weight")?,
                    mlp: Mlp::load(vb.pp("mlp"), cfg)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = vb.pp("model.norm").get(h, "weight")?;
        Ok(Self { embed, blocks, norm, lm_head, eps: cfg.rms_norm_eps as f32, hidden: h })
    }

    /// Every linear layer, mutably, in a fixed order (for swapping formats).
    pub fn linears_mut(&mut self) -> Vec<&mut QLinear> {
        let mut v = Vec::with_capacity(self.blocks.len() * 4 + 1);
        for b in self.blocks.iter_mut() {
            v.extend([&mut b.attn.qkv, &mut b.attn.o, &mut b.mlp.gate_up, &mut b.mlp.down]);
        }
        v.push(&mut self.lm_head);
        v
    }

    /// Every linear layer, in the order of `linears_mut`.
    pub fn linears(&self) -> Vec<&QLinear> {
        let mut v: Vec<&QLinear> = self.blocks.iter().flat_map(|b| [&b.attn.qkv, &b.attn.o, &b.mlp.gate_up, &b.mlp.down]).collect();
        v.push(&self.lm_head);
        v
    }

    /// Re-encode every linear layer in `format`, except the output head, which a GGML
    /// format keeps at Q8_0 (as llama.cpp does: it is the most sensitive matrix, and the
    /// default GGUF ships it that way). Returns how many layers took the block-32
    /// fallback (rows not a multiple of the format's block).
    pub fn quantize(&mut self, format: WeightFormat) -> Result<usize> {
        let mut fallbacks = 0;
        let mut layers = self.linears_mut();
        let head = layers.pop();
        for l in layers {
            let (_, k) = l.shape()?;
            if let Some((_, true)) = format.ggml_dtype(k) {
                fallbacks += 1;
            }
            *l = l.quantize(format)?;
        }
        if let Some(head) = head {
            let head_format = if format == WeightFormat::Dense { format } else { WeightFormat::Q8_0 };
            *head = head.quantize(head_format)?;
        }
        Ok(fallbacks)
    }

    /// Bits per weight over all linear layers, counting every byte they read.
    pub fn bits_per_weight(&self) -> Result<f64> {
        let (mut bytes, mut n) = (0usize, 0usize);
        for l in self.linears() {
            let (o, i) = l.shape()?;
            bytes += l.weight_bytes()?;
            n += o * i;
        }
        Ok(bytes as f64 * 8.0 / n.max(1) as f64)
    }

    /// Bytes of every weight the model holds (linear layers, embedding, norms).
    pub fn weight_bytes(&self) -> Result<usize> {
        let t = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let mut bytes = t(&self.embed) + t(&self.norm);
        for l in self.linears() {
            bytes += l.weight_bytes()?;
        }
        for b in &self.blocks {
            bytes += t(&b.attn_norm) + t(&b.mlp_norm);
        }
        Ok(bytes)
    }

    /// Hidden states after the final norm, `[b, seq, hidden]`.
    fn hidden_states(&self, input_ids: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let (b, seq) = input_ids.dims2()?;
        if seq == 0 {
            candle_core::bail!("forward: empty input (batch {b}, 0 tokens)")
        }
        cache.check(self.blocks.len(), index_pos + seq)?;
        if index_pos == 0 {
            cache.generation += 1;
        }
        let pads = cache.pads_for(b)?;
        let (cos, sin) = cache.rope_tables(&pads, index_pos, seq)?;
        let mask = if seq == 1 && pads.iter().all(|&p| p == 0) {
            None
        } else {
            Some(causal_mask(&pads, index_pos, seq, input_ids.device())?)
        };
        let dev = cache.step_positions(&pads, Tensor::new(&[index_pos as u32], input_ids.device())?)?;
        let ctx = StepCtx { pos: index_pos, dev: &dev, cos: &cos, sin: &sin, mask: mask.as_ref() };
        self.layers(&input_ids.flatten_all()?, (b, seq), &ctx, &mut cache.kvs)
    }

    /// The transformer over token ids `[b * seq]`: embedding, every block, final norm.
    fn layers(&self, ids: &Tensor, (b, seq): (usize, usize), ctx: &StepCtx, kvs: &mut [KvCache]) -> Result<Tensor> {
        let mut res = embed_gather(&self.embed, ids)?.reshape((b, seq, self.hidden))?;
        let Some(first) = self.blocks.first() else { candle_core::bail!("model has no layers") };
        let mut xn = candle_nn::ops::rms_norm(&res, &first.attn_norm, self.eps)?;
        for (i, (blk, kv)) in self.blocks.iter().zip(kvs.iter_mut()).enumerate() {
            let a = blk.attn.forward(&xn, kv, ctx)?;
            (res, xn) = add_rms_norm(&a, &res, &blk.mlp_norm, self.eps)?;
            let m = blk.mlp.forward(&xn)?;
            let next_norm = self.blocks.get(i + 1).map(|b| &b.attn_norm).unwrap_or(&self.norm);
            (res, xn) = add_rms_norm(&m, &res, next_norm, self.eps)?;
        }
        Ok(xn)
    }

    /// One decode step for the graph decoder: ids `[b]` and the position on the device;
    /// 7 launches per layer for dense weights at batch 1 (two fused add + RMSNorm, the QKV,
    /// o, gate/up with SiLU·mul, and down projections, one decode attention that also does
    /// RoPE + KV append; at batch > 1 the projections are cuBLAS's and SiLU·mul its own
    /// launch) and 5 more per token (embedding, first norm, output head, logits copy,
    /// position advance); GGML formats add candle's activation quantization before each
    /// projection. Writes f32 logits `[b, vocab]` into `logits` and advances `pos` by one. Every launch
    /// reads its inputs from device buffers that outlive a captured graph.
    pub(crate) fn decode_step_into(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        host_pos: usize,
        logits: &Tensor,
        cache: &mut Cache,
    ) -> Result<()> {
        let b = ids.dim(0)?;
        let pads = cache.pads_for(b)?;
        let dev = cache.step_positions(&pads, pos.clone())?;
        let (cos, sin) = (cache.cos.narrow(0, host_pos, 1)?, cache.sin.narrow(0, host_pos, 1)?);
        let ctx = StepCtx { pos: host_pos, dev: &dev, cos: &cos, sin: &sin, mask: None };
        let xn = self.layers(ids, (b, 1), &ctx, &mut cache.kvs)?;
        let out = self.lm_head.forward_f32(&xn.reshape((b, self.hidden))?)?;
        logits.slice_set(&out, 0, 0)?;
        crate::ops::advance_pos(pos, 1)
    }

    /// Whether every layer can take the fused decode path (needed for graph replay).
    pub fn fused_decode_ok(&self) -> bool {
        self.blocks.iter().all(|b| b.attn.heads().fused_ok())
    }

    pub fn vocab_size(&self) -> Result<usize> {
        Ok(self.lm_head.shape()?.0)
    }

    /// Logits `[b, vocab]` (f32) of the last position of `input_ids` `[b, seq]` (u32), whose
    /// first token sits at position `index_pos` of the cache.
    pub fn forward(&self, input_ids: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let xn = self.hidden_states(input_ids, index_pos, cache)?;
        let seq = xn.dim(1)?;
        let last = xn.i((.., seq - 1, ..))?.contiguous()?;
        self.lm_head.forward_f32(&last)
    }

    /// Logits `[b, seq, vocab]` (f32) of every position (for perplexity).
    pub fn forward_all(&self, input_ids: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let xn = self.hidden_states(input_ids, index_pos, cache)?;
        self.lm_head.forward(&xn)?.to_dtype(DType::F32)
    }
}
