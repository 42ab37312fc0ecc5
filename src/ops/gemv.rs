//! Skinny matmul for decode: `y = x · Wᵀ` for `m <= 8` rows of activations and a dense
//! weight, streaming `W` at DRAM speed (kernel: `cuda/gemv.cu`).
//!
//! `QLinear` takes this path on the GPU for dense weights when a call has at most
//! [`GEMV_MAX_M`] rows and [`gemv_ok`] holds; larger calls go to cuBLAS through candle.
//! [`gemv_silu_mul`] is the MLP's gate/up projection with SiLU·mul in the epilogue (one
//! launch instead of two, bit-identical to `silu_mul(gemv(x, w))`).

use super::contiguous_slice;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

/// Most activation rows the kernel takes.
pub const GEMV_MAX_M: usize = 8;

/// `x [m, k]` · `w [n, k]`ᵀ → `[m, n]` in `out` (the inputs' dtype, or f32); with
/// `silu_mul`, `w` holds gate rows then up rows and the result is `[m, n / 2]` =
/// `silu(gate) * up` in the inputs' dtype.
#[derive(Debug, Clone, Copy)]
pub struct Gemv {
    pub out: DType,
    pub silu_mul: bool,
}

/// Whether [`gemv`] takes `x [m, k]` and `w [n, k]` as they are: same dtype (f32, f16 or
/// bf16), `1 <= m <= 8`, rows of a multiple of 16 bytes, both contiguous from a 16-byte
/// aligned offset.
pub fn gemv_ok(x: &Tensor, w: &Tensor) -> bool {
    let (Ok((m, k)), Ok((_, kw))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    gemv_weight_ok(w)
        && x.dtype() == w.dtype()
        && (1..=GEMV_MAX_M).contains(&m)
        && k == kw
        && aligned(x)
}

/// The weight's half of [`gemv_ok`]: `w [n, k]` in f32, f16 or bf16, rows of a multiple of
/// 16 bytes, contiguous from a 16-byte aligned offset.
pub fn gemv_weight_ok(w: &Tensor) -> bool {
    let Ok((_, k)) = w.dims2() else { return false };
    let dt = w.dtype();
    matches!(dt, DType::F32 | DType::F16 | DType::BF16)
        && (k * dt.size_in_bytes()).is_multiple_of(16)
        && aligned(w)
}

fn aligned(t: &Tensor) -> bool {
    let l = t.layout();
    l.is_contiguous() && (l.start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
}

/// `y [m, n] = x [m, k] · w [n, k]ᵀ`, f32 accumulation, rounded once to `out`
/// (`x.dtype()` or `DType::F32`). Errors unless [`gemv_ok`].
pub fn gemv(x: &Tensor, w: &Tensor, out: DType) -> Result<Tensor> {
    if !gemv_ok(x, w) {
        candle_core::bail!(
            "gemv: x {:?} {:?} / w {:?} {:?} not supported (same dtype f32/f16/bf16, 1..={GEMV_MAX_M} rows, \
             rows a multiple of 16 bytes, contiguous and 16-byte aligned)",
            x.shape(),
            x.dtype(),
            w.shape(),
            w.dtype()
        )
    }
    if out != x.dtype() && out != DType::F32 {
        candle_core::bail!(
            "gemv: output dtype {out:?} must be the input's ({:?}) or f32",
            x.dtype()
        )
    }
    x.apply_op2_no_bwd(
        w,
        &Gemv {
            out,
            silu_mul: false,
        },
    )
}

/// The gate/up projection with SiLU·mul fused: `w [2 I, k]` holds the gate rows then the up
/// rows; returns `silu(x · gateᵀ) * (x · upᵀ)`, `[m, I]` in x's dtype, rounded exactly as
/// `ops::silu_mul(&gemv(x, w, x.dtype())?)`. Errors unless [`gemv_ok`] and `w` has an
/// even number of rows.
pub fn gemv_silu_mul(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !gemv_ok(x, w) || w.dim(0)? % 2 != 0 {
        candle_core::bail!(
            "gemv_silu_mul: x {:?} {:?} / w {:?} {:?} not supported (as gemv, and w's rows gate then up: an even count)",
            x.shape(),
            x.dtype(),
            w.shape(),
            w.dtype()
        )
    }
    x.apply_op2_no_bwd(
        w,
        &Gemv {
            out: x.dtype(),
            silu_mul: true,
        },
    )
}

/// Warps that share one output row (the kernel's WPR) and warps per block: one warp per
/// row, four rows per block, for rows under 8 KiB; eight warps per row, one row per block,
/// from there (see cuda/gemv.cu for the measurements behind the split).
#[cfg(feature = "cuda")]
fn split(row_bytes: usize) -> (usize, usize) {
    if row_bytes >= 8192 {
        (8, 8)
    } else {
        (1, 4)
    }
}

impl Gemv {
    /// SiLU·mul writes the inputs' dtype (as the unfused pair does).
    fn check(&self, dt: DType) -> Result<()> {
        if self.silu_mul && self.out != dt {
            candle_core::bail!(
                "gemv_silu_mul: output dtype {:?} must be the input's ({dt:?})",
                self.out
            )
        }
        Ok(())
    }

    fn out_shape(&self, (m, n, _): (usize, usize, usize)) -> Shape {
        Shape::from((m, if self.silu_mul { n / 2 } else { n }))
    }
}

fn dims(l1: &Layout, l2: &Layout) -> Result<(usize, usize, usize)> {
    let (m, k) = l1.shape().dims2()?;
    let (n, kw) = l2.shape().dims2()?;
    if k != kw {
        candle_core::bail!(
            "gemv: x {:?} and w {:?} differ in k",
            l1.shape(),
            l2.shape()
        )
    }
    Ok((m, n, k))
}

fn cpu_ref<T: WithDType, O: WithDType>(
    x: &[T],
    w: &[T],
    (m, n, k): (usize, usize, usize),
) -> Vec<O> {
    let mut y = Vec::with_capacity(m * n);
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for r in 0..n {
            let wr = &w[r * k..(r + 1) * k];
            let s: f32 = xr
                .iter()
                .zip(wr)
                .map(|(a, b)| a.to_f64() as f32 * b.to_f64() as f32)
                .sum();
            y.push(O::from_f64(s as f64));
        }
    }
    y
}

impl CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        if self.silu_mul {
            "gemv-silu-mul"
        } else {
            "gemv"
        }
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = dims(l1, l2)?;
        self.check(s1.dtype())?;
        use half::{bf16, f16};
        fn run<T: WithDType, O: WithDType>(
            (s1, l1, s2, l2): (&CpuStorage, &Layout, &CpuStorage, &Layout),
            d: (usize, usize, usize),
            silu_mul: bool,
        ) -> Result<CpuStorage> {
            let y = cpu_ref::<T, O>(
                contiguous_slice(s1, l1, "x")?,
                contiguous_slice(s2, l2, "w")?,
                d,
            );
            Ok(O::to_cpu_storage_owned(if silu_mul {
                super::decode::silu_mul_ref(&y, d.1 / 2)
            } else {
                y
            }))
        }
        let args = (s1, l1, s2, l2);
        let out = match (s1.dtype(), self.out) {
            (DType::F32, DType::F32) => run::<f32, f32>(args, d, self.silu_mul)?,
            (DType::F16, DType::F16) => run::<f16, f16>(args, d, self.silu_mul)?,
            (DType::F16, DType::F32) => run::<f16, f32>(args, d, self.silu_mul)?,
            (DType::BF16, DType::BF16) => run::<bf16, bf16>(args, d, self.silu_mul)?,
            (DType::BF16, DType::F32) => run::<bf16, f32>(args, d, self.silu_mul)?,
            (dt, o) => candle_core::bail!("gemv: unsupported dtypes {dt:?} -> {o:?}"),
        };
        Ok((out, self.out_shape(d)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::kernels::{contiguous_view, dptr, launch_pdl, Arg};
        use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
        use candle_core::cuda_backend::{CudaDType, CudaStorage};
        use half::{bf16, f16};

        let (m, n, k) = dims(l1, l2)?;
        self.check(s1.dtype())?;
        let size = s1.dtype().size_in_bytes();
        if !(1..=GEMV_MAX_M).contains(&m) || !(k * size).is_multiple_of(16) {
            candle_core::bail!("gemv: m {m} / k {k} out of the kernel's range")
        }
        for (l, what) in [(l1, "x"), (l2, "w")] {
            if !(l.start_offset() * size).is_multiple_of(16) {
                candle_core::bail!(
                    "gemv: {what} starts at element {}, not 16-byte aligned",
                    l.start_offset()
                )
            }
        }
        let bucket = match m {
            1 => 1,
            2 => 2,
            3 | 4 => 4,
            _ => 8,
        };
        // `n` output columns per activation row (the gemv's n, or I for SiLU·mul).
        fn launch<T: CudaDType + DeviceRepr, O: CudaDType + DeviceRepr>(
            name: &str,
            (m, n, k, (wpr, warps)): (usize, usize, usize, (usize, usize)),
            (s1, l1, s2, l2): (&CudaStorage, &Layout, &CudaStorage, &Layout),
        ) -> Result<CudaStorage> {
            let dev = s1.device();
            let stream = dev.cuda_stream();
            let x = contiguous_view::<T>(s1, l1, "x")?;
            let w = contiguous_view::<T>(s2, l2, "w")?;
            let y = unsafe { dev.alloc::<O>(m * n)? };
            let func = crate::kernels::func(dev, name, &crate::kernels::modules::GEMV)?;
            if n > 0 {
                let cfg = LaunchConfig {
                    grid_dim: ((n * wpr).div_ceil(warps) as u32, 1, 1),
                    block_dim: (32 * warps as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let ((xp, _gx), (wp, _gw), (yp, _gy)) =
                    (dptr(&x, &stream), dptr(&w, &stream), dptr(&y, &stream));
                let ints = [m, n, k].map(|v| Arg::I32(v as i32));
                unsafe {
                    launch_pdl(
                        &func,
                        &stream,
                        cfg,
                        &[xp, wp, yp, ints[0], ints[1], ints[2]],
                    )
                }?;
            }
            Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
        }
        let args = (s1, l1, s2, l2);
        let wpr = split(k * size);
        let suffix = format!("m{bucket}_w{}", wpr.0);
        if self.silu_mul {
            let d = (m, n / 2, k, wpr);
            let y = match s1.dtype() {
                DType::F32 => launch::<f32, f32>(&format!("gemv_silu_mul_f32_{suffix}"), d, args)?,
                DType::F16 => launch::<f16, f16>(&format!("gemv_silu_mul_f16_{suffix}"), d, args)?,
                DType::BF16 => {
                    launch::<bf16, bf16>(&format!("gemv_silu_mul_bf16_{suffix}"), d, args)?
                }
                dt => candle_core::bail!("gemv_silu_mul: unsupported dtype {dt:?}"),
            };
            return Ok((y, self.out_shape((m, n, k))));
        }
        let d = (m, n, k, wpr);
        let y = match (s1.dtype(), self.out) {
            (DType::F32, DType::F32) => {
                launch::<f32, f32>(&format!("gemv_f32_f32_{suffix}"), d, args)?
            }
            (DType::F16, DType::F16) => {
                launch::<f16, f16>(&format!("gemv_f16_f16_{suffix}"), d, args)?
            }
            (DType::F16, DType::F32) => {
                launch::<f16, f32>(&format!("gemv_f16_f32_{suffix}"), d, args)?
            }
            (DType::BF16, DType::BF16) => {
                launch::<bf16, bf16>(&format!("gemv_bf16_bf16_{suffix}"), d, args)?
            }
            (DType::BF16, DType::F32) => {
                launch::<bf16, f32>(&format!("gemv_bf16_f32_{suffix}"), d, args)?
            }
            (dt, o) => candle_core::bail!("gemv: unsupported dtypes {dt:?} -> {o:?}"),
        };
        Ok((y, self.out_shape((m, n, k))))
    }
}
