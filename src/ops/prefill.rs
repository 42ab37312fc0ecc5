//! The fused causal attention of a prompt chunk (kernel: `cuda/prefill_attention.cu`):
//! RoPE of the queries, scores, mask, softmax and the weighted sum of the values in one
//! launch, nothing of size `seq × len` in memory. The prefill counterpart of the decode
//! step's attention; the CPU reference here is what the kernel is tested against.

use super::decode::{check_positions, cpu_f32, cpu_storage_as, HostPositions};
use super::{Heads, StepPositions};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// Head dims the CUDA kernel is built for.
pub const PREFILL_HEAD_DIMS: [usize; 2] = [64, 128];

/// Why the CUDA kernel does not take these heads in `dtype` (`None`: it does).
pub fn prefill_unsupported(heads: Heads, dtype: DType) -> Option<String> {
    if !matches!(dtype, DType::F16 | DType::BF16) {
        return Some(format!(
            "fused prefill attention: {dtype:?} (f16 or bf16 only)"
        ));
    }
    if !PREFILL_HEAD_DIMS.contains(&heads.hd)
        || heads.nkv == 0
        || !heads.nh.is_multiple_of(heads.nkv)
    {
        return Some(format!(
            "fused prefill attention: {heads:?} (head dim 64 or 128, query heads a multiple of KV heads)"
        ));
    }
    None
}

/// Causal attention of the `seq` query tokens of `qkv` `[b, seq, (nh + 2 nkv) hd]` (their
/// q heads unrotated, as the projection gives them; the tokens sit at cache rows
/// `pos .. pos + seq`) over the keys and values `k`, `v` `[b, nkv, pos + seq, hd]` (K
/// rotated, as the cache holds it; any strides with rows of `hd` contiguous values, so a
/// view of a dense cache needs no copy). RoPE positions and left padding come from `p`
/// (`p.pos` must hold `pos`): the query at row `r = pos + i` of sequence `s` is rotated
/// for position `r − pads[s]` and sees key `j` iff `j ≤ r` and (`j ≥ pads[s]` or `j = r`).
/// Scale `1/√hd`. Returns `[b, seq, nh hd]` in qkv's dtype (f16 or bf16 on CUDA, with
/// `hd` 64 or 128: see [`prefill_unsupported`]; also f32 on the CPU).
pub fn prefill_attention(
    qkv: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: Heads,
    p: &StepPositions,
    pos: usize,
) -> Result<Tensor> {
    let (b, seq, w) = qkv.dims3()?;
    let Heads { nh, nkv, hd } = heads;
    let len = pos + seq;
    let want = [b, nkv, len, hd];
    for (name, t) in [("k", k), ("v", v)] {
        let st = t.stride();
        if t.dims() != want
            || t.dtype() != qkv.dtype()
            || st.len() != 4
            || st[3] != 1
            || st[2] != hd
        {
            candle_core::bail!(
                "prefill_attention: {name} {:?} {:?} (strides {st:?}) must be {want:?} {:?} with rows of {hd} contiguous values",
                t.shape(),
                t.dtype(),
                qkv.dtype()
            )
        }
    }
    if w != heads.qkv_width()
        || nkv == 0
        || !nh.is_multiple_of(nkv)
        || !hd.is_multiple_of(2)
        || seq == 0
    {
        candle_core::bail!(
            "prefill_attention: qkv {:?} does not fit {heads:?} (width {}, nh a multiple of nkv, seq > 0)",
            qkv.shape(),
            heads.qkv_width()
        )
    }
    if qkv.device().is_cuda() {
        if let Some(why) = prefill_unsupported(heads, qkv.dtype()) {
            candle_core::bail!("{why}")
        }
    }
    check_positions(p, b, hd)?;
    if p.cos.dim(0)? < len {
        candle_core::bail!(
            "prefill_attention: rope tables of {} positions, rows up to {len}",
            p.cos.dim(0)?
        )
    }
    let op = PrefillAttention {
        heads,
        p: p.clone(),
        pos,
    };
    qkv.contiguous()?.apply_op3_no_bwd(k, v, &op)
}

struct PrefillAttention {
    heads: Heads,
    p: StepPositions,
    pos: usize,
}

/// Element `(s, h, j, e)` of a `[b, nkv, len, hd]` view as f32 rows per (s, h): the CPU
/// reference's keys or values, read through the layout's strides.
fn head_rows(s: &CpuStorage, l: &Layout, what: &str) -> Result<Vec<Vec<f32>>> {
    let dims = l.dims();
    let (b, nkv, len, hd) = (dims[0], dims[1], dims[2], dims[3]);
    let st = l.stride();
    // Read the whole underlying buffer once (a view may skip rows: a cache's capacity).
    let end = l.start_offset() + (0..4).map(|i| (dims[i].max(1) - 1) * st[i]).sum::<usize>() + 1;
    let flat = Layout::contiguous_with_offset((end,), 0);
    let all = cpu_f32(s, &flat).map_err(|e| candle_core::Error::Msg(format!("{what}: {e}")))?;
    let mut out = Vec::with_capacity(b * nkv);
    for si in 0..b {
        for h in 0..nkv {
            let mut rows = vec![0f32; len * hd];
            for j in 0..len {
                let o = l.start_offset() + si * st[0] + h * st[1] + j * st[2];
                rows[j * hd..(j + 1) * hd].copy_from_slice(&all[o..o + hd]);
            }
            out.push(rows);
        }
    }
    Ok(out)
}

/// `x` rounded to `dt` (the kernel holds its rotated queries in the run dtype).
fn round_to(x: f32, dt: DType) -> f32 {
    match dt {
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        _ => x,
    }
}

impl CustomOp3 for PrefillAttention {
    fn name(&self) -> &'static str {
        "prefill-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let hp = HostPositions::read(&self.p)?;
        if hp.pos != self.pos {
            candle_core::bail!(
                "prefill_attention: positions hold {} but the call says {}",
                hp.pos,
                self.pos
            )
        }
        let Heads { nh, nkv, hd } = self.heads;
        let (b, seq, w) = (l1.dims()[0], l1.dims()[1], l1.dims()[2]);
        let (keys, vals) = (head_rows(s2, l2, "k")?, head_rows(s3, l3, "v")?);
        let qkv = cpu_f32(s1, l1)?;
        let (g, dt) = (nh / nkv, s1.dtype());
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0f32; b * seq * nh * hd];
        let mut q = vec![0f32; hd];
        for s in 0..b {
            let pad = hp.pads[s] as usize;
            for h in 0..nh {
                let (kr, vr) = (&keys[s * nkv + h / g], &vals[s * nkv + h / g]);
                for i in 0..seq {
                    let row = (s * seq + i) * w + h * hd;
                    hp.rotate(&qkv[row..row + hd], hp.rope_pos(s, i), &mut q)?;
                    q.iter_mut().for_each(|x| *x = round_to(*x * scale, dt));
                    let r = self.pos + i;
                    let scores: Vec<f32> = (0..=r)
                        .map(|j| match j >= pad || j == r {
                            true => (0..hd).map(|e| q[e] * kr[j * hd + e]).sum(),
                            false => f32::NEG_INFINITY,
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let e: Vec<f32> = scores.iter().map(|&x| (x - m).exp()).collect();
                    let l: f32 = e.iter().sum();
                    let o = &mut out[(s * seq + i) * nh * hd + h * hd..][..hd];
                    for (j, &ej) in e.iter().enumerate() {
                        for (d, od) in o.iter_mut().enumerate() {
                            *od += ej * vr[j * hd + d];
                        }
                    }
                    o.iter_mut().for_each(|x| *x /= l);
                }
            }
        }
        Ok((cpu_storage_as(out, dt), Shape::from((b, seq, nh * hd))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (b, seq) = (l1.dims()[0], l1.dims()[1]);
        let out =
            cuda::prefill_attention(self.heads, &self.p, self.pos, (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, Shape::from((b, seq, self.heads.nh * self.heads.hd))))
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{Heads, StepPositions};
    use crate::kernels::{dtype_suffix, launch_params, raw_ptr, with_positions};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
    use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{DType, Layout, Result, WithDType};
    use half::{bf16, f16};

    /// Warps per block, query rows per block and keys per tile (PF_WARPS, PF_BM, PF_BN in
    /// cuda/prefill_attention.cu).
    const PF_WARPS: usize = 4;
    const PF_BM: usize = 16 * PF_WARPS;
    const PF_BN: usize = 64;

    /// `PrefillParams` of `cuda/prefill_attention.cu`, field for field.
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    struct PrefillParams {
        qkv: u64,
        cos: u64,
        sin: u64,
        pads: u64,
        k: u64,
        v: u64,
        out: u64,
        k_bs: i64,
        k_hs: i64,
        v_bs: i64,
        v_hs: i64,
        seq: i32,
        nh: i32,
        nkv: i32,
        pos: i32,
        scale: f32,
        pad: i32,
    }

    type Input<'a> = (&'a CudaStorage, &'a Layout);

    pub(super) fn prefill_attention(
        heads: Heads,
        p: &StepPositions,
        pos: usize,
        q: Input,
        k: Input,
        v: Input,
    ) -> Result<CudaStorage> {
        match q.0.dtype() {
            DType::F16 => run::<f16>(heads, p, pos, q, k, v),
            DType::BF16 => run::<bf16>(heads, p, pos, q, k, v),
            dt => candle_core::bail!("prefill_attention: unsupported dtype {dt:?} (f16, bf16)"),
        }
    }

    fn run<T: CudaDType + DeviceRepr + WithDType>(
        heads: Heads,
        p: &StepPositions,
        pos: usize,
        (s1, l1): Input,
        (s2, l2): Input,
        (s3, l3): Input,
    ) -> Result<CudaStorage> {
        let dev = s1.device();
        let stream = dev.cuda_stream();
        let Heads { nh, nkv, hd } = heads;
        let (b, seq) = (l1.dims()[0], l1.dims()[1]);
        let qkv = crate::kernels::contiguous_view::<T>(s1, l1, "qkv")?;
        let (ks, vs) = (s2.as_cuda_slice::<T>()?, s3.as_cuda_slice::<T>()?);
        // The kernel copies 16-byte row pieces: row starts must be 16-byte aligned.
        let epv = 16 / T::DTYPE.size_in_bytes();
        if l1.start_offset() % epv != 0 {
            candle_core::bail!(
                "prefill_attention: qkv must start at a 16-byte boundary, got {l1:?}"
            )
        }
        for (name, l) in [("k", l2), ("v", l3)] {
            let st = l.stride();
            if l.start_offset() % epv != 0 || st[0] % epv != 0 || st[1] % epv != 0 {
                candle_core::bail!(
                    "prefill_attention: {name} rows must start at 16-byte boundaries, got {l:?}"
                )
            }
        }
        let (k_s, v_s) = (ks.slice(l2.start_offset()..), vs.slice(l3.start_offset()..));
        let out = unsafe { dev.alloc::<T>(b * seq * nh * hd)? };
        let name = format!("attn_prefill_{}_h{hd}", dtype_suffix(T::DTYPE)?);
        let func = crate::kernels::func(dev, &name, &crate::kernels::modules::PREFILL_ATTENTION)?;
        let smem = (PF_BM + 4 * PF_BN) * (hd + 8) * T::DTYPE.size_in_bytes();
        if smem > 48 * 1024 {
            func.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(candle_core::Error::wrap)?;
        }
        let tables = [&p.cos, &p.sin, &p.pos, &p.pads];
        with_positions(tables, &stream, |[cp, sp, _pp, dp]| {
            let ((qp, _g1), (kp, _g2)) = (raw_ptr(&qkv, &stream), raw_ptr(&k_s, &stream));
            let ((vp, _g3), (op, _g4)) = (raw_ptr(&v_s, &stream), raw_ptr(&out, &stream));
            let (st2, st3) = (l2.stride(), l3.stride());
            let params = PrefillParams {
                qkv: qp,
                cos: cp,
                sin: sp,
                pads: dp,
                k: kp,
                v: vp,
                out: op,
                k_bs: st2[0] as i64,
                k_hs: st2[1] as i64,
                v_bs: st3[0] as i64,
                v_hs: st3[1] as i64,
                seq: seq as i32,
                nh: nh as i32,
                nkv: nkv as i32,
                pos: pos as i32,
                scale: 1f32 / (hd as f32).sqrt(),
                pad: 0,
            };
            let cfg = LaunchConfig {
                grid_dim: (seq.div_ceil(PF_BM) as u32, nh as u32, b as u32),
                block_dim: (32 * PF_WARPS as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            unsafe { launch_params(&func, &stream, cfg, 0, &params) }
        })?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
}
