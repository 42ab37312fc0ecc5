//! KV caches: one layer's [`KvCache`] over every KV encoding, and the encodings.
//!
//! - [`KvFormat`]: the registry tag the CLI and the bench read (`f16`, `kv4`, `oaken`).
//! - [`KvEncoding`]: what a format does with its storage: allocate, append a prompt's K
//!   and V, hand back K and V rows for the generic attention, and the fused decode step
//!   (append and attention) where it has one (an `Option`: the model asks the cache, and
//!   takes the generic path on `None`). Implemented by [`DenseKv`] (rows in the run
//!   dtype) and [`PackedKv`] (one [`KvCodec`]: [`kv4`] or [`oaken`], the CPU references in
//!   their modules, the kernels in `cuda/kv_codec.cuh`).
//! - [`KvSpec`]: a format with what it needs to run (Oaken's per-layer thresholds).
//!
//! Storage is preallocated on first use and written in place by fused kernels: dense
//! `[2, b, nkv, max_len, hd]` in the run dtype, packed `u8 [2, b, nkv, max_len, rec]`
//! (keys, then values; `rec` bytes per (token, KV head)). The decode attention reads the
//! packed cache directly (dequantizing in registers); prompts append with a quantize-append
//! kernel and attend over the dequantized cache (every row, the prompt's own included, so
//! prefill sees what decode sees: perplexity measures the cache's real error).

pub mod kv4;
pub mod oaken;

use crate::ops::decode::{
    append_decode_attention, decode_attention, rope_kv_append, Heads, StepPositions,
};
use crate::ops::kv_quant::{kv_append, kv_dequantize};
use crate::ops::{prefill_attention, prefill_unsupported};
use candle_core::{DType, Device, Result, Tensor};
pub use oaken::{OakenFractions, OakenLayer};
use std::sync::Arc;

/// KV-cache formats. Parse one from a CLI string with `str::parse`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvFormat {
    /// Dense, in the run dtype (f16 on GPU by default). CLI: `f16`.
    Dense,
    /// Asymmetric INT4 per (token, KV head), f16 scale and min. CLI: `kv4`.
    Kv4,
    /// Oaken: offline thresholds, group-shift, dense-and-sparse 4/5-bit. CLI: `oaken`.
    Oaken,
}

impl KvFormat {
    /// Every format, in the order of `NAMES`: the registry the benchmark iterates over.
    pub const ALL: &'static [Self] = &[Self::Dense, Self::Kv4, Self::Oaken];

    pub const NAMES: &'static [&'static str] = &["f16", "kv4", "oaken"];

    pub fn name(&self) -> &'static str {
        match self {
            Self::Dense => "f16",
            Self::Kv4 => "kv4",
            Self::Oaken => "oaken",
        }
    }

    /// Whether the format needs calibration thresholds ([`KvSpec::Oaken`]).
    pub fn needs_calibration(&self) -> bool {
        matches!(self, Self::Oaken)
    }

    /// Bytes of one (token, KV head) row of K or V, everything counted, for head dim `hd`
    /// and run dtype `dtype` (the dense format's element type).
    pub fn row_bytes(&self, hd: usize, dtype: DType) -> usize {
        match self {
            Self::Dense => hd * dtype.size_in_bytes(),
            Self::Kv4 => kv4::rec_bytes(hd),
            Self::Oaken => oaken::rec_bytes(hd),
        }
    }

    /// Bits per cached value, everything counted.
    pub fn bits_per_value(&self, hd: usize, dtype: DType) -> f64 {
        self.row_bytes(hd, dtype) as f64 * 8.0 / hd as f64
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
            "kv4" | "int4" => Ok(Self::Kv4),
            "oaken" => Ok(Self::Oaken),
            _ => candle_core::bail!(
                "unknown kv-cache format '{s}'; supported: {}",
                Self::NAMES.join(", ")
            ),
        }
    }
}

/// A KV format with what it needs to run: Oaken's thresholds, one entry per layer.
#[derive(Debug, Clone, PartialEq)]
pub enum KvSpec {
    Dense,
    Kv4,
    Oaken(Vec<OakenLayer>),
}

impl KvSpec {
    /// The spec of a format that needs no calibration (an error naming what to do for one
    /// that does).
    pub fn from_format(f: KvFormat) -> Result<Self> {
        match f {
            KvFormat::Dense => Ok(Self::Dense),
            KvFormat::Kv4 => Ok(Self::Kv4),
            KvFormat::Oaken => candle_core::bail!(
                "the oaken KV cache needs per-layer thresholds from calibration: quantize with --kv-cache oaken, or give --calib text"
            ),
        }
    }

    /// `f` for speed measurements on models without calibration: Oaken's thresholds are
    /// those of N(0, 1) values at the default fractions, for each of `layers` layers.
    pub fn uncalibrated(f: KvFormat, layers: usize) -> Result<Self> {
        match f {
            KvFormat::Oaken => Ok(Self::Oaken(vec![
                OakenLayer::gaussian(
                    1.0,
                    OakenFractions::default()
                )?;
                layers
            ])),
            f => Self::from_format(f),
        }
    }

    pub fn format(&self) -> KvFormat {
        match self {
            Self::Dense => KvFormat::Dense,
            Self::Kv4 => KvFormat::Kv4,
            Self::Oaken(_) => KvFormat::Oaken,
        }
    }

    /// The encoding of layer `layer`.
    pub fn encoding(&self, layer: usize) -> Result<Arc<dyn KvEncoding>> {
        self.encoding_with(layer, false)
    }

    /// The encoding of layer `layer`, with quantized K encoded before RoPE where
    /// `k_pre_rope` (for measuring that choice: only the generic attention reads it).
    pub fn encoding_with(&self, layer: usize, k_pre_rope: bool) -> Result<Arc<dyn KvEncoding>> {
        Ok(match self {
            Self::Dense => Arc::new(DenseKv),
            Self::Kv4 => Arc::new(PackedKv(KvCodec::Kv4, k_pre_rope)),
            Self::Oaken(t) => match t.get(layer) {
                Some(l) => Arc::new(PackedKv(KvCodec::Oaken(*l), k_pre_rope)),
                None => candle_core::bail!(
                    "oaken: thresholds for {} layers, none for layer {layer}",
                    t.len()
                ),
            },
        })
    }
}

/// A quantized encoding as the kernels take it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvCodec {
    Kv4,
    Oaken(OakenLayer),
}

impl KvCodec {
    /// The kernels' name suffix.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Kv4 => "kv4",
            Self::Oaken(_) => "oaken",
        }
    }

    pub fn format(&self) -> KvFormat {
        match self {
            Self::Kv4 => KvFormat::Kv4,
            Self::Oaken(_) => KvFormat::Oaken,
        }
    }

    /// Head dims the encoding takes: kv4 64 and 128 (its tensor-core attention), oaken
    /// 32, 64 and 128 (one warp encodes a row, 1, 2 or 4 values per lane).
    pub fn supports(&self, hd: usize) -> bool {
        match self {
            Self::Kv4 => matches!(hd, 64 | 128),
            Self::Oaken(_) => matches!(hd, 32 | 64 | 128),
        }
    }

    /// Head dims the fused decode attention reads this encoding at: 64 and 128 (its
    /// tensor-core kernel); at others the cache is dequantized for the generic attention.
    pub fn attends(&self, hd: usize) -> bool {
        matches!(hd, 64 | 128)
    }

    pub fn rec_bytes(&self, hd: usize) -> usize {
        self.format().row_bytes(hd, DType::U8)
    }

    /// Thresholds of K (`kv` 0) and V (`kv` 1) as the kernels take them (zero for kv4).
    pub fn thr(&self, kv: usize) -> oaken::KvThr {
        match self {
            Self::Kv4 => oaken::KvThr::default(),
            Self::Oaken(l) => if kv == 0 { l.k } else { l.v }.params(),
        }
    }

    /// Encode one row of K (`kv` 0) or V (`kv` 1): the CPU reference of the kernels' encoder.
    pub fn quantize_row(&self, kv: usize, x: &[f32], rec: &mut [u8]) {
        match self {
            Self::Kv4 => kv4::quantize_row(kv, x, rec),
            Self::Oaken(_) => oaken::quantize_row(kv, x, rec, &self.thr(kv)),
        }
    }

    /// Decode one record: the CPU reference of the kernels' decoder.
    pub fn dequantize_row(&self, kv: usize, rec: &[u8], out: &mut [f32]) {
        match self {
            Self::Kv4 => kv4::dequantize_row(kv, rec, out),
            Self::Oaken(_) => oaken::dequantize_row(kv, rec, out, &self.thr(kv)),
        }
    }
}

/// What a KV format does with its storage (one layer's, allocated by [`KvEncoding::alloc`]).
/// `qkv` is always a fused projection `[b, seq, (nh + 2 nkv) hd]` with unrotated K.
pub trait KvEncoding: std::fmt::Debug + Send + Sync {
    fn format(&self) -> KvFormat;

    /// Zeroed storage for `b` sequences of up to `max_len` tokens.
    fn alloc(
        &self,
        b: usize,
        heads: Heads,
        max_len: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor>;

    /// Write K (rotated for its positions) and V of `qkv` at rows `p.pos..p.pos + seq`.
    fn append(&self, store: &Tensor, qkv: &Tensor, heads: Heads, p: &StepPositions) -> Result<()>;

    /// K and V rows `0..len` as `[b, nkv, len, hd]` tensors in `dtype`, K rotated (`p`:
    /// the RoPE tables and padding of the last append, for encodings that store K before
    /// RoPE).
    fn keys_values(
        &self,
        store: &Tensor,
        len: usize,
        heads: Heads,
        dtype: DType,
        p: Option<&StepPositions>,
    ) -> Result<(Tensor, Tensor)>;

    /// Why the fused decode kernels do not take `heads` for this encoding (`None`: they do).
    fn no_fused(&self, heads: Heads) -> Option<String>;

    /// The packed encoding the decode kernels take (`None`: dense rows of the run dtype).
    fn codec(&self) -> Option<KvCodec>;

    /// The fused decode attention over rows `0..=pos` (`qkv` `[b, 1, ..]`; `[b, 1, nh hd]`),
    /// with the step's append in the same launch where `append`; `None` where this encoding
    /// has no fused kernel for `heads` (nothing was written).
    fn fused_decode(
        &self,
        store: &Tensor,
        counters: &Tensor,
        qkv: &Tensor,
        (heads, p): (Heads, &StepPositions),
        append: bool,
    ) -> Result<Option<Tensor>> {
        if self.no_fused(heads).is_some() {
            return Ok(None);
        }
        let codec = self.codec();
        match append {
            true => append_decode_attention(qkv, store, counters, heads, p, codec),
            false => decode_attention(qkv, store, counters, heads, p, codec),
        }
        .map(Some)
    }
}

/// Rows in the run dtype.
#[derive(Debug, Clone, Copy)]
pub struct DenseKv;

impl KvEncoding for DenseKv {
    fn format(&self) -> KvFormat {
        KvFormat::Dense
    }

    fn alloc(&self, b: usize, h: Heads, max_len: usize, dt: DType, dev: &Device) -> Result<Tensor> {
        Tensor::zeros((2, b, h.nkv, max_len, h.hd), dt, dev)
    }

    fn append(&self, store: &Tensor, qkv: &Tensor, heads: Heads, p: &StepPositions) -> Result<()> {
        rope_kv_append(store, qkv, heads, p)
    }

    fn keys_values(
        &self,
        store: &Tensor,
        len: usize,
        _: Heads,
        dt: DType,
        _: Option<&StepPositions>,
    ) -> Result<(Tensor, Tensor)> {
        let k = store.get(0)?.narrow(2, 0, len)?.to_dtype(dt)?;
        let v = store.get(1)?.narrow(2, 0, len)?.to_dtype(dt)?;
        Ok((k, v))
    }

    fn no_fused(&self, heads: Heads) -> Option<String> {
        (!heads.fused_ok()).then(|| format!("no fused decode attention for {heads:?}"))
    }

    fn codec(&self) -> Option<KvCodec> {
        None
    }
}

/// Rows packed by one [`KvCodec`] into `u8 [2, b, nkv, max_len, rec]`; K after RoPE, or
/// (`k_pre_rope`, for measuring the choice) as projected, rotated when it is read back —
/// which only the generic attention does.
#[derive(Debug, Clone, Copy)]
pub struct PackedKv(pub KvCodec, pub bool);

impl PackedKv {
    /// K encoded after RoPE: the crate's choice, read by the fused decode attention.
    pub fn new(codec: KvCodec) -> Self {
        Self(codec, false)
    }

    fn k_pre_rope(&self) -> bool {
        self.1
    }
}

impl KvEncoding for PackedKv {
    fn format(&self) -> KvFormat {
        self.0.format()
    }

    fn alloc(&self, b: usize, h: Heads, max_len: usize, _: DType, dev: &Device) -> Result<Tensor> {
        if !self.0.supports(h.hd) {
            candle_core::bail!(
                "{} KV cache: head dim {} unsupported (kv4: 64 or 128; oaken: 32, 64 or 128)",
                self.0.name(),
                h.hd
            )
        }
        Tensor::zeros(
            (2, b, h.nkv, max_len, self.0.rec_bytes(h.hd)),
            DType::U8,
            dev,
        )
    }

    fn append(&self, store: &Tensor, qkv: &Tensor, heads: Heads, p: &StepPositions) -> Result<()> {
        kv_append(store, qkv, heads, p, self.0, !self.k_pre_rope())
    }

    fn keys_values(
        &self,
        store: &Tensor,
        len: usize,
        heads: Heads,
        dt: DType,
        p: Option<&StepPositions>,
    ) -> Result<(Tensor, Tensor)> {
        let kv = kv_dequantize(store, len, heads.hd, self.0, dt)?;
        let (k, v) = (kv.get(0)?, kv.get(1)?);
        if !self.k_pre_rope() {
            return Ok((k, v));
        }
        let Some(p) = p else {
            candle_core::bail!("kv cache: K stored before RoPE, but no positions to rotate it")
        };
        // Row j of sequence s sits at RoPE position j - pads[s].
        let pads = p.pads.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
        let ids: Vec<u32> = pads
            .iter()
            .flat_map(|&pad| (0..len as u32).map(move |j| j.saturating_sub(pad)))
            .collect();
        let ids = Tensor::new(ids, store.device())?;
        let half = heads.hd / 2;
        let b = pads.len();
        let cos = p
            .cos
            .index_select(&ids, 0)?
            .reshape((b, len, half))?
            .to_dtype(dt)?;
        let sin = p
            .sin
            .index_select(&ids, 0)?
            .reshape((b, len, half))?
            .to_dtype(dt)?;
        Ok((
            candle_nn::rotary_emb::rope(&k.contiguous()?, &cos, &sin)?,
            v,
        ))
    }

    fn no_fused(&self, heads: Heads) -> Option<String> {
        if !heads.fused_ok() {
            return Some(format!("no fused decode attention for {heads:?}"));
        }
        if self.k_pre_rope() {
            return Some("K is stored before RoPE (the fused attention reads rotated keys)".into());
        }
        (!self.0.attends(heads.hd)).then(|| {
            format!(
                "{}: no fused decode attention at head dim {} (64 or 128)",
                self.0.name(),
                heads.hd
            )
        })
    }

    fn codec(&self) -> Option<KvCodec> {
        Some(self.0)
    }
}

/// One layer's cache: K and V of every sequence in one storage tensor of its encoding.
#[derive(Debug, Clone)]
pub struct KvCache {
    enc: Arc<dyn KvEncoding>,
    heads: Heads,
    max_len: usize,
    dtype: DType,
    device: Device,
    store: Option<Tensor>,
    /// u32 `[batch * n_kv]`, zero between calls: the fused decode attention's merge counters.
    counters: Option<Tensor>,
    /// The RoPE tables and padding of the last append (for K stored before RoPE).
    rope: Option<StepPositions>,
}

impl KvCache {
    /// A cache in `enc` for `heads` (query heads `nh` over `nkv` KV heads of `hd`), up to
    /// `max_len` tokens per sequence, run dtype `dtype`. Storage is allocated by the first
    /// `append` at position 0.
    pub fn new(
        enc: Arc<dyn KvEncoding>,
        heads: Heads,
        max_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Self {
        Self {
            enc,
            heads,
            max_len,
            dtype,
            device: device.clone(),
            store: None,
            counters: None,
            rope: None,
        }
    }

    /// A cache of a format that needs no calibration (see [`KvSpec::from_format`]).
    pub fn of_format(
        f: KvFormat,
        heads: Heads,
        max_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let enc = KvSpec::from_format(f)?.encoding(0)?;
        Ok(Self::new(enc, heads, max_len, dtype, device))
    }

    pub fn format(&self) -> KvFormat {
        self.enc.format()
    }

    pub fn encoding(&self) -> &Arc<dyn KvEncoding> {
        &self.enc
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The attention geometry the cache holds (query heads over KV heads of `hd`).
    pub fn heads(&self) -> Heads {
        self.heads
    }

    /// The batch size the cache is allocated for (0 before first use).
    pub fn batch(&self) -> usize {
        self.store.as_ref().map(|kv| kv.dims()[1]).unwrap_or(0)
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        self.store
            .as_ref()
            .map(|kv| kv.elem_count() * kv.dtype().size_in_bytes())
            .unwrap_or(0)
    }

    /// Drop the storage (the next `append` at position 0 allocates again).
    pub fn clear(&mut self) {
        self.store = None;
        self.counters = None;
    }

    /// Why the fused decode step does not apply to this cache (`None`: it does).
    pub fn no_fused(&self) -> Option<String> {
        self.enc.no_fused(self.heads)
    }

    /// Write the K (rotated for its positions) and V parts of a fused projection
    /// `qkv` `[b, seq, (nh + 2 nkv) hd]` at rows `p.pos..p.pos + seq`. `pos` is the host
    /// copy of `p.pos`, used to allocate at 0 and to check the capacity.
    pub fn append(&mut self, qkv: &Tensor, pos: usize, p: &StepPositions) -> Result<()> {
        let (heads, enc) = (self.heads, self.enc.clone());
        enc.append(self.storage_for(qkv, pos)?.0, qkv, heads, p)?;
        self.rope = Some(p.clone());
        Ok(())
    }

    /// A decode step's attention with its append: as [`KvCache::append`] of the one new
    /// token per sequence (`qkv` `[b, 1, ..]`) followed by [`KvCache::attend_decode`], in one
    /// launch on CUDA. `None` where the encoding has no fused kernel for these heads
    /// (nothing was written: append and attend instead).
    pub fn append_attend_decode(
        &mut self,
        qkv: &Tensor,
        pos: usize,
        p: &StepPositions,
    ) -> Result<Option<Tensor>> {
        if self.no_fused().is_some() {
            return Ok(None);
        }
        let (heads, enc) = (self.heads, self.enc.clone());
        let (kv, counters) = self.storage_for(qkv, pos)?;
        enc.fused_decode(kv, counters, qkv, (heads, p), true)
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
            let h = self.heads;
            self.store = None;
            self.store = Some(
                self.enc
                    .alloc(b, h, self.max_len, self.dtype, &self.device)?,
            );
            self.counters = Some(Tensor::zeros(b * h.nkv, DType::U32, &self.device)?);
        }
        let (Some(kv), Some(counters)) = (&self.store, &self.counters) else {
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
    /// `append`) over rows `0..=pos`, with the fused decode kernel. `[b, 1, nh hd]`; `None`
    /// where the encoding has no fused kernel for these heads (use [`KvCache::attend`]).
    pub fn attend_decode(&self, qkv: &Tensor, p: &StepPositions) -> Result<Option<Tensor>> {
        let (Some(kv), Some(counters)) = (&self.store, &self.counters) else {
            candle_core::bail!("kv cache: attend before any append")
        };
        self.enc
            .fused_decode(kv, counters, qkv, (self.heads, p), false)
    }

    /// Why [`KvCache::attend_prefill`] does not run the fused kernel here (`None`: it does).
    pub fn no_fused_prefill(&self) -> Option<String> {
        if !self.device.is_cuda() {
            return Some("fused prefill attention: CUDA only".into());
        }
        if !fused_prefill_enabled() {
            return Some("fused prefill attention: off (CANDLE_LOWBIT_FUSED_PREFILL=0)".into());
        }
        prefill_unsupported(self.heads, self.dtype)
    }

    /// Causal attention of a prompt chunk already appended at rows `pos..pos + seq`
    /// (`qkv` `[b, seq, ..]` as given to [`KvCache::append`], its q heads unrotated) over
    /// rows `0..pos + seq`, in one fused launch: `[b, seq, nh hd]`. Dense caches are read
    /// in place; packed ones are dequantized to the run dtype first (the same values the
    /// decode steps attend over). `None` where [`KvCache::no_fused_prefill`] says why
    /// (use [`KvCache::attend`]).
    pub fn attend_prefill(
        &self,
        qkv: &Tensor,
        pos: usize,
        p: &StepPositions,
    ) -> Result<Option<Tensor>> {
        // (The cheap checks first: no reason string is built on every layer of a prompt.)
        if !self.device.is_cuda()
            || !fused_prefill_enabled()
            || prefill_unsupported(self.heads, self.dtype).is_some()
        {
            return Ok(None);
        }
        let Some(kv) = &self.store else {
            candle_core::bail!("kv cache: attend before any append")
        };
        let len = pos + qkv.dim(1)?;
        let (k, v) = self
            .enc
            .keys_values(kv, len, self.heads, self.dtype, self.rope.as_ref())?;
        prefill_attention(qkv, &k, &v, self.heads, p, pos).map(Some)
    }

    /// Attention of rotated queries `q` `[b, nh, seq, hd]` over the first `len` rows.
    ///
    /// `mask`: optional additive f32 mask `[b, 1, seq, len]` (0 or -inf). Query heads are
    /// grouped onto KV heads (`nh / nkv` each) without copying the cache.
    /// Scores and softmax are in f32. Returns `[b, nh, seq, hd]`.
    pub fn attend(&self, q: &Tensor, len: usize, mask: Option<&Tensor>) -> Result<Tensor> {
        let Some(kv) = &self.store else {
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
        let (k, v) = self
            .enc
            .keys_values(kv, len, self.heads, self.dtype, self.rope.as_ref())?;
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

/// Whether prompts use the fused prefill attention where it applies: on (its GPU test
/// `tests/cuda_ops.rs` `prefill_attention_cuda_matches_cpu` and the GPU model tests passed
/// with it on the H200, 2026-12-03) unless the environment's `CANDLE_LOWBIT_FUSED_PREFILL=0`
/// asks for the candle-ops path (for measuring; read once).
fn fused_prefill_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CANDLE_LOWBIT_FUSED_PREFILL").as_deref() != Ok("0"))
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
