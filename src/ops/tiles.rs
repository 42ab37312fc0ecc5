//! Matmul and dequantize for tiled low-bit weights (`w2416`, and `int4` / `int2` in tiles;
//! layout: `src/formats/w2416.rs`, kernels: `cuda/tiles.cu`).
//!
//! One token (the decode step) on sm_90 builds takes the GEMV of `super::tiles_gemv`.
//! Otherwise on the GPU with f16 activations and `m <=` [`TILES_MAX_M`] rows, one launch: codes
//! turned into f16 `1024 + q` in registers for the tensor cores (weights as the mma's A
//! operand), each group's scale and zero applied once per row and tile, outliers added in
//! its epilogue (and, for the MLP's gate/up projection, SiLU·mul); above one row the
//! outliers read x transposed by a small kernel before it (`tiles_xt`). For `16 < m <=`
//! [`TILES_GEMM_MAX_M`] on sm_90a builds: a warpgroup-MMA GEMM (`tiles_gemm`: the weights
//! dequantized to f16 in registers as wgmma's A operand, the activations streamed through
//! shared memory, split-k where the grid would leave SMs idle), then, for layers with
//! sparse outliers, their products added onto y from x transposed (`tiles_outliers_add`).
//! Otherwise the weight is dequantized and candle's matmul (cuBLAS) runs, which is
//! faster at prefill sizes (`CANDLE_LOWBIT_TILES_GEMM=1` takes the GEMM at every `m > 16`,
//! `=0` at none). The CPU runs the reference ([`Tiles::dequantize_ref`] then a matmul in f32).

use super::contiguous_slice;
use super::tiles_gemv::{gemv_fits, gemv_ok};
use crate::formats::w2416::Tiles;
use crate::formats::{Epilogue, Plan, WeightFormat};
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// Most activation rows of the fused kernel.
pub const TILES_MAX_M: usize = 16;

/// Kernel epilogues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Epi {
    F16,
    F32,
    SiluMul,
}

/// Extra inputs of the one-token kernel (`super::tiles_gemv`): its input is
/// `rms_norm(x) · w` (`norm`: the weight `[k]` and eps), and `add` `[n]` is added to its f16
/// output (a residual).
#[derive(Debug, Clone, Default)]
pub(super) struct Fuse {
    pub norm: Option<(Tensor, f32)>,
    pub add: Option<Tensor>,
}

impl Fuse {
    fn is_empty(&self) -> bool {
        self.norm.is_none() && self.add.is_none()
    }
}

fn on_cuda(t: &Tiles) -> bool {
    t.device().is_cuda()
}

/// Whether the fused kernel takes `x`: GPU, f16, `1 <= m <= 16`, `k` the weight's.
fn kernel_ok(t: &Tiles, x: &Tensor) -> bool {
    let Ok((m, k)) = x.dims2() else { return false };
    on_cuda(t)
        && x.dtype() == DType::F16
        && (1..=TILES_MAX_M).contains(&m)
        && k == t.k
        && k <= TILES_MAX_K
}

/// Whether the large-m GEMM takes `x`: GPU, f16, `m >` [`TILES_MAX_M`] within
/// [`gemm_wanted`], `k` the weight's and a multiple of 8 (16-byte rows), an sm_90a build
/// (sparse outliers are added by a second kernel from x transposed).
fn gemm_ok(t: &Tiles, x: &Tensor) -> bool {
    let Ok((m, k)) = x.dims2() else { return false };
    on_cuda(t)
        && x.dtype() == DType::F16
        && m > TILES_MAX_M
        && k == t.k
        && k.is_multiple_of(8)
        && k <= TILES_MAX_K
        && crate::kernels::wgmma_built()
        && gemm_wanted(m)
}

/// Most activation rows the large-m GEMM takes by default. Measured on the H200 (Llama-2-7B
/// shapes, BENCHMARKS.md "Split-k"): at m = 17..128 it is 1.2-2.5x faster than dequantize +
/// cuBLAS (at m <= 64 as fast as cuBLAS on f16 weights), at m = 256 equal or slower, at
/// m = 2048 1.6-1.8x slower.
pub const TILES_GEMM_MAX_M: usize = 128;

/// Whether the large-m GEMM is wanted for `m > 16` rows: `m <=` [`TILES_GEMM_MAX_M`] unless
/// the environment says `CANDLE_LOWBIT_TILES_GEMM=1` (every m) or `=0` (none);
/// [`force_gemm_tokens`] takes it at every m.
fn gemm_wanted(m: usize) -> bool {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    if GEMM_TOKENS.with(|c| c.get()).is_some() {
        return true;
    }
    let mode = *MODE.get_or_init(
        || match std::env::var("CANDLE_LOWBIT_TILES_GEMM").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        },
    );
    mode.unwrap_or(m <= TILES_GEMM_MAX_M)
}

thread_local! {
    static GEMM_TOKENS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// Turns the large-m GEMM on at every `m > 16` for this thread with `bn` tokens per CTA (64
/// or 128); `None` goes back to the default ([`TILES_GEMM_MAX_M`], the host's width). For
/// tests and measurements.
#[doc(hidden)]
pub fn force_gemm_tokens(bn: Option<usize>) {
    GEMM_TOKENS.with(|c| c.set(bn.filter(|b| *b == 64 || *b == 128)));
}

/// Tokens per CTA of the large-m GEMM for `r` row blocks and `m` tokens on `sms` SMs: 128
/// (one CTA per SM) where that fills the GPU in no more waves than 64 (two per SM) would,
/// else 64. `CANDLE_LOWBIT_TILES_BN` or [`force_gemm_tokens`] override.
#[cfg(feature = "cuda")]
fn gemm_tokens(r: usize, m: usize, sms: usize) -> usize {
    if let Some(bn) = GEMM_TOKENS.with(|c| c.get()) {
        return bn;
    }
    static ENV: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    if let Some(bn) = env_override(&ENV, "CANDLE_LOWBIT_TILES_BN", |b| b == 64 || b == 128) {
        return bn;
    }
    let rows = r.div_ceil(4);
    let (c128, c64) = (rows * m.div_ceil(128), rows * m.div_ceil(64));
    if c128 >= sms && c128.div_ceil(sms) <= c64.div_ceil(2 * sms) {
        128
    } else {
        64
    }
}

/// A measuring override from the environment: `name` as a number where `ok` holds, read
/// once into `cell`.
#[cfg(feature = "cuda")]
pub(super) fn env_override(
    cell: &'static std::sync::OnceLock<Option<usize>>,
    name: &str,
    ok: impl Fn(usize) -> bool,
) -> Option<usize> {
    *cell.get_or_init(|| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v| ok(v))
    })
}

/// Widest rows of the fused kernel (its descriptors sit in shared memory; the outlier
/// entries' column field is 16 bits).
pub const TILES_MAX_K: usize = 65536;

/// The plan of a tiled layer.
pub fn tiles_plan(t: &Tiles, format: WeightFormat) -> Plan {
    if !on_cuda(t) {
        let why = || Err("the CPU runs the reference (dequantize + matmul)".to_string());
        return Plan {
            matmul: format!("{format}: reference dequantize + matmul on the CPU"),
            silu_mul: why(),
            f32_out: why(),
        };
    }
    let silu = if (t.n / 2).is_multiple_of(32) && t.n.is_multiple_of(64) {
        Ok(())
    } else {
        Err(format!(
            "gate/up rows {} are not two halves of whole 32-row blocks",
            t.n
        ))
    };
    let large = if !crate::kernels::wgmma_built() {
        "dequantize to f16 + cuBLAS above (no sm_90a build: no warpgroup-MMA GEMM)".to_string()
    } else if !t.k.is_multiple_of(8) {
        "dequantize to f16 + cuBLAS above (k not a multiple of 8)".to_string()
    } else {
        let (lo, hi) = (gemm_wanted(TILES_MAX_M + 1), gemm_wanted(usize::MAX));
        match (lo, hi) {
            (true, true) => "warpgroup-MMA GEMM above (CANDLE_LOWBIT_TILES_GEMM=1)".to_string(),
            (false, _) => {
                "dequantize to f16 + cuBLAS above (CANDLE_LOWBIT_TILES_GEMM=0)".to_string()
            }
            (true, false) => format!(
                "warpgroup-MMA GEMM (weights dequantized to f16 in registers, split-k on small \
                 grids) up to m = {TILES_GEMM_MAX_M}, dequantize to f16 + cuBLAS above \
                 (faster there)"
            ),
        }
    };
    let one = if gemv_ok(t) {
        "one token on the GEMV (tiles streamed by bulk copies into per-warp rings), "
    } else {
        ""
    };
    Plan {
        matmul: format!(
            "{format}: {one}tiled tensor-core kernel for f16 at m <= {TILES_MAX_M} (codes as f16 \
             1024 + q in registers, scales per row and tile), {large}"
        ),
        silu_mul: silu,
        f32_out: Ok(()),
    }
}

/// `x` `[m, k]` · Wᵀ → `[m, n]` in `x`'s dtype (f32, f16, bf16).
pub fn tiles_forward(t: &Tiles, x: &Tensor) -> Result<Tensor> {
    let (_, k) = x.dims2()?;
    if k != t.k {
        candle_core::bail!(
            "tiles: input {:?} for a [{}, {}] weight",
            x.shape(),
            t.n,
            t.k
        )
    }
    if kernel_ok(t, x) || gemm_ok(t, x) {
        return tiles_matmul(t, x, Epi::F16);
    }
    match x.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => {
            // The weight in the kernels' column order, x gathered into it (m × k values,
            // not the n × k of the weight).
            let w = tiles_dequantize(t, x.dtype())?;
            match &t.perm {
                Some(p) => x.index_select(&p.idx, 1)?.matmul(&w.t()?),
                None => x.matmul(&w.t()?),
            }
        }
        dt => candle_core::bail!("tiles: unsupported input dtype {dt:?} (f32, f16, bf16)"),
    }
}

/// The fused path `e` where it applies to `x`.
pub fn tiles_fused(t: &Tiles, e: Epilogue, x: &Tensor) -> Option<Result<Tensor>> {
    if !kernel_ok(t, x) {
        return None;
    }
    match e {
        Epilogue::F32Out => Some(tiles_matmul(t, x, Epi::F32)),
        Epilogue::SiluMul => {
            if !silu_ok(t) {
                return None;
            }
            Some(tiles_matmul(t, x, Epi::SiluMul))
        }
    }
}

/// Whether `m` rows of `dtype` take a norm in the kernel's prologue or a residual add in
/// its epilogue ([`tiles_normed`], [`tiles_add`]): the one-token f16 GEMV (GPU, sm_90 build,
/// `m` = 1); `CANDLE_LOWBIT_FUSE_NORM=0` turns both off (read once).
pub fn tiles_fuse_ok(t: &Tiles, m: usize, dtype: DType) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("CANDLE_LOWBIT_FUSE_NORM").as_deref() == Ok("0"));
    !off && dtype == DType::F16 && on_cuda(t) && m == 1 && gemv_ok(t) && gemv_fits(t)
}

/// `rms_norm(h) · w` (eps `eps`) times Wᵀ for one token `h` f16 `[1, k]`, with the SiLU·mul
/// epilogue where `silu`, in one launch: the norm is computed in the kernel's prologue
/// (rounded as `ops::add_rms_norm` rounds it). `None` where [`tiles_fuse_ok`] does not hold
/// (in particular on the CPU, whose reference is the unfused composition).
pub fn tiles_normed(
    t: &Tiles,
    h: &Tensor,
    w: &Tensor,
    eps: f32,
    silu: bool,
) -> Option<Result<Tensor>> {
    let m = h.dims2().ok()?.0;
    if !tiles_fuse_ok(t, m, h.dtype()) || (silu && !silu_ok(t)) {
        return None;
    }
    let epi = if silu { Epi::SiluMul } else { Epi::F16 };
    let fuse = Fuse {
        norm: Some((w.clone(), eps)),
        add: None,
    };
    Some(tiles_matmul_with(t, h, epi, fuse))
}

/// `x · Wᵀ + res` for one token (`x` f16 `[1, k]`, `res` f16 `[1, n]`), the residual added in
/// the kernel's epilogue (rounded as `ops::add_rms_norm` adds it). `None` where
/// [`tiles_fuse_ok`] does not hold.
pub fn tiles_add(t: &Tiles, x: &Tensor, res: &Tensor) -> Option<Result<Tensor>> {
    let m = x.dims2().ok()?.0;
    if !tiles_fuse_ok(t, m, x.dtype()) {
        return None;
    }
    let fuse = Fuse {
        norm: None,
        add: Some(res.clone()),
    };
    Some(tiles_matmul_with(t, x, Epi::F16, fuse))
}

fn silu_ok(t: &Tiles) -> bool {
    (t.n / 2).is_multiple_of(32) && t.n.is_multiple_of(64)
}

/// The kernels, validated: `x` f16 `[m <= 16, k]` on the GPU, or (plain f16 output) any
/// `m` where the large-m GEMM applies.
fn tiles_matmul(t: &Tiles, x: &Tensor, epi: Epi) -> Result<Tensor> {
    tiles_matmul_with(t, x, epi, Fuse::default())
}

/// [`tiles_matmul`] with the one-token kernel's extra inputs (`fuse`: one row only).
fn tiles_matmul_with(t: &Tiles, x: &Tensor, epi: Epi, fuse: Fuse) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let skinny = (1..=TILES_MAX_M).contains(&m);
    if x.dtype() != DType::F16
        || !(skinny || (epi == Epi::F16 && gemm_ok(t, x)))
        || k != t.k
        || k > TILES_MAX_K
    {
        candle_core::bail!(
            "tiles_matmul: x {:?} {:?} (want f16 [1..={TILES_MAX_M}, {}], or more rows with k a \
             multiple of 8 on an sm_90a build; k <= {TILES_MAX_K})",
            x.shape(),
            x.dtype(),
            t.k
        )
    }
    if !fuse.is_empty() && m != 1 {
        candle_core::bail!("tiles_matmul: a fused norm or residual takes one row, got {m}")
    }
    x.contiguous()?.apply_op1_no_bwd(&TilesMatmul {
        tiles: t.clone(),
        epi,
        fuse,
    })
}

/// The weight `[n, k]` in `dtype` (f32, f16 or bf16), its columns in the kernels' order
/// (reordered tiles: `Tiles::dequantize` gives the input's).
pub fn tiles_dequantize(t: &Tiles, dtype: DType) -> Result<Tensor> {
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        candle_core::bail!("tiles_dequantize: unsupported output dtype {dtype:?}")
    }
    t.codes.apply_op1_no_bwd(&TilesDequantize {
        tiles: t.clone(),
        dtype,
    })
}

fn to_storage(v: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(v),
        DType::F16 => CpuStorage::F16(v.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(v.into_iter().map(bf16::from_f32).collect()),
        dt => candle_core::bail!("tiles: unsupported dtype {dt:?}"),
    })
}

struct TilesMatmul {
    tiles: Tiles,
    epi: Epi,
    fuse: Fuse,
}

impl CustomOp1 for TilesMatmul {
    fn name(&self) -> &'static str {
        "tiles-matmul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        if !self.fuse.is_empty() {
            candle_core::bail!("tiles_matmul: a fused norm or residual runs on the GPU only")
        }
        let (m, k) = l.shape().dims2()?;
        let n = self.tiles.n;
        let x: Vec<f32> = match s {
            CpuStorage::F16(_) => contiguous_slice::<f16>(s, l, "x")?
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            _ => candle_core::bail!("tiles_matmul: x must be f16"),
        };
        // Columns in the tiles' order of the input channels.
        let x = match &self.tiles.perm {
            Some(p) => {
                let o = p.order()?;
                (0..m * k)
                    .map(|i| x[(i / k) * k + o[i % k] as usize])
                    .collect()
            }
            None => x,
        };
        let w = self.tiles.dequantize_ref()?;
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for r in 0..n {
                y[i * n + r] = (0..k).map(|j| x[i * k + j] * w[r * k + j]).sum();
            }
        }
        match self.epi {
            Epi::F16 => Ok((to_storage(y, DType::F16)?, Shape::from((m, n)))),
            Epi::F32 => Ok((CpuStorage::F32(y), Shape::from((m, n)))),
            Epi::SiluMul => {
                let h = n / 2;
                let r16 = |v: f32| f16::from_f32(v).to_f32();
                let out = (0..m * h)
                    .map(|idx| {
                        let (i, c) = (idx / h, idx % h);
                        let (g, u) = (r16(y[i * n + c]), r16(y[i * n + h + c]));
                        f16::from_f32(r16(g / (1.0 + (-g).exp())) * u)
                    })
                    .collect();
                Ok((CpuStorage::F16(out), Shape::from((m, h))))
            }
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let m = l.shape().dims2()?.0;
        if m == 1 && gemv_ok(&self.tiles) {
            // The GEMV reads x through the column order itself.
            return super::tiles_gemv::gemv(&self.tiles, self.epi, &self.fuse, s, l);
        }
        if !self.fuse.is_empty() {
            candle_core::bail!(
                "tiles_matmul: a fused norm or residual needs the one-token GEMV (m = 1, sm_90 build)"
            )
        }
        let gathered = cuda::gathered(&self.tiles, s, l)?;
        let (s, l) = gathered.as_ref().map_or((s, l), |(g, gl)| (g, gl));
        if m > super::TILES_MAX_M {
            return cuda::gemm(&self.tiles, s, l);
        }
        cuda::matmul(&self.tiles, self.epi, s, l)
    }
}

struct TilesDequantize {
    tiles: Tiles,
    dtype: DType,
}

impl CustomOp1 for TilesDequantize {
    fn name(&self) -> &'static str {
        "tiles-dequantize"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        let w = self.tiles.dequantize_ref()?;
        Ok((
            to_storage(w, self.dtype)?,
            Shape::from((self.tiles.n, self.tiles.k)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::dequantize(&self.tiles, self.dtype)
    }
}

#[cfg(feature = "cuda")]
pub(super) mod cuda {
    use super::{Epi, Tiles};
    use crate::formats::w2416::TileScales;
    use crate::kernels::{
        contiguous_view, dptr, launch_pdl, launch_pdl_cluster, sm_count, with_view, Arg,
    };
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, SyncOnDrop,
    };
    use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
    use candle_core::{DType, Layout, Result, Shape, Tensor};
    use half::{bf16, f16};

    /// Warps per block of `tiles_mm` (TILES_NW) and threads per block of the kernels.
    const WARPS: usize = 4;
    const THREADS: u32 = 128;

    /// Blocks per cluster (1 to 8): as many as fit one wave of resident blocks (`per_sm`, the
    /// kernel's occupancy: its registers and shared memory), with every warp at least two
    /// tile columns (`CANDLE_LOWBIT_TILES_KS` overrides, for measuring).
    fn cluster(pairs: usize, g: usize, sms: usize, per_sm: usize) -> usize {
        static KS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        if let Some(ks) =
            super::env_override(&KS, "CANDLE_LOWBIT_TILES_KS", |v| (1..=8).contains(&v))
        {
            return ks;
        }
        let wave = per_sm.max(1) * sms / pairs.max(1);
        let columns = g / (WARPS * 2);
        wave.min(columns).clamp(1, 8)
    }

    /// Resident blocks per SM of a `tiles_mm` variant (its registers and shared memory, `smem`
    /// bytes of it dynamic), asked of the driver once per kernel name and size (one GPU model
    /// per process assumed; another GPU gets the first one's figure, which only changes the
    /// cluster size chosen).
    fn occupancy(name: &str, func: &CudaFunction, smem: usize) -> Result<usize> {
        use std::collections::HashMap;
        use std::sync::Mutex;
        static CACHE: Mutex<Option<HashMap<String, HashMap<usize, usize>>>> = Mutex::new(None);
        let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        let map = cache.get_or_insert_with(HashMap::new);
        if let Some(&n) = map.get(name).and_then(|by_smem| by_smem.get(&smem)) {
            return Ok(n);
        }
        let n = func
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)
            .map_err(candle_core::Error::wrap)? as usize;
        map.entry(name.to_string()).or_default().insert(smem, n);
        Ok(n)
    }

    /// The scale tensors as kernel arguments: (two-level?, sc, supers, plain, group).
    pub(in crate::ops) fn scale_tensors(
        t: &Tiles,
    ) -> (
        bool,
        Option<&Tensor>,
        Option<&Tensor>,
        Option<&Tensor>,
        usize,
    ) {
        match &t.scales {
            TileScales::TwoLevel { codes, supers } => (true, Some(codes), Some(supers), None, 64),
            TileScales::Plain { group, sz } => (false, None, None, Some(sz), *group),
        }
    }

    type Stream = std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>;

    /// Device address of an optional tensor (0 where absent), with its guard kept by `f`.
    pub(in crate::ops) fn with_opt<T: CudaDType + DeviceRepr, R>(
        t: Option<&Tensor>,
        what: &str,
        stream: &Stream,
        f: impl FnOnce(Arg) -> Result<R>,
    ) -> Result<R> {
        match t {
            None => f(Arg::Ptr(0)),
            Some(t) => with_view::<T, R>(t, what, |v| {
                let (p, _g) = dptr(&v, stream);
                f(p)
            }),
        }
    }

    /// `x` f16 (`s`, `l`: `[m, k]`, contiguous) with its columns in the tiles' order of the
    /// input channels (`tiles_gather`), where the tiles are reordered, else `None`. No host
    /// data travels with the launch: CUDA-graph safe.
    pub(in crate::ops) fn gathered(
        t: &Tiles,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<Option<(CudaStorage, Layout)>> {
        let Some(p) = &t.perm else { return Ok(None) };
        let (m, k) = l.shape().dims2()?;
        if k != t.k || !k.is_multiple_of(2) {
            candle_core::bail!(
                "tiles_gather: x {:?} for a [{}, {}] weight (k even)",
                l.shape(),
                t.n,
                t.k
            )
        }
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let x = contiguous_view::<f16>(s, l, "x")?;
        let func = crate::kernels::func(&dev, "tiles_gather", &crate::kernels::modules::TILES)?;
        let y = unsafe { dev.alloc::<f16>(m * k)? };
        let cfg = LaunchConfig {
            grid_dim: ((m * k / 2).div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        with_opt::<u32, _>(Some(&p.words), "column order", &stream, |pp| {
            let ((xp, _g1), (yp, _g2)) = (dptr(&x, &stream), dptr(&y, &stream));
            let ints = [m, k].map(|v| Arg::I32(v as i32));
            unsafe { launch_pdl(&func, &stream, cfg, &[xp, pp, yp, ints[0], ints[1]]) }
        })?;
        Ok(Some((
            CudaStorage::wrap_cuda_slice(y, dev),
            Layout::contiguous((m, k)),
        )))
    }

    /// Weight arguments: codes, desc, sc, supers, plain, entries, row_end.
    pub(in crate::ops) fn with_weights<R>(
        t: &Tiles,
        stream: &Stream,
        f: impl FnOnce([Arg; 7]) -> Result<R>,
    ) -> Result<R> {
        let (_, sc, sup, plain, _) = scale_tensors(t);
        let (ent, rend) = match &t.outliers {
            Some(o) => (Some(&o.entries), Some(&o.row_end)),
            None => (None, None),
        };
        with_opt::<u32, R>(Some(&t.codes), "codes", stream, |codes| {
            with_opt::<u32, R>(Some(&t.desc), "desc", stream, |desc| {
                with_opt::<u8, R>(sc, "scales", stream, |sc| {
                    with_opt::<f16, R>(sup, "supers", stream, |sup| {
                        with_opt::<f16, R>(plain, "scales", stream, |plain| {
                            with_opt::<u32, R>(ent, "entries", stream, |ent| {
                                with_opt::<u32, R>(rend, "row_end", stream, |rend| {
                                    f([codes, desc, sc, sup, plain, ent, rend])
                                })
                            })
                        })
                    })
                })
            })
        })
    }

    /// The device address of an optional buffer (0 where absent) and its guard.
    fn opt_ptr<'a>(
        b: Option<&'a CudaSlice<f16>>,
        stream: &'a Stream,
    ) -> (Arg, Option<SyncOnDrop<'a>>) {
        match b {
            Some(b) => {
                let (p, g) = dptr(b, stream);
                (p, Some(g))
            }
            None => (Arg::Ptr(0), None),
        }
    }

    /// `x` f16 `[m, k]` transposed to f16 `[k][mt]` (`tiles_xt`; `mt` a multiple of 8 and
    /// `>= m`, tokens past m zero): each column's activations contiguous, for the outliers.
    fn transpose_x(
        dev: &CudaDevice,
        stream: &Stream,
        x: &CudaView<'_, f16>,
        m: usize,
        k: usize,
        mt: usize,
    ) -> Result<CudaSlice<f16>> {
        if !mt.is_multiple_of(8) || mt < m {
            candle_core::bail!(
                "tiles_xt: {mt} token slots for {m} tokens (want a multiple of 8, >= m)"
            )
        }
        let func = crate::kernels::func(dev, "tiles_xt", &crate::kernels::modules::TILES)?;
        let xt = unsafe { dev.alloc::<f16>(k * mt)? };
        let cfg = LaunchConfig {
            grid_dim: ((k * mt / 8).div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        {
            let ((xp, _g1), (tp, _g2)) = (dptr(x, stream), dptr(&xt, stream));
            let ints = [m, k, mt].map(|v| Arg::I32(v as i32));
            unsafe { launch_pdl(&func, stream, cfg, &[xp, tp, ints[0], ints[1], ints[2]])? };
        }
        Ok(xt)
    }

    pub(in crate::ops) fn matmul(
        t: &Tiles,
        epi: Epi,
        s: &CudaStorage,
        l: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        let (n, g) = (t.n, crate::formats::w2416::tile_cols(t.k));
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let x = contiguous_view::<f16>(s, l, "x")?;
        let (two, _, _, _, group) = scale_tensors(t);
        let (out_cols, pairs) = out_and_pairs(t, epi);
        let name = format!(
            "tiles_mm_{}_m{}",
            variant(two, epi),
            if m <= 8 { 8 } else { 16 }
        );
        let func = crate::kernels::func(&dev, &name, &crate::kernels::modules::TILES)?;
        // Dynamic shared memory: the two row blocks' tile descriptors, u32 [2][g].
        let smem = 2 * g * 4;
        let per_sm = occupancy(&name, &func, smem)?;
        let ks = cluster(pairs, g, sm_count(&dev)?, per_sm);
        let e = t.outliers.as_ref().map_or(0, |o| o.per_block);
        // Above one token the outliers read their activations from x transposed.
        let xt = if e > 0 && m > 1 {
            Some(transpose_x(
                &dev,
                &stream,
                &x,
                m,
                k,
                if m <= 8 { 8 } else { 16 },
            )?)
        } else {
            None
        };
        let cfg = LaunchConfig {
            grid_dim: ((pairs * ks) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let launch = |out: Arg| -> Result<()> {
            with_weights(t, &stream, |wa| {
                let (xp, _gx) = dptr(&x, &stream);
                let (xtp, _gt) = opt_ptr(xt.as_ref(), &stream);
                let ints = [m, n, k, t.h4, e, group, ks].map(|v| Arg::I32(v as i32));
                let mut args = vec![xp];
                args.extend(wa);
                args.extend([xtp, out]);
                args.extend(ints);
                unsafe { launch_clustered(&func, &stream, cfg, ks, &args) }
            })
        };
        let storage = with_output(&dev, epi, m * out_cols, launch)?;
        Ok((storage, Shape::from((m, out_cols))))
    }

    /// Output columns and row-block pairs of a launch: SiLU·mul pairs gate block p with up
    /// block p + R/2 and writes half the rows; the others pair 2p and 2p + 1.
    pub(in crate::ops) fn out_and_pairs(t: &Tiles, epi: Epi) -> (usize, usize) {
        let (n, r) = (t.n, t.n / 32);
        match epi {
            Epi::SiluMul => (n / 2, r / 2),
            _ => (n, r.div_ceil(2)),
        }
    }

    /// A kernel variant's name part: its scales (`two` / `plain`) and epilogue.
    pub(in crate::ops) fn variant(two: bool, epi: Epi) -> String {
        let e = match epi {
            Epi::F16 => "f16",
            Epi::F32 => "f32",
            Epi::SiluMul => "silu",
        };
        format!("{}_{e}", if two { "two" } else { "plain" })
    }

    /// Launches with clusters of `ks` blocks along x where `ks > 1`.
    ///
    /// # Safety
    /// As [`launch_pdl`].
    pub(in crate::ops) unsafe fn launch_clustered(
        func: &CudaFunction,
        stream: &Stream,
        cfg: LaunchConfig,
        ks: usize,
        args: &[Arg],
    ) -> Result<()> {
        if ks > 1 {
            launch_pdl_cluster(func, stream, cfg, ks as u32, args)
        } else {
            launch_pdl(func, stream, cfg, args)
        }
    }

    /// `len` outputs (f32 for the f32 epilogue, else f16), written by `launch` given their
    /// device address.
    pub(in crate::ops) fn with_output(
        dev: &CudaDevice,
        epi: Epi,
        len: usize,
        launch: impl FnOnce(Arg) -> Result<()>,
    ) -> Result<CudaStorage> {
        let stream = dev.cuda_stream();
        Ok(if epi == Epi::F32 {
            let out = unsafe { dev.alloc::<f32>(len)? };
            {
                let (op, _g) = dptr(&out, &stream);
                launch(op)?;
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        } else {
            let out = unsafe { dev.alloc::<f16>(len)? };
            {
                let (op, _g) = dptr(&out, &stream);
                launch(op)?;
            }
            CudaStorage::wrap_cuda_slice(out, dev.clone())
        })
    }

    /// Shared memory of a `tiles_gemm` variant (`TgTile` in the .cu file): its stages (6 of
    /// 128 tokens, or 4 of 64), the descriptors of its 4 row blocks, 1 KiB to align.
    fn gemm_smem(bn: usize, g: usize) -> usize {
        let stage = (bn * 128 + 4096 + 512).div_ceil(1024) * 1024;
        let stages = if bn == 128 { 6 } else { 4 };
        stages * stage + 16 * g + 1024
    }

    /// Split-k count of the large-m GEMM (`CANDLE_LOWBIT_TILES_SPLITS` overrides, 1..=8, for
    /// measuring; never more than a quarter of the tile columns).
    fn gemm_splits(tiles: usize, g: usize, slots: usize) -> usize {
        static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        match super::env_override(&FORCED, "CANDLE_LOWBIT_TILES_SPLITS", |v| {
            (1..=8).contains(&v)
        }) {
            Some(s) => s.min((g / 4).max(1)),
            None => crate::kernels::split_k(tiles, g, slots, 4),
        }
    }

    /// The large-m GEMM: `x` f16 `[m, k]` (validated by `tiles_matmul`) → y f16 `[m, n]`.
    pub(super) fn gemm(t: &Tiles, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
        let (m, k) = l.shape().dims2()?;
        let (n, r, g) = (t.n, t.n / 32, crate::formats::w2416::tile_cols(t.k));
        let dev = s.device().clone();
        let stream = dev.cuda_stream();
        let x = contiguous_view::<f16>(s, l, "x")?;
        let (two, _, _, _, group) = scale_tensors(t);
        let bn = super::gemm_tokens(r, m, sm_count(&dev)?);
        let name = format!("tiles_gemm_{}_bn{bn}", if two { "two" } else { "plain" });
        let func = crate::kernels::func(&dev, &name, &crate::kernels::modules::TILES)?;
        let smem = gemm_smem(bn, g);
        func.set_attribute(
            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(candle_core::Error::wrap)?;
        // Split-k where the row blocks x token tiles leave SMs idle (the kernel's occupancy:
        // one CTA per SM at 128 tokens, two at 64), at least 4 tile columns per split; f32 partials in `ws`, a
        // zeroed arrival counter per tile (the kernel leaves it zero).
        let tiles = r.div_ceil(4) * m.div_ceil(bn);
        let per_sm = func
            .occupancy_max_active_blocks_per_multiprocessor(256, smem, None)
            .map_err(candle_core::Error::wrap)?
            .max(1) as usize;
        let splits = gemm_splits(tiles, g, sm_count(&dev)? * per_sm);
        let cfg = LaunchConfig {
            grid_dim: (r.div_ceil(4) as u32, m.div_ceil(bn) as u32, splits as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let scratch = if splits > 1 {
            let ws = unsafe { dev.alloc::<f32>(tiles * splits * 256 * (bn / 2))? };
            Some((ws, dev.alloc_zeros::<u32>(tiles)?))
        } else {
            None
        };
        // Sparse outliers: x transposed before the GEMM, their products added onto y after it.
        let e = t.outliers.as_ref().map_or(0, |o| o.per_block);
        let mt = m.div_ceil(8) * 8;
        let xt = if e > 0 {
            Some(transpose_x(&dev, &stream, &x, m, k, mt)?)
        } else {
            None
        };
        let out = unsafe { dev.alloc::<f16>(m * n)? };
        {
            let (op, _g) = dptr(&out, &stream);
            let (wsp, cp, _g1, _g2) = match &scratch {
                Some((ws, c)) => {
                    let ((a, g1), (b, g2)) = (dptr(ws, &stream), dptr(c, &stream));
                    (a, b, Some(g1), Some(g2))
                }
                None => (Arg::Ptr(0), Arg::Ptr(0), None, None),
            };
            with_weights(t, &stream, |wa| {
                let (xp, _gx) = dptr(&x, &stream);
                let ints = [m, n, k, t.h4, group, splits].map(|v| Arg::I32(v as i32));
                let mut args = vec![xp];
                args.extend(&wa[..5]);
                args.extend([op, wsp, cp]);
                args.extend(ints);
                unsafe { launch_pdl(&func, &stream, cfg, &args) }
            })?;
            if let Some(xt) = &xt {
                let add = crate::kernels::func(
                    &dev,
                    "tiles_outliers_add",
                    &crate::kernels::modules::TILES,
                )?;
                // TILES_ADD_SPLITS (8) warps per row block and 8 tokens.
                let cfg = LaunchConfig {
                    grid_dim: (r as u32, (mt / 8) as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                with_weights(t, &stream, |wa| {
                    let (tp, _gt) = dptr(xt, &stream);
                    let ints = [m, n, e, mt].map(|v| Arg::I32(v as i32));
                    let args = [tp, wa[5], wa[6], op, ints[0], ints[1], ints[2], ints[3]];
                    unsafe { launch_pdl(&add, &stream, cfg, &args) }
                })?;
            }
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((m, n)),
        ))
    }

    pub(super) fn dequantize(t: &Tiles, dtype: DType) -> Result<(CudaStorage, Shape)> {
        fn run<T: CudaDType + DeviceRepr>(t: &Tiles, suf: &str) -> Result<CudaStorage> {
            let dev = match t.codes.device() {
                candle_core::Device::Cuda(d) => d.clone(),
                _ => candle_core::bail!("tiles: codes must be on the GPU"),
            };
            let stream = dev.cuda_stream();
            let (n, k) = (t.n, t.k);
            let (two, _, _, _, group) = scale_tensors(t);
            let out = unsafe { dev.alloc::<T>(n * k)? };
            let tiles = (n / 32) * crate::formats::w2416::tile_cols(k);
            let name = format!(
                "tiles_dequantize_{}_{suf}",
                if two { "two" } else { "plain" }
            );
            let func = crate::kernels::func(&dev, &name, &crate::kernels::modules::TILES)?;
            let cfg = LaunchConfig {
                grid_dim: (tiles.div_ceil(THREADS as usize / 32) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            {
                let (op, _g) = dptr(&out, &stream);
                with_weights(t, &stream, |wa| {
                    let ints = [n, k, t.h4, group].map(|v| Arg::I32(v as i32));
                    let args = [
                        wa[0], wa[1], wa[2], wa[3], wa[4], op, ints[0], ints[1], ints[2], ints[3],
                    ];
                    unsafe { launch_pdl(&func, &stream, cfg, &args) }
                })?;
                if let Some(o) = &t.outliers {
                    let f2 = crate::kernels::func(
                        &dev,
                        &format!("tiles_add_outliers_{suf}"),
                        &crate::kernels::modules::TILES,
                    )?;
                    let cfg2 = LaunchConfig {
                        grid_dim: (n.div_ceil(THREADS as usize / 32) as u32, 1, 1),
                        block_dim: (THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    with_weights(t, &stream, |wa| {
                        let ints = [n, k, o.per_block].map(|v| Arg::I32(v as i32));
                        let args = [wa[5], wa[6], op, ints[0], ints[1], ints[2]];
                        unsafe { launch_pdl(&f2, &stream, cfg2, &args) }
                    })?;
                }
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let st = match dtype {
            DType::F32 => run::<f32>(t, "f32")?,
            DType::F16 => run::<f16>(t, "f16")?,
            DType::BF16 => run::<bf16>(t, "bf16")?,
            dt => candle_core::bail!("tiles_dequantize: unsupported output dtype {dt:?}"),
        };
        Ok((st, Shape::from((t.n, t.k))))
    }
}
