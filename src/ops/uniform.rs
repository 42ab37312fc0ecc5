//! Packing and dequantizing the uniform integer formats (`int2` / `int3` / `int4`; layout:
//! `src/formats/uniform.rs`, kernels: `cuda/uniform.cu`). The CPU side runs the format
//! module's references; the kernels compute the same bits.

use super::contiguous_slice;
use crate::formats::uniform::{dequantize, groups, pack, words_per_row};
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Layout, Result, Shape, Tensor};
use half::f16;

fn check_bits(bits: u32) -> Result<()> {
    if !(2..=4).contains(&bits) {
        candle_core::bail!("uniform: {bits} bits per code (2, 3 or 4)")
    }
    Ok(())
}

/// Pack codes u8 `[n, k]` (each `< 2^bits`) into u32 `[n, ⌈k·bits/32⌉]`.
pub fn uniform_pack(codes: &Tensor, bits: u32) -> Result<Tensor> {
    check_bits(bits)?;
    if codes.dtype() != DType::U8 || codes.rank() != 2 {
        candle_core::bail!(
            "uniform_pack: codes must be u8 [n, k], got {:?} {:?}",
            codes.shape(),
            codes.dtype()
        )
    }
    codes.contiguous()?.apply_op1_no_bwd(&UniformPack { bits })
}

/// The weight `[n, k]` in `dtype` (f32, f16 or bf16) from packed `qweight` u32
/// `[n, ⌈k·bits/32⌉]` and f16 `scales` / `zeros` `[n, ⌈k/128⌉]`.
pub fn uniform_dequantize(
    qweight: &Tensor,
    scales: &Tensor,
    zeros: &Tensor,
    k: usize,
    bits: u32,
    dtype: DType,
) -> Result<Tensor> {
    check_bits(bits)?;
    let (n, w) = qweight.dims2()?;
    let g = groups(k);
    let ok = qweight.dtype() == DType::U32
        && w == words_per_row(k, bits)
        && [scales, zeros]
            .iter()
            .all(|t| t.dtype() == DType::F16 && t.dims() == [n, g])
        && matches!(dtype, DType::F32 | DType::F16 | DType::BF16);
    if !ok {
        candle_core::bail!(
            "uniform_dequantize: qweight {:?} {:?}, scales {:?} {:?}, zeros {:?} {:?} do not describe a \
             [{n}, {k}] int{bits} weight (want u32 [{n}, {}], f16 [{n}, {g}] twice), output {dtype:?}",
            qweight.shape(),
            qweight.dtype(),
            scales.shape(),
            scales.dtype(),
            zeros.shape(),
            zeros.dtype(),
            words_per_row(k, bits)
        )
    }
    qweight.contiguous()?.apply_op3_no_bwd(
        &scales.contiguous()?,
        &zeros.contiguous()?,
        &UniformDequantize { k, bits, dtype },
    )
}

struct UniformPack {
    bits: u32,
}

impl CustomOp1 for UniformPack {
    fn name(&self) -> &'static str {
        "uniform-pack"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, k) = l.shape().dims2()?;
        let words = pack(contiguous_slice::<u8>(s, l, "codes")?, n, k, self.bits)?;
        Ok((
            CpuStorage::U32(words),
            Shape::from((n, words_per_row(k, self.bits))),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::kernels::{contiguous_view, dptr, launch_pdl, Arg};
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let (n, k) = l.shape().dims2()?;
        let words = words_per_row(k, self.bits);
        let dev = s.device();
        let stream = dev.cuda_stream();
        let codes = contiguous_view::<u8>(s, l, "codes")?;
        let out = unsafe { dev.alloc::<u32>(n * words)? };
        if n * words > 0 {
            let func =
                crate::kernels::func(dev, "uniform_pack", &crate::kernels::modules::UNIFORM)?;
            let cfg = LaunchConfig::for_num_elems((n * words) as u32);
            let ((cp, _g1), (op, _g2)) = (dptr(&codes, &stream), dptr(&out, &stream));
            let ints = [n, k, self.bits as usize, words].map(|v| Arg::I32(v as i32));
            unsafe {
                launch_pdl(
                    &func,
                    &stream,
                    cfg,
                    &[cp, op, ints[0], ints[1], ints[2], ints[3]],
                )
            }?;
        }
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, words)),
        ))
    }
}

struct UniformDequantize {
    k: usize,
    bits: u32,
    dtype: DType,
}

impl CustomOp3 for UniformDequantize {
    fn name(&self) -> &'static str {
        "uniform-dequantize"
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
        let (n, _) = l1.shape().dims2()?;
        let w = dequantize(
            contiguous_slice::<u32>(s1, l1, "qweight")?,
            contiguous_slice::<f16>(s2, l2, "scales")?,
            contiguous_slice::<f16>(s3, l3, "zeros")?,
            n,
            self.k,
            self.bits,
        );
        let out = match self.dtype {
            DType::F32 => CpuStorage::F32(w),
            DType::F16 => CpuStorage::F16(w.into_iter().map(f16::from_f32).collect()),
            DType::BF16 => CpuStorage::BF16(w.into_iter().map(half::bf16::from_f32).collect()),
            dt => candle_core::bail!("uniform_dequantize: unsupported output dtype {dt:?}"),
        };
        Ok((out, Shape::from((n, self.k))))
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
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
        use candle_core::cuda_backend::{CudaDType, CudaStorage};
        let (n, words) = l1.shape().dims2()?;
        let k = self.k;
        fn launch<T: CudaDType + DeviceRepr>(
            name: &str,
            (n, k, bits, words): (usize, usize, u32, usize),
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
            let q = contiguous_view::<u32>(s1, l1, "qweight")?;
            let s = contiguous_view::<f16>(s2, l2, "scales")?;
            let z = contiguous_view::<f16>(s3, l3, "zeros")?;
            let out = unsafe { dev.alloc::<T>(n * k)? };
            if n * k > 0 {
                let func = crate::kernels::func(dev, name, &crate::kernels::modules::UNIFORM)?;
                let cfg = LaunchConfig::for_num_elems((n * k) as u32);
                let ((qp, _g1), (sp, _g2)) = (dptr(&q, &stream), dptr(&s, &stream));
                let ((zp, _g3), (op, _g4)) = (dptr(&z, &stream), dptr(&out, &stream));
                let ints = [n, k, bits as usize, words].map(|v| Arg::I32(v as i32));
                unsafe {
                    launch_pdl(
                        &func,
                        &stream,
                        cfg,
                        &[qp, sp, zp, op, ints[0], ints[1], ints[2], ints[3]],
                    )
                }?;
            }
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let d = (n, k, self.bits, words);
        let args = (s1, l1, s2, l2, s3, l3);
        let out = match self.dtype {
            DType::F32 => launch::<f32>("uniform_dequantize_f32", d, args)?,
            DType::F16 => launch::<f16>("uniform_dequantize_f16", d, args)?,
            DType::BF16 => launch::<half::bf16>("uniform_dequantize_bf16", d, args)?,
            dt => candle_core::bail!("uniform_dequantize: unsupported output dtype {dt:?}"),
        };
        Ok((out, Shape::from((n, k))))
    }
}
