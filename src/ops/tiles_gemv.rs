//! The one-token matmul of tiled low-bit weights (`w2416`, `int4` / `int2` in tiles) on
//! sm_90 builds: `tiles_gemv` (cuda/tiles_gemv.cu), where each warp streams its tiles, pair
//! after pair of row blocks, through a ring of shared-memory stages filled by bulk copies,
//! codes become f16 `base + q` by one lop3 per pair, and the scales, outliers and SiLU·mul
//! epilogue are applied as the skinny kernel (`super::tiles`) applies them. When it applies
//! ([`gemv_ok`]), how it splits a weight ([`gemv_plan`], chosen on the host), the launch.
//! `CANDLE_LOWBIT_TILES_GEMV=0` keeps one token on the skinny kernel.

use crate::formats::w2416::Tiles;

/// Whether one token takes the GEMV (`tiles_gemv`: each warp streams its tiles through a
/// shared-memory ring filled by bulk copies; sm_90 builds, weights 16-byte aligned) rather
/// than the skinny kernel; `CANDLE_LOWBIT_TILES_GEMV=0` keeps the skinny kernel (read once).
pub(super) fn gemv_ok(t: &Tiles) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = match GEMV_FORCE.with(|c| c.get()) {
        Some((ks, _)) => ks == 0,
        None => {
            *OFF.get_or_init(|| std::env::var("CANDLE_LOWBIT_TILES_GEMV").as_deref() == Ok("0"))
        }
    };
    !off && crate::kernels::wgmma_built() && t.bulk_aligned()
}

/// Whether the GEMV's default split of `t` fits a block's shared memory on `t`'s GPU (it
/// does but for very wide rows; where it does not, one token takes the skinny kernel).
pub(super) fn gemv_fits(t: &Tiles) -> bool {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = t.device() {
        let nc = crate::formats::w2416::tile_cols(t.k).div_ceil(GV_CH);
        return crate::kernels::sm_count(&d)
            .is_ok_and(|sms| gemv_plan((t.n / 32).div_ceil(2), nc, sms, None, 0).is_some());
    }
    let _ = t;
    false
}

thread_local! {
    static GEMV_FORCE: std::cell::Cell<Option<(usize, usize)>> = const { std::cell::Cell::new(None) };
}

/// For this thread: `Some((0, _))` keeps one token on the skinny kernel; `Some((ks, cl))`
/// (`ks` 1..=8) takes the GEMV with `ks` blocks per cluster and, where `cl > 0`, at most
/// `cl` clusters (each then takes several row-block pairs); `None` goes back to the
/// default. For tests and measurements.
#[doc(hidden)]
pub fn force_gemv(mode: Option<(usize, usize)>) {
    GEMV_FORCE.with(|c| c.set(mode.filter(|&(ks, _)| ks <= 8)));
}

/// Tile columns per chunk (`GV_CH` of cuda/tiles_gemv.cu): what one stage of a warp's ring
/// holds, and the unit of the host's split.
pub const GV_CH: usize = 4;

/// Stages of each computing warp's ring (`GV_STAGES`): chunks in flight.
pub const GV_STAGES: usize = 2;

/// Bytes of a stage (`GV_STAGE`): `GV_CH` tiles' codes at the 4-bit size and their scales.
const GV_STAGE: usize = GV_CH * (1024 + 128);

/// Warps of `tiles_gemv` (cuda/tiles_gemv.cu): 16 computing, 2 for the outliers.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const GV_THREADS: u32 = 18 * 32;

/// Static shared memory of `tiles_gemv` (its partial sums: f32 [2][18][32] and [2][2][32]),
/// which a block's dynamic shared memory must leave room for.
const GV_STATIC_SMEM: usize = 4 * (2 * 18 * 32 + 2 * 2 * 32);

/// Shared memory one block may have (sm_90).
const SMEM_PER_BLOCK: usize = 227 * 1024;

/// How `tiles_gemv` splits a weight: `ks` blocks per cluster (each a `ks`-th of the
/// columns), `parts` computing warps per row block, `ncl` clusters (each taking every
/// `ncl`-th row-block pair), and its dynamic shared memory.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemvPlan {
    pub ks: usize,
    pub parts: usize,
    pub ncl: usize,
    pub smem: usize,
}

/// Dynamic shared memory of `tiles_gemv` (the layout in cuda/tiles_gemv.cu): the warps'
/// rings (16 warps x [`GV_STAGES`] stages) and barriers, then for `c` columns x in
/// fragment order and its sums, `nb` buffers of two blocks' descriptors and the warps'
/// super scales (outlier entries are read from global memory).
fn gemv_smem(c: usize, nb: usize, parts: usize) -> usize {
    const WARPS: usize = 16;
    WARPS * GV_STAGES * (GV_STAGE + 8)
        + c * (128 + 16)
        + nb * 2 * c * 4
        + nb * WARPS * (c / (16 * parts) + 3) * 64
}

/// The split of `np` row-block pairs of `nc` chunks of [`GV_CH`] tile columns
/// over `sms` SMs (one block each): the least estimated time, counted in pairs per SM
/// (pairs per cluster times the widest block's share of a pair's chunks, over a rate that
/// falls when fewer than 8 warps per block compute), among splits whose shared memory fits,
/// whose blocks have at least two chunks each (one where `ks` is forced), and where a block
/// that takes several pairs gives each computing warp at least [`GV_STAGES`] chunks of a pair
/// (its ring's stages). `ks` forces the cluster size, `most > 0` caps the clusters (tests and
/// measurements); `None` where nothing fits (very wide rows).
#[doc(hidden)]
pub fn gemv_plan(
    np: usize,
    nc: usize,
    sms: usize,
    ks: Option<usize>,
    most: usize,
) -> Option<GemvPlan> {
    let mut best: Option<(f64, GemvPlan)> = None;
    // Chunks every block of a cluster must get: two, or one where the size is forced.
    let min_chunks = if ks.is_some() { 1 } else { 2 };
    for ks in ks.map_or(1..=8, |f| f..=f) {
        if ks > 1 && nc / ks < min_chunks {
            continue;
        }
        let ncl = (sms / ks).clamp(1, np.max(1));
        let ncl = if most > 0 { ncl.min(most) } else { ncl };
        let per = np.div_ceil(ncl);
        let (c, nb) = (GV_CH * nc.div_ceil(ks), if per > 1 { 2 } else { 1 });
        let fewest = nc / ks; // chunks of the block with the fewest
        let Some(parts) = [8, 4, 2, 1]
            .into_iter()
            .find(|&p| per == 1 || fewest / p >= GV_STAGES)
        else {
            continue;
        };
        let smem = gemv_smem(c, nb, parts);
        if smem + GV_STATIC_SMEM > SMEM_PER_BLOCK {
            continue;
        }
        let rate = match parts {
            8 => 1.0,
            4 => 0.75,
            2 => 0.5,
            _ => 0.3,
        };
        let cost = (per * nc.div_ceil(ks)) as f64 / nc.max(1) as f64 / rate;
        let plan = GemvPlan {
            ks,
            parts,
            ncl,
            smem,
        };
        if best.is_none_or(|(b, _)| cost < b - 1e-9) {
            best = Some((cost, plan));
        }
    }
    best.map(|(_, p)| p)
}

#[cfg(feature = "cuda")]
pub(super) use cuda::gemv;

#[cfg(feature = "cuda")]
mod cuda {
    use super::{gemv_plan, GEMV_FORCE, GV_CH, GV_THREADS};
    use crate::formats::w2416::Tiles;
    use crate::kernels::{contiguous_view, dptr, sm_count, Arg};
    use crate::ops::tiles::cuda::{
        gathered, launch_clustered, matmul, out_and_pairs, scale_tensors, variant, with_opt,
        with_output, with_weights,
    };
    use crate::ops::tiles::{env_override, Epi, Fuse};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
    use candle_core::cuda_backend::CudaStorage;
    use candle_core::{Layout, Result, Shape, Tensor};
    use half::f16;

    /// `t` is f16 with `len` values, or an error naming `what`.
    fn check_vector(t: &Tensor, len: usize, what: &str) -> Result<()> {
        if t.dtype() != candle_core::DType::F16 || t.elem_count() != len {
            candle_core::bail!(
                "tiles_gemv: {what} {:?} {:?} (want f16 with {len} values)",
                t.shape(),
                t.dtype()
            )
        }
        Ok(())
    }

    /// One token: `x` f16 `[1, k]` → y `[1, n]` (f16 or f32) or `[1, n / 2]` (SiLU·mul),
    /// by `tiles_gemv` (validated by `tiles_matmul`; sm_90 builds). `fuse`: the input is
    /// `rms_norm(x) · norm` and, for f16 output, `add` is added to y (see the kernel).
    pub(in crate::ops) fn gemv(
        t: &Tiles,
        epi: Epi,
        fuse: &Fuse,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
        let (m, k) = l.shape().dims2()?;
        if m != 1 {
            candle_core::bail!("tiles_gemv: x {:?} (want one row)", l.shape())
        }
        let (n, g) = (t.n, crate::formats::w2416::tile_cols(t.k));
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let x = contiguous_view::<f16>(s, l, "x")?;
        let (two, _, _, _, group) = scale_tensors(t);
        let (out_cols, pairs) = out_and_pairs(t, epi);
        let name = format!("tiles_gemv_{}", variant(two, epi));
        let func = crate::kernels::func(&dev, &name, &crate::kernels::modules::TILES_GEMV)?;
        let e = t.outliers.as_ref().map_or(0, |o| o.per_block);
        static KS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        let test = GEMV_FORCE.with(|c| c.get()).filter(|&(ks, _)| ks > 0);
        let forced = test
            .map(|(ks, _)| ks)
            .or_else(|| env_override(&KS, "CANDLE_LOWBIT_GEMV_KS", |v| (1..=8).contains(&v)));
        let most = test.map_or(0, |(_, cl)| cl);
        let Some(plan) = gemv_plan(pairs, g.div_ceil(GV_CH), sm_count(&dev)?, forced, most) else {
            // No split fits shared memory (very wide rows): the skinny kernel.
            if fuse.norm.is_some() || fuse.add.is_some() {
                candle_core::bail!(
                    "tiles_gemv: no split of [{n}, {k}] fits shared memory, and the skinny kernel \
                     has no fused norm or residual"
                )
            }
            return match gathered(t, s, l)? {
                Some((g, gl)) => matmul(t, epi, &g, &gl),
                None => matmul(t, epi, s, l),
            };
        };
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            plan.smem as i32,
        )
        .map_err(candle_core::Error::wrap)?;
        let ks = plan.ks;
        let cfg = LaunchConfig {
            grid_dim: ((plan.ncl * ks) as u32, 1, 1),
            block_dim: (GV_THREADS, 1, 1),
            shared_mem_bytes: plan.smem as u32,
        };
        if let Some((w, _)) = &fuse.norm {
            check_vector(w, k, "norm weight")?;
            if !k.is_multiple_of(2) {
                candle_core::bail!("tiles_gemv: a fused norm needs an even k, got {k}")
            }
        }
        if let Some(r) = &fuse.add {
            check_vector(r, n, "residual")?;
            if epi != Epi::F16 {
                candle_core::bail!("tiles_gemv: the residual is added to f16 outputs only")
            }
        }
        let eps = fuse.norm.as_ref().map_or(0.0, |(_, e)| *e);
        let launch = |out: Arg| -> Result<()> {
            with_weights(t, &stream, |wa| {
                with_opt::<f16, _>(
                    fuse.norm.as_ref().map(|(w, _)| w),
                    "norm weight",
                    &stream,
                    |np| {
                        with_opt::<f16, _>(fuse.add.as_ref(), "residual", &stream, |ap| {
                            let order = t.perm.as_ref().map(|p| &p.words);
                            with_opt::<u32, _>(order, "column order", &stream, |pp| {
                                let (xp, _gx) = dptr(&x, &stream);
                                let ints = [n, k, t.h4, e, group, ks, plan.parts]
                                    .map(|v| Arg::I32(v as i32));
                                let mut args = vec![xp];
                                args.extend(wa);
                                args.extend([pp, np, ap, Arg::F32(eps), out]);
                                args.extend(ints);
                                unsafe { launch_clustered(&func, &stream, cfg, ks, &args) }
                            })
                        })
                    },
                )
            })
        };
        let storage = with_output(&dev, epi, out_cols, launch)?;
        Ok((storage, Shape::from((1, out_cols))))
    }
}
