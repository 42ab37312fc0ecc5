//! Fused residual-add + RMSNorm: `s = x + res` (rounded to the dtype), `n = rmsnorm(s) * w`.
//!
//! One launch replaces an add and a norm in every transformer block. Kernel:
//! `cuda/rms_norm.cu`.

use crate::formats::{Activation, InputEncoding};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType};

/// The op: inputs `x [.., h]`, `res [.., h]` (same shape and dtype), `w [h]`;
/// output `[2, .., h]` holding the sum then the normalised sum.
#[derive(Debug, Clone, Copy)]
pub struct AddRmsNorm {
    pub eps: f32,
}

/// Returns `(x + res, rmsnorm(x + res) * w)`, both shaped like `x`.
///
/// `x`, `res`: `[.., h]`, f32/f16/bf16, same dtype; `w`: `[h]`, same dtype.
pub fn add_rms_norm(x: &Tensor, res: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    if x.shape() != res.shape() {
        candle_core::bail!(
            "add_rms_norm: x {:?} and res {:?} differ in shape",
            x.shape(),
            res.shape()
        )
    }
    if x.dtype() != res.dtype() || x.dtype() != w.dtype() {
        candle_core::bail!(
            "add_rms_norm: dtypes differ: x {:?}, res {:?}, w {:?}",
            x.dtype(),
            res.dtype(),
            w.dtype()
        )
    }
    let h = x.dim(candle_core::D::Minus1)?;
    if w.dims() != [h] {
        candle_core::bail!(
            "add_rms_norm: w {:?} must be [{h}] for x {:?}",
            w.shape(),
            x.shape()
        )
    }
    let x = x.contiguous()?;
    let res = res.contiguous()?;
    let w = w.contiguous()?;
    let out = x.apply_op3_no_bwd(&res, &w, &AddRmsNorm { eps })?;
    Ok((out.get(0)?, out.get(1)?))
}

fn check_layouts(l1: &Layout, l2: &Layout, l3: &Layout) -> Result<(usize, usize)> {
    let dims = l1.shape().dims();
    let h = match dims.last() {
        Some(&h) if h > 0 => h,
        _ => candle_core::bail!(
            "add_rms_norm: x must have a non-empty last dim, got {:?}",
            l1.shape()
        ),
    };
    if l2.shape() != l1.shape() || l3.shape().dims() != [h] {
        candle_core::bail!(
            "add_rms_norm: shapes x {:?}, res {:?}, w {:?} do not match",
            l1.shape(),
            l2.shape(),
            l3.shape()
        )
    }
    Ok((l1.shape().elem_count() / h, h))
}

fn out_shape(l1: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l1.shape().dims());
    Shape::from(dims)
}

fn cpu_ref<T: WithDType>(x: &[T], res: &[T], w: &[T], rows: usize, h: usize, eps: f32) -> Vec<T> {
    let mut out = vec![T::zero(); 2 * rows * h];
    let (sum_out, norm_out) = out.split_at_mut(rows * h);
    for r in 0..rows {
        let o = r * h;
        let mut ss = 0f32;
        for i in 0..h {
            let s = T::from_f64((x[o + i].to_f64() as f32 + res[o + i].to_f64() as f32) as f64);
            sum_out[o + i] = s;
            let sf = s.to_f64() as f32;
            ss += sf * sf;
        }
        let inv = 1f32 / (ss / h as f32 + eps).sqrt();
        for i in 0..h {
            let v = sum_out[o + i].to_f64() as f32 * inv * w[i].to_f64() as f32;
            norm_out[o + i] = T::from_f64(v as f64);
        }
    }
    out
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
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
        let (rows, h) = check_layouts(l1, l2, l3)?;
        let eps = self.eps;
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(cpu_ref(
                super::contiguous_slice(s1, l1, "x")?,
                super::contiguous_slice(s2, l2, "res")?,
                super::contiguous_slice(s3, l3, "w")?,
                rows,
                h,
                eps,
            )),
            DType::F16 => CpuStorage::F16(cpu_ref(
                super::contiguous_slice(s1, l1, "x")?,
                super::contiguous_slice(s2, l2, "res")?,
                super::contiguous_slice(s3, l3, "w")?,
                rows,
                h,
                eps,
            )),
            DType::BF16 => CpuStorage::BF16(cpu_ref(
                super::contiguous_slice(s1, l1, "x")?,
                super::contiguous_slice(s2, l2, "res")?,
                super::contiguous_slice(s3, l3, "w")?,
                rows,
                h,
                eps,
            )),
            dt => candle_core::bail!("add_rms_norm: unsupported dtype {dt:?} (f32, f16, bf16)"),
        };
        Ok((out, out_shape(l1)))
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
        use crate::kernels::{contiguous_view, dptr, launch_pdl, Arg};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        use candle_core::cuda_backend::{CudaDType, CudaStorage};
        use half::{bf16, f16};

        let (rows, h) = check_layouts(l1, l2, l3)?;
        fn launch<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
            name: &str,
            eps: f32,
            (rows, h): (usize, usize),
            (s1, l1, s2, l2, s3, l3): (
                &CudaStorage,
                &Layout,
                &CudaStorage,
                &Layout,
                &CudaStorage,
                &Layout,
            ),
        ) -> Result<CudaStorage> {
            let dev = s1.device();
            let stream = dev.cuda_stream();
            let x = contiguous_view::<T>(s1, l1, "x")?;
            let res = contiguous_view::<T>(s2, l2, "res")?;
            let w = contiguous_view::<T>(s3, l3, "w")?;
            let out = unsafe { dev.alloc::<T>(2 * rows * h)? };
            let func = crate::kernels::func(dev, name, &crate::kernels::modules::RMS_NORM)?;
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            if rows > 0 {
                let ((xp, _g1), (rp, _g2)) = (dptr(&x, &stream), dptr(&res, &stream));
                let ((wp, _g3), (op, _g4)) = (dptr(&w, &stream), dptr(&out, &stream));
                let args = [
                    xp,
                    rp,
                    wp,
                    op,
                    Arg::I32(rows as i32),
                    Arg::I32(h as i32),
                    Arg::F32(eps),
                ];
                unsafe { launch_pdl(&func, &stream, cfg, &args) }?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let args = (s1, l1, s2, l2, s3, l3);
        let out = match s1.dtype() {
            DType::F32 => launch::<f32>("add_rms_norm_f32", self.eps, (rows, h), args)?,
            DType::F16 => launch::<f16>("add_rms_norm_f16", self.eps, (rows, h), args)?,
            DType::BF16 => launch::<bf16>("add_rms_norm_bf16", self.eps, (rows, h), args)?,
            dt => candle_core::bail!("add_rms_norm: unsupported dtype {dt:?} (f32, f16, bf16)"),
        };
        Ok((out, out_shape(l1)))
    }
}

/// [`add_rms_norm`] with the norm in `enc`, the encoding the next projection reads (a
/// format that reads quantized input gets its fused norm-and-quantize here).
pub fn add_rms_norm_as(
    x: &Tensor,
    res: &Tensor,
    w: &Tensor,
    eps: f32,
    enc: InputEncoding,
) -> Result<(Tensor, Activation)> {
    match enc {
        InputEncoding::Dense => {
            let (sum, norm) = add_rms_norm(x, res, w, eps)?;
            Ok((sum, Activation::Dense(norm)))
        }
        InputEncoding::W4a4(spec) => {
            let src = super::ActSource::AddRmsNorm { x, res, w, eps };
            let (sum, act) = super::w4a4_quantize(src, &spec)?;
            let Some(sum) = sum else {
                candle_core::bail!("add_rms_norm_as: the W4A4 quantizer returned no residual")
            };
            Ok((sum, Activation::W4a4(act)))
        }
    }
}

/// `rms_norm(x) * w` in `enc` (the first norm of the model, which has no residual to add).
pub fn rms_norm_as(x: &Tensor, w: &Tensor, eps: f32, enc: InputEncoding) -> Result<Activation> {
    match enc {
        InputEncoding::Dense => Ok(Activation::Dense(candle_nn::ops::rms_norm(x, w, eps)?)),
        InputEncoding::W4a4(spec) => {
            let src = super::ActSource::RmsNorm { x, w, eps };
            Ok(Activation::W4a4(super::w4a4_quantize(src, &spec)?.1))
        }
    }
}
