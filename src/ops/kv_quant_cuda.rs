//! CUDA launchers of `cuda/kv_quant.cu`. Shapes and dtypes are validated in `kv_quant.rs`.

use super::{Heads, StepPositions};
use crate::kernels::{
    contiguous_view, dtype_suffix as suffix, launch_params, raw_ptr, with_positions,
};
use crate::kv::oaken::KvThr;
use crate::kv::KvCodec;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{DType, Layout, Result, WithDType};
use half::{bf16, f16};

/// `AppendParams` of `cuda/kv_quant.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AppendParams {
    qkv: u64,
    cos: u64,
    sin: u64,
    pos: u64,
    pads: u64,
    k: u64,
    v: u64,
    b: i32,
    seq: i32,
    nh: i32,
    nkv: i32,
    hd: i32,
    max_len: i32,
    rec: i32,
    rotate_k: i32,
    thr_k: KvThr,
    thr_v: KvThr,
}

/// `DequantParams` of `cuda/kv_quant.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct DequantParams {
    cache: u64,
    out: u64,
    b: i32,
    nkv: i32,
    hd: i32,
    max_len: i32,
    len: i32,
    rec: i32,
    thr_k: KvThr,
    thr_v: KvThr,
}

pub(super) fn kv_append(
    heads: Heads,
    p: &StepPositions,
    (codec, rotate_k): (KvCodec, bool),
    s1: &mut CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> Result<()> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        heads: Heads,
        p: &StepPositions,
        (codec, rotate_k): (KvCodec, bool),
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        let dev = s1.device().clone();
        let dims = l1.shape().dims().to_vec();
        let (b, max_len, rec) = (dims[1], dims[3], dims[4]);
        let seq = l2.shape().dims()[1];
        let qkv = contiguous_view::<T>(s2, l2, "qkv")?;
        let name = format!("kv_append_{}_{}", suffix(T::DTYPE)?, codec.name());
        let func = crate::kernels::func(&dev, &name, &crate::kernels::modules::KV_QUANT)?;
        let stream = dev.cuda_stream();
        let cache = s1.as_cuda_slice_mut::<u8>()?;
        let half = cache.len() / 2;
        let (k, v) = cache.split_at_mut(half);
        let tables = [&p.cos, &p.sin, &p.pos, &p.pads];
        with_positions(tables, &stream, |[cp, sp, pp, dp]| {
            let (qp, _g1) = raw_ptr(&qkv, &stream);
            let ((kp, _g6), (vp, _g7)) = (raw_ptr(&k, &stream), raw_ptr(&v, &stream));
            let params = AppendParams {
                qkv: qp,
                cos: cp,
                sin: sp,
                pos: pp,
                pads: dp,
                k: kp,
                v: vp,
                b: b as i32,
                seq: seq as i32,
                nh: heads.nh as i32,
                nkv: heads.nkv as i32,
                hd: heads.hd as i32,
                max_len: max_len as i32,
                rec: rec as i32,
                rotate_k: rotate_k as i32,
                thr_k: codec.thr(0),
                thr_v: codec.thr(1),
            };
            let cfg = LaunchConfig {
                grid_dim: (seq as u32, b as u32, heads.nkv as u32),
                block_dim: (64, 1, 1),
                shared_mem_bytes: 0,
            };
            unsafe { launch_params(&func, &stream, cfg, 0, &params) }
        })?;
        if l1.start_offset() != 0 {
            candle_core::bail!("kv_append: cache must start at offset 0")
        }
        Ok(())
    }
    match s2.dtype() {
        DType::F32 => run::<f32>(heads, p, (codec, rotate_k), s1, l1, s2, l2),
        DType::F16 => run::<f16>(heads, p, (codec, rotate_k), s1, l1, s2, l2),
        DType::BF16 => run::<bf16>(heads, p, (codec, rotate_k), s1, l1, s2, l2),
        dt => candle_core::bail!("kv_append: unsupported dtype {dt:?}"),
    }
}

pub(super) fn kv_dequantize(
    codec: KvCodec,
    len: usize,
    hd: usize,
    dtype: DType,
    s: &CudaStorage,
    l: &Layout,
) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        codec: KvCodec,
        len: usize,
        hd: usize,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<CudaStorage> {
        let dev = s.device().clone();
        let dims = l.shape().dims().to_vec();
        let (b, nkv, max_len, rec) = (dims[1], dims[2], dims[3], dims[4]);
        let cache = contiguous_view::<u8>(s, l, "cache")?;
        let n = 2 * b * nkv * len * hd;
        let out = unsafe { dev.alloc::<T>(n)? };
        if n > 0 {
            let name = format!("kv_dequantize_{}_{}", suffix(T::DTYPE)?, codec.name());
            let func = crate::kernels::func(&dev, &name, &crate::kernels::modules::KV_QUANT)?;
            let stream = dev.cuda_stream();
            let ((cp, _g1), (op, _g2)) = (raw_ptr(&cache, &stream), raw_ptr(&out, &stream));
            let params = DequantParams {
                cache: cp,
                out: op,
                b: b as i32,
                nkv: nkv as i32,
                hd: hd as i32,
                max_len: max_len as i32,
                len: len as i32,
                rec: rec as i32,
                thr_k: codec.thr(0),
                thr_v: codec.thr(1),
            };
            // A block of hd threads per row, rows strided over the grid.
            let rows = (2 * b * nkv * len).min(1 << 20) as u32;
            let cfg = LaunchConfig {
                grid_dim: (rows, 1, 1),
                block_dim: (hd as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            unsafe { launch_params(&func, &stream, cfg, 0, &params) }?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
    match dtype {
        DType::F32 => run::<f32>(codec, len, hd, s, l),
        DType::F16 => run::<f16>(codec, len, hd, s, l),
        DType::BF16 => run::<bf16>(codec, len, hd, s, l),
        dt => candle_core::bail!("kv_dequantize: unsupported dtype {dt:?}"),
    }
}
