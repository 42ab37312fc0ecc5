//! What every section shares: the run context (device, filter, budget), the timer, the
//! device-memory sampler, error classification, and small tensor helpers.

use crate::report::{Report, Row, Status};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

/// The run: device, options, the report, and the streaming-read ceiling.
pub struct Ctx {
    pub dev: Device,
    /// Activation / dense-weight dtype: f16 on CUDA, f32 on the CPU.
    pub dtype: DType,
    pub quick: bool,
    /// Timed samples per row.
    pub iters: usize,
    pub filters: Vec<String>,
    pub list: bool,
    pub ms: Vec<usize>,
    /// Kernel-row shapes (`--shapes`); empty: the section's own.
    pub shapes: Vec<(usize, usize)>,
    pub report: Report,
    pub ceiling: crate::ceiling::Ceiling,
    /// Quantizer settings of the rows built in a format (`--bits`, `--outliers`, ...).
    pub quant: candle_lowbit::formats::QuantOptions,
    deadline: Option<Instant>,
}

impl Ctx {
    pub fn new(dev: Device, args: &crate::Args) -> Result<Self> {
        let dtype = if dev.is_cuda() {
            DType::F16
        } else {
            DType::F32
        };
        let ceiling = crate::ceiling::Ceiling::new(&dev, args.quick)?;
        if !args.quick && !args.list {
            warm_up(&dev, 1.0)?;
        }
        let deadline = (args.budget_s > 0.0)
            .then(|| Instant::now() + std::time::Duration::from_secs_f64(args.budget_s));
        Ok(Self {
            dev,
            dtype,
            quick: args.quick,
            iters: args.iters.max(1),
            filters: args
                .filter
                .iter()
                .filter(|f| !f.is_empty())
                .cloned()
                .collect(),
            list: args.list,
            ms: args.m.clone(),
            shapes: args.shapes.clone(),
            report: Report::new(args.json),
            ceiling,
            quant: args.calib.quant_options(),
            deadline,
        })
    }

    /// Whether the row `name` is selected by `--filter` (with `--list`: print it, run nothing).
    pub fn wants(&self, name: &str) -> bool {
        let hit = self.filters.is_empty() || self.filters.iter().any(|f| name.contains(f.as_str()));
        if hit && self.list {
            println!("{name}");
            return false;
        }
        hit
    }

    pub fn over_budget(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() > d)
    }

    /// Record `row`.
    pub fn push(&mut self, row: Row) {
        self.report.push(row)
    }

    /// A SKIP row for work the time budget left out.
    pub fn skip_budget(&mut self, group: &'static str, name: &str) {
        self.push(Row::new(group, name).status(Status::Skip, "over the --budget-s time budget"));
    }

    /// One case of `group`'s rows: `f` runs with the `names` the filters want (none: nothing
    /// runs) and reports them; over the time budget they are skipped; if `f` fails, each
    /// wanted row it did not report gets the error, and the device is checked.
    pub fn run_case(
        &mut self,
        group: &'static str,
        names: impl IntoIterator<Item = String>,
        label: &str,
        f: impl FnOnce(&mut Ctx, &[String]) -> Result<()>,
    ) -> Result<()> {
        let wanted: Vec<String> = names.into_iter().filter(|n| self.wants(n)).collect();
        if wanted.is_empty() {
            return Ok(());
        }
        if self.over_budget() {
            wanted.iter().for_each(|n| self.skip_budget(group, n));
            return Ok(());
        }
        eprintln!("{group}: {label}");
        if let Err(e) = f(self, &wanted) {
            let (status, note) = classify(&e);
            let done: Vec<String> = self.report.rows.iter().map(|r| r.name.clone()).collect();
            for n in wanted.iter().filter(|n| !done.contains(n)) {
                self.push(Row::new(group, n).status(status, note.clone()));
            }
            self.check_device()?;
        }
        Ok(())
    }

    /// After a failed row: make sure the device still works (a sticky CUDA error, e.g.
    /// an illegal address, poisons every later row; stop then rather than report garbage).
    pub fn check_device(&self) -> Result<()> {
        self.dev
            .synchronize()
            .map_err(|e| anyhow::anyhow!("the device is unusable after an error, stopping: {e}"))
    }
}

/// A row's status and note for an error: OOM if the message says so.
pub fn classify(e: &anyhow::Error) -> (Status, String) {
    let s = format!("{e:#}");
    let lower = s.to_lowercase();
    let first = s
        .lines()
        .next()
        .unwrap_or("")
        .chars()
        .take(160)
        .collect::<String>();
    if lower.contains("out of memory") || lower.contains("out_of_memory") {
        (Status::Oom, first)
    } else {
        (Status::Err, first)
    }
}

/// Timing of one row: seconds per iteration.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Timing {
    /// (max − min) / median of the samples, in percent: how far to trust a difference.
    pub fn spread_pct(&self) -> f64 {
        (self.max - self.min) / self.median * 100.0
    }
}

pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Time `f(i)` (iteration `i`; rotate inputs with it): warm up, estimate one call, then
/// `samples` samples of back-to-back calls between two synchronizes, each sample at
/// least `min_sample_s` long. Returns the median, min and max seconds per call.
pub fn time_batched(
    dev: &Device,
    samples: usize,
    min_sample_s: f64,
    mut f: impl FnMut(usize) -> candle_core::Result<()>,
) -> Result<Timing> {
    let mut i = 0;
    for _ in 0..2 {
        f(i)?;
        i += 1;
    }
    dev.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..3 {
        f(i)?;
        i += 1;
    }
    dev.synchronize()?;
    let est = (t0.elapsed().as_secs_f64() / 3.0).max(1e-7);
    let per_sample = ((min_sample_s / est).ceil() as usize).clamp(1, 20_000);
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples.max(1) {
        dev.synchronize()?;
        let t0 = Instant::now();
        for _ in 0..per_sample {
            f(i)?;
            i += 1;
        }
        dev.synchronize()?;
        v.push(t0.elapsed().as_secs_f64() / per_sample as f64);
    }
    let min = v.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = v.iter().cloned().fold(0f64, f64::max);
    Ok(Timing {
        median: median(&mut v),
        min,
        max,
    })
}

/// How many copies of a `bytes`-sized buffer to cycle through so that together they
/// exceed `ROTATE_BYTES` (L2 on the H200 is 60 MB); at least 1, at most `max`.
pub const ROTATE_BYTES: usize = 256 << 20;

pub fn rotation(bytes: usize, max: usize) -> usize {
    ROTATE_BYTES.div_ceil(bytes.max(1)).clamp(1, max.max(1))
}

/// ‖y − r‖ / ‖r‖ over all elements (f32), NaN if either holds a non-finite value.
pub fn rel_err(y: &Tensor, r: &Tensor) -> Result<f64> {
    let y = y.to_dtype(DType::F32)?;
    let r = r.to_dtype(DType::F32)?;
    anyhow::ensure!(
        y.dims() == r.dims(),
        "output {:?} vs reference {:?}",
        y.dims(),
        r.dims()
    );
    let num = (&y - &r)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    let den = r.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    let e = (num / den.max(1e-30)).sqrt();
    Ok(if e.is_finite() { e } else { f64::NAN })
}

/// A random normal tensor on `dev`. candle draws f32 only, so large tensors are drawn in
/// chunks of 64M values, each cast to `dtype` (bounding the f32 temporary).
pub fn randn(shape: &[usize], std: f64, dtype: DType, dev: &Device) -> Result<Tensor> {
    const CHUNK: usize = 64 << 20;
    let n: usize = shape.iter().product();
    if n <= CHUNK {
        return Ok(Tensor::randn(0f32, std as f32, shape, dev)?.to_dtype(dtype)?);
    }
    let chunks = (0..n)
        .step_by(CHUNK)
        .map(|s| Ok(Tensor::randn(0f32, std as f32, CHUNK.min(n - s), dev)?.to_dtype(dtype)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&chunks, 0)?.reshape(shape)?)
}

/// Bytes of a tensor.
pub fn nbytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Device memory in use (total − free, every process), sampled by a background thread
/// every millisecond while alive; `stop` returns the peak in bytes (None on the CPU).
pub struct MemSampler {
    #[cfg(feature = "cuda")]
    inner: Option<(
        std::sync::Arc<std::sync::atomic::AtomicBool>,
        std::thread::JoinHandle<usize>,
    )>,
}

impl MemSampler {
    pub fn start(dev: &Device) -> Self {
        #[cfg(feature = "cuda")]
        {
            use std::sync::atomic::{AtomicBool, Ordering};
            let Device::Cuda(d) = dev else {
                return Self { inner: None };
            };
            let ctx = d.cuda_stream().context().clone();
            let stop = std::sync::Arc::new(AtomicBool::new(false));
            let stop2 = stop.clone();
            let handle = std::thread::spawn(move || {
                let mut peak = 0usize;
                loop {
                    if let Ok((free, total)) = ctx.mem_get_info() {
                        peak = peak.max(total.saturating_sub(free));
                    }
                    if stop2.load(Ordering::Relaxed) {
                        return peak;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            });
            Self {
                inner: Some((stop, handle)),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = dev;
            Self {}
        }
    }

    pub fn stop(self) -> Option<usize> {
        #[cfg(feature = "cuda")]
        {
            let (stop, handle) = self.inner?;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            handle.join().ok()
        }
        #[cfg(not(feature = "cuda"))]
        None
    }
}

/// Device memory in use now (total − free), if known.
pub fn mem_used(dev: &Device) -> Option<usize> {
    MemSampler::start(dev).stop()
}

/// `(name, SM count)` of the device.
pub fn device_info(dev: &Device) -> (String, usize) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
        let ctx = d.cuda_stream().context().clone();
        let name = ctx.name().unwrap_or_else(|_| "cuda".into());
        let sms = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(132);
        return (name, sms.max(1) as usize);
    }
    let _ = dev;
    ("cpu".into(), 1)
}

pub fn gib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// Seeded token ids `[b, n]` in `0..vocab`.
pub fn token_ids(b: usize, n: usize, vocab: usize, seed: u64, dev: &Device) -> Result<Tensor> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let ids: Vec<u32> = (0..b * n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect();
    Ok(Tensor::from_vec(ids, (b, n), dev)?)
}

/// Keep the GPU busy for `secs` before the first timed row. Without it the first row of a
/// run (stock f16 4096x4096, m = 1) read 17.8–22.0 µs in three runs on 2026-12-01, and
/// 14.2–16.1 µs in four runs with it (DESIGN.md §3: 13.3): an idle GPU starts slow.
pub fn warm_up(dev: &Device, secs: f64) -> Result<()> {
    if !dev.is_cuda() {
        return Ok(());
    }
    let (_, sms) = device_info(dev);
    let x = randn(&[128 << 20], 1.0, DType::F16, dev)?; // 256 MiB
    let blocks = candle_lowbit::ops::stream_read_blocks(256 << 20, sms);
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < secs {
        for _ in 0..16 {
            candle_lowbit::ops::stream_read(&x, blocks)?;
        }
        dev.synchronize()?;
    }
    Ok(())
}

/// Runs `f` (one decode step) between `cuProfilerStart` and `cuProfilerStop` when
/// `CANDLE_LOWBIT_PROFILE_STEP` is set, for `ncu --profile-from-start off` (e.g. with
/// `--graph-profiling node`: every kernel of one replayed step); otherwise does nothing.
pub fn profile_step(dev: &Device, f: impl FnOnce() -> Result<()>) -> Result<()> {
    if std::env::var_os("CANDLE_LOWBIT_PROFILE_STEP").is_none() {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        use candle_core::cuda_backend::cudarc::driver::sys;
        d.cuda_stream().context().bind_to_thread()?;
        dev.synchronize()?;
        unsafe { sys::cuProfilerStart() }.result()?;
        f()?;
        dev.synchronize()?;
        unsafe { sys::cuProfilerStop() }.result()?;
        return Ok(());
    }
    let _ = (dev, f);
    Ok(())
}
