//! CUDA launchers of the decode ops (`cuda/decode.cu`, `cuda/decode_attention.cu`).
//! Shapes and dtypes are validated by the callers in `decode.rs`.

use super::{Heads, StepPositions};
use crate::kernels::{contiguous_view, launch_err, ptx};
use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::backend::BackendStorage;
use candle_core::{DType, Layout, Result, Storage, Tensor, WithDType};
use half::{bf16, f16};

/// Keys per chunk and the largest GQA group of `attn_partial` (see its header).
const ATTN_CHUNK: usize = 256;
const ATTN_THREADS: u32 = 128;

fn suffix(dt: DType) -> Result<&'static str> {
    Ok(match dt {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        dt => candle_core::bail!("unsupported dtype {dt:?} (f32, f16, bf16)"),
    })
}

/// Run `f` with a contiguous device view of `t` (which must live on the GPU).
fn with_view<T: CudaDType + DeviceRepr, R>(t: &Tensor, what: &str, f: impl FnOnce(CudaView<'_, T>) -> Result<R>) -> Result<R> {
    let (st, l) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else { candle_core::bail!("{what} must be on the GPU") };
    f(contiguous_view::<T>(cs, l, what)?)
}

fn grid(x: usize, y: usize, z: usize, threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (x as u32, y as u32, z as u32), block_dim: (threads, 1, 1), shared_mem_bytes: smem }
}

pub(super) fn embed_gather(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    n: usize,
    h: usize,
    vocab: usize,
) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout, n: usize, h: usize, vocab: usize,
    ) -> Result<CudaStorage> {
        let dev = s1.device();
        let table = contiguous_view::<T>(s1, l1, "table")?;
        let ids = contiguous_view::<u32>(s2, l2, "ids")?;
        let out = unsafe { dev.alloc::<T>(n * h)? };
        let name = format!("embed_gather_{}", suffix(T::DTYPE)?);
        let func = dev.get_or_load_custom_func(&name, "decode", ptx::DECODE)?;
        let (n_i, h_i, v_i) = (n as i32, h as i32, vocab as i32);
        let mut b = func.builder();
        b.arg(&table).arg(&ids).arg(&out).arg(&n_i).arg(&h_i).arg(&v_i);
        if n > 0 {
            unsafe { b.launch(grid(n, 1, 1, 128, 0)) }.map_err(launch_err)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    match s1.dtype() {
        DType::F32 => run::<f32>(s1, l1, s2, l2, n, h, vocab),
        DType::F16 => run::<f16>(s1, l1, s2, l2, n, h, vocab),
        DType::BF16 => run::<bf16>(s1, l1, s2, l2, n, h, vocab),
        dt => candle_core::bail!("embed_gather: unsupported dtype {dt:?}"),
    }
}

pub(super) fn silu_mul(s: &CudaStorage, l: &Layout, rows: usize, inter: usize) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(s: &CudaStorage, l: &Layout, rows: usize, inter: usize) -> Result<CudaStorage> {
        let dev = s.device();
        let gu = contiguous_view::<T>(s, l, "gu")?;
        let out = unsafe { dev.alloc::<T>(rows * inter)? };
        let func = dev.get_or_load_custom_func(&format!("silu_mul_{}", suffix(T::DTYPE)?), "decode", ptx::DECODE)?;
        let n = rows * inter;
        let (r_i, i_i) = (rows as i32, inter as i32);
        let mut b = func.builder();
        b.arg(&gu).arg(&out).arg(&r_i).arg(&i_i);
        if n > 0 {
            unsafe { b.launch(grid(n.div_ceil(256).min(65535), 1, 1, 256, 0)) }.map_err(launch_err)?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    match s.dtype() {
        DType::F32 => run::<f32>(s, l, rows, inter),
        DType::F16 => run::<f16>(s, l, rows, inter),
        DType::BF16 => run::<bf16>(s, l, rows, inter),
        dt => candle_core::bail!("silu_mul: unsupported dtype {dt:?}"),
    }
}

pub(super) fn rope_kv_append(
    heads: Heads,
    p: &StepPositions,
    s1: &mut CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> Result<()> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        heads: Heads, p: &StepPositions, s1: &mut CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout,
    ) -> Result<()> {
        let dev = s1.device().clone();
        let dims = l1.shape().dims().to_vec();
        let (b, max_len, seq) = (dims[1], dims[3], l2.shape().dims()[1]);
        let qkv = contiguous_view::<T>(s2, l2, "qkv")?;
        let func = dev.get_or_load_custom_func(&format!("rope_kv_{}", suffix(T::DTYPE)?), "decode", ptx::DECODE)?;
        let cache = s1.as_cuda_slice_mut::<T>()?;
        let half = cache.len() / 2;
        let (mut k, mut v) = cache.split_at_mut(half);
        with_view::<f32, _>(&p.cos, "cos", |cos| {
            with_view::<f32, _>(&p.sin, "sin", |sin| {
                with_view::<u32, _>(&p.pos, "pos", |pos| {
                    with_view::<u32, _>(&p.pads, "pads", |pads| {
                        let ints = [seq, heads.nh, heads.nkv, heads.hd, max_len].map(|x| x as i32);
                        let mut bld = func.builder();
                        bld.arg(&qkv).arg(&cos).arg(&sin).arg(&pos).arg(&pads).arg(&mut k).arg(&mut v);
                        for x in &ints {
                            bld.arg(x);
                        }
                        let cfg = grid(seq, b, heads.nkv, (heads.hd / 2) as u32, 0);
                        unsafe { bld.launch(cfg) }.map_err(launch_err)?;
                        Ok(())
                    })
                })
            })
        })?;
        if l1.start_offset() != 0 {
            candle_core::bail!("rope_kv_append: cache must start at offset 0")
        }
        Ok(())
    }
    match s2.dtype() {
        DType::F32 => run::<f32>(heads, p, s1, l1, s2, l2),
        DType::F16 => run::<f16>(heads, p, s1, l1, s2, l2),
        DType::BF16 => run::<bf16>(heads, p, s1, l1, s2, l2),
        dt => candle_core::bail!("rope_kv_append: unsupported dtype {dt:?}"),
    }
}

pub(super) fn decode_attention(
    heads: Heads,
    p: &StepPositions,
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        heads: Heads, p: &StepPositions, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout,
    ) -> Result<CudaStorage> {
        let dev = s1.device();
        let dims = l2.shape().dims().to_vec();
        let (b, max_len) = (dims[1], dims[3]);
        let Heads { nh, nkv, hd } = heads;
        let g = nh / nkv;
        let n_split = max_len.div_ceil(ATTN_CHUNK);
        let qkv = contiguous_view::<T>(s1, l1, "qkv")?;
        let cache = contiguous_view::<T>(s2, l2, "cache")?;
        let (k, v) = cache.split_at(cache.len() / 2);
        let part_o = unsafe { dev.alloc::<f32>(b * nh * n_split * hd)? };
        let part_ml = unsafe { dev.alloc::<f32>(b * nh * n_split * 2)? };
        let out = unsafe { dev.alloc::<T>(b * nh * hd)? };
        let sfx = suffix(T::DTYPE)?;
        let partial = dev.get_or_load_custom_func(&format!("attn_partial_{sfx}"), "decode_attention", ptx::DECODE_ATTENTION)?;
        let combine = dev.get_or_load_custom_func(&format!("attn_combine_{sfx}"), "decode_attention", ptx::DECODE_ATTENTION)?;
        let scale = 1f32 / (hd as f32).sqrt();
        let ints = [nh, nkv, hd, max_len, n_split].map(|x| x as i32);
        let smem = ((g * hd + g * ATTN_CHUNK) * 4) as u32;
        with_view::<f32, _>(&p.cos, "cos", |cos| {
            with_view::<f32, _>(&p.sin, "sin", |sin| {
                with_view::<u32, _>(&p.pos, "pos", |pos| {
                    with_view::<u32, _>(&p.pads, "pads", |pads| {
                        let mut bld = partial.builder();
                        bld.arg(&qkv).arg(&cos).arg(&sin).arg(&k).arg(&v).arg(&pos).arg(&pads);
                        bld.arg(&part_o).arg(&part_ml);
                        for x in &ints {
                            bld.arg(x);
                        }
                        bld.arg(&scale);
                        unsafe { bld.launch(grid(n_split, nkv, b, ATTN_THREADS, smem)) }.map_err(launch_err)?;
                        let (nh_i, hd_i, ns_i) = (nh as i32, hd as i32, n_split as i32);
                        let mut bld = combine.builder();
                        bld.arg(&part_o).arg(&part_ml).arg(&pos).arg(&out).arg(&nh_i).arg(&hd_i).arg(&ns_i);
                        unsafe { bld.launch(grid(nh, b, 1, hd as u32, 0)) }.map_err(launch_err)?;
                        Ok(())
                    })
                })
            })
        })?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    match s1.dtype() {
        DType::F32 => run::<f32>(heads, p, s1, l1, s2, l2),
        DType::F16 => run::<f16>(heads, p, s1, l1, s2, l2),
        DType::BF16 => run::<bf16>(heads, p, s1, l1, s2, l2),
        dt => candle_core::bail!("decode_attention: unsupported dtype {dt:?}"),
    }
}

pub(super) fn advance_pos(s: &mut CudaStorage, l: &Layout, by: u32) -> Result<()> {
    let dev = s.device().clone();
    let func = dev.get_or_load_custom_func("advance_pos", "decode", ptx::DECODE)?;
    let slice = s.as_cuda_slice_mut::<u32>()?;
    let mut view = slice.slice_mut(l.start_offset()..l.start_offset() + 1);
    let mut b = func.builder();
    b.arg(&mut view).arg(&by);
    unsafe { b.launch(grid(1, 1, 1, 32, 0)) }.map_err(launch_err)?;
    Ok(())
}
