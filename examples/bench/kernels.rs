//! Section 1: matmul kernels at Llama-2-7B shapes (or `--shapes`).
//!
//! `y[m, n] = x[m, k] · W[n, k]ᵀ` for every implementation:
//! - `candle-f16`: stock candle, `x.matmul(&w.t())` in f16 (cuBLAS), the baseline;
//! - `candle-<q>`: stock `QMatMul` in Q4_0, Q4K, Q3K, Q2K, fed f32 as candle's own models do;
//! - `ours-<format>`: our `QLinear` in every format the registry times
//!   (`WeightFormat::timed()`: a GPTQ variant stores exactly as its round-to-nearest twin),
//!   fed the run dtype (f16), exactly as our Llama calls it.
//!
//! Each (shape, implementation) holds enough distinct copies of its weight that together
//! they exceed 256 MiB (L2 is 60 MB) and cycles through them. Each row is checked against
//! `x_f32 · deq(W)ᵀ` in f32 over the same quantized weight before it is timed.
//! Bytes counted: the weight in its format (codes, scales, everything), x as passed, y.

use crate::quant::Prototypes;
use crate::report::{Row, Status};
use crate::util::{classify, randn, rel_err, rotation, time_batched, Ctx, Timing};
use anyhow::Result;
use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Module, Tensor};
use candle_lowbit::{QLinear, WeightFormat};

/// Samples of at least this long (back-to-back calls between two synchronizes).
pub const MIN_SAMPLE_S: f64 = 2e-3;

#[derive(Debug, Clone, Copy)]
enum Impl {
    CandleF16,
    CandleGgml(GgmlDType),
    Ours(WeightFormat),
}

impl Impl {
    fn name(&self) -> String {
        match self {
            Self::CandleF16 => "candle-f16".into(),
            Self::CandleGgml(d) => format!("candle-{}", format!("{d:?}").to_lowercase()),
            Self::Ours(f) => format!("ours-{}", f.name()),
        }
    }

    fn all() -> Vec<Self> {
        let mut v = vec![Self::CandleF16];
        v.extend(
            [
                GgmlDType::Q4_0,
                GgmlDType::Q4K,
                GgmlDType::Q3K,
                GgmlDType::Q2K,
            ]
            .map(Self::CandleGgml),
        );
        v.extend(WeightFormat::timed().map(Self::Ours));
        v
    }

    /// Relative-error bound against the f32 reference over the same quantized weight:
    /// f16 output rounding; candle quantizes x to 8 bits (q8_1) in its GGML kernels; each
    /// format of ours states its own (`FormatSpec::tolerance`).
    fn tolerance(&self) -> f64 {
        match self {
            Self::CandleF16 => 5e-3,
            Self::CandleGgml(_) => 3e-2,
            Self::Ours(f) => f.spec().tolerance,
        }
    }
}

/// One implementation's weight, in `n_copies` distinct device buffers.
enum Weights {
    Dense(Vec<Tensor>),
    Ggml(Vec<QMatMul>),
    Ours(Vec<QLinear>),
}

struct Shape {
    n: usize,
    k: usize,
    w: Tensor,
    xs: Vec<(usize, Tensor, Tensor)>,
}

pub fn run(ctx: &mut Ctx) -> Result<()> {
    let shapes: Vec<(usize, usize)> = if !ctx.shapes.is_empty() {
        ctx.shapes.clone()
    } else if ctx.quick {
        vec![(256, 256), (512, 768)]
    } else {
        vec![(4096, 4096), (11008, 4096), (4096, 11008)]
    };
    let ms: Vec<usize> = if !ctx.ms.is_empty() {
        ctx.ms.clone()
    } else if ctx.quick {
        vec![1, 3, 16]
    } else {
        vec![1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096]
    };
    for &(n, k) in &shapes {
        let wanted: Vec<Impl> = Impl::all()
            .into_iter()
            .filter(|i| ms.iter().any(|&m| ctx.wants(&row_name(n, k, i, m))))
            .collect();
        if wanted.is_empty() {
            continue;
        }
        eprintln!(
            "kernels: {n}x{k}, {} implementations, m in {ms:?}",
            wanted.len()
        );
        run_shape(ctx, n, k, &ms, &wanted)?;
    }
    if !ctx.quick {
        design_check(ctx);
    }
    ctx.report.print_group("kernels");
    Ok(())
}

/// Stock candle's µs per call on this H200 as DESIGN.md §3 records them: `(n, k, m, impl, µs)`.
const DESIGN_US: &[(usize, usize, usize, &str, f64)] = &[
    (4096, 4096, 1, "candle-f16", 13.3),
    (4096, 4096, 1, "candle-q4_0", 9.1),
    (4096, 4096, 1, "candle-q4k", 9.8),
    (4096, 4096, 1, "candle-q2k", 11.1),
    (11008, 4096, 1, "candle-f16", 25.6),
    (11008, 4096, 1, "candle-q4_0", 14.7),
    (11008, 4096, 1, "candle-q4k", 16.8),
    (11008, 4096, 1, "candle-q2k", 18.4),
    (4096, 11008, 1, "candle-f16", 29.3),
    (4096, 11008, 1, "candle-q4_0", 15.0),
    (4096, 11008, 1, "candle-q4k", 16.4),
    (4096, 11008, 1, "candle-q2k", 17.3),
    (11008, 4096, 16, "candle-f16", 26.8),
    (11008, 4096, 16, "candle-q4_0", 35.1),
    (11008, 4096, 16, "candle-q4k", 32.6),
    (11008, 4096, 16, "candle-q2k", 39.2),
    (11008, 4096, 256, "candle-f16", 36.1),
    (11008, 4096, 256, "candle-q4_0", 144.9),
    (11008, 4096, 256, "candle-q4k", 167.5),
    (11008, 4096, 256, "candle-q2k", 345.4),
];

/// The method's sanity check: stock candle's rows of this run against DESIGN.md §3
/// (table `kernels: vs DESIGN.md`), FAIL beyond ±25%.
fn design_check(ctx: &mut Ctx) {
    for &(n, k, m, imp, want) in DESIGN_US {
        let name = format!("kernels/{n}x{k}/{imp}/m={m}");
        let Some(got) = ctx
            .report
            .rows
            .iter()
            .find(|r| r.name == name)
            .and_then(|r| r.get("us"))
        else {
            continue;
        };
        let ratio = got / want;
        let row = Row::new("kernels", &format!("{name}/design"))
            .table("vs DESIGN.md §3")
            .num("design_us", want)
            .num("us", got)
            .num("ratio", ratio);
        let row = if (0.75..=1.25).contains(&ratio) {
            row
        } else {
            row.status(Status::Fail, "more than 25% off DESIGN.md §3")
        };
        ctx.push(row);
    }
}

fn row_name(n: usize, k: usize, i: &Impl, m: usize) -> String {
    format!("kernels/{n}x{k}/{}/m={m}", i.name())
}

fn run_shape(ctx: &mut Ctx, n: usize, k: usize, ms: &[usize], wanted: &[Impl]) -> Result<()> {
    let dev = ctx.dev.clone();
    let w = randn(&[n, k], 1.0 / (k as f64).sqrt(), ctx.dtype, &dev)?;
    let mut protos = Prototypes::new(&dev, &ctx.quant);
    protos.set_dense(w.to_dtype(DType::F32)?)?;
    let xs = ms
        .iter()
        .map(|&m| {
            let x = randn(&[m, k], 1.0, ctx.dtype, &dev)?;
            let x32 = x.to_dtype(DType::F32)?;
            Ok((m, x, x32))
        })
        .collect::<Result<Vec<_>>>()?;
    let shape = Shape { n, k, w, xs };
    // The f16 baseline always runs first (every row's ratio needs it); shown if wanted.
    let base = run_impl(ctx, &shape, Impl::CandleF16, &mut protos, None)?;
    for i in wanted.iter().filter(|i| !matches!(i, Impl::CandleF16)) {
        if ctx.over_budget() {
            ms.iter()
                .for_each(|&m| ctx.skip_budget("kernels", &row_name(n, k, i, m)));
            continue;
        }
        if let Err(e) = run_impl(ctx, &shape, *i, &mut protos, Some(&base)) {
            let (status, note) = classify(&e);
            for &m in ms {
                ctx.push(Row::new("kernels", &row_name(n, k, i, m)).status(status, note.clone()));
            }
            ctx.check_device()?;
        }
    }
    Ok(())
}

/// Build the copies, then check and time every m. Returns seconds per call by m.
fn run_impl(
    ctx: &mut Ctx,
    s: &Shape,
    i: Impl,
    protos: &mut Prototypes,
    base: Option<&[Option<f64>]>,
) -> Result<Vec<Option<f64>>> {
    let dev = ctx.dev.clone();
    let (weights, reference, bytes_w) = build(ctx, s, i, protos)?;
    let mut out = vec![];
    for (j, (m, x16, x32)) in s.xs.iter().enumerate() {
        let name = row_name(s.n, s.k, &i, *m);
        let show = ctx.wants(&name);
        if !show && base.is_some() {
            out.push(None);
            continue;
        }
        let x = match &weights {
            Weights::Ggml(_) => x32,
            _ => x16,
        };
        let row = Row::new("kernels", &name)
            .text("shape", format!("{}x{}", s.n, s.k))
            .num("m", *m as f64)
            .text("impl", i.name())
            .num("bits/w", bytes_w as f64 * 8.0 / (s.n * s.k) as f64);
        let r = measure(ctx, &weights, x, &reference, i.tolerance());
        let row = match r {
            Ok((err, None)) => {
                out.push(None);
                row.num("err", err).status(
                    Status::Fail,
                    format!("rel err {err:.2e} > {:.0e}", i.tolerance()),
                )
            }
            Ok((err, Some(timing))) => {
                let t = timing.median;
                out.push(Some(t));
                let bytes = bytes_w + crate::util::nbytes(x) + s.n * m * x.dtype().size_in_bytes();
                let ceil = ctx.ceiling.seconds(&dev, ctx.iters, MIN_SAMPLE_S, bytes)?;
                let f16 = base
                    .and_then(|b| b.get(j).copied().flatten())
                    .or((base.is_none()).then_some(t));
                row.num("us", t * 1e6)
                    .num("GB/s", bytes as f64 / t / 1e9)
                    .num("TFLOP/s", 2.0 * (m * s.n * s.k) as f64 / t / 1e12)
                    .opt("vs_f16", f16.map(|b| b / t))
                    .opt("ceil_us", ceil.map(|c| c * 1e6))
                    .opt("of_ceil", ceil.map(|c| c / t))
                    .num("err", err)
                    .num("spread%", timing.spread_pct())
                    .num("MB", bytes as f64 / 1e6)
            }
            Err(e) => {
                out.push(None);
                let (status, note) = classify(&e);
                row.status(status, note)
            }
        };
        let failed = row.status != Status::Ok;
        if show {
            ctx.push(row);
        }
        if failed {
            ctx.check_device()?;
        }
    }
    Ok(out)
}

/// The copies of `i`'s weight, its f32 dequantized reference `[n, k]`, and weight bytes.
fn build(
    ctx: &Ctx,
    s: &Shape,
    i: Impl,
    protos: &mut Prototypes,
) -> Result<(Weights, Tensor, usize)> {
    let dev = &ctx.dev;
    let (n, k) = (s.n, s.k);
    Ok(match i {
        Impl::CandleF16 => {
            let bytes = crate::util::nbytes(&s.w);
            let copies = (0..rotation(bytes, 64))
                .map(|_| s.w.copy())
                .collect::<candle_core::Result<Vec<_>>>()?;
            (Weights::Dense(copies), s.w.to_dtype(DType::F32)?, bytes)
        }
        Impl::CandleGgml(dt) => {
            let q = protos.qtensor(n, k, dt, dev)?;
            let bytes = q.storage_size_in_bytes();
            let copies = (0..rotation(bytes, 64))
                .map(|_| Ok(QMatMul::from_qtensor(protos.qtensor(n, k, dt, dev)?)?))
                .collect::<Result<Vec<_>>>()?;
            (Weights::Ggml(copies), q.dequantize(dev)?, bytes)
        }
        Impl::Ours(f) => {
            let first = protos.layer(n, k, f, ctx.dtype)?;
            let bytes = first.weight_bytes();
            let copies = (0..rotation(bytes, 64))
                .map(|_| protos.copy(n, k, f, ctx.dtype))
                .collect::<Result<Vec<_>>>()?;
            (
                Weights::Ours(copies),
                first.dequantize()?.to_dtype(DType::F32)?,
                bytes,
            )
        }
    })
}

fn forward(w: &Weights, j: usize, x: &Tensor) -> candle_core::Result<Tensor> {
    match w {
        Weights::Dense(c) => x.matmul(&c[j % c.len()].t()?),
        Weights::Ggml(c) => c[j % c.len()].forward(x),
        Weights::Ours(c) => c[j % c.len()].forward(x),
    }
}

/// Check against the reference (on the last copy, so every copy's upload is exercised
/// at least once across m), then time. `(err, None)` when the check fails.
fn measure(
    ctx: &Ctx,
    w: &Weights,
    x: &Tensor,
    reference: &Tensor,
    tol: f64,
) -> Result<(f64, Option<Timing>)> {
    let n_copies = match w {
        Weights::Dense(c) => c.len(),
        Weights::Ggml(c) => c.len(),
        Weights::Ours(c) => c.len(),
    };
    let y = forward(w, n_copies - 1, x)?;
    let want = x.to_dtype(DType::F32)?.matmul(&reference.t()?)?;
    let err = rel_err(&y, &want)?;
    if err.is_nan() || err > tol {
        return Ok((err, None));
    }
    drop((y, want));
    let t = time_batched(&ctx.dev, ctx.iters, MIN_SAMPLE_S, |j| {
        forward(w, j, x).map(|_| ())
    })?;
    Ok((err, Some(t)))
}
