//! Quantized KV caches outside the decode attention (kernels: `cuda/kv_quant.cu`, the
//! encodings in `cuda/kv_codec.cuh`, CPU references in `src/kv/{kv4,oaken}.rs`).
//!
//! - [`kv_append`]: RoPE on the K part of a fused projection, then K and V rows encoded
//!   into a packed cache `u8 [2, b, nkv, max_len, rec]` at rows `pos..pos + seq`.
//! - [`kv_dequantize`]: rows `0..len` of a packed cache as `[2, b, nkv, len, hd]` in a
//!   float dtype.

use super::decode::{check_positions, Heads, HostPositions, StepPositions};
use crate::kv::KvCodec;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, InplaceOp2, Layout, Result, Shape, Tensor};

/// Shapes of a packed cache for `heads` under `codec`: `(b, max_len)`.
fn packed_dims(cache: &Tensor, heads: Heads, codec: KvCodec) -> Result<(usize, usize)> {
    if !codec.supports(heads.hd) {
        candle_core::bail!(
            "{} cache: head dim {} unsupported (kv4: 64 or 128; oaken: 32, 64 or 128)",
            codec.name(),
            heads.hd
        )
    }
    let (two, b, nkv, max_len, rec) = cache.dims5()?;
    if cache.dtype() != DType::U8
        || two != 2
        || nkv != heads.nkv
        || rec != codec.rec_bytes(heads.hd)
    {
        candle_core::bail!(
            "{} cache: got {:?} {:?}, expected u8 [2, b, {}, max_len, {}] for head dim {}",
            codec.name(),
            cache.shape(),
            cache.dtype(),
            heads.nkv,
            codec.rec_bytes(heads.hd),
            heads.hd
        )
    }
    if !cache.is_contiguous() || cache.layout().start_offset() != 0 {
        candle_core::bail!("{} cache: must be a whole contiguous tensor", codec.name())
    }
    Ok((b, max_len))
}

/// Rotate and encode the K and V of `qkv` `[b, seq, (nh + 2 nkv) hd]` into `cache` at rows
/// `p.pos..p.pos + seq` (in place). K is rotated in f32 and rounded to `qkv`'s dtype
/// before it is encoded, as a dense cache would hold it; with `rotate_k` false K is
/// encoded as projected (before RoPE).
pub fn kv_append(
    cache: &Tensor,
    qkv: &Tensor,
    heads: Heads,
    p: &StepPositions,
    codec: KvCodec,
    rotate_k: bool,
) -> Result<()> {
    let (b, _) = packed_dims(cache, heads, codec)?;
    let (qb, seq, w) = qkv.dims3()?;
    if qb != b
        || w != heads.qkv_width()
        || !matches!(qkv.dtype(), DType::F32 | DType::F16 | DType::BF16)
    {
        candle_core::bail!(
            "kv_append: qkv {:?} {:?} does not fit a cache of batch {b} for {heads:?}",
            qkv.shape(),
            qkv.dtype()
        )
    }
    check_positions(p, b, heads.hd)?;
    if seq == 0 {
        return Ok(());
    }
    cache.inplace_op2(
        &qkv.contiguous()?,
        &KvAppend {
            heads,
            p: p.clone(),
            codec,
            rotate_k,
        },
    )
}

struct KvAppend {
    heads: Heads,
    p: StepPositions,
    codec: KvCodec,
    rotate_k: bool,
}

/// The rounding of `x` to dtype `dt` (the value a dense cache of that dtype would hold).
pub(crate) fn round_to(x: f32, dt: DType) -> f32 {
    match dt {
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

impl InplaceOp2 for KvAppend {
    fn name(&self) -> &'static str {
        "kv-append"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let hp = HostPositions::read(&self.p)?;
        let Heads { nh, nkv, hd } = self.heads;
        let dims = l1.shape().dims().to_vec();
        let (b, max_len, rec) = (dims[1], dims[3], dims[4]);
        let seq = l2.shape().dims()[1];
        if hp.pos + seq > max_len {
            candle_core::bail!(
                "kv_append: rows {}..{} past the cache's {max_len}",
                hp.pos,
                hp.pos + seq
            )
        }
        let dt = s2.dtype();
        let qkv = super::decode::cpu_f32(s2, l2)?;
        let cache = match s1 {
            CpuStorage::U8(v) => v,
            _ => candle_core::bail!("kv_append: cache must be u8"),
        };
        let w = self.heads.qkv_width();
        let (mut rot, mut val) = (vec![0f32; hd], vec![0f32; hd]);
        for s in 0..b {
            for i in 0..seq {
                let row = &qkv[(s * seq + i) * w..(s * seq + i + 1) * w];
                for kh in 0..nkv {
                    let k = &row[(nh + kh) * hd..(nh + kh + 1) * hd];
                    if self.rotate_k {
                        hp.rotate(k, hp.rope_pos(s, i), &mut rot)?;
                    } else {
                        rot.copy_from_slice(k);
                    }
                    rot.iter_mut().for_each(|x| *x = round_to(*x, dt));
                    val.copy_from_slice(&row[(nh + nkv + kh) * hd..(nh + nkv + kh + 1) * hd]);
                    for (kv, x) in [(0, &rot), (1, &val)] {
                        let off = (((kv * b + s) * nkv + kh) * max_len + hp.pos + i) * rec;
                        self.codec.quantize_row(kv, x, &mut cache[off..off + rec]);
                    }
                }
            }
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        cuda::kv_append(
            self.heads,
            &self.p,
            (self.codec, self.rotate_k),
            s1,
            l1,
            s2,
            l2,
        )
    }
}

/// Rows `0..len` of the packed `cache` decoded into `[2, b, nkv, len, hd]` of `dtype`.
pub fn kv_dequantize(
    cache: &Tensor,
    len: usize,
    hd: usize,
    codec: KvCodec,
    dtype: DType,
) -> Result<Tensor> {
    let nkv = cache.dim(2)?;
    let heads = Heads { nh: nkv, nkv, hd };
    let (_, max_len) = packed_dims(cache, heads, codec)?;
    if len > max_len || !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!(
            "kv_dequantize: {len} rows of a {max_len}-row cache into {dtype:?} (f32, f16, bf16)"
        )
    }
    cache.apply_op1_no_bwd(&KvDequantize {
        len,
        hd,
        codec,
        dtype,
    })
}

struct KvDequantize {
    len: usize,
    hd: usize,
    codec: KvCodec,
    dtype: DType,
}

impl CustomOp1 for KvDequantize {
    fn name(&self) -> &'static str {
        "kv-dequantize"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = l.shape().dims().to_vec();
        let (b, nkv, max_len, rec) = (dims[1], dims[2], dims[3], dims[4]);
        let cache = super::contiguous_slice::<u8>(s, l, "cache")?;
        let (len, hd) = (self.len, self.hd);
        let mut out = vec![0f32; 2 * b * nkv * len * hd];
        for head in 0..2 * b * nkv {
            let kv = head / (b * nkv);
            for j in 0..len {
                let off = (head * max_len + j) * rec;
                let o = (head * len + j) * hd;
                self.codec
                    .dequantize_row(kv, &cache[off..off + rec], &mut out[o..o + hd]);
            }
        }
        let shape = Shape::from((2, b, nkv, len, hd));
        Ok((super::decode::cpu_storage_as(out, self.dtype), shape))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dims = l.shape().dims().to_vec();
        let shape = Shape::from((2, dims[1], dims[2], self.len, self.hd));
        let out = cuda::kv_dequantize(self.codec, self.len, self.hd, self.dtype, s, l)?;
        Ok((out, shape))
    }
}

#[cfg(feature = "cuda")]
#[path = "kv_quant_cuda.rs"]
mod cuda;
