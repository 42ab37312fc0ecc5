//! Weights in candle's GGML formats, made fast enough for the benchmark.
//!
//! candle quantizes on the CPU only (`QTensor::quantize` copies a CUDA tensor to the host
//! and back), one thread per call: a 7B model would take minutes per format. So:
//! - quantization runs on all cores, split by rows (GGML blocks never cross a row, so the
//!   concatenated bytes are exactly what one call would produce);
//! - each distinct matrix shape is quantized once ("prototype") and its bytes uploaded
//!   into as many distinct device buffers as needed (the rotation copies, the 32 layers
//!   of a model). Values repeat, addresses do not: every read still comes from DRAM.

use anyhow::{Context, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_lowbit::QLinear;
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

/// GGML bytes of the row-major `[n, k]` f32 matrix `w`, quantized on every core.
pub fn quantize_bytes(w: &[f32], n: usize, k: usize, dtype: GgmlDType) -> Result<Vec<u8>> {
    anyhow::ensure!(w.len() == n * k, "quantize: {} values for a [{n}, {k}] matrix", w.len());
    anyhow::ensure!(
        k.is_multiple_of(dtype.block_size()),
        "quantize: rows of {k} are not a multiple of {dtype:?}'s block"
    );
    let threads = std::thread::available_parallelism().map(|t| t.get()).unwrap_or(4).min(32);
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
        handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("a quantizer thread panicked"))?).collect()
    });
    let mut out = Vec::with_capacity(n * k / dtype.block_size() * dtype.type_size());
    for c in chunks {
        out.extend_from_slice(&c?);
    }
    anyhow::ensure!(
        out.len() == n * k / dtype.block_size() * dtype.type_size(),
        "quantize: {} bytes for [{n}, {k}] {dtype:?}",
        out.len()
    );
    Ok(out)
}

/// A `QTensor` `[n, k]` on `dev` holding `bytes` (a fresh buffer on every call).
pub fn upload(bytes: &[u8], n: usize, k: usize, dtype: GgmlDType, dev: &Device) -> Result<QTensor> {
    // candle reinterprets the bytes as block structs and asserts their alignment.
    anyhow::ensure!((bytes.as_ptr() as usize).is_multiple_of(8), "quantized bytes are not 8-byte aligned");
    anyhow::ensure!(bytes.len() == n * k / dtype.block_size() * dtype.type_size(), "upload: wrong byte count");
    let storage = QStorage::from_data(Cow::Borrowed(bytes), dev, dtype)?;
    Ok(QTensor::new(storage, (n, k))?)
}

/// Our linear layer in GGML format `dtype` over `bytes`.
pub fn ggml_linear(bytes: &[u8], n: usize, k: usize, dtype: GgmlDType, dev: &Device) -> Result<QLinear> {
    let w = QMatMul::from_qtensor(upload(bytes, n, k, dtype, dev)?)?;
    Ok(QLinear::Ggml { w, dtype, shape: (n, k), b: None })
}

/// Quantized bytes of random matrices, one per `(n, k, dtype)`; the dense source of a
/// shape is drawn once (normal, std 1/√k) and shared by every dtype.
#[derive(Default)]
pub struct Prototypes {
    dense: HashMap<(usize, usize), Arc<Vec<f32>>>,
    bytes: HashMap<(usize, usize, GgmlDType), Arc<Vec<u8>>>,
}

impl Prototypes {
    /// Seed the dense source of `[n, k]` with given values (so that a benchmark's dense
    /// and quantized rows share a weight).
    pub fn set_dense(&mut self, n: usize, k: usize, w: Vec<f32>) {
        self.dense.insert((n, k), Arc::new(w));
    }

    pub fn dense(&mut self, n: usize, k: usize, dev: &Device) -> Result<Arc<Vec<f32>>> {
        if let Some(w) = self.dense.get(&(n, k)) {
            return Ok(w.clone());
        }
        let t = crate::util::randn(&[n, k], 1.0 / (k as f64).sqrt(), DType::F32, dev)?;
        let w = Arc::new(t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?);
        self.dense.insert((n, k), w.clone());
        Ok(w)
    }

    pub fn bytes(&mut self, n: usize, k: usize, dtype: GgmlDType, dev: &Device) -> Result<Arc<Vec<u8>>> {
        if let Some(b) = self.bytes.get(&(n, k, dtype)) {
            return Ok(b.clone());
        }
        let w = self.dense(n, k, dev)?;
        let t0 = std::time::Instant::now();
        let b =
            Arc::new(quantize_bytes(&w, n, k, dtype).with_context(|| format!("quantizing [{n}, {k}] to {dtype:?}"))?);
        eprintln!("  quantized [{n}, {k}] to {dtype:?} in {:.1}s", t0.elapsed().as_secs_f64());
        self.bytes.insert((n, k, dtype), b.clone());
        Ok(b)
    }

    /// A CPU `QTensor` of the prototype (for writing a GGUF).
    pub fn cpu_qtensor(&mut self, n: usize, k: usize, dtype: GgmlDType, dev: &Device) -> Result<QTensor> {
        let b = self.bytes(n, k, dtype, dev)?;
        upload(&b, n, k, dtype, &Device::Cpu)
    }
}
