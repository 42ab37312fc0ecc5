//! How the drop-in Llama meets the outside: its linear layers by HF name ([`Slot`]), where
//! it gets its weights ([`WeightSource`]: a dense `VarBuilder`, a quantized checkpoint),
//! and what calibration sees of a forward pass ([`Observer`]).

use super::Config;
use crate::linear::QLinear;
use candle_core::{Result, Tensor};
use candle_nn::VarBuilder;

/// The linear layers of a block, in forward order. Each is one [`QLinear`], stacked from
/// its HF-named parts along the output rows (QKV: q, k, v; gate/up: gate, up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Slot {
    Qkv,
    O,
    GateUp,
    Down,
}

impl Slot {
    pub const ALL: [Self; 4] = [Self::Qkv, Self::O, Self::GateUp, Self::Down];

    /// The HF names of the parts under `model.layers.{layer}.`, with their rows, for `cfg`.
    pub fn parts(&self, cfg: &Config, layer: usize) -> Vec<(String, usize)> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let hd = h / cfg.num_attention_heads.max(1);
        let (q, kv) = (cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd);
        let names: &[(&str, usize)] = match self {
            Self::Qkv => &[
                ("self_attn.q_proj", q),
                ("self_attn.k_proj", kv),
                ("self_attn.v_proj", kv),
            ],
            Self::O => &[("self_attn.o_proj", h)],
            Self::GateUp => &[("mlp.gate_proj", i), ("mlp.up_proj", i)],
            Self::Down => &[("mlp.down_proj", h)],
        };
        names
            .iter()
            .map(|(n, r)| (format!("model.layers.{layer}.{n}"), *r))
            .collect()
    }

    /// The layer's input width.
    pub fn in_dim(&self, cfg: &Config) -> usize {
        let hd = cfg.hidden_size / cfg.num_attention_heads.max(1);
        match self {
            Self::Qkv | Self::GateUp => cfg.hidden_size,
            Self::O => cfg.num_attention_heads * hd,
            Self::Down => cfg.intermediate_size,
        }
    }

    /// Whether the model folds this layer's input order into the layer before it where the
    /// format reorders its inputs: the down projection, whose input channels are the gate/up
    /// rows' ([`crate::Llama::fold_down_order`]). Random weights drawn for speed rows take no
    /// order here ([`crate::formats::QuantOptions::input_in_order`]).
    pub fn input_order_folded(&self) -> bool {
        matches!(self, Self::Down)
    }

    /// The slot that holds the HF-named part `name` (`model.layers.{i}.mlp.down_proj`).
    pub fn of_part(name: &str) -> Option<Self> {
        let tail = name
            .rsplit_once(".self_attn.")
            .map(|(_, t)| ("self_attn", t));
        let tail = tail.or_else(|| name.rsplit_once(".mlp.").map(|(_, t)| ("mlp", t)))?;
        Some(match tail {
            ("self_attn", "q_proj" | "k_proj" | "v_proj") => Self::Qkv,
            ("self_attn", "o_proj") => Self::O,
            ("mlp", "gate_proj" | "up_proj") => Self::GateUp,
            ("mlp", "down_proj") => Self::Down,
            _ => return None,
        })
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Qkv => "qkv",
            Self::O => "o",
            Self::GateUp => "gate_up",
            Self::Down => "down",
        }
    }
}

/// Where [`crate::Llama::load_from`] gets its weights: a dense `VarBuilder`, or a quantized
/// checkpoint ([`crate::checkpoint`]).
pub trait WeightSource {
    /// A dense tensor (embedding, norms) by HF name, of `dims`.
    fn tensor(&self, name: &str, dims: &[usize]) -> Result<Tensor>;
    /// One linear layer stacked from HF-named parts `(name, rows)` along the output rows,
    /// each `[rows, in_dim]`.
    fn linear(&self, parts: &[(String, usize)], in_dim: usize) -> Result<QLinear>;
    /// The output head `[vocab, hidden]`; with tied embeddings a dense source reuses `embed`.
    fn lm_head(&self, cfg: &Config, embed: &Tensor) -> Result<QLinear> {
        if cfg.tie_word_embeddings {
            QLinear::from_weight(embed.clone(), None)
        } else {
            self.linear(&[("lm_head".to_string(), cfg.vocab_size)], cfg.hidden_size)
        }
    }
}

impl WeightSource for VarBuilder<'_> {
    fn tensor(&self, name: &str, dims: &[usize]) -> Result<Tensor> {
        self.get(dims, name)
    }

    fn linear(&self, parts: &[(String, usize)], in_dim: usize) -> Result<QLinear> {
        let ws = parts
            .iter()
            .map(|(name, rows)| self.get((*rows, in_dim), &format!("{name}.weight")))
            .collect::<Result<Vec<_>>>()?;
        let w = if ws.len() == 1 {
            ws[0].clone()
        } else {
            Tensor::cat(&ws, 0)?
        };
        QLinear::from_weight(w, None)
    }
}

/// What calibration sees of a forward pass ([`crate::Llama::block_prefill`] calls it; every method
/// defaults to doing nothing).
pub trait Observer {
    /// The input `x` `[.., in]` (dense) of linear layer `slot` of block `layer`.
    fn linear_input(&mut self, layer: usize, slot: Slot, x: &Tensor) -> Result<()> {
        let _ = (layer, slot, x);
        Ok(())
    }
    /// Whether [`Observer::kv`] wants to be called (the model then computes K after RoPE
    /// for it).
    fn wants_kv(&self) -> bool {
        false
    }
    /// Keys before and after RoPE and values of block `layer`, each `[b, seq, nkv · hd]`.
    fn kv(&mut self, layer: usize, k_pre: &Tensor, k_post: &Tensor, v: &Tensor) -> Result<()> {
        let _ = (layer, k_pre, k_post, v);
        Ok(())
    }
}

/// An observer that observes nothing.
pub struct NoObserver;

impl Observer for NoObserver {}
