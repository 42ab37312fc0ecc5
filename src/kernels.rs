//! Kernels built from `cuda/*.cu` (cuda feature only: PTX, and a cubin of each made by
//! ptxas at build time) and launch helpers shared by the ops.

#[cfg(feature = "cuda")]
pub mod ptx {
    include!(concat!(env!("OUT_DIR"), "/ptx.rs"));
}

/// One kernel file of `cuda/`: its PTX and the cubin ptxas made of it for the PTX's own
/// target (sm_90a where `CUDA_COMPUTE_CAP` is 90).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy)]
pub struct Module {
    /// The file's stem (`tiles_gemv` for `cuda/tiles_gemv.cu`).
    pub name: &'static str,
    pub ptx: &'static str,
    pub cubin: &'static [u8],
}

/// Every kernel file as a [`Module`], named as in [`ptx`] (`modules::TILES_GEMV`).
#[cfg(feature = "cuda")]
pub mod modules {
    use super::Module;
    include!(concat!(env!("OUT_DIR"), "/modules.rs"));
}

#[cfg(feature = "cuda")]
pub use cuda::*;

/// Whether the kernels were built for sm_90a, so that their warpgroup-MMA (wgmma) kernels
/// are real rather than traps (every `cuda/*.cu` is built with the same target; read once).
pub fn wgmma_built() -> bool {
    #[cfg(feature = "cuda")]
    {
        static BUILT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *BUILT.get_or_init(|| ptx::W4A4.contains(".target sm_90a"))
    }
    #[cfg(not(feature = "cuda"))]
    false
}

/// Split-k count for a grid of `tiles` CTAs over `units` k steps with `slots` CTAs resident
/// at once: 1 where the tiles alone fill two waves, else the count (at most 8, at least
/// `min_units` steps each) that minimizes waves per unit of work, ties to fewer.
pub fn split_k(tiles: usize, units: usize, slots: usize, min_units: usize) -> usize {
    let slots = slots.max(1);
    if tiles >= 2 * slots {
        return 1;
    }
    let cost = |s: usize| (tiles * s).div_ceil(slots) as f64 / s as f64;
    (1..=8usize)
        .filter(|&s| s == 1 || units / s >= min_units)
        .fold(
            1,
            |best, s| if cost(s) < cost(best) - 1e-9 { s } else { best },
        )
}

/// `(free, total)` bytes of the device's memory; `None` on the CPU (or without the cuda
/// feature).
pub fn device_memory(dev: &candle_core::Device) -> candle_core::Result<Option<(usize, usize)>> {
    match dev {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(c) => c
            .cuda_stream()
            .context()
            .mem_get_info()
            .map(Some)
            .map_err(candle_core::Error::wrap),
        _ => Ok(None),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use candle_core::cuda_backend::cudarc::driver::{
        sys, CudaFunction, CudaSlice, CudaStream, CudaView, DevicePtr, DeviceRepr, LaunchConfig,
        SyncOnDrop,
    };
    use candle_core::cuda_backend::{CudaDType, CudaStorage};
    use candle_core::{Layout, Result};
    use std::ffi::c_void;

    /// Run `f` with a contiguous device view of `t` (which must live on the GPU), naming
    /// `what` in the errors.
    pub fn with_view<T: CudaDType + DeviceRepr, R>(
        t: &candle_core::Tensor,
        what: &str,
        f: impl FnOnce(CudaView<'_, T>) -> Result<R>,
    ) -> Result<R> {
        let (st, l) = t.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*st else {
            candle_core::bail!("{what} must be on the GPU")
        };
        f(contiguous_view::<T>(cs, l, what)?)
    }

    /// The contiguous view of `storage` that `layout` describes, or an error naming `what`.
    pub fn contiguous_view<'a, T: CudaDType + DeviceRepr>(
        storage: &'a CudaStorage,
        layout: &Layout,
        what: &str,
    ) -> Result<CudaView<'a, T>> {
        let slice: &CudaSlice<T> = storage.as_cuda_slice::<T>()?;
        match layout.contiguous_offsets() {
            Some((start, end)) => Ok(slice.slice(start..end)),
            None => candle_core::bail!("{what} must be contiguous, got layout {layout:?}"),
        }
    }

    /// Kernel `name` of `module` on `dev`'s context. The module is loaded once per context
    /// (later calls find it in a cache): from its cubin, so that no run waits on the driver
    /// compiling PTX, or from its PTX where the driver refuses the cubin (another GPU
    /// architecture, an older driver), which it then compiles as before.
    pub fn func(
        dev: &candle_core::CudaDevice,
        name: &str,
        module: &super::Module,
    ) -> Result<CudaFunction> {
        use candle_core::cuda_backend::cudarc::driver::CudaModule;
        use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
        use std::sync::{Arc, Mutex};
        type Loaded = Vec<(usize, &'static str, Arc<CudaModule>)>;
        static LOADED: Mutex<Loaded> = Mutex::new(Vec::new());
        let ctx = dev.cuda_stream().context().clone();
        let key = ctx.cu_ctx() as usize;
        let m = {
            let mut loaded = LOADED
                .lock()
                .map_err(|_| candle_core::Error::Msg("kernel module cache poisoned".into()))?;
            match loaded
                .iter()
                .find(|(c, n, _)| *c == key && *n == module.name)
            {
                Some((_, _, m)) => m.clone(),
                None => {
                    let m = ctx
                        .load_module(Ptx::from_binary(module.cubin.to_vec()))
                        .or_else(|e| {
                            eprintln!(
                                "note: cuda/{}.cu: the driver refused its cubin ({e}); \
                                 compiling its PTX instead",
                                module.name
                            );
                            ctx.load_module(Ptx::from_src(module.ptx))
                        })
                        .map_err(|e| {
                            candle_core::Error::Msg(format!(
                                "cannot load the kernels of cuda/{}.cu: {e}",
                                module.name
                            ))
                        })?;
                    loaded.push((key, module.name, m.clone()));
                    m
                }
            }
        };
        m.load_function(name).map_err(|e| {
            candle_core::Error::Msg(format!("no kernel {name} in cuda/{}.cu: {e}", module.name))
        })
    }

    /// The kernel-name suffix of a float dtype (`f32`, `f16`, `bf16`).
    pub fn dtype_suffix(dt: candle_core::DType) -> Result<&'static str> {
        use candle_core::DType;
        Ok(match dt {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            dt => candle_core::bail!("unsupported dtype {dt:?} (f32, f16, bf16)"),
        })
    }

    /// The device's number of streaming multiprocessors (launch shapes that fill one wave).
    pub fn sm_count(dev: &candle_core::CudaDevice) -> Result<usize> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
        let n = dev
            .cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(candle_core::Error::wrap)?;
        Ok(n.max(1) as usize)
    }

    /// Map a cudarc driver error into a candle error.
    pub fn launch_err(e: impl std::error::Error + Send + Sync + 'static) -> candle_core::Error {
        candle_core::Error::wrap(e)
    }

    /// One kernel parameter for [`launch_pdl`] (by value: device addresses and scalars).
    #[derive(Debug, Clone, Copy)]
    pub enum Arg {
        Ptr(sys::CUdeviceptr),
        I32(i32),
        U32(u32),
        F32(f32),
    }

    /// Whether launches ask for programmatic dependent launch (on unless the environment
    /// sets `CANDLE_LOWBIT_PDL=0`; read once).
    pub fn pdl_enabled() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| {
            std::env::var("CANDLE_LOWBIT_PDL")
                .map(|v| v != "0")
                .unwrap_or(true)
        })
    }

    /// Launch `func` on `stream` with programmatic dependent launch allowed: the kernel may
    /// start while the previous kernel in the stream is finishing, so every kernel launched
    /// this way calls `pdl_wait()` (cuda/common.cuh) before it reads anything an earlier
    /// kernel wrote or writes anything. Captured into a CUDA graph, the dependency becomes a
    /// programmatic edge. Device addresses in `args` must stay valid until the kernel runs
    /// (callers hold the views, and their `SyncOnDrop` guards, across this call).
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list in number, order and type.
    pub unsafe fn launch_pdl(
        func: &CudaFunction,
        stream: &CudaStream,
        cfg: LaunchConfig,
        args: &[Arg],
    ) -> Result<()> {
        launch_ex(func, stream, cfg, 0, args)
    }

    /// [`launch_pdl`] with thread-block clusters of `cluster_x` blocks along x (sm_90+;
    /// `grid_dim.0` must be a multiple of it).
    ///
    /// # Safety
    /// As [`launch_pdl`].
    pub unsafe fn launch_pdl_cluster(
        func: &CudaFunction,
        stream: &CudaStream,
        cfg: LaunchConfig,
        cluster_x: u32,
        args: &[Arg],
    ) -> Result<()> {
        if cluster_x == 0 || !cfg.grid_dim.0.is_multiple_of(cluster_x) {
            candle_core::bail!(
                "launch: grid x {} is not a multiple of the cluster's {cluster_x}",
                cfg.grid_dim.0
            )
        }
        launch_ex(func, stream, cfg, cluster_x, args)
    }

    /// Launch `func` with one kernel parameter, the `#[repr(C)]` struct `params` (passed by
    /// value, `__grid_constant__` on the device side), with programmatic dependent launch as
    /// [`launch_pdl`] and clusters of `cluster_x` blocks along x where `cluster_x > 0`.
    ///
    /// # Safety
    /// `P` must have exactly the layout of the kernel's parameter struct, and every device
    /// address in it must stay valid until the kernel has run.
    pub unsafe fn launch_params<P: Copy>(
        func: &CudaFunction,
        stream: &CudaStream,
        cfg: LaunchConfig,
        cluster_x: u32,
        params: &P,
    ) -> Result<()> {
        if cluster_x > 0 && !cfg.grid_dim.0.is_multiple_of(cluster_x) {
            candle_core::bail!(
                "launch: grid x {} is not a multiple of the cluster's {cluster_x}",
                cfg.grid_dim.0
            )
        }
        let mut p = *params;
        let mut ptrs = [&mut p as *mut P as *mut c_void];
        launch_raw(func, stream, cfg, cluster_x, &mut ptrs)
    }

    unsafe fn launch_ex(
        func: &CudaFunction,
        stream: &CudaStream,
        cfg: LaunchConfig,
        cluster_x: u32,
        args: &[Arg],
    ) -> Result<()> {
        let mut vals: Vec<Arg> = args.to_vec();
        let mut ptrs: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|a| match a {
                Arg::Ptr(p) => p as *mut sys::CUdeviceptr as *mut c_void,
                Arg::I32(v) => v as *mut i32 as *mut c_void,
                Arg::U32(v) => v as *mut u32 as *mut c_void,
                Arg::F32(v) => v as *mut f32 as *mut c_void,
            })
            .collect();
        launch_raw(func, stream, cfg, cluster_x, &mut ptrs)
    }

    unsafe fn launch_raw(
        func: &CudaFunction,
        stream: &CudaStream,
        cfg: LaunchConfig,
        cluster_x: u32,
        ptrs: &mut [*mut c_void],
    ) -> Result<()> {
        let mut attrs: [sys::CUlaunchAttribute; 2] = std::mem::zeroed();
        let mut n = 0;
        if pdl_enabled() {
            attrs[n].id =
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        if cluster_x > 0 {
            attrs[n].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = cluster_x;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        sys::cuLaunchKernelEx(
            &lc,
            func.cu_function(),
            ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .map_err(launch_err)
    }

    /// The device address of a view (and the guard that keeps cudarc's stream tracking
    /// right until it is dropped, after the launch).
    pub fn dptr<'a, T>(v: &'a impl DevicePtr<T>, stream: &'a CudaStream) -> (Arg, SyncOnDrop<'a>) {
        let (p, guard) = v.device_ptr(stream);
        (Arg::Ptr(p), guard)
    }

    /// The device addresses `[cos, sin, pos, pads]` of a decode step's positions (f32, f32,
    /// u32, u32 tensors on the GPU: `ops::StepPositions`), valid while `f` runs.
    pub fn with_positions<R>(
        t: [&candle_core::Tensor; 4],
        stream: &CudaStream,
        f: impl FnOnce([u64; 4]) -> Result<R>,
    ) -> Result<R> {
        with_view::<f32, _>(t[0], "cos", |cos| {
            with_view::<f32, _>(t[1], "sin", |sin| {
                with_view::<u32, _>(t[2], "pos", |pos| {
                    with_view::<u32, _>(t[3], "pads", |pads| {
                        let ((a, _g1), (b, _g2)) = (raw_ptr(&cos, stream), raw_ptr(&sin, stream));
                        let ((c, _g3), (d, _g4)) = (raw_ptr(&pos, stream), raw_ptr(&pads, stream));
                        f([a, b, c, d])
                    })
                })
            })
        })
    }

    /// The raw device address of a view, for a kernel's parameter struct (and its guard,
    /// to hold until after the launch).
    pub fn raw_ptr<'a, T>(
        v: &'a impl DevicePtr<T>,
        stream: &'a CudaStream,
    ) -> (u64, SyncOnDrop<'a>) {
        v.device_ptr(stream)
    }
}

#[cfg(test)]
mod tests {
    use super::split_k;

    #[test]
    fn split_k_fills_idle_sms_only() {
        // Two waves of tiles already: no split.
        assert_eq!(split_k(264, 64, 132, 4), 1);
        // 32 tiles on 264 slots: the most splits that still leave 4 steps each.
        assert_eq!(split_k(32, 64, 264, 4), 8);
        assert_eq!(split_k(32, 24, 264, 4), 6);
        assert_eq!(split_k(1, 8, 132, 4), 2);
        // Too few steps to split at all.
        assert_eq!(split_k(1, 7, 132, 4), 1);
        // 172 tiles on 132 slots: 3 splits make 4 waves of 1/3 the work (1.33 < 2 unsplit).
        assert_eq!(split_k(172, 64, 132, 4), 3);
    }
}
