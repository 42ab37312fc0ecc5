//! Dense weights `[n, k]` in the run dtype (f32, f16 or bf16): the reference every format
//! is measured against, and the fastest path for f16 today (the skinny-matmul kernel at
//! decode sizes, cuBLAS above; `src/ops/gemv.rs`).

use super::{
    Calibration, Codec, Epilogue, FormatSpec, LinearWeights, Plan, QuantOptions, WeightFormat,
};
use candle_core::{DType, Device, Result, Tensor};
use std::collections::HashMap;

pub static SPEC: FormatSpec = FormatSpec {
    name: "f16",
    aliases: &["dense", "bf16", "f32"],
    about: "dense weights in --dtype (the reference)",
    error_bound: 1e-2,
    tolerance: 5e-3,
    calibration: Calibration::None,
    graph_safe: true,
    version: 1,
    stores_as: None,
    codec: &DenseCodec,
};

/// Where dense layers on the GPU use the skinny-matmul kernel (`ops::gemv`) instead of
/// cuBLAS: up to `GEMV_ROWS` rows of input. Measured on the H200 (f16, full bench run of
/// 2026-12-01 07:47, BENCHMARKS.md): at m = 1, 4096x4096 9.5 µs against cuBLAS's 14.3,
/// 11008x4096 21.9 against 27.2, 4096x11008 22.4 against 29.5; at m = 2 / 4 / 8 cuBLAS won
/// against the kernel's earlier one-warp-per-row form (4096x4096: 15.0 / 15.5 / 16.1 against
/// 16.6 / 24.1 / 39.6), so those stay on cuBLAS.
pub const GEMV_ROWS: usize = 1;

/// A dense weight and the kernel choice made for it.
#[derive(Debug, Clone)]
pub struct DenseWeights {
    w: Tensor,
    /// `Ok` where the skinny-matmul kernel takes this weight, else why not.
    gemv: std::result::Result<(), String>,
}

impl DenseWeights {
    /// A weight `[n, k]` in f32, f16 or bf16.
    pub fn new(w: Tensor) -> Result<Self> {
        let (n, k) = w.dims2()?;
        if !matches!(w.dtype(), DType::F32 | DType::F16 | DType::BF16) {
            candle_core::bail!(
                "dense weight [{n}, {k}] has dtype {:?} (f32, f16 or bf16)",
                w.dtype()
            )
        }
        let gemv = gemv_plan(&w);
        Ok(Self { w, gemv })
    }

    pub fn weight(&self) -> &Tensor {
        &self.w
    }

    fn use_gemv(&self, x: &Tensor) -> bool {
        self.gemv.is_ok()
            && x.dims2().is_ok_and(|(m, _)| m <= GEMV_ROWS)
            && crate::ops::gemv_ok(x, &self.w)
    }
}

fn gemv_plan(w: &Tensor) -> std::result::Result<(), String> {
    if !w.device().is_cuda() {
        return Err("not on a CUDA device".into());
    }
    if crate::ops::gemv_weight_ok(w) {
        Ok(())
    } else {
        Err(format!(
            "the skinny matmul needs rows of a multiple of 16 bytes, contiguous and aligned (weight {:?} {:?})",
            w.shape(),
            w.dtype()
        ))
    }
}

impl LinearWeights for DenseWeights {
    fn format(&self) -> WeightFormat {
        WeightFormat::Dense
    }

    fn shape(&self) -> (usize, usize) {
        let d = self.w.dims();
        (d[0], d[1])
    }

    fn bytes(&self) -> usize {
        self.w.elem_count() * self.w.dtype().size_in_bytes()
    }

    fn encoding(&self) -> String {
        self.w.dtype().as_str().to_string()
    }

    fn device(&self) -> Device {
        self.w.device().clone()
    }

    fn dequantize(&self) -> Result<Tensor> {
        self.w.to_dtype(DType::F32)
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dtype() != self.w.dtype() {
            candle_core::bail!(
                "dense layer: input dtype {:?} != weight dtype {:?}",
                x.dtype(),
                self.w.dtype()
            )
        }
        if self.use_gemv(x) {
            return crate::ops::gemv(x, &self.w, x.dtype());
        }
        x.matmul(&self.w.t()?)
    }

    fn plan(&self) -> Plan {
        let matmul = match &self.gemv {
            Ok(()) => format!("skinny matmul at m <= {GEMV_ROWS}, cuBLAS above"),
            Err(why) => format!("candle matmul ({why})"),
        };
        let (n, _) = self.shape();
        let silu_mul = match (&self.gemv, n % 2) {
            (Ok(()), 0) => Ok(()),
            (Ok(()), _) => Err(format!("{n} rows cannot split into gate and up")),
            (Err(why), _) => Err(why.clone()),
        };
        Plan {
            matmul,
            silu_mul,
            f32_out: self.gemv.clone(),
        }
    }

    fn forward_fused(&self, e: Epilogue, x: &Tensor) -> Option<Result<Tensor>> {
        if !self.use_gemv(x) {
            return None;
        }
        match e {
            Epilogue::SiluMul if self.shape().0.is_multiple_of(2) => {
                Some(crate::ops::gemv_silu_mul(x, &self.w))
            }
            Epilogue::SiluMul => None,
            Epilogue::F32Out => Some(crate::ops::gemv(x, &self.w, DType::F32)),
        }
    }

    fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        Ok(vec![("weight".to_string(), self.w.clone())])
    }
}

struct DenseCodec;

impl Codec for DenseCodec {
    fn quantize(
        &self,
        _format: WeightFormat,
        w: &Tensor,
        _hessian: Option<&Tensor>,
        _opts: &QuantOptions,
    ) -> Result<Box<dyn LinearWeights>> {
        Ok(Box::new(DenseWeights::new(w.clone())?))
    }

    fn rebuild(
        &self,
        format: WeightFormat,
        shape: (usize, usize),
        tensors: &HashMap<String, Tensor>,
    ) -> Result<Box<dyn LinearWeights>> {
        let w = super::field(tensors, "weight", format, shape)?;
        if w.dims() != [shape.0, shape.1] {
            candle_core::bail!(
                "dense weight is {:?}, expected [{}, {}]",
                w.dims(),
                shape.0,
                shape.1
            )
        }
        Ok(Box::new(DenseWeights::new(w.clone())?))
    }
}
