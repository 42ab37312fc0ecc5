//! CUDA launchers of `cuda/w4a4.cu`. Shapes and dtypes are validated in `w4a4.rs`.

use super::w4a4::{tma_tiles, wgmma_tiles, Matmul, Quantize, W4a4Kernel, H200_SMS};
use crate::formats::w4a4::blocks as nb;
use crate::formats::LinearWeights;
use crate::kernels::{contiguous_view, dtype_suffix, launch_params, raw_ptr, with_view};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{self, CUfunction_attribute_enum};
use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{DType, Layout, Result, Shape};
use half::{bf16, f16};

/// `QuantParams` of `cuda/w4a4.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct QuantParams {
    x: u64,
    res: u64,
    gamma: u64,
    perm: u64,
    sum: u64,
    act: u64,
    m: i32,
    k: i32,
    kn: i32,
    nb: i32,
    mode: i32,
    per_token: i32,
    eps: f32,
    clip4: f32,
    clip8: f32,
}

/// `GemmParams` of `cuda/w4a4.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct GemmParams {
    act: u64,
    w4: u64,
    w8: u64,
    sw: u64,
    y: u64,
    ws: u64,
    counters: u64,
    m: i32,
    n: i32,
    k: i32,
    kn: i32,
    k8w: i32,
    nb: i32,
    np: i32,
    splits: i32,
}

/// A `CUtensorMap` (`TensorMap` of `cuda/w4a4.cu`): 128 opaque bytes.
#[repr(C, align(128))]
#[derive(Debug, Clone, Copy)]
struct TensorMap([u64; 16]);

/// `TmaParams` of `cuda/w4a4.cu`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct TmaParams {
    act: TensorMap,
    w4: TensorMap,
    w8: TensorMap,
    sw: TensorMap,
    g: GemmParams,
}

/// Warp-specialized GEMM: 6 stages of 33 KiB (`TMA_STAGE`), plus 1 KiB to align the first.
const TMA_SMEM: u32 = 6 * 33792 + 1024;

/// A 2-D tiled tensor map over `rows` rows of `cols` elements of `elem` bytes, `stride`
/// bytes apart, read in boxes of `box_cols` × `box_rows` (out-of-bounds elements read as
/// zeros).
fn tensor_map(
    ptr: u64,
    elem: usize,
    (cols, rows, stride): (usize, usize, usize),
    (box_cols, box_rows): (u32, u32),
    swizzle_128: bool,
) -> Result<TensorMap> {
    use sys::{
        CUtensorMapDataType as D, CUtensorMapFloatOOBfill as O, CUtensorMapInterleave as I,
        CUtensorMapL2promotion as L, CUtensorMapSwizzle as S,
    };
    if !ptr.is_multiple_of(16) || !stride.is_multiple_of(16) || cols == 0 || rows == 0 {
        candle_core::bail!(
            "w4a4: tensor map over {rows} x {cols} elements ({stride}-byte rows at {ptr:#x}): \
             want a 16-byte aligned base and stride"
        )
    }
    let dtype = match elem {
        1 => D::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        2 => D::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        _ => candle_core::bail!("w4a4: tensor map of {elem}-byte elements"),
    };
    let dims = [cols as u64, rows as u64];
    let strides = [stride as u64];
    let boxes = [box_cols, box_rows];
    let ones = [1u32, 1];
    let mut map = TensorMap([0; 16]);
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map as *mut TensorMap as *mut sys::CUtensorMap,
            dtype,
            2,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            ones.as_ptr(),
            I::CU_TENSOR_MAP_INTERLEAVE_NONE,
            if swizzle_128 {
                S::CU_TENSOR_MAP_SWIZZLE_128B
            } else {
                S::CU_TENSOR_MAP_SWIZZLE_NONE
            },
            L::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            O::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        candle_core::bail!(
            "w4a4: cuTensorMapEncodeTiled over {rows} x {cols} ({stride}-byte rows, box \
             {box_cols} x {box_rows}): {r:?}"
        )
    }
    Ok(map)
}

/// Tiled GEMM: 3 stages of activation codes, weight codes (16 KiB each) and their scales.
const GEMM_SMEM: u32 = 3 * (2 * 16384 + 128 * 4 + 128 * 2);

/// Warpgroup GEMM (`WgTile` in the .cu file): 8 (one CTA per SM) or 4 (two) stages of 64
/// activation rows and 128 weight rows of 128 bytes and their scales, each stage rounded
/// up to 1 KiB (the swizzle's alignment), plus 1 KiB to align the first.
fn wgmma_smem(ctas_per_sm: usize) -> u32 {
    let stage = (64usize * 128 + 128 * 128 + 64 * 4 + 128 * 2).div_ceil(1024) * 1024;
    let stages = if ctas_per_sm == 1 { 8 } else { 4 };
    (stages * stage + 1024) as u32
}

/// Run `f` with the device address of the bytes `l` describes in `s` (any dtype).
fn with_bytes<R>(s: &CudaStorage, l: &Layout, f: impl FnOnce(u64) -> Result<R>) -> Result<R> {
    let stream = s.device().cuda_stream();
    macro_rules! go {
        ($t:ty) => {{
            let v = contiguous_view::<$t>(s, l, "act")?;
            let (p, _g) = raw_ptr(&v, &stream);
            f(p)
        }};
    }
    match s.dtype() {
        DType::U8 => go!(u8),
        DType::F32 => go!(f32),
        DType::F16 => go!(f16),
        DType::BF16 => go!(bf16),
        dt => candle_core::bail!("w4a4: activation buffer of dtype {dt:?}"),
    }
}

fn alloc_bytes(dev: &candle_core::CudaDevice, dt: DType, len: usize) -> Result<CudaStorage> {
    Ok(match dt {
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(len)? }, dev.clone()),
        DType::F16 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f16>(len)? }, dev.clone()),
        DType::BF16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<bf16>(len)? }, dev.clone())
        }
        dt => candle_core::bail!("w4a4: unsupported dtype {dt:?}"),
    })
}

pub(super) fn quantize(
    op: &Quantize,
    (s1, l1): (&CudaStorage, &Layout),
    (s2, l2): (&CudaStorage, &Layout),
    (s3, l3): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Shape)> {
    let dev = s1.device().clone();
    let stream = dev.cuda_stream();
    let dt = s1.dtype();
    let (spec, mode, m, eps) = (&op.spec, op.mode as i32, op.m, op.eps);
    let (sum_elems, len) = op.out_len(dt);
    let out = alloc_bytes(&dev, dt, len)?;
    let out_layout = Layout::contiguous(len);
    let name = format!("w4a4_quant_{}", dtype_suffix(dt)?);
    let func = crate::kernels::func(&dev, &name, &crate::kernels::modules::W4A4)?;
    let launch = |perm: u64| -> Result<()> {
        with_bytes(s1, l1, |x| {
            with_bytes(s2, l2, |res| {
                with_bytes(s3, l3, |gamma| {
                    with_bytes(&out, &out_layout, |o| {
                        let esz = dt.size_in_bytes() as u64;
                        let params = QuantParams {
                            x,
                            res,
                            gamma,
                            perm,
                            sum: o,
                            act: o + (sum_elems as u64) * esz,
                            m: m as i32,
                            k: spec.k as i32,
                            kn: spec.kn as i32,
                            nb: nb(spec.k) as i32,
                            mode,
                            per_token: spec.per_token as i32,
                            eps,
                            clip4: spec.clip4,
                            clip8: spec.clip8,
                        };
                        if m == 0 {
                            return Ok(());
                        }
                        // A warp per block of 128 channels (at most 32 warps).
                        let warps = nb(spec.k).clamp(1, 32) as u32;
                        let cfg = LaunchConfig {
                            grid_dim: (m as u32, 1, 1),
                            block_dim: (32 * warps, 1, 1),
                            shared_mem_bytes: 0,
                        };
                        unsafe { launch_params(&func, &stream, cfg, 0, &params) }
                    })
                })
            })
        })
    };
    match &spec.perm {
        Some(p) => with_view::<u32, _>(p, "perm", |v| {
            let (pp, _g) = raw_ptr(&v, &stream);
            launch(pp)
        })?,
        None => launch(0)?,
    }
    Ok((out, Shape::from(len)))
}

pub(super) fn matmul(op: &Matmul, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
    let dev = s.device().clone();
    let stream = dev.cuda_stream();
    let w = &op.w;
    let (n, k) = w.shape();
    let m = op.m;
    let out = alloc_bytes(&dev, op.dtype, m * n)?;
    let out_layout = Layout::contiguous(m * n);
    if m * n == 0 {
        return Ok((out, Shape::from((m, n))));
    }
    let suf = dtype_suffix(op.dtype)?;
    let (tiles, splits) = match op.kernel {
        W4a4Kernel::Wgmma { ctas_per_sm } => {
            let tiles = wgmma_tiles(m, n);
            (
                tiles,
                crate::kernels::split_k(tiles, nb(k), H200_SMS * ctas_per_sm, 4),
            )
        }
        W4a4Kernel::Tma => {
            let tiles = tma_tiles(m, n);
            (tiles, crate::kernels::split_k(tiles, nb(k), H200_SMS, 4))
        }
        _ => (0, 1),
    };
    // Split-k scratch floats per CTA: 256 threads × their 32 (wgmma) or 64 (tma) sums.
    let per_cta = if op.kernel == W4a4Kernel::Tma {
        256 * 64
    } else {
        128 * 64
    };
    let (name, cfg) = match op.kernel {
        W4a4Kernel::Skinny => (
            format!("w4a4_skinny_{suf}_m1"),
            LaunchConfig {
                grid_dim: (n.div_ceil(8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            },
        ),
        W4a4Kernel::Mma => (
            format!("w4a4_gemm_{suf}"),
            LaunchConfig {
                grid_dim: (n.div_ceil(128) as u32, m.div_ceil(128) as u32, 1),
                block_dim: (512, 1, 1),
                shared_mem_bytes: GEMM_SMEM,
            },
        ),
        W4a4Kernel::Wgmma { ctas_per_sm } => (
            format!("w4a4_wgmma_{suf}_x{ctas_per_sm}"),
            LaunchConfig {
                grid_dim: (n.div_ceil(128) as u32, m.div_ceil(64) as u32, splits as u32),
                block_dim: (256, 1, 1),
                shared_mem_bytes: wgmma_smem(ctas_per_sm),
            },
        ),
        W4a4Kernel::Tma => (
            format!("w4a4_tma_{suf}"),
            LaunchConfig {
                grid_dim: (
                    n.div_ceil(128) as u32,
                    m.div_ceil(128) as u32,
                    splits as u32,
                ),
                block_dim: (288, 1, 1),
                shared_mem_bytes: TMA_SMEM,
            },
        ),
    };
    // Split-k scratch: each CTA's f32 tile, and a zeroed arrival counter per tile.
    let scratch = if splits > 1 {
        let ws = unsafe { dev.alloc::<f32>(tiles * splits * per_cta)? };
        let counters = dev.alloc_zeros::<u32>(tiles)?;
        Some((ws, counters))
    } else {
        None
    };
    let func = crate::kernels::func(&dev, &name, &crate::kernels::modules::W4A4)?;
    if cfg.shared_mem_bytes > 48 * 1024 {
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            cfg.shared_mem_bytes as i32,
        )
        .map_err(candle_core::Error::wrap)?;
    }
    let launch = |w8: u64| -> Result<()> {
        with_bytes(s, l, |act| {
            with_view::<u8, _>(w.w4(), "w4", |w4| {
                with_view::<f16, _>(w.scales_t(), "scales_t", |sw| {
                    with_bytes(&out, &out_layout, |y| {
                        let ((w4p, _g1), (swp, _g2)) =
                            (raw_ptr(&w4, &stream), raw_ptr(&sw, &stream));
                        let (ws, counters, _g3) = match &scratch {
                            Some((ws, c)) => {
                                let (wp, g1) = raw_ptr(ws, &stream);
                                let (cp, g2) = raw_ptr(c, &stream);
                                (wp, cp, Some((g1, g2)))
                            }
                            None => (0, 0, None),
                        };
                        let params = GemmParams {
                            act,
                            w4: w4p,
                            w8,
                            sw: swp,
                            y,
                            ws,
                            counters,
                            m: m as i32,
                            n: n as i32,
                            k: k as i32,
                            kn: w.act().kn as i32,
                            k8w: w.k8w() as i32,
                            nb: nb(k) as i32,
                            np: w.scales_t().dim(1)? as i32,
                            splits: splits as i32,
                        };
                        if op.kernel != W4a4Kernel::Tma {
                            return unsafe { launch_params(&func, &stream, cfg, 0, &params) };
                        }
                        let k4 = k - w.k8w();
                        let np = params.np as usize;
                        let w4_map = tensor_map(w4p, 1, (k4 / 2, n, k4 / 2), (64, 128), false)?;
                        let tma = TmaParams {
                            act: tensor_map(act, 1, (k, m, k), (128, 128), true)?,
                            w4: w4_map,
                            w8: match w.k8w() {
                                0 => w4_map,
                                k8w => tensor_map(w8, 1, (k8w, n, k8w), (128, 128), false)?,
                            },
                            sw: tensor_map(swp, 2, (np, nb(k), 2 * np), (128, 1), false)?,
                            g: params,
                        };
                        unsafe { launch_params(&func, &stream, cfg, 0, &tma) }
                    })
                })
            })
        })
    };
    match w.w8() {
        Some(t) => with_view::<u8, _>(t, "w8", |v| {
            let (p, _g) = raw_ptr(&v, &stream);
            launch(p)
        })?,
        None => launch(0)?,
    }
    Ok((out, Shape::from((m, n))))
}
