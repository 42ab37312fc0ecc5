//! candle's own GGML formats (`q8_0`, `q4_0`, `q4_1`, `q4k`, `q3k`, `q2k`) through
//! `QMatMul`: the peers every format of ours is measured against.
//!
//! candle's k-quants need rows that are a multiple of 256; other widths fall back to a
//! block-32 format as llama.cpp does (`q4k` → `q5_0`, `q3k` / `q2k` → `q4_0`), and
//! [`LinearWeights::encoding`] names what a layer took. candle quantizes on the CPU, one
//! thread per call; [`quantize_bytes`] splits the rows over every core (GGML blocks never
//! cross a row, so the bytes are exactly one call's).
//!
//! Stored as one tensor `qweight`: u8 `[n, k / block · block_bytes]`, each row its GGML
//! blocks in order (the layout of a GGUF tensor's data).

use super::{Calibration, Codec, FormatSpec, LinearWeights, Plan, QuantOptions, WeightFormat};
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Module, Result, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// A GGML format: the dtype it wants, and the block-32 dtype rows it cannot take fall
/// back to.
pub struct GgmlCodec {
    pub want: GgmlDType,
    pub fallback: GgmlDType,
}

macro_rules! ggml_spec {
    ($name:ident, $cli:literal, $alias:expr, $codec:ident, $bound:expr, $about:literal) => {
        pub static $name: FormatSpec = FormatSpec {
            name: $cli,
            aliases: $alias,
            about: $about,
            error_bound: $bound,
            // candle quantizes activations to 8 bits (q8_1) inside its kernels.
            tolerance: 3e-2,
            calibration: Calibration::None,
            graph_safe: true,
            version: 1,
            stores_as: None,
            codec: $codec,
        };
    };
}

ggml_spec!(
    Q8_0,
    "q8_0",
    &[],
    Q8_0_CODEC,
    0.01,
    "candle/GGML Q8_0 (8.5 bits)"
);
ggml_spec!(
    Q4_0,
    "q4_0",
    &[],
    Q4_0_CODEC,
    0.1,
    "candle/GGML Q4_0 (4.5 bits)"
);
ggml_spec!(
    Q4_1,
    "q4_1",
    &[],
    Q4_1_CODEC,
    0.1,
    "candle/GGML Q4_1 (5 bits)"
);
ggml_spec!(
    Q4K,
    "q4k",
    &["q4_k"],
    Q4K_CODEC,
    0.1,
    "candle/GGML Q4_K (rows not of 256: q5_0)"
);
ggml_spec!(
    Q3K,
    "q3k",
    &["q3_k"],
    Q3K_CODEC,
    0.2,
    "candle/GGML Q3_K (rows not of 256: q4_0)"
);
ggml_spec!(
    Q2K,
    "q2k",
    &["q2_k"],
    Q2K_CODEC,
    0.4,
    "candle/GGML Q2_K (rows not of 256: q4_0)"
);

impl GgmlCodec {
    /// The GGML dtype for rows `k` long, and whether that is the fallback.
    pub fn dtype_for(&self, k: usize) -> (GgmlDType, bool) {
        if k.is_multiple_of(self.want.block_size()) {
            (self.want, false)
        } else {
            (self.fallback, true)
        }
    }
}

/// The GGML dtype `format` takes for rows `k` long and whether it fell back; `None` for
/// a format that is not one of candle's.
pub fn ggml_dtype(format: WeightFormat, k: usize) -> Option<(GgmlDType, bool)> {
    let codec: &GgmlCodec = match format {
        WeightFormat::Q8_0 => Q8_0_CODEC,
        WeightFormat::Q4_0 => Q4_0_CODEC,
        WeightFormat::Q4_1 => Q4_1_CODEC,
        WeightFormat::Q4K => Q4K_CODEC,
        WeightFormat::Q3K => Q3K_CODEC,
        WeightFormat::Q2K => Q2K_CODEC,
        _ => return None,
    };
    Some(codec.dtype_for(k))
}

const Q8_0_CODEC: &GgmlCodec = &GgmlCodec {
    want: GgmlDType::Q8_0,
    fallback: GgmlDType::Q8_0,
};
const Q4_0_CODEC: &GgmlCodec = &GgmlCodec {
    want: GgmlDType::Q4_0,
    fallback: GgmlDType::Q4_0,
};
const Q4_1_CODEC: &GgmlCodec = &GgmlCodec {
    want: GgmlDType::Q4_1,
    fallback: GgmlDType::Q4_1,
};
const Q4K_CODEC: &GgmlCodec = &GgmlCodec {
    want: GgmlDType::Q4K,
    fallback: GgmlDType::Q5_0,
};
const Q3K_CODEC: &GgmlCodec = &GgmlCodec {
    want: GgmlDType::Q3K,
    fallback: GgmlDType::Q4_0,
};
const Q2K_CODEC: &GgmlCodec = &GgmlCodec {
    want: GgmlDType::Q2K,
    fallback: GgmlDType::Q4_0,
};

/// GGML bytes of the row-major `[n, k]` f32 matrix `w`, quantized on every core.
pub fn quantize_bytes(w: &[f32], n: usize, k: usize, dtype: GgmlDType) -> Result<Vec<u8>> {
    if w.len() != n * k || !k.is_multiple_of(dtype.block_size()) {
        candle_core::bail!(
            "ggml quantize: {} values for [{n}, {k}] in {dtype:?} (rows of whole blocks)",
            w.len()
        )
    }
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(4)
        .min(32);
    let rows_per = n.div_ceil(threads).max(1);
    let chunks: Vec<Result<Vec<u8>>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .step_by(rows_per)
            .map(|r0| {
                let r1 = (r0 + rows_per).min(n);
                let part = &w[r0 * k..r1 * k];
                s.spawn(move || -> Result<Vec<u8>> {
                    let t = Tensor::from_slice(part, (r1 - r0, k), &Device::Cpu)?;
                    Ok(QTensor::quantize(&t, dtype)?.data()?.into_owned())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(candle_core::Error::Msg(
                        "a quantizer thread panicked".into(),
                    ))
                })
            })
            .collect()
    });
    let mut out = Vec::with_capacity(row_bytes(k, dtype) * n);
    for c in chunks {
        out.extend_from_slice(&c?);
    }
    Ok(out)
}

/// Bytes of one row of `k` values in `dtype`.
pub fn row_bytes(k: usize, dtype: GgmlDType) -> usize {
    k / dtype.block_size() * dtype.type_size()
}

/// A `QTensor` `[n, k]` on `dev` over GGML `bytes` (copied through an 8-byte aligned
/// buffer: candle reads the bytes as block structs).
pub fn upload(bytes: &[u8], n: usize, k: usize, dtype: GgmlDType, dev: &Device) -> Result<QTensor> {
    if bytes.len() != n * row_bytes(k, dtype) {
        candle_core::bail!(
            "ggml: {} bytes for a [{n}, {k}] {dtype:?} tensor, want {}",
            bytes.len(),
            n * row_bytes(k, dtype)
        )
    }
    let mut aligned = vec![0u64; bytes.len().div_ceil(8)];
    // Safety: a u64 buffer viewed as its bytes (u8 has no alignment or validity needs).
    let view = unsafe {
        std::slice::from_raw_parts_mut(aligned.as_mut_ptr() as *mut u8, aligned.len() * 8)
    };
    view[..bytes.len()].copy_from_slice(bytes);
    let storage =
        QStorage::from_data(std::borrow::Cow::Borrowed(&view[..bytes.len()]), dev, dtype)?;
    QTensor::new(storage, (n, k))
}

/// The `QTensor` of a GGML layer's weights, uploaded to `dev` (from its stored `qweight`).
pub fn qtensor_of(w: &dyn LinearWeights, dev: &Device) -> Result<QTensor> {
    let (n, k) = w.shape();
    let Some((dtype, _)) = ggml_dtype(w.format(), k) else {
        candle_core::bail!("{} is not a GGML format", w.format())
    };
    let Some((_, t)) = w.tensors()?.into_iter().find(|(name, _)| name == "qweight") else {
        candle_core::bail!("{} layer stores no qweight", w.format())
    };
    upload(
        &t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>()?,
        n,
        k,
        dtype,
        dev,
    )
}

/// One of candle's GGML formats over a `QTensor` `[n, k]`.
#[derive(Debug, Clone)]
pub struct GgmlWeights {
    format: WeightFormat,
    q: Arc<QTensor>,
    shape: (usize, usize),
}

impl GgmlWeights {
    /// Wrap a `QTensor` `[n, k]` as the weights of `format`.
    pub fn new(format: WeightFormat, q: QTensor) -> Result<Self> {
        let (n, k) = q.shape().dims2()?;
        let Some((want, _)) = ggml_dtype(format, k) else {
            candle_core::bail!("{format} is not a GGML format")
        };
        if q.dtype() != want {
            candle_core::bail!(
                "{format} rows of {k} take {want:?}, got a {:?} tensor",
                q.dtype()
            )
        }
        Ok(Self {
            format,
            q: Arc::new(q),
            shape: (n, k),
        })
    }

    pub fn qtensor(&self) -> &QTensor {
        &self.q
    }
}

impl LinearWeights for GgmlWeights {
    fn format(&self) -> WeightFormat {
        self.format
    }

    fn shape(&self) -> (usize, usize) {
        self.shape
    }

    fn bytes(&self) -> usize {
        self.shape.0 * row_bytes(self.shape.1, self.q.dtype())
    }

    fn encoding(&self) -> String {
        format!("{:?}", self.q.dtype()).to_lowercase()
    }

    fn device(&self) -> Device {
        self.q.device()
    }

    fn dequantize(&self) -> Result<Tensor> {
        self.q.dequantize(&self.q.device())
    }

    /// candle's quantized matmuls take f32/f16/bf16 inputs directly (CUDA: the MMVQ/MMQ
    /// paths for every format here; CPU: all three), output in that dtype.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (dt, k) = (self.q.dtype(), self.shape.1);
        let paired = matches!(dt, GgmlDType::Q4_1 | GgmlDType::Q5_0 | GgmlDType::Q5_1);
        if x.device().is_cpu() && paired && !(k / dt.block_size()).is_multiple_of(2) {
            // candle's CPU dot products for these take blocks in pairs (and panic otherwise).
            candle_core::bail!(
                "{}: candle's CPU {dt:?} kernels need rows of an even number of blocks (k = {k})",
                self.format
            )
        }
        match x.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => {
                QMatMul::QTensor(self.q.clone()).forward(&x.contiguous()?)
            }
            dt => candle_core::bail!(
                "{}: unsupported input dtype {dt:?} (f32, f16, bf16)",
                self.format
            ),
        }
    }

    fn plan(&self) -> Plan {
        let none = || Err("candle's QMatMul has no fused epilogue".to_string());
        Plan {
            matmul: format!("candle QMatMul ({})", self.encoding()),
            silu_mul: none(),
            f32_out: none(),
        }
    }

    fn tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let (n, k) = self.shape;
        let bytes = self.q.data()?.into_owned();
        let t = Tensor::from_vec(bytes, (n, row_bytes(k, self.q.dtype())), &Device::Cpu)?;
        Ok(vec![(
            "qweight".to_string(),
            t.to_device(&self.q.device())?,
        )])
    }
}

impl Codec for GgmlCodec {
    fn quantize(
        &self,
        format: WeightFormat,
        w: &Tensor,
        _hessian: Option<&Tensor>,
        _opts: &QuantOptions,
    ) -> Result<Box<dyn LinearWeights>> {
        let (n, k) = w.dims2()?;
        let (dtype, _) = self.dtype_for(k);
        let host = w
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let bytes = quantize_bytes(&host, n, k, dtype)?;
        Ok(Box::new(GgmlWeights::new(
            format,
            upload(&bytes, n, k, dtype, w.device())?,
        )?))
    }

    fn rebuild(
        &self,
        format: WeightFormat,
        shape: (usize, usize),
        tensors: &HashMap<String, Tensor>,
    ) -> Result<Box<dyn LinearWeights>> {
        let (n, k) = shape;
        let (dtype, _) = self.dtype_for(k);
        let t = super::field(tensors, "qweight", format, shape)?;
        super::expect(t, "qweight", &[n, row_bytes(k, dtype)], DType::U8)?;
        let bytes = t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>()?;
        Ok(Box::new(GgmlWeights::new(
            format,
            upload(&bytes, n, k, dtype, t.device())?,
        )?))
    }
}
