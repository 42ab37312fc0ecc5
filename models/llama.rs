//! The drop-in Llama: the public shape of `candle_transformers::models::llama`
//! (`Config` from a HF `config.json`, a `Cache`, `Llama::load(vb, &cfg)`,
//! `forward(&input_ids, index_pos, &mut cache) -> logits`), with two swap points:
//! every linear layer is a [`QLinear`] and every layer's cache a [`KvCache`].
//!
//! Differences from stock candle that a user can rely on:
//! - the KV cache is preallocated and written in place (no `Tensor::cat` per step);
//! - residual adds are fused into the next RMSNorm (`ops::add_rms_norm`), or, where a
//!   projection adds the residual in its epilogue and the next computes the norm in its
//!   prologue (tiled formats at one token), into those two kernels
//!   ([`QLinear::forward_residual_norm`]); Q, K and V are one projection, gate and up another;
//! - batches of prompts of different lengths work: left-pad them and call
//!   [`Cache::set_left_padding`]; masks and RoPE positions then skip the padding.

use crate::formats::{Activation, WeightFormat};
use crate::kv::{causal_mask, KvCache};
use crate::linear::QLinear;
use crate::ops::{embed_gather, StepPositions};
use candle_core::{DType, IndexOp, Module, Result, Tensor};
use candle_nn::VarBuilder;

#[path = "cache.rs"]
mod cache;
#[path = "parts.rs"]
mod parts;

pub use cache::Cache;
pub use parts::{NoObserver, Observer, Slot, WeightSource};

pub use candle_transformers::models::llama::{
    Config, Llama3RopeConfig, Llama3RopeType, LlamaConfig, LlamaEosToks,
};

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
    /// Tell `obs` this step's keys (before and after RoPE) and values.
    fn observe_kv(
        &self,
        qkv: &Tensor,
        ctx: &StepCtx,
        layer: usize,
        obs: &mut dyn Observer,
    ) -> Result<()> {
        if !obs.wants_kv() {
            return Ok(());
        }
        let (b, seq, _) = qkv.dims3()?;
        let (n_h, n_kv, hd) = (self.n_h, self.n_kv, self.hd);
        let k = qkv.narrow(2, n_h * hd, n_kv * hd)?;
        let v = qkv.narrow(2, (n_h + n_kv) * hd, n_kv * hd)?;
        let kr = k
            .reshape((b, seq, n_kv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let kr = candle_nn::rotary_emb::rope(&kr, ctx.cos, ctx.sin)?
            .transpose(1, 2)?
            .reshape((b, seq, n_kv * hd))?;
        obs.kv(layer, &k, &kr, &v)
    }

    /// One token per sequence: the fused append + decode attention (one launch on CUDA).
    /// Prompts: the fused append (RoPE on K, K and V into the cache), then the fused prefill
    /// attention over the cache (CUDA, f16 / bf16), else candle ops over it.
    fn forward(
        &self,
        x: &Activation,
        kv: &mut KvCache,
        ctx: &StepCtx,
        layer: usize,
        obs: &mut dyn Observer,
    ) -> Result<Tensor> {
        let (b, seq, _) = x.dims3()?;
        let (n_h, hd) = (self.n_h, self.hd);
        // Observers see dense inputs (calibration runs blocks before they are quantized).
        if let Activation::Dense(d) = x {
            obs.linear_input(layer, Slot::Qkv, d)?;
        }
        let qkv = self.qkv.forward_act(x)?;
        self.observe_kv(&qkv, ctx, layer, obs)?;
        let fused = match seq {
            1 => kv.append_attend_decode(&qkv, ctx.pos, ctx.dev)?,
            _ => None,
        };
        let y = match fused {
            Some(y) => y,
            None => {
                kv.append(&qkv, ctx.pos, ctx.dev)?;
                match kv.attend_prefill(&qkv, ctx.pos, ctx.dev)? {
                    Some(y) => y,
                    None => {
                        let q = qkv
                            .narrow(2, 0, n_h * hd)?
                            .reshape((b, seq, n_h, hd))?
                            .transpose(1, 2)?
                            .contiguous()?;
                        let q = candle_nn::rotary_emb::rope(&q, ctx.cos, ctx.sin)?;
                        let y = kv.attend(&q, ctx.pos + seq, ctx.mask)?;
                        y.transpose(1, 2)?.reshape((b, seq, n_h * hd))?
                    }
                }
            }
        };
        obs.linear_input(layer, Slot::O, &y)?;
        Ok(y)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    /// Gate and up in one weight `[2 I, H]` (gate rows first).
    gate_up: QLinear,
    down: QLinear,
}

impl Mlp {
    /// The down projection's input, `silu(gate) · up`.
    fn forward(&self, x: &Activation, layer: usize, obs: &mut dyn Observer) -> Result<Activation> {
        if let Activation::Dense(d) = x {
            obs.linear_input(layer, Slot::GateUp, d)?;
        }
        let h = self
            .gate_up
            .forward_silu_mul_as(x, &self.down.input_encoding())?;
        if let Activation::Dense(d) = &h {
            obs.linear_input(layer, Slot::Down, d)?;
        }
        Ok(h)
    }

    /// The hidden channels renumbered: channel `j` becomes the old channel `order[j]` (the
    /// gate and up rows taken in that order, the down projection's columns with them).
    /// `silu(gate) · up` is elementwise, so the block computes exactly what it did. Both
    /// layers come back dense f32 (this runs right before they are quantized).
    fn permute_hidden(&mut self, order: &[u32]) -> Result<()> {
        let ((n2, _), (_, i)) = (self.gate_up.shape(), self.down.shape());
        let mut seen = vec![false; i];
        if n2 != 2 * i || order.len() != i {
            candle_core::bail!(
                "permute_hidden: an order of {} channels for gate/up [{n2}, _] and down [_, {i}]",
                order.len()
            )
        }
        for &c in order {
            match seen.get_mut(c as usize) {
                Some(s) if !*s => *s = true,
                _ => candle_core::bail!("permute_hidden: the order is not a permutation of 0..{i}"),
            }
        }
        let dev = self.down.weights().device();
        let rows: Vec<u32> = order
            .iter()
            .chain(order)
            .enumerate()
            .map(|(r, &c)| c + (r / i * i) as u32)
            .collect();
        let rows = Tensor::from_vec(rows, 2 * i, &dev)?;
        let cols = Tensor::from_vec(order.to_vec(), i, &dev)?;
        let gate_up = self.gate_up.dequantize()?.index_select(&rows, 0)?;
        let b = self
            .gate_up
            .bias()
            .map(|b| b.index_select(&rows, 0))
            .transpose()?;
        self.gate_up = QLinear::from_weight(gate_up, b)?;
        let down = self.down.dequantize()?.index_select(&cols, 1)?;
        self.down = QLinear::from_weight(down, self.down.bias().cloned())?;
        Ok(())
    }
}

#[derive(Debug, Clone)]
struct Block {
    attn_norm: Tensor,
    attn: Attention,
    mlp_norm: Tensor,
    mlp: Mlp,
}

impl Block {
    fn load(src: &dyn WeightSource, cfg: &Config, layer: usize) -> Result<Self> {
        let (h, n_h, n_kv) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        let lin = |s: Slot| src.linear(&s.parts(cfg, layer), s.in_dim(cfg));
        let p = format!("model.layers.{layer}");
        Ok(Self {
            attn_norm: src.tensor(&format!("{p}.input_layernorm.weight"), &[h])?,
            attn: Attention {
                qkv: lin(Slot::Qkv)?,
                o: lin(Slot::O)?,
                n_h,
                n_kv,
                hd: h / n_h,
            },
            mlp_norm: src.tensor(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
            mlp: Mlp {
                gate_up: lin(Slot::GateUp)?,
                down: lin(Slot::Down)?,
            },
        })
    }

    fn linear(&self, slot: Slot) -> &QLinear {
        match slot {
            Slot::Qkv => &self.attn.qkv,
            Slot::O => &self.attn.o,
            Slot::GateUp => &self.mlp.gate_up,
            Slot::Down => &self.mlp.down,
        }
    }

    fn linear_mut(&mut self, slot: Slot) -> &mut QLinear {
        match slot {
            Slot::Qkv => &mut self.attn.qkv,
            Slot::O => &mut self.attn.o,
            Slot::GateUp => &mut self.mlp.gate_up,
            Slot::Down => &mut self.mlp.down,
        }
    }

    /// The block over the residual stream `res` and its normed copy `xn`: returns the new
    /// residual and its norm under `next` (the next block's input norm, or the final one,
    /// in the encoding the projection after it reads).
    fn forward(
        &self,
        (res, xn): (&Tensor, &Activation),
        next: (&Tensor, &QLinear),
        kv: &mut KvCache,
        ctx: &StepCtx,
        (layer, eps): (usize, f32),
        obs: &mut dyn Observer,
    ) -> Result<(Tensor, Activation)> {
        let y = self.attn.forward(xn, kv, ctx, layer, obs)?;
        let (res, xn) = self.attn.o.forward_residual_norm(
            &Activation::Dense(y),
            res,
            &self.mlp_norm,
            eps,
            &self.mlp.gate_up,
        )?;
        let h = self.mlp.forward(&xn, layer, obs)?;
        self.mlp
            .down
            .forward_residual_norm(&h, &res, next.0, eps, next.1)
    }
}

/// Bits per weight of `layers` together, every byte counted.
fn bits_of(layers: &[&QLinear]) -> f64 {
    let (mut bytes, mut n) = (0usize, 0usize);
    for l in layers {
        let (o, i) = l.shape();
        bytes += l.weight_bytes();
        n += o * i;
    }
    bytes as f64 * 8.0 / n.max(1) as f64
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
        Self::load_from(&vb, cfg)
    }

    /// Load from any [`WeightSource`] (a `VarBuilder`, a quantized checkpoint).
    pub fn load_from(src: &dyn WeightSource, cfg: &Config) -> Result<Self> {
        let h = cfg.hidden_size;
        if cfg.num_attention_heads == 0 || !h.is_multiple_of(cfg.num_attention_heads) {
            candle_core::bail!(
                "config: hidden_size {h} not divisible by {} heads",
                cfg.num_attention_heads
            )
        }
        if cfg.num_key_value_heads == 0
            || !cfg
                .num_attention_heads
                .is_multiple_of(cfg.num_key_value_heads)
        {
            candle_core::bail!(
                "config: {} attention heads not a multiple of {} kv heads",
                cfg.num_attention_heads,
                cfg.num_key_value_heads
            )
        }
        let embed = src.tensor("model.embed_tokens.weight", &[cfg.vocab_size, h])?;
        let lm_head = src.lm_head(cfg, &embed)?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| Block::load(src, cfg, i))
            .collect::<Result<Vec<_>>>()?;
        let norm = src.tensor("model.norm.weight", &[h])?;
        Ok(Self {
            embed,
            blocks,
            norm,
            lm_head,
            eps: cfg.rms_norm_eps as f32,
            hidden: h,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.blocks.len()
    }

    /// Linear layer `slot` of block `layer`.
    pub fn linear(&self, layer: usize, slot: Slot) -> Result<&QLinear> {
        match self.blocks.get(layer) {
            Some(b) => Ok(b.linear(slot)),
            None => candle_core::bail!("layer {layer} out of range ({} layers)", self.blocks.len()),
        }
    }

    /// Replace linear layer `slot` of block `layer` (same shape).
    pub fn set_linear(&mut self, layer: usize, slot: Slot, l: QLinear) -> Result<()> {
        let n = self.blocks.len();
        let Some(b) = self.blocks.get_mut(layer) else {
            candle_core::bail!("layer {layer} out of range ({n} layers)")
        };
        let cur = b.linear_mut(slot);
        if cur.shape() != l.shape() {
            candle_core::bail!(
                "layer {layer} {}: new weight {:?} for a {:?} layer",
                slot.name(),
                l.shape(),
                cur.shape()
            )
        }
        *cur = l;
        Ok(())
    }

    pub fn lm_head(&self) -> &QLinear {
        &self.lm_head
    }

    pub fn set_lm_head(&mut self, l: QLinear) -> Result<()> {
        if l.shape() != self.lm_head.shape() {
            candle_core::bail!(
                "lm_head: new weight {:?} for a {:?} head",
                l.shape(),
                self.lm_head.shape()
            )
        }
        self.lm_head = l;
        Ok(())
    }

    /// The dense tensors (embedding, norms) by HF name.
    pub fn dense_tensors(&self) -> Vec<(String, Tensor)> {
        let mut v = vec![("model.embed_tokens.weight".to_string(), self.embed.clone())];
        for (i, b) in self.blocks.iter().enumerate() {
            v.push((
                format!("model.layers.{i}.input_layernorm.weight"),
                b.attn_norm.clone(),
            ));
            v.push((
                format!("model.layers.{i}.post_attention_layernorm.weight"),
                b.mlp_norm.clone(),
            ));
        }
        v.push(("model.norm.weight".to_string(), self.norm.clone()));
        v
    }

    /// Every linear layer, mutably, in a fixed order (blocks' slots, then the head).
    pub fn linears_mut(&mut self) -> Vec<&mut QLinear> {
        let mut v = Vec::with_capacity(self.blocks.len() * 4 + 1);
        for b in self.blocks.iter_mut() {
            v.extend([
                &mut b.attn.qkv,
                &mut b.attn.o,
                &mut b.mlp.gate_up,
                &mut b.mlp.down,
            ]);
        }
        v.push(&mut self.lm_head);
        v
    }

    /// Every linear layer, in the order of `linears_mut`.
    pub fn linears(&self) -> Vec<&QLinear> {
        let mut v: Vec<&QLinear> = self
            .blocks
            .iter()
            .flat_map(|b| [&b.attn.qkv, &b.attn.o, &b.mlp.gate_up, &b.mlp.down])
            .collect();
        v.push(&self.lm_head);
        v
    }

    /// The format the output head takes when the blocks take `format`: itself for dense,
    /// Q8_0 otherwise (as llama.cpp does: it is the most sensitive matrix, and the default
    /// GGUF ships it that way).
    pub fn head_format(format: WeightFormat) -> WeightFormat {
        if format == WeightFormat::Dense {
            format
        } else {
            WeightFormat::Q8_0
        }
    }

    /// Re-encode every linear layer in `format` (one that needs no calibration; GPTQ
    /// formats go through [`crate::calib::quantize_model`]), the head in
    /// [`Llama::head_format`].
    pub fn quantize(&mut self, format: WeightFormat) -> Result<()> {
        self.quantize_with(format, &crate::formats::QuantOptions::default())
    }

    /// [`Llama::quantize`] with the quantizer's options.
    pub fn quantize_with(
        &mut self,
        format: WeightFormat,
        opts: &crate::formats::QuantOptions,
    ) -> Result<()> {
        if format.needs_calibration() {
            candle_core::bail!(
                "{format} needs calibration statistics: quantize through candle_lowbit::calib::quantize_model \
                 (the tools: --calib FILE)"
            )
        }
        for layer in 0..self.blocks.len() {
            self.fold_down_order(layer, format, opts, None)?;
            for slot in Slot::ALL {
                let q = self.blocks[layer]
                    .linear(slot)
                    .quantize_with(format, None, opts)?;
                *self.blocks[layer].linear_mut(slot) = q;
            }
        }
        self.lm_head = self.lm_head.quantize(Self::head_format(format))?;
        Ok(())
    }

    /// Before block `layer` is quantized in `format`: where the format reorders its input
    /// channels ([`Codec::input_order`](crate::formats::Codec::input_order), `w2416`), the
    /// down projection's order is taken into the block itself — the gate/up rows and the
    /// down columns renumbered by it, an exact change of the hidden channels' numbering —
    /// so that the quantized down projection stores no order and its GEMV reads its input
    /// as the SiLU·mul epilogue writes it. `hessian`: the down projection's input Hessian
    /// `[I, I]` (f32) where calibration gave one. Returns it renumbered with the channels
    /// (unchanged where nothing was folded), for the down projection's quantizer.
    pub fn fold_down_order(
        &mut self,
        layer: usize,
        format: WeightFormat,
        opts: &crate::formats::QuantOptions,
        hessian: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let n = self.blocks.len();
        let Some(b) = self.blocks.get_mut(layer) else {
            candle_core::bail!("layer {layer} out of range ({n} layers)")
        };
        let codec = format.spec().codec;
        let Some(order) = codec.input_order(b.mlp.down.weights(), hessian, opts)? else {
            return Ok(hessian.cloned());
        };
        b.mlp.permute_hidden(&order)?;
        match hessian {
            Some(h) => {
                let i = order.len();
                let idx = Tensor::from_vec(order, i, h.device())?;
                Ok(Some(h.index_select(&idx, 0)?.index_select(&idx, 1)?))
            }
            None => Ok(None),
        }
    }

    /// Bits per weight over all linear layers (the output head included), counting every
    /// byte they read.
    pub fn bits_per_weight(&self) -> f64 {
        bits_of(&self.linears())
    }

    /// Bits per weight over the blocks' linear layers (the head left out).
    pub fn block_bits_per_weight(&self) -> f64 {
        let mut layers = self.linears();
        layers.pop();
        bits_of(&layers)
    }

    /// Bytes of every weight the model holds (linear layers, embedding, norms).
    pub fn weight_bytes(&self) -> usize {
        let dense: usize = self
            .dense_tensors()
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        dense
            + self
                .linears()
                .iter()
                .map(|l| l.weight_bytes())
                .sum::<usize>()
    }

    /// The decode paths not taken, once per distinct reason: "`layers` `what`: `reason`"
    /// (the graph decoder prints them).
    pub fn path_notes(&self) -> Vec<String> {
        let mut notes: Vec<(String, usize)> = vec![];
        let mut add = |what: String| match notes.iter_mut().find(|(n, _)| *n == what) {
            Some((_, c)) => *c += 1,
            None => notes.push((what, 1)),
        };
        for b in &self.blocks {
            if let Err(why) = &b.mlp.gate_up.plan().silu_mul {
                add(format!("gate/up SiLU·mul unfused: {why}"));
            }
        }
        if let Err(why) = &self.lm_head.plan().f32_out {
            add(format!("output head f32 logits by a cast: {why}"));
        }
        notes
            .into_iter()
            .map(|(n, c)| format!("{c} layer(s): {n}"))
            .collect()
    }

    /// Hidden states after the final norm, `[b, seq, hidden]`.
    fn hidden_states(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
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
        let dev =
            cache.step_positions(&pads, Tensor::new(&[index_pos as u32], input_ids.device())?)?;
        let ctx = StepCtx {
            pos: index_pos,
            dev: &dev,
            cos: &cos,
            sin: &sin,
            mask: mask.as_ref(),
        };
        let xn = self.layers(&input_ids.flatten_all()?, (b, seq), &ctx, &mut cache.kvs)?;
        xn.to_dense()
    }

    /// The embedding of `ids` `[b, seq]` and its first norm: the state before block 0,
    /// `(res, xn)`, each `[b, seq, hidden]`.
    pub fn embed(&self, ids: &Tensor) -> Result<(Tensor, Activation)> {
        let (b, seq) = ids.dims2()?;
        let res = embed_gather(&self.embed, &ids.flatten_all()?)?.reshape((b, seq, self.hidden))?;
        let Some(first) = self.blocks.first() else {
            candle_core::bail!("model has no layers")
        };
        let xn = first
            .attn
            .qkv
            .input_norm(&res, &first.attn_norm, self.eps)?;
        Ok((res, xn))
    }

    /// The norm after block `i` and the projection that reads it: the next block's input
    /// norm and QKV projection, or the final norm and the output head.
    fn next_norm(&self, i: usize) -> (&Tensor, &QLinear) {
        match self.blocks.get(i + 1) {
            Some(b) => (&b.attn_norm, &b.attn.qkv),
            None => (&self.norm, &self.lm_head),
        }
    }

    /// The transformer over token ids `[b * seq]`: embedding, every block, final norm.
    fn layers(
        &self,
        ids: &Tensor,
        (b, seq): (usize, usize),
        ctx: &StepCtx,
        kvs: &mut [KvCache],
    ) -> Result<Activation> {
        let (mut res, mut xn) = self.embed(&ids.reshape((b, seq))?)?;
        for (i, (blk, kv)) in self.blocks.iter().zip(kvs.iter_mut()).enumerate() {
            (res, xn) = blk.forward(
                (&res, &xn),
                self.next_norm(i),
                kv,
                ctx,
                (i, self.eps),
                &mut NoObserver,
            )?;
        }
        Ok(xn)
    }

    /// Block `layer` alone over a batch of prompts that start at position 0, from the state
    /// before it (`res`, `xn` `[b, seq, hidden]`, as [`Llama::embed`] or the previous call
    /// returned) to the state after it; `obs` sees its linear inputs and K/V. Uses only
    /// the cache's layer `layer`, whose storage the prompt's rows overwrite (reallocated only
    /// when the batch size changes). Calibration runs the model this way, one
    /// block at a time.
    pub fn block_prefill(
        &self,
        layer: usize,
        (res, xn): (&Tensor, &Activation),
        cache: &mut Cache,
        obs: &mut dyn Observer,
    ) -> Result<(Tensor, Activation)> {
        let (b, seq, _) = res.dims3()?;
        let Some(blk) = self.blocks.get(layer) else {
            candle_core::bail!("layer {layer} out of range")
        };
        cache.check(self.blocks.len(), seq)?;
        cache.generation += 1;
        let pads = cache.pads_for(b)?;
        let (cos, sin) = cache.rope_tables(&pads, 0, seq)?;
        let mask = causal_mask(&pads, 0, seq, res.device())?;
        let dev = cache.step_positions(&pads, Tensor::new(&[0u32], res.device())?)?;
        let ctx = StepCtx {
            pos: 0,
            dev: &dev,
            cos: &cos,
            sin: &sin,
            mask: Some(&mask),
        };
        let kv = &mut cache.kvs[layer];
        blk.forward(
            (res, xn),
            self.next_norm(layer),
            kv,
            &ctx,
            (layer, self.eps),
            obs,
        )
    }

    /// One decode step for the graph decoder: ids `[b]` and the position on the device;
    /// 7 launches per layer for dense weights at batch 1 (two fused add + RMSNorm, the QKV,
    /// o, gate/up with SiLU·mul, and down projections, one decode attention that also does
    /// RoPE + KV append; at batch > 1 the projections are cuBLAS's and SiLU·mul its own
    /// launch) and 5 more per token (embedding, first norm, output head, logits copy,
    /// position advance); other formats take the paths their plans say (the tiled formats at
    /// batch 1: 5 per layer, the residual adds and norms inside the projections; the first
    /// norm inside the first QKV projection). Writes f32 logits
    /// `[b, vocab]` into `logits` and advances `pos` by one. Every launch reads its inputs
    /// from device buffers that outlive a captured graph.
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
        let (cos, sin) = (
            cache.cos.narrow(0, host_pos, 1)?,
            cache.sin.narrow(0, host_pos, 1)?,
        );
        let ctx = StepCtx {
            pos: host_pos,
            dev: &dev,
            cos: &cos,
            sin: &sin,
            mask: None,
        };
        let xn = self.layers(ids, (b, 1), &ctx, &mut cache.kvs)?;
        let out = self
            .lm_head
            .forward_f32(&xn.to_dense()?.reshape((b, self.hidden))?)?;
        logits.slice_set(&out, 0, 0)?;
        crate::ops::advance_pos(pos, 1)
    }

    /// Whether the decode step can be captured as a CUDA graph, or why not.
    pub fn graph_ready(&self, cache: &Cache) -> std::result::Result<(), String> {
        if let Some(why) = cache.no_fused() {
            return Err(why);
        }
        match self
            .linears()
            .iter()
            .find(|l| !l.format().spec().graph_safe)
        {
            Some(l) => Err(format!("{} layers upload host data per call", l.format())),
            None => Ok(()),
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.lm_head.shape().0
    }

    /// Logits `[b, vocab]` (f32) of the last position of `input_ids` `[b, seq]` (u32), whose
    /// first token sits at position `index_pos` of the cache.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let xn = self.hidden_states(input_ids, index_pos, cache)?;
        let seq = xn.dim(1)?;
        let last = xn.i((.., seq - 1, ..))?.contiguous()?;
        self.lm_head.forward_f32(&last)
    }

    /// Logits `[b, seq, vocab]` (f32) of every position (for perplexity).
    pub fn forward_all(
        &self,
        input_ids: &Tensor,
        index_pos: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let xn = self.hidden_states(input_ids, index_pos, cache)?;
        self.lm_head.forward(&xn)?.to_dtype(DType::F32)
    }
}
