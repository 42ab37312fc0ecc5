//! Weights in every format, made fast enough for the benchmark: each distinct matrix
//! shape is quantized once per format ("prototype", by the format's own quantizer) and
//! copied into as many distinct device buffers as needed (the rotation copies, the 32
//! layers of a model, through [`QLinear::deep_copy`]). Values repeat, addresses do not:
//! every read still comes from DRAM. Nothing here knows a format by name.

use anyhow::{Context, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use candle_lowbit::formats::ggml;
use candle_lowbit::{QLinear, WeightFormat};
use std::collections::HashMap;

/// The format of ours that stores rows of `k` in candle's `dt` (so that a stock QMatMul row
/// and ours read the same bytes).
pub fn ggml_format(dt: GgmlDType, k: usize) -> Option<WeightFormat> {
    WeightFormat::ALL
        .iter()
        .copied()
        .find(|&f| ggml::ggml_dtype(f, k) == Some((dt, false)))
}

/// Per-shape dense sources (normal, std 1/√k, f32 on the bench's device) and per-(shape,
/// format) quantized prototypes, all on that device.
pub struct Prototypes {
    dev: Device,
    dense: HashMap<(usize, usize), Tensor>,
    /// By shape, format and whether the layer's input order is folded into its producer.
    layers: HashMap<(usize, usize, WeightFormat, bool), QLinear>,
    /// Draw prototypes directly in their format (random codes and scales, where the format
    /// offers it: models too large to quantize here) instead of quantizing a dense one.
    pub direct: bool,
    /// The quantizer's settings (`--bits`, `--outliers`, ...).
    opts: candle_lowbit::formats::QuantOptions,
}

impl Prototypes {
    pub fn new(dev: &Device, opts: &candle_lowbit::formats::QuantOptions) -> Self {
        Self {
            dev: dev.clone(),
            dense: HashMap::new(),
            layers: HashMap::new(),
            direct: false,
            opts: opts.clone(),
        }
    }

    /// Seed the dense source of `[n, k]` with given values (so that a benchmark's stock and
    /// our rows share a weight).
    pub fn set_dense(&mut self, w: Tensor) -> Result<()> {
        let (n, k) = w.dims2()?;
        self.dense.insert((n, k), w);
        Ok(())
    }

    fn dense(&mut self, n: usize, k: usize, dtype: DType) -> Result<Tensor> {
        if let Some(w) = self.dense.get(&(n, k)) {
            return Ok(w.to_dtype(dtype)?);
        }
        let w = crate::util::randn(&[n, k], 1.0 / (k as f64).sqrt(), DType::F32, &self.dev)?;
        self.dense.insert((n, k), w.clone());
        Ok(w.to_dtype(dtype)?)
    }

    /// The prototype of `[n, k]` in `format` (dense ones in `dtype`).
    pub fn layer(
        &mut self,
        n: usize,
        k: usize,
        format: WeightFormat,
        dtype: DType,
    ) -> Result<QLinear> {
        self.layer_with(n, k, format, dtype, false)
    }

    /// [`Prototypes::layer`] for a model's layer whose input order the model folds into
    /// the layer before it (`folded`: `Slot::input_order_folded`), which then stores none.
    fn layer_with(
        &mut self,
        n: usize,
        k: usize,
        format: WeightFormat,
        dtype: DType,
        folded: bool,
    ) -> Result<QLinear> {
        if let Some(l) = self.layers.get(&(n, k, format, folded)) {
            return Ok(l.clone());
        }
        let opts = match folded {
            true => self.opts.input_in_order(),
            false => self.opts.clone(),
        };
        let t0 = std::time::Instant::now();
        // Formats that need calibration are drawn at random here (speed rows only).
        let drawn = match self.direct || format.needs_calibration() {
            true => {
                format
                    .spec()
                    .codec
                    .random(format, (n, k), &opts, (n * 31 + k) as u64, &self.dev)
            }
            false => None,
        };
        let l = match drawn {
            Some(w) => QLinear::new(w?, None),
            None => QLinear::from_weight(self.dense(n, k, dtype)?, None)?
                .quantize_with(format, None, &opts)
                .with_context(|| format!("quantizing [{n}, {k}] to {format}"))?,
        };
        if format != WeightFormat::Dense {
            self.dev.synchronize()?;
            eprintln!(
                "  quantized [{n}, {k}] to {} in {:.1}s",
                l.format_name(),
                t0.elapsed().as_secs_f64()
            );
        }
        self.layers.insert((n, k, format, folded), l.clone());
        Ok(l)
    }

    /// A fresh copy (own device buffers) of the prototype.
    pub fn copy(
        &mut self,
        n: usize,
        k: usize,
        format: WeightFormat,
        dtype: DType,
    ) -> Result<QLinear> {
        Ok(self.layer(n, k, format, dtype)?.deep_copy()?)
    }

    /// A fresh copy of the prototype for a model's layer in `slot` (see
    /// [`Prototypes::layer_with`]).
    pub fn copy_for(
        &mut self,
        slot: candle_lowbit::llama::Slot,
        (n, k): (usize, usize),
        format: WeightFormat,
        dtype: DType,
    ) -> Result<QLinear> {
        let l = self.layer_with(n, k, format, dtype, slot.input_order_folded())?;
        Ok(l.deep_copy()?)
    }

    /// The prototype's GGML bytes as a `QTensor` on `dev` (for stock candle's rows: a
    /// QMatMul, or a GGUF written for quantized_llama).
    pub fn qtensor(&mut self, n: usize, k: usize, dt: GgmlDType, dev: &Device) -> Result<QTensor> {
        let Some(f) = ggml_format(dt, k) else {
            anyhow::bail!("no format of ours stores [{n}, {k}] as {dt:?}")
        };
        let l = self.layer(n, k, f, DType::F32)?;
        Ok(ggml::qtensor_of(l.weights(), dev)?)
    }
}
