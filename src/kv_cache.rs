//! `KvCache`: one layer's key/value cache, and the swap point for KV formats.
//!
//! The cache is preallocated to `[2, batch, n_kv_heads, max_len, head_dim]` on first use
//! and written in place by fused kernels: no `Tensor::cat` per step. Appending and
//! attention are methods of the cache, so that a quantized cache can write and read its
//! own encoding inside fused kernels; the model calls `append_attend_decode` for one new
//! token per sequence (one launch on CUDA), and `append` then `attend` for prompts.

use crate::ops::decode::{
    append_decode_attention, decode_attention, rope_kv_append, Heads, StepPositions,
};
use candle_core::{DType, Device, Result, Tensor};

/// KV-cache formats. Parse one from a CLI string with `str::parse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFormat {
    /// Dense, in the run dtype (f16 on GPU by default). CLI: `f16`.
    Dense,
}

impl KvFormat {
    /// Every format, in the order of `NAMES`: the registry the benchmark iterates over.
    pub const ALL: &'static [Self] = &[Self::Dense];

    pub const NAMES: &'static [&'static str] = &["f16"];

    pub fn name(&self) -> &'static str {
        match self {
            Self::Dense => "f16",
        }
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvFormat {
    type Err = candle_core::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f16" | "dense" => Ok(Self::Dense),
            _ => candle_core::bail!(
                "unknown kv-cache format '{s}'; supported: {}",
                Self::NAMES.join(", ")
            ),
        }
    }
}

/// One layer's cache: keys and values in one tensor `[2, batch, n_kv, max_len, head_dim]`.
#[derive(Debug, Clone)]
pub struct KvCache {
    format: KvFormat,
    heads: Heads,
    max_len: usize,
    dtype: DType,
    device: Device,
    kv: Option<Tensor>,
    /// u32 `[batch * n_kv]`, zero between calls: the fused decode attention's merge counters.
    counters: Option<Tensor>,
}

impl KvCache {
    /// A cache for `heads` (query heads `nh` over `nkv` KV heads of `hd`), up to `max_len`
    /// tokens per sequence. Storage is allocated by the first `append` at position 0.
    pub fn new(
        format: KvFormat,
        heads: Heads,
        max_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Self {
        Self {
            format,
            heads,
            max_len,
            dtype,
            device: device.clone(),
            kv: None,
            counters: None,
        }
    }

    pub fn format(&self) -> KvFormat {
        self.format
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The batch size the cache is allocated for (0 before first use).
    pub fn batch(&self) -> usize {
        self.kv.as_ref().map(|kv| kv.dims()[1]).unwrap_or(0)
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        self.kv
            .as_ref()
            .map(|kv| kv.elem_count() * self.dtype.size_in_bytes())
            .unwrap_or(0)
    }

    /// Drop the storage (the next `append` at position 0 allocates again).
    pub fn clear(&mut self) {
        self.kv = None;
        self.counters = None;
    }

    /// Write the K (rotated for its positions) and V parts of a fused projection
    /// `qkv` `[b, seq, (nh + 2 nkv) hd]` at rows `p.pos..p.pos + seq`. `pos` is the host
    /// copy of `p.pos`, used to allocate at 0 and to check the capacity.
    pub fn append(&mut self, qkv: &Tensor, pos: usize, p: &StepPositions) -> Result<()> {
        let heads = self.heads;
        rope_kv_append(self.storage_for(qkv, pos)?.0, qkv, heads, p)
    }

    /// A decode step's attention with its append: as [`KvCache::append`] of the one new
    /// token per sequence (`qkv` `[b, 1, ..]`) followed by [`KvCache::attend_decode`], in one
    /// launch on CUDA. Callers check [`Heads::fused_ok`] first.
    pub fn append_attend_decode(
        &mut self,
        qkv: &Tensor,
        pos: usize,
        p: &StepPositions,
    ) -> Result<Tensor> {
        let heads = self.heads;
        let (kv, counters) = self.storage_for(qkv, pos)?;
        append_decode_attention(qkv, kv, counters, heads, p)
    }

    /// The cache tensor and merge counters for rows `pos..pos + seq` of `qkv`
    /// `[b, seq, ..]`: allocated at position 0 (for batch `b`), else checked against `b`
    /// and the capacity.
    fn storage_for(&mut self, qkv: &Tensor, pos: usize) -> Result<(&Tensor, &Tensor)> {
        let (b, seq, _) = qkv.dims3()?;
        if pos + seq > self.max_len {
            candle_core::bail!(
                "kv cache: positions {pos}..{} exceed the cache's capacity of {} tokens",
                pos + seq,
                self.max_len
            )
        }
        if pos == 0 && self.batch() != b {
            let shape = (2, b, self.heads.nkv, self.max_len, self.heads.hd);
            self.kv = Some(Tensor::zeros(shape, self.dtype, &self.device)?);
            self.counters = Some(Tensor::zeros(b * self.heads.nkv, DType::U32, &self.device)?);
        }
        let (Some(kv), Some(counters)) = (&self.kv, &self.counters) else {
            candle_core::bail!("kv cache: first append must be at position 0, got {pos}")
        };
        if kv.dims()[1] != b {
            candle_core::bail!(
                "kv cache: batch {b} but the cache holds batch {}",
                kv.dims()[1]
            )
        }
        Ok((kv, counters))
    }

    /// Attention of the one new token per sequence (`qkv` `[b, 1, ..]`, as given to
    /// `append`) over rows `0..=pos`, with the fused decode kernel. `[b, 1, nh hd]`.
    /// Callers check [`Heads::fused_ok`] first and use [`KvCache::attend`] otherwise.
    pub fn attend_decode(&self, qkv: &Tensor, p: &StepPositions) -> Result<Tensor> {
        let (Some(kv), Some(counters)) = (&self.kv, &self.counters) else {
            candle_core::bail!("kv cache: attend before any append")
        };
        decode_attention(qkv, kv, counters, self.heads, p)
    }

    /// Attention of rotated queries `q` `[b, nh, seq, hd]` over the first `len` rows.
    ///
    /// `mask`: optional additive f32 mask `[b, 1, seq, len]` (0 or -inf). Query heads are
    /// grouped onto KV heads (`nh / nkv` each) without copying the cache.
    /// Scores and softmax are in f32. Returns `[b, nh, seq, hd]`.
    pub fn attend(&self, q: &Tensor, len: usize, mask: Option<&Tensor>) -> Result<Tensor> {
        let Some(kv) = &self.kv else {
            candle_core::bail!("kv cache: attend before any append")
        };
        let (b, n_h, seq, hd) = q.dims4()?;
        let n_kv = self.heads.nkv;
        if n_h != self.heads.nh || hd != self.heads.hd || b != kv.dims()[1] || len > self.max_len {
            candle_core::bail!(
                "kv cache: q {:?} incompatible with cache {:?} at len {len}",
                q.shape(),
                kv.shape()
            )
        }
        let g = n_h / n_kv;
        let k = kv.get(0)?.narrow(2, 0, len)?;
        let v = kv.get(1)?.narrow(2, 0, len)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let q = (q.contiguous()? * scale)?.reshape((b, n_kv, g * seq, hd))?;
        let att = q.matmul(&k.t()?)?.to_dtype(DType::F32)?;
        let att = match mask {
            None => att,
            Some(m) => att
                .reshape((b, n_kv, g, seq, len))?
                .broadcast_add(&m.unsqueeze(1)?)?
                .reshape((b, n_kv, g * seq, len))?,
        };
        let att = candle_nn::ops::softmax_last_dim(&att)?.to_dtype(self.dtype)?;
        let y = att.matmul(&v)?;
        y.reshape((b, n_h, seq, hd))?.to_dtype(q.dtype())
    }
}

/// Additive causal mask `[b, 1, seq, pos + seq]` (f32: 0 allowed, -inf masked) for
/// queries at positions `pos..pos+seq` of sequences left-padded by `pads[i]` tokens.
///
/// A query may see keys at or before its own position that are not padding; a padding
/// query sees only itself (its output is never used, but must stay finite).
pub fn causal_mask(pads: &[usize], pos: usize, seq: usize, device: &Device) -> Result<Tensor> {
    let len = pos + seq;
    let mut m = vec![0f32; pads.len() * seq * len];
    for (bi, &pad) in pads.iter().enumerate() {
        for i in 0..seq {
            let p = pos + i;
            let row = &mut m[(bi * seq + i) * len..(bi * seq + i + 1) * len];
            for (j, x) in row.iter_mut().enumerate() {
                let visible = j <= p && (j >= pad || j == p);
                if !visible {
                    *x = f32::NEG_INFINITY;
                }
            }
        }
    }
    Tensor::from_vec(m, (pads.len(), 1, seq, len), device)
}
