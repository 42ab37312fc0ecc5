//! Fused decode-step ops (kernels: `cuda/decode.cu`, `cuda/decode_attention.cu`).
//!
//! Positions live in device memory (`pos`: u32 `[1]`, the cache row of the first new
//! token; `pads`: u32 `[b]`, left padding per sequence), so that a step's launches do not
//! change from token to token and can be captured once in a CUDA graph. RoPE tables are
//! f32 `[max_pos, hd/2]` in the HF "rotate half" convention.
//!
//! The KV cache is one tensor `[2, b, n_kv, max_len, hd]` (keys, then values).

use crate::kv::KvCodec;
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, InplaceOp1, InplaceOp2, Layout, Result, Shape, Tensor,
    WithDType,
};

/// Head geometry of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub nh: usize,
    pub nkv: usize,
    pub hd: usize,
}

impl Heads {
    /// Width of a fused QKV row: `(nh + 2 nkv) hd`.
    pub fn qkv_width(&self) -> usize {
        (self.nh + 2 * self.nkv) * self.hd
    }

    /// Whether the fused decode kernels support this geometry (else use the generic path).
    pub fn fused_ok(&self) -> bool {
        (8..=128).contains(&self.hd)
            && 128 % self.hd == 0
            && self.nkv > 0
            && self.nh.is_multiple_of(self.nkv)
            && self.nh / self.nkv <= 8
    }
}

/// RoPE tables and device-resident positions shared by the ops of one step.
#[derive(Debug, Clone)]
pub struct StepPositions {
    /// f32 `[max_pos, hd/2]`.
    pub cos: Tensor,
    pub sin: Tensor,
    /// u32 `[1]`: cache row of the first new token.
    pub pos: Tensor,
    /// u32 `[b]`: left padding per sequence.
    pub pads: Tensor,
}

fn msg(s: String) -> candle_core::Error {
    candle_core::Error::Msg(s)
}

fn cpu_vec<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    t.flatten_all()?.to_vec1::<T>()
}

use super::contiguous_slice;

macro_rules! dispatch_float {
    ($dt:expr, $what:expr, $f:ident, $($args:expr),*) => {
        match $dt {
            DType::F32 => $f::<f32>($($args),*),
            DType::F16 => $f::<half::f16>($($args),*),
            DType::BF16 => $f::<half::bf16>($($args),*),
            dt => Err(msg(format!("{}: unsupported dtype {dt:?} (f32, f16, bf16)", $what))),
        }
    };
}

/// Mutable access to a CPU storage's elements, for the in-place ops' references.
trait CpuMut: WithDType {
    fn slice_mut(s: &mut CpuStorage) -> Result<&mut [Self]>;
}

macro_rules! cpu_mut {
    ($t:ty, $v:ident) => {
        impl CpuMut for $t {
            fn slice_mut(s: &mut CpuStorage) -> Result<&mut [Self]> {
                match s {
                    CpuStorage::$v(v) => Ok(v.as_mut_slice()),
                    other => Err(msg(format!(
                        "expected {:?} storage, got {:?}",
                        <$t>::DTYPE,
                        other.dtype()
                    ))),
                }
            }
        }
    };
}
cpu_mut!(f32, F32);
cpu_mut!(half::f16, F16);
cpu_mut!(half::bf16, BF16);
cpu_mut!(u32, U32);

/// A contiguous float CPU tensor's elements as f32 (the references' inputs).
pub(crate) fn cpu_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    Ok(match s.dtype() {
        DType::F32 => contiguous_slice::<f32>(s, l, "input")?.to_vec(),
        DType::F16 => contiguous_slice::<half::f16>(s, l, "input")?
            .iter()
            .map(|&x| f(x))
            .collect(),
        DType::BF16 => contiguous_slice::<half::bf16>(s, l, "input")?
            .iter()
            .map(|&x| f(x))
            .collect(),
        dt => candle_core::bail!("unsupported dtype {dt:?} (f32, f16, bf16)"),
    })
}

/// The inverse of [`cpu_f32`]: f32 values as a CPU storage of `dt` (f16 / bf16 rounded to
/// nearest; any other dtype stays f32).
pub(crate) fn cpu_storage_as(out: Vec<f32>, dt: DType) -> CpuStorage {
    match dt {
        DType::F16 => CpuStorage::F16(out.into_iter().map(half::f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(out.into_iter().map(half::bf16::from_f32).collect()),
        _ => CpuStorage::F32(out),
    }
}

fn f<T: WithDType>(x: T) -> f32 {
    x.to_f64() as f32
}

fn t<T: WithDType>(x: f32) -> T {
    T::from_f64(x as f64)
}

// ---------------------------------------------------------------------------------------
// embed_gather

/// Rows of `table` `[vocab, h]` at `ids` (u32 `[n]`): `[n, h]`. Graph-safe replacement for
/// `embedding` (whose index upload is not). Ids must be `< vocab`.
pub fn embed_gather(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if ids.dtype() != DType::U32 || ids.rank() != 1 || table.rank() != 2 {
        candle_core::bail!(
            "embed_gather: table {:?} {:?}, ids {:?} {:?}",
            table.shape(),
            table.dtype(),
            ids.shape(),
            ids.dtype()
        )
    }
    table
        .contiguous()?
        .apply_op2_no_bwd(&ids.contiguous()?, &EmbedGather)
}

struct EmbedGather;

impl CustomOp2 for EmbedGather {
    fn name(&self) -> &'static str {
        "embed-gather"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (vocab, h) = l1.shape().dims2()?;
        let ids = contiguous_slice::<u32>(s2, l2, "ids")?;
        fn run<T: WithDType>(
            s: &CpuStorage,
            l: &Layout,
            ids: &[u32],
            vocab: usize,
            h: usize,
        ) -> Result<CpuStorage> {
            let table = contiguous_slice::<T>(s, l, "table")?;
            let mut out = Vec::with_capacity(ids.len() * h);
            for &id in ids {
                if id as usize >= vocab {
                    candle_core::bail!("embed_gather: token id {id} out of range (vocab {vocab})")
                }
                out.extend_from_slice(&table[id as usize * h..(id as usize + 1) * h]);
            }
            Ok(T::to_cpu_storage_owned(out))
        }
        let out = dispatch_float!(s1.dtype(), "embed_gather", run, s1, l1, ids, vocab, h)?;
        Ok((out, Shape::from((ids.len(), h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (vocab, h) = l1.shape().dims2()?;
        let n = l2.shape().elem_count();
        let out = cuda::embed_gather(s1, l1, s2, l2, n, h, vocab)?;
        Ok((out, Shape::from((n, h))))
    }
}

// ---------------------------------------------------------------------------------------
// silu_mul

/// `silu(gate) * up` for `gu = [.., 2I]` holding gate then up: `[.., I]`.
pub fn silu_mul(gu: &Tensor) -> Result<Tensor> {
    let w = gu.dim(candle_core::D::Minus1)?;
    if w % 2 != 0 {
        candle_core::bail!(
            "silu_mul: last dim of {:?} must be even (gate then up)",
            gu.shape()
        )
    }
    gu.contiguous()?.apply_op1_no_bwd(&SiluMul)
}

struct SiluMul;

/// `silu(gate) * up` over rows `[gate (inter), up (inter)]` of `gu`, with silu(gate) rounded
/// to T before the product (as the unfused candle ops do): the CPU reference of
/// `silu_mul` and of the fused `gemv_silu_mul`.
pub(super) fn silu_mul_ref<T: WithDType>(gu: &[T], inter: usize) -> Vec<T> {
    gu.chunks(2 * inter.max(1))
        .flat_map(|row| {
            (0..inter).map(move |c| {
                let g = f(row[c]);
                let sg = f(t::<T>(g / (1. + (-g).exp())));
                t::<T>(sg * f(row[inter + c]))
            })
        })
        .collect()
}

fn silu_mul_shape(l: &Layout) -> Shape {
    let mut d = l.shape().dims().to_vec();
    if let Some(last) = d.last_mut() {
        *last /= 2;
    }
    Shape::from(d)
}

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let shape = silu_mul_shape(l);
        let inter = *shape.dims().last().unwrap_or(&0);
        fn run<T: WithDType>(s: &CpuStorage, l: &Layout, inter: usize) -> Result<CpuStorage> {
            Ok(T::to_cpu_storage_owned(silu_mul_ref(
                contiguous_slice::<T>(s, l, "gu")?,
                inter,
            )))
        }
        Ok((
            dispatch_float!(s.dtype(), "silu_mul", run, s, l, inter)?,
            shape,
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let shape = silu_mul_shape(l);
        let inter = *shape.dims().last().unwrap_or(&0);
        let rows = shape.elem_count().checked_div(inter).unwrap_or(0);
        Ok((cuda::silu_mul(s, l, rows, inter)?, shape))
    }
}

// ---------------------------------------------------------------------------------------
// rope_kv_append

/// Rotate the K part of `qkv` (`[b, seq, (nh + 2 nkv) hd]`) and write K and V into `cache`
/// (`[2, b, nkv, max_len, hd]`) at rows `pos..pos+seq`, in place.
pub fn rope_kv_append(cache: &Tensor, qkv: &Tensor, heads: Heads, p: &StepPositions) -> Result<()> {
    let (b, seq, w) = qkv.dims3()?;
    let (two, cb, nkv, max_len, hd) = cache.dims5()?;
    if w != heads.qkv_width()
        || two != 2
        || cb != b
        || nkv != heads.nkv
        || hd != heads.hd
        || seq > max_len
    {
        candle_core::bail!(
            "rope_kv_append: qkv {:?} does not fit cache {:?} for {heads:?}",
            qkv.shape(),
            cache.shape()
        )
    }
    if qkv.dtype() != cache.dtype() {
        candle_core::bail!(
            "rope_kv_append: qkv {:?} vs cache {:?}",
            qkv.dtype(),
            cache.dtype()
        )
    }
    check_positions(p, b, hd)?;
    cache.inplace_op2(
        &qkv.contiguous()?,
        &RopeKvAppend {
            heads,
            p: p.clone(),
        },
    )
}

pub(crate) fn check_positions(p: &StepPositions, b: usize, hd: usize) -> Result<()> {
    if p.pos.dtype() != DType::U32
        || p.pos.elem_count() != 1
        || p.pads.dtype() != DType::U32
        || p.pads.elem_count() != b
    {
        candle_core::bail!(
            "positions: pos {:?} and pads {:?} must be u32 [1] and [{b}]",
            p.pos.shape(),
            p.pads.shape()
        )
    }
    if p.cos.dtype() != DType::F32 || p.cos.dim(1)? * 2 != hd || p.sin.shape() != p.cos.shape() {
        candle_core::bail!(
            "positions: rope tables {:?} must be f32 [max_pos, {}]",
            p.cos.shape(),
            hd / 2
        )
    }
    Ok(())
}

struct RopeKvAppend {
    heads: Heads,
    p: StepPositions,
}

/// Host copies of positions and tables (CPU reference only).
pub(crate) struct HostPositions {
    pub(crate) pos: usize,
    pub(crate) pads: Vec<u32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
}

impl HostPositions {
    pub(crate) fn read(p: &StepPositions) -> Result<Self> {
        Ok(Self {
            pos: cpu_vec::<u32>(&p.pos)?[0] as usize,
            pads: cpu_vec(&p.pads)?,
            cos: cpu_vec(&p.cos)?,
            sin: cpu_vec(&p.sin)?,
            half: p.cos.dim(1)?,
        })
    }

    /// Rotate `x` (one head, hd values) for RoPE position `rpos` into `out`.
    pub(crate) fn rotate(&self, x: &[f32], rpos: usize, out: &mut [f32]) -> Result<()> {
        let h = self.half;
        if (rpos + 1) * h > self.cos.len() {
            candle_core::bail!(
                "rope: position {rpos} beyond the table of {} positions",
                self.cos.len() / h
            )
        }
        for j in 0..h {
            let (c, s) = (self.cos[rpos * h + j], self.sin[rpos * h + j]);
            out[j] = x[j] * c - x[j + h] * s;
            out[j + h] = x[j + h] * c + x[j] * s;
        }
        Ok(())
    }

    pub(crate) fn rope_pos(&self, seq_idx: usize, i: usize) -> usize {
        (self.pos + i).saturating_sub(self.pads[seq_idx] as usize)
    }
}

impl InplaceOp2 for RopeKvAppend {
    fn name(&self) -> &'static str {
        "rope-kv-append"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let hp = HostPositions::read(&self.p)?;
        let dims = l1.shape().dims().to_vec();
        let seq = l2.shape().dims()[1];
        fn run<T: CpuMut>(
            op: &RopeKvAppend,
            hp: &HostPositions,
            cache: &mut CpuStorage,
            dims: &[usize],
            seq: usize,
            qkv: &[T],
        ) -> Result<()> {
            let Heads { nh, nkv, hd } = op.heads;
            let (b, max_len) = (dims[1], dims[3]);
            if hp.pos + seq > max_len {
                candle_core::bail!(
                    "rope_kv_append: rows {}..{} past the cache's {max_len}",
                    hp.pos,
                    hp.pos + seq
                )
            }
            let cache: &mut [T] = T::slice_mut(cache)?;
            let (w, mut rot) = (op.heads.qkv_width(), vec![0f32; hd]);
            for s in 0..b {
                for i in 0..seq {
                    let row = &qkv[(s * seq + i) * w..(s * seq + i + 1) * w];
                    for kh in 0..nkv {
                        let k: Vec<f32> = row[(nh + kh) * hd..(nh + kh + 1) * hd]
                            .iter()
                            .map(|&x| f(x))
                            .collect();
                        hp.rotate(&k, hp.rope_pos(s, i), &mut rot)?;
                        let off = ((s * nkv + kh) * max_len + hp.pos + i) * hd;
                        let v_off = b * nkv * max_len * hd + off;
                        for d in 0..hd {
                            cache[off + d] = t(rot[d]);
                            cache[v_off + d] = row[(nh + nkv + kh) * hd + d];
                        }
                    }
                }
            }
            Ok(())
        }
        if l1.contiguous_offsets() != Some((0, l1.shape().elem_count())) {
            candle_core::bail!("rope_kv_append: the cache must be a whole contiguous tensor")
        }
        match s2.dtype() {
            DType::F32 => run(
                self,
                &hp,
                s1,
                &dims,
                seq,
                contiguous_slice::<f32>(s2, l2, "qkv")?,
            ),
            DType::F16 => run(
                self,
                &hp,
                s1,
                &dims,
                seq,
                contiguous_slice::<half::f16>(s2, l2, "qkv")?,
            ),
            DType::BF16 => run(
                self,
                &hp,
                s1,
                &dims,
                seq,
                contiguous_slice::<half::bf16>(s2, l2, "qkv")?,
            ),
            dt => candle_core::bail!("rope_kv_append: unsupported dtype {dt:?}"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        cuda::rope_kv_append(self.heads, &self.p, s1, l1, s2, l2)
    }
}

// ---------------------------------------------------------------------------------------
// decode_attention

/// Attention of each sequence's one new token (the Q part of `qkv` `[b, 1, (nh+2nkv) hd]`,
/// rotated here for its position) over cache rows `0..=pos`. Returns `[b, 1, nh hd]`.
///
/// `cache`: dense `[2, b, nkv, max_len, hd]` in `qkv`'s dtype (`codec` `None`), or packed
/// `u8 [2, b, nkv, max_len, rec]` in `codec`'s encoding (read and dequantized in registers).
///
/// `counters`: u32 `[b * nkv]`, all zero, owned by the caller and kept for every later
/// call on this cache (the GPU kernel's blocks count themselves in it to decide which
/// merges the key chunks, and leave it zero again; a captured graph relies on that).
pub fn decode_attention(
    qkv: &Tensor,
    cache: &Tensor,
    counters: &Tensor,
    heads: Heads,
    p: &StepPositions,
    codec: Option<KvCodec>,
) -> Result<Tensor> {
    check_attention(qkv, cache, counters, heads, p, codec)?;
    let op = DecodeAttention {
        heads,
        p: p.clone(),
        counters: counters.clone(),
        append: false,
        codec,
    };
    qkv.contiguous()?
        .apply_op2_no_bwd(&cache.contiguous()?, &op)
}

/// The whole attention of a decode step: [`rope_kv_append`] of the new token's K and V at
/// row `pos`, then [`decode_attention`] over rows `0..=pos`; arguments and result as
/// there (`cache` must be a whole contiguous tensor). On CUDA one launch does both (the
/// block that holds row `pos` writes it and uses it from shared memory); on the CPU it
/// runs the two references in turn, which is what the GPU is tested against.
pub fn append_decode_attention(
    qkv: &Tensor,
    cache: &Tensor,
    counters: &Tensor,
    heads: Heads,
    p: &StepPositions,
    codec: Option<KvCodec>,
) -> Result<Tensor> {
    if !cache.device().is_cuda() {
        match codec {
            None => rope_kv_append(cache, qkv, heads, p)?,
            Some(c) => super::kv_quant::kv_append(cache, qkv, heads, p, c, true)?,
        }
        return decode_attention(qkv, cache, counters, heads, p, codec);
    }
    let dtype_ok = match codec {
        None => qkv.dtype() == cache.dtype(),
        Some(_) => cache.dtype() == DType::U8,
    };
    if !cache.is_contiguous() || cache.layout().start_offset() != 0 || !dtype_ok {
        candle_core::bail!(
            "append_decode_attention: the cache must be a whole contiguous tensor of qkv's dtype, got {:?} {:?} for qkv {:?}",
            cache.layout(),
            cache.dtype(),
            qkv.dtype()
        )
    }
    check_attention(qkv, cache, counters, heads, p, codec)?;
    let op = DecodeAttention {
        heads,
        p: p.clone(),
        counters: counters.clone(),
        append: true,
        codec,
    };
    qkv.contiguous()?.apply_op2_no_bwd(cache, &op)
}

fn check_attention(
    qkv: &Tensor,
    cache: &Tensor,
    counters: &Tensor,
    heads: Heads,
    p: &StepPositions,
    codec: Option<KvCodec>,
) -> Result<()> {
    let (b, seq, w) = qkv.dims3()?;
    let (_, cb, nkv, _, row) = cache.dims5()?;
    let (row_ok, dtype_ok) = match codec {
        None => (row == heads.hd, cache.dtype() == qkv.dtype()),
        Some(c) => (
            c.supports(heads.hd) && row == c.rec_bytes(heads.hd),
            cache.dtype() == DType::U8,
        ),
    };
    if seq != 1
        || w != heads.qkv_width()
        || cb != b
        || nkv != heads.nkv
        || !row_ok
        || !dtype_ok
        || !heads.fused_ok()
    {
        candle_core::bail!(
            "decode_attention: qkv {:?} {:?} / cache {:?} {:?} unsupported for {heads:?} ({})",
            qkv.shape(),
            qkv.dtype(),
            cache.shape(),
            cache.dtype(),
            codec.map_or("dense", |c| c.name())
        )
    }
    if counters.dtype() != DType::U32
        || counters.elem_count() != b * nkv
        || !counters.is_contiguous()
    {
        candle_core::bail!(
            "decode_attention: counters must be contiguous u32 [{}], got {:?} {:?}",
            b * nkv,
            counters.shape(),
            counters.dtype()
        )
    }
    check_positions(p, b, heads.hd)
}

struct DecodeAttention {
    heads: Heads,
    p: StepPositions,
    /// Read by the CUDA kernel only (the CPU reference needs no merge counters).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    counters: Tensor,
    /// The kernel also writes row `pos` of the cache (CUDA only: on the CPU
    /// `append_decode_attention` runs the append first and this op without it).
    append: bool,
    /// The packed cache's encoding (`None`: dense rows of the run dtype).
    codec: Option<KvCodec>,
}

fn attend_one(
    hp: &HostPositions,
    q: &[f32],
    keys: &[f32],
    vals: &[f32],
    pad: usize,
    hd: usize,
) -> Vec<f32> {
    let len = hp.pos + 1;
    let scale = 1.0 / (hd as f32).sqrt();
    let scores: Vec<f32> = (0..len)
        .map(|j| {
            if j < pad && j != hp.pos {
                return f32::NEG_INFINITY;
            }
            (0..hd).map(|d| q[d] * keys[j * hd + d]).sum::<f32>() * scale
        })
        .collect();
    let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = scores.iter().map(|&s| (s - m).exp()).collect();
    let l: f32 = e.iter().sum();
    (0..hd)
        .map(|d| (0..len).map(|j| e[j] * vals[j * hd + d]).sum::<f32>() / l)
        .collect()
}

impl CustomOp2 for DecodeAttention {
    fn name(&self) -> &'static str {
        "decode-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if self.append {
            candle_core::bail!("decode_attention: appending inside the op is CUDA only (use append_decode_attention)")
        }
        let hp = HostPositions::read(&self.p)?;
        let dims = l2.shape().dims().to_vec();
        let Heads { nh, nkv, hd } = self.heads;
        let (b, max_len, row) = (dims[1], dims[3], dims[4]);
        if hp.pos >= max_len {
            candle_core::bail!(
                "decode_attention: position {} past the cache's {max_len}",
                hp.pos
            )
        }
        let len = hp.pos + 1;
        // Rows 0..len of head (kv, s, kvh) in f32: dense rows, or decoded records.
        let dense = match self.codec {
            None => Some(cpu_f32(s2, l2)?),
            Some(_) => None,
        };
        let packed = match self.codec {
            Some(_) => Some(contiguous_slice::<u8>(s2, l2, "cache")?),
            None => None,
        };
        let rows = |kv: usize, s: usize, kvh: usize| -> Vec<f32> {
            let head = (kv * b + s) * nkv + kvh;
            match (&dense, packed, self.codec) {
                (Some(d), _, _) => d[head * max_len * hd..(head * max_len + len) * hd].to_vec(),
                (_, Some(c), Some(codec)) => {
                    let mut out = vec![0f32; len * hd];
                    for j in 0..len {
                        let off = (head * max_len + j) * row;
                        codec.dequantize_row(
                            kv,
                            &c[off..off + row],
                            &mut out[j * hd..(j + 1) * hd],
                        );
                    }
                    out
                }
                _ => vec![],
            }
        };
        let qkv = cpu_f32(s1, l1)?;
        let (w, g) = (self.heads.qkv_width(), nh / nkv);
        let mut out = vec![0f32; b * nh * hd];
        let mut q = vec![0f32; hd];
        for s in 0..b {
            for kvh in 0..nkv {
                let (keys, vals) = (rows(0, s, kvh), rows(1, s, kvh));
                for hh in 0..g {
                    let head = kvh * g + hh;
                    let x = &qkv[s * w + head * hd..s * w + (head + 1) * hd];
                    hp.rotate(x, hp.rope_pos(s, 0), &mut q)?;
                    let o = attend_one(&hp, &q, &keys, &vals, hp.pads[s] as usize, hd);
                    out[(s * nh + head) * hd..(s * nh + head + 1) * hd].copy_from_slice(&o);
                }
            }
        }
        let out = cpu_storage_as(out, s1.dtype());
        Ok((
            out,
            Shape::from((dims[1], 1, self.heads.nh * self.heads.hd)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let b = l2.shape().dims()[1];
        let out = cuda::decode_attention(
            self.heads,
            &self.p,
            &self.counters,
            (self.append, self.codec),
            s1,
            l1,
            s2,
            l2,
        )?;
        Ok((out, Shape::from((b, 1, self.heads.nh * self.heads.hd))))
    }
}

// ---------------------------------------------------------------------------------------
// advance_pos

/// `pos += by` on the device (u32 `[1]`): the last launch of a captured decode step.
pub fn advance_pos(pos: &Tensor, by: u32) -> Result<()> {
    if pos.dtype() != DType::U32 || pos.elem_count() != 1 {
        candle_core::bail!(
            "advance_pos: pos must be u32 [1], got {:?} {:?}",
            pos.shape(),
            pos.dtype()
        )
    }
    pos.inplace_op1(&AdvancePos(by))
}

struct AdvancePos(u32);

impl InplaceOp1 for AdvancePos {
    fn name(&self) -> &'static str {
        "advance-pos"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let v = u32::slice_mut(s)?;
        v[l.start_offset()] += self.0;
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &mut candle_core::CudaStorage, l: &Layout) -> Result<()> {
        cuda::advance_pos(s, l, self.0)
    }
}

#[cfg(feature = "cuda")]
#[path = "decode_cuda.rs"]
mod cuda;
