//! The drop-in Llama's per-model state: every layer's [`KvCache`], the RoPE tables, and the
//! left padding of a batch of prompts.

use super::{Config, Llama3RopeType};
use crate::kv::{KvCache, KvFormat, KvSpec};
use crate::ops::{Heads, StepPositions};
use candle_core::{DType, Device, Result, Tensor};

/// Inverse RoPE frequencies for `head_dim`, with Llama-3 scaling where configured
/// (the same formula as `candle_transformers::models::llama`).
fn inv_freqs(cfg: &Config, head_dim: usize) -> Vec<f32> {
    let base: Vec<f32> = (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / head_dim as f32))
        .collect();
    let Some(rs) = cfg
        .rope_scaling
        .as_ref()
        .filter(|r| matches!(r.rope_type, Llama3RopeType::Llama3))
    else {
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
                let smooth = (orig / wavelen - rs.low_freq_factor)
                    / (rs.high_freq_factor - rs.low_freq_factor);
                (1. - smooth) * freq / rs.factor + smooth * freq
            }
        })
        .collect()
}

/// Per-model state across calls: the KV caches, RoPE tables and the left padding.
#[derive(Debug, Clone)]
pub struct Cache {
    pub(crate) kvs: Vec<KvCache>,
    /// RoPE tables in the run dtype (for candle's `rope` on prefill queries)...
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
    /// ...and in f32 for the fused kernels, `[max_len, hd/2]`.
    pub(crate) cos32: Tensor,
    pub(crate) sin32: Tensor,
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
        Self::with_capacity(
            cfg.max_position_embeddings,
            KvFormat::Dense,
            dtype,
            cfg,
            device,
        )
    }

    /// A cache of `max_len` tokens per sequence in KV format `format` (one that needs no
    /// calibration: see [`Cache::with_spec`] for Oaken). Storage is allocated on the first
    /// forward call, for its batch size.
    pub fn with_capacity(
        max_len: usize,
        format: KvFormat,
        dtype: DType,
        cfg: &Config,
        device: &Device,
    ) -> Result<Self> {
        Self::with_spec(max_len, &KvSpec::from_format(format)?, dtype, cfg, device)
    }

    /// A cache of `max_len` tokens per sequence in the KV format of `spec` (with Oaken's
    /// per-layer thresholds, one per layer of `cfg`).
    pub fn with_spec(
        max_len: usize,
        spec: &KvSpec,
        dtype: DType,
        cfg: &Config,
        device: &Device,
    ) -> Result<Self> {
        Self::with_spec_k_pre_rope(max_len, spec, false, dtype, cfg, device)
    }

    /// As [`Cache::with_spec`], with quantized K encoded before RoPE where `k_pre_rope`
    /// (to measure that choice; such a cache takes the generic attention path).
    pub fn with_spec_k_pre_rope(
        max_len: usize,
        spec: &KvSpec,
        k_pre_rope: bool,
        dtype: DType,
        cfg: &Config,
        device: &Device,
    ) -> Result<Self> {
        if cfg.num_attention_heads == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads)
        {
            candle_core::bail!(
                "config: hidden_size {} not divisible by {} heads",
                cfg.hidden_size,
                cfg.num_attention_heads
            )
        }
        let hd = cfg.hidden_size / cfg.num_attention_heads;
        let freqs = inv_freqs(cfg, hd);
        let n_pos = max_len.max(1);
        let t = Tensor::arange(0u32, n_pos as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((n_pos, 1))?;
        let idx_theta = t.matmul(&Tensor::new(freqs.as_slice(), device)?.reshape((1, hd / 2))?)?;
        let heads = Heads {
            nh: cfg.num_attention_heads,
            nkv: cfg.num_key_value_heads,
            hd,
        };
        if let KvSpec::Oaken(t) = spec {
            if t.len() != cfg.num_hidden_layers {
                candle_core::bail!(
                    "oaken thresholds for {} layers, the model has {}",
                    t.len(),
                    cfg.num_hidden_layers
                )
            }
        }
        let kvs = (0..cfg.num_hidden_layers)
            .map(|l| {
                let enc = spec.encoding_with(l, k_pre_rope)?;
                Ok(KvCache::new(enc, heads, max_len, dtype, device))
            })
            .collect::<Result<Vec<_>>>()?;
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

    /// The KV format of the layers' caches.
    pub fn kv_format(&self) -> KvFormat {
        self.kvs.first().map_or(KvFormat::Dense, KvCache::format)
    }

    /// Why the fused decode step does not apply to some layer's cache (`None`: it does).
    pub fn no_fused(&self) -> Option<String> {
        self.kvs.iter().find_map(KvCache::no_fused)
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

    /// Rows `0..len` of every layer's cache, for `b` unpadded sequences, written from
    /// K and V values drawn from N(0, 1) (K rotated for its positions, as a prefill
    /// writes it) instead of a prompt's: the state a `len`-token prompt leaves, for timing
    /// decode steps at contexts whose prefill would take minutes (random-weight models,
    /// speed only). Drawn in `dtype` in blocks of at most 1024 rows; the next forward or
    /// decode step continues at position `len`.
    pub fn fill_random(&mut self, b: usize, len: usize, dtype: DType) -> Result<()> {
        if b == 0 || len == 0 || len > self.max_len {
            candle_core::bail!(
                "fill_random: batch {b} x {len} rows for a cache of {} tokens",
                self.max_len
            )
        }
        self.clear(); // bumps `generation`: a captured graph points at the old storage
        let pads = vec![0; b];
        const BLOCK: usize = 1024;
        for l in 0..self.kvs.len() {
            let width = self.kvs[l].heads().qkv_width();
            for s in (0..len).step_by(BLOCK) {
                let n = BLOCK.min(len - s);
                let qkv =
                    Tensor::randn(0f32, 1f32, (b, n, width), &self.device)?.to_dtype(dtype)?;
                let p = self.step_positions(&pads, Tensor::new(&[s as u32], &self.device)?)?;
                self.kvs[l].append(&qkv, s, &p)?;
            }
        }
        Ok(())
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
    pub(crate) fn step_positions(&mut self, pads: &[usize], pos: Tensor) -> Result<StepPositions> {
        let stale = self
            .pads_dev
            .as_ref()
            .is_none_or(|t| t.elem_count() != pads.len());
        if stale {
            let v: Vec<u32> = pads.iter().map(|&p| p as u32).collect();
            self.pads_dev = Some(Tensor::new(v, &self.device)?);
            self.generation += 1;
        }
        let Some(pads_dev) = self.pads_dev.clone() else {
            candle_core::bail!("pads not set")
        };
        Ok(StepPositions {
            cos: self.cos32.clone(),
            sin: self.sin32.clone(),
            pos,
            pads: pads_dev,
        })
    }

    /// Check that this cache fits a model of `layers` layers and `end` tokens.
    pub(crate) fn check(&self, layers: usize, end: usize) -> Result<()> {
        if end > self.max_len {
            candle_core::bail!(
                "forward: positions up to {end} exceed the context of {} tokens",
                self.max_len
            )
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

    pub(crate) fn pads_for(&self, b: usize) -> Result<Vec<usize>> {
        match self.pads.len() {
            0 => Ok(vec![0; b]),
            n if n == b => Ok(self.pads.clone()),
            n => candle_core::bail!("left padding given for {n} sequences but the batch has {b}"),
        }
    }

    /// `(cos, sin)` for queries at `pos..pos+seq`: `[seq, hd/2]` without padding,
    /// `[b, seq, hd/2]` with it.
    pub(crate) fn rope_tables(
        &self,
        pads: &[usize],
        pos: usize,
        seq: usize,
    ) -> Result<(Tensor, Tensor)> {
        if pads.iter().all(|&p| p == 0) {
            return Ok((self.cos.narrow(0, pos, seq)?, self.sin.narrow(0, pos, seq)?));
        }
        let ids: Vec<u32> = pads
            .iter()
            .flat_map(|&pad| (pos..pos + seq).map(move |p| p.saturating_sub(pad) as u32))
            .collect();
        let ids = Tensor::new(ids, &self.device)?;
        let hd2 = self.cos.dim(1)?;
        let cos = self
            .cos
            .index_select(&ids, 0)?
            .reshape((pads.len(), seq, hd2))?;
        let sin = self
            .sin
            .index_select(&ids, 0)?
            .reshape((pads.len(), seq, hd2))?;
        Ok((cos, sin))
    }
}
