//! Calibration: statistics of real activations, gathered by running a loaded [`Llama`] over
//! calibration text one block at a time ([`Llama::block_prefill`] with an [`Observer`]),
//! and the sequential quantization that GPTQ formats need.
//!
//! - [`windows`]: `samples` windows of `len` tokens from the tokenized text, at seeded
//!   random offsets (as GPTQ's and Atom's scripts draw them).
//! - [`collect`]: one pass, every block: for each linear layer's input the per-channel sum
//!   of squares (`diag(XᵀX)`), absmax and, where asked, the full `XᵀX` (f32, on the model's
//!   device); for each layer's K (before and after RoPE) and V the value quantiles at the
//!   given fractions, averaged over passes (batches) as Oaken's code averages them.
//! - [`quantize_model`]: GPTQ's sequential mode: block `i` is calibrated on inputs that the
//!   already quantized blocks before it produced, quantized, and then run again (quantized)
//!   to produce block `i + 1`'s inputs. Memory stays bounded: one block's Hessians at a time,
//!   plus the residual stream of every window.

use crate::formats::{Activation, QuantOptions, WeightFormat};
use crate::kv::KvFormat;
use crate::llama::{Cache, Config, Llama, NoObserver, Observer, Slot};
use candle_core::{DType, Device, Result, Tensor};
use std::collections::HashMap;

/// How calibration samples its text.
#[derive(Debug, Clone, PartialEq)]
pub struct CalibConfig {
    /// Windows of text.
    pub samples: usize,
    /// Tokens per window.
    pub len: usize,
    /// Seed of the window offsets.
    pub seed: u64,
    /// Windows per forward pass.
    pub batch: usize,
}

impl Default for CalibConfig {
    /// 128 windows of 512 tokens, seed 0, 8 per pass: the defaults for small models.
    fn default() -> Self {
        Self {
            samples: 128,
            len: 512,
            seed: 0,
            batch: 8,
        }
    }
}

/// `cfg.samples` windows of `cfg.len` tokens of `tokens`, starting at seeded uniform offsets.
pub fn windows(tokens: &[u32], cfg: &CalibConfig) -> Result<Vec<Vec<u32>>> {
    use rand::{Rng, SeedableRng};
    if cfg.samples == 0 || cfg.len == 0 {
        candle_core::bail!(
            "calibration: {} samples of {} tokens (both must be at least 1)",
            cfg.samples,
            cfg.len
        )
    }
    if tokens.len() < cfg.len {
        candle_core::bail!(
            "calibration text has {} tokens, fewer than one window of {}",
            tokens.len(),
            cfg.len
        )
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(cfg.seed);
    Ok((0..cfg.samples)
        .map(|_| {
            let s = rng.gen_range(0..=tokens.len() - cfg.len);
            tokens[s..s + cfg.len].to_vec()
        })
        .collect())
}

/// What a long calibration reports as it goes (the tools draw progress bars from it).
pub trait Progress {
    /// A stage of `total` steps begins.
    fn start(&mut self, stage: &str, total: usize);
    /// One step of the stage is done; `what` names what it worked on (a layer).
    fn step(&mut self, what: &str);
    fn finish(&mut self);
}

/// Progress that shows nothing.
pub struct Quiet;

impl Progress for Quiet {
    fn start(&mut self, _: &str, _: usize) {}
    fn step(&mut self, _: &str) {}
    fn finish(&mut self) {}
}

/// Statistics of one linear layer's input over `count` rows (tokens).
#[derive(Debug, Clone)]
pub struct InputStats {
    pub count: usize,
    /// f32 `[k]`: Σ x² per channel, `diag(XᵀX)`.
    pub sq: Tensor,
    /// f32 `[k]`: max |x| per channel.
    pub absmax: Tensor,
    /// f32 `[k, k]`: `XᵀX`, where it was asked for.
    pub xtx: Option<Tensor>,
}

impl InputStats {
    /// GPTQ's Hessian `XᵀX / count` `[k, k]`.
    pub fn hessian(&self) -> Result<Tensor> {
        match &self.xtx {
            Some(x) => x / self.count.max(1) as f64,
            None => candle_core::bail!("calibration gathered no XᵀX for this layer"),
        }
    }

    fn add(&mut self, x: &Tensor, full: bool) -> Result<()> {
        self.count += x.dim(0)?;
        self.sq = (&self.sq + x.sqr()?.sum(0)?)?;
        self.absmax = self.absmax.maximum(&x.abs()?.max(0)?)?;
        if full {
            let xtx = x.t()?.matmul(x)?;
            self.xtx = Some(match self.xtx.take() {
                Some(acc) => (acc + xtx)?,
                None => xtx,
            });
        }
        Ok(())
    }
}

/// K / V value quantiles of one layer at the configured fractions, averaged over passes.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvQuantiles {
    pub k_pre_rope: Vec<f64>,
    pub k_post_rope: Vec<f64>,
    pub v: Vec<f64>,
    pub passes: usize,
}

/// The `f` quantile of `v` (sorted ascending) with linear interpolation, as `torch.quantile`.
pub fn quantile(sorted: &[f32], f: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = f.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    let t = pos - lo as f64;
    sorted[lo] as f64 * (1.0 - t) + sorted[hi] as f64 * t
}

fn quantiles(t: &Tensor, fractions: &[f64]) -> Result<Vec<f64>> {
    let mut v = t
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_device(&Device::Cpu)?
        .to_vec1::<f32>()?;
    v.sort_unstable_by(f32::total_cmp);
    Ok(fractions.iter().map(|&f| quantile(&v, f)).collect())
}

/// What [`collect`] gathers.
#[derive(Debug, Clone)]
pub struct Stats {
    pub inputs: HashMap<(usize, Slot), InputStats>,
    /// Per layer (empty where no fractions were asked for).
    pub kv: Vec<KvQuantiles>,
    pub kv_fractions: Vec<f64>,
    /// Per layer, where asked for: sampled K / V rows for Oaken's threshold search.
    pub kv_rows: Vec<KvRows>,
}

/// Rows of one layer's K (as the cache stores it: before or after RoPE) and V,
/// `[n, nkv · hd]` flattened: every `stride`-th token of the calibration text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvRows {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// Tokens seen so far (sampled or not).
    pub tokens: usize,
}

/// The observer behind [`collect`] and [`quantize_model`].
struct Collector {
    /// Layers whose inputs get a full `XᵀX`.
    full: Vec<usize>,
    kv_fractions: Vec<f64>,
    /// Keep every `kv_stride`-th token's K / V rows (0: none); K before RoPE where
    /// `k_pre_rope`.
    kv_stride: usize,
    k_pre_rope: bool,
    stats: Stats,
}

impl Collector {
    fn new(
        full: Vec<usize>,
        kv_fractions: Vec<f64>,
        (kv_stride, k_pre_rope): (usize, bool),
    ) -> Self {
        let stats = Stats {
            inputs: HashMap::new(),
            kv: vec![],
            kv_fractions: kv_fractions.clone(),
            kv_rows: vec![],
        };
        Self {
            full,
            kv_fractions,
            kv_stride,
            k_pre_rope,
            stats,
        }
    }

    fn keep_rows(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        if self.stats.kv_rows.len() <= layer {
            self.stats.kv_rows.resize(layer + 1, KvRows::default());
        }
        let width = v.dim(candle_core::D::Minus1)?;
        let rows = |t: &Tensor| -> Result<Vec<f32>> {
            t.to_dtype(DType::F32)?
                .flatten_all()?
                .to_device(&Device::Cpu)?
                .to_vec1::<f32>()
        };
        let (a, c) = (rows(k)?, rows(v)?);
        let r = &mut self.stats.kv_rows[layer];
        let n = c.len() / width.max(1);
        for t in 0..n {
            if (r.tokens + t).is_multiple_of(self.kv_stride) {
                let span = t * width..(t + 1) * width;
                r.k.extend_from_slice(&a[span.clone()]);
                r.v.extend_from_slice(&c[span]);
            }
        }
        r.tokens += n;
        Ok(())
    }
}

impl Observer for Collector {
    fn linear_input(&mut self, layer: usize, slot: Slot, x: &Tensor) -> Result<()> {
        let k = x.dim(candle_core::D::Minus1)?;
        let x = x
            .reshape((x.elem_count() / k.max(1), k))?
            .to_dtype(DType::F32)?;
        let full = self.full.contains(&layer);
        let e = match self.stats.inputs.entry((layer, slot)) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => v.insert(InputStats {
                count: 0,
                sq: Tensor::zeros(k, DType::F32, x.device())?,
                absmax: Tensor::zeros(k, DType::F32, x.device())?,
                xtx: None,
            }),
        };
        e.add(&x, full)
    }

    fn wants_kv(&self) -> bool {
        !self.kv_fractions.is_empty()
    }

    fn kv(&mut self, layer: usize, k_pre: &Tensor, k_post: &Tensor, v: &Tensor) -> Result<()> {
        if self.stats.kv.len() <= layer {
            self.stats.kv.resize(layer + 1, KvQuantiles::default());
        }
        let f = &self.kv_fractions;
        let (a, b, c) = (
            quantiles(k_pre, f)?,
            quantiles(k_post, f)?,
            quantiles(v, f)?,
        );
        let q = &mut self.stats.kv[layer];
        let n = q.passes as f64;
        let mean = |acc: &mut Vec<f64>, new: Vec<f64>| {
            if acc.is_empty() {
                *acc = new;
            } else {
                acc.iter_mut()
                    .zip(new)
                    .for_each(|(m, x)| *m = (*m * n + x) / (n + 1.0));
            }
        };
        mean(&mut q.k_pre_rope, a);
        mean(&mut q.k_post_rope, b);
        mean(&mut q.v, c);
        q.passes += 1;
        if self.kv_stride > 0 {
            let k = if self.k_pre_rope { k_pre } else { k_post };
            self.keep_rows(layer, k, v)?;
        }
        Ok(())
    }
}

/// The windows as batches of token ids `[b, len]` on `dev`.
fn batches(windows: &[Vec<u32>], batch: usize, dev: &Device) -> Result<Vec<Tensor>> {
    let Some(len) = windows.first().map(Vec::len) else {
        candle_core::bail!("calibration: no windows")
    };
    if windows.iter().any(|w| w.len() != len) {
        candle_core::bail!("calibration: windows of different lengths")
    }
    windows
        .chunks(batch.max(1))
        .map(|c| Tensor::from_vec(c.concat(), (c.len(), len), dev))
        .collect()
}

fn cache_for(model: &Llama, cfg: &Config, len: usize, dtype: DType, dev: &Device) -> Result<Cache> {
    if cfg.num_hidden_layers != model.num_layers() {
        candle_core::bail!(
            "config has {} layers, the model {}",
            cfg.num_hidden_layers,
            model.num_layers()
        )
    }
    Cache::with_capacity(len, KvFormat::Dense, dtype, cfg, dev)
}

/// One pass of `model` over `windows` (equal lengths), block by block: every linear
/// input's statistics (a full `XᵀX` for the layers in `full`) and, if `kv_fractions` is not
/// empty, the K/V quantiles of every layer. `dtype` is the model's run dtype.
pub fn collect(
    model: &Llama,
    cfg: &Config,
    windows: &[Vec<u32>],
    (batch, dtype): (usize, DType),
    (full, kv_fractions): (Vec<usize>, Vec<f64>),
    progress: &mut dyn Progress,
) -> Result<Stats> {
    let obs = Collector::new(full, kv_fractions, (0, false));
    run_collector(model, cfg, windows, (batch, dtype), obs, progress)
}

fn run_collector(
    model: &Llama,
    cfg: &Config,
    windows: &[Vec<u32>],
    (batch, dtype): (usize, DType),
    mut obs: Collector,
    progress: &mut dyn Progress,
) -> Result<Stats> {
    let dev = model.lm_head().weights().device();
    let ids = batches(windows, batch, &dev)?;
    let mut cache = cache_for(model, cfg, windows[0].len(), dtype, &dev)?;
    progress.start("calibration", ids.len() * model.num_layers());
    for b in &ids {
        let (mut res, mut xn) = model.embed(b)?;
        for layer in 0..model.num_layers() {
            (res, xn) = model.block_prefill(layer, (&res, &xn), &mut cache, &mut obs)?;
            progress.step(&format!("model.layers.{layer}"));
        }
    }
    progress.finish();
    Ok(obs.stats)
}

/// How [`oaken_thresholds`] sets each layer's thresholds.
#[derive(Debug, Clone, PartialEq)]
pub enum OakenChoice {
    /// The same fractions for every layer and for K and V (the paper's rule).
    Fixed(crate::kv::OakenFractions),
    /// Per layer and separately for K and V, the candidate whose thresholds give the least
    /// squared error of the encoded-then-decoded rows (the CPU reference codec), on about
    /// `rows` sampled (token, KV head) rows of the calibration text. The default:
    /// [`OakenChoice::search`].
    Search {
        candidates: Vec<crate::kv::OakenFractions>,
        rows: usize,
    },
}

impl OakenChoice {
    /// The search over [`crate::kv::oaken::search_grid`] on 16 384 rows.
    pub fn search() -> Self {
        Self::Search {
            candidates: crate::kv::oaken::search_grid(),
            rows: 16384,
        }
    }
}

/// Oaken's per-layer thresholds for `model`: one pass over `windows` gathering the K
/// (after RoPE, as the cache stores it, or before where `k_pre_rope`) and V quantiles at
/// the fractions `choice` asks for, averaged over the passes as the authors' code does.
/// The result's `picked` names each layer's chosen K and V fractions (empty for
/// [`OakenChoice::Fixed`]); its `fractions` is the fixed one, or the first candidate.
pub fn oaken_thresholds(
    model: &Llama,
    cfg: &Config,
    windows: &[Vec<u32>],
    (batch, dtype): (usize, DType),
    (choice, k_pre_rope): (&OakenChoice, bool),
    progress: &mut dyn Progress,
) -> Result<crate::kv::oaken::OakenCalibration> {
    let candidates = match choice {
        OakenChoice::Fixed(f) => vec![*f],
        OakenChoice::Search { candidates, .. } => candidates.clone(),
    };
    if candidates.is_empty() {
        candle_core::bail!("oaken calibration: no candidate fractions")
    }
    let mut fractions = vec![];
    for c in &candidates {
        fractions.extend(c.quantiles()?);
    }
    let hd = cfg.hidden_size / cfg.num_attention_heads.max(1);
    let stride = match choice {
        OakenChoice::Fixed(_) => 0,
        OakenChoice::Search { rows, .. } => {
            let tokens: usize = windows.iter().map(Vec::len).sum();
            (tokens * cfg.num_key_value_heads)
                .div_ceil((*rows).max(1))
                .max(1)
        }
    };
    let obs = Collector::new(vec![], fractions, (stride, k_pre_rope));
    let stats = run_collector(model, cfg, windows, (batch, dtype), obs, progress)?;
    if stats.kv.len() != model.num_layers() {
        candle_core::bail!(
            "oaken calibration: K/V quantiles for {} of {} layers",
            stats.kv.len(),
            model.num_layers()
        )
    }
    let mut layers = Vec::with_capacity(stats.kv.len());
    let mut picked = Vec::with_capacity(stats.kv.len());
    for (i, q) in stats.kv.iter().enumerate() {
        let k = if k_pre_rope {
            &q.k_pre_rope
        } else {
            &q.k_post_rope
        };
        let layer_of = |c: usize| {
            let span = 4 * c..4 * c + 4;
            crate::kv::OakenLayer::from_quantiles(&k[span.clone()], &q.v[span])
                .map_err(|e| candle_core::Error::Msg(format!("layer {i}: {e}")))
        };
        let tried = (0..candidates.len())
            .map(layer_of)
            .collect::<Result<Vec<_>>>()?;
        let (kc, vc) = match stats.kv_rows.get(i) {
            Some(r) if stride > 0 => {
                let best = |kv: usize, rows: &[f32]| {
                    let err = |c: &crate::kv::OakenLayer| {
                        let t = if kv == 0 { &c.k } else { &c.v };
                        crate::kv::oaken::sq_error(kv, rows, hd, t)
                    };
                    use rayon::prelude::*;
                    let e: Vec<f64> = tried.par_iter().map(err).collect();
                    (0..e.len())
                        .min_by(|&a, &b| e[a].total_cmp(&e[b]))
                        .unwrap_or(0)
                };
                (best(0, &r.k), best(1, &r.v))
            }
            _ => (0, 0),
        };
        layers.push(crate::kv::OakenLayer {
            k: tried[kc].k,
            v: tried[vc].v,
        });
        picked.push([candidates[kc], candidates[vc]]);
    }
    if stride == 0 {
        picked.clear();
    }
    Ok(crate::kv::oaken::OakenCalibration {
        fractions: candidates[0],
        k_rope: if k_pre_rope { "pre-rope" } else { "post-rope" }.into(),
        layers,
        picked,
    })
}

/// What [`quantize_model`] did, and where its time went (seconds; the device synchronized
/// at each stage's end).
#[derive(Debug, Clone, Default)]
pub struct QuantReport {
    pub format: Option<WeightFormat>,
    pub seconds: f64,
    /// Calibration tokens each layer saw.
    pub tokens: usize,
    /// Embedding every window.
    pub embed_s: f64,
    /// The observed passes of the dense blocks (statistics, Hessians).
    pub calibrate_s: f64,
    /// Quantizing the blocks' layers (GPTQ).
    pub quantize_s: f64,
    /// The passes of the quantized blocks (the next blocks' inputs).
    pub propagate_s: f64,
    /// Quantizing the output head.
    pub head_s: f64,
}

/// Quantize every linear layer of `model` in `format`, the head in
/// [`Llama::head_format`]. Formats that use calibration go through the sequential mode
/// over `windows` (see the module docs; GPTQ formats need them, `w2416` ranks its tiles by
/// them where given); others are rounded directly and `windows` is not read. `dtype` is the model's run dtype.
pub fn quantize_model(
    model: &mut Llama,
    cfg: &Config,
    format: WeightFormat,
    opts: &QuantOptions,
    (windows, calib): (&[Vec<u32>], &CalibConfig),
    dtype: DType,
    progress: &mut dyn Progress,
) -> Result<QuantReport> {
    let t0 = std::time::Instant::now();
    let mut report = QuantReport {
        format: Some(format),
        ..Default::default()
    };
    if !format.uses_calibration() || (windows.is_empty() && !format.needs_calibration()) {
        progress.start("quantize", 1);
        model.quantize_with(format, opts)?;
        progress.step("every layer");
        progress.finish();
        report.seconds = t0.elapsed().as_secs_f64();
        return Ok(report);
    }
    let dev = model.lm_head().weights().device();
    let mut clock = Clock::new(&dev)?;
    let ids = batches(windows, calib.batch, &dev)?;
    let mut cache = cache_for(model, cfg, windows[0].len(), dtype, &dev)?;
    let mut states: Vec<(Tensor, Activation)> =
        ids.iter().map(|b| model.embed(b)).collect::<Result<_>>()?;
    report.embed_s = clock.lap()?;
    let layers = model.num_layers();
    progress.start(
        &format!("{format} (GPTQ, sequential)"),
        layers * (2 * ids.len() + 1),
    );
    for layer in 0..layers {
        let name = format!("model.layers.{layer}");
        let mut obs = Collector::new(vec![layer], vec![], (0, false));
        for (res, xn) in &states {
            model.block_prefill(layer, (res, xn), &mut cache, &mut obs)?;
            progress.step(&format!("{name} calibrate"));
        }
        report.calibrate_s += clock.lap()?;
        let hessian = |slot: Slot| match obs.stats.inputs.get(&(layer, slot)) {
            Some(st) => st.hessian(),
            None => candle_core::bail!("calibration saw no input for {name} {}", slot.name()),
        };
        let down = model.fold_down_order(layer, format, opts, Some(&hessian(Slot::Down)?))?;
        for slot in Slot::ALL {
            let h = match (slot, &down) {
                (Slot::Down, Some(h)) => h.clone(),
                _ => hessian(slot)?,
            };
            let q = model
                .linear(layer, slot)?
                .quantize_with(format, Some(&h), opts)?;
            model.set_linear(layer, slot, q)?;
        }
        drop(obs);
        progress.step(&format!("{name} quantize"));
        report.quantize_s += clock.lap()?;
        // The last block's outputs feed nothing.
        for s in states.iter_mut().filter(|_| layer + 1 < layers) {
            *s = model.block_prefill(layer, (&s.0, &s.1), &mut cache, &mut NoObserver)?;
            progress.step(&format!("{name} propagate"));
        }
        report.propagate_s += clock.lap()?;
    }
    let head = model.lm_head().quantize(Llama::head_format(format))?;
    model.set_lm_head(head)?;
    report.head_s = clock.lap()?;
    progress.finish();
    report.tokens = windows.iter().map(Vec::len).sum();
    report.seconds = t0.elapsed().as_secs_f64();
    Ok(report)
}

/// Seconds between laps, with the device synchronized at each lap (its work is async).
struct Clock {
    dev: Device,
    t: std::time::Instant,
}

impl Clock {
    fn new(dev: &Device) -> Result<Self> {
        dev.synchronize()?;
        Ok(Self {
            dev: dev.clone(),
            t: std::time::Instant::now(),
        })
    }

    fn lap(&mut self) -> Result<f64> {
        self.dev.synchronize()?;
        let now = std::time::Instant::now();
        let s = (now - self.t).as_secs_f64();
        self.t = now;
        Ok(s)
    }
}
