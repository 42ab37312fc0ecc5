//! The benchmark harness: every later change is judged by its numbers, measured on the
//! H200 as ratios against stock candle in the same run. Method and figures:
//! `BENCHMARKS.md`.
//!
//! Sections (row names start with the section; `--filter` selects by substring):
//! - `kernels/<n>x<k>/<impl>/m=<m>`: matmul at Llama-2-7B shapes, stock candle (f16,
//!   QMatMul Q4_0/Q4K/Q3K/Q2K) and ours in every `WeightFormat::ALL`; µs, GB/s, TFLOP/s,
//!   the ratio to stock f16, and the streaming-read ceiling for the same bytes.
//! - `attention/<mha|gqa>/L<len>/b<batch>/<impl>`: one decode step of attention over a
//!   cache of L tokens, stock candle's computation and our `KvCache` in every `KvFormat::ALL`.
//! - `floor/<config>/...`: the 32 layers at tiny widths (host-side cost per token).
//! - `e2e/<config>/...`: a Llama-2-7B-shaped model with random weights: prefill tokens/s,
//!   decode ms/token by context, decode tokens/s by batch, peak device memory.
//! - `gptq/...`: the quantizer: the inverse-Hessian factor at 7B widths, and GPTQ of one
//!   Llama-2-7B-shaped block on 128 × 2048 calibration tokens (extrapolated to the model).
//! - `model/<name>/<config>/...` (with `--model`): a real model or checkpoint, loaded as
//!   `generate` loads it: load time, graph check, prefill, decode.
//!
//! ```text
//! cargo run --release --features cuda --example bench                # everything (< 8 min on the H200)
//! cargo run --release --features cuda --example bench -- --filter kernels/4096x4096 --m 1,16
//! cargo run --release --features cuda --example bench -- --json > bench.jsonl
//! cargo run --example bench -- --quick                               # CPU smoke test, tiny shapes
//! cargo run --example bench -- --list                                # the row names, nothing run
//! cargo run --release --features cuda --example bench -- --model ck --filter model  # a checkpoint
//! ```

#[path = "bench/attention.rs"]
mod attention;
#[path = "bench/ceiling.rs"]
mod ceiling;
#[path = "common/mod.rs"]
mod common;
#[path = "bench/e2e.rs"]
mod e2e;
#[path = "bench/gptq.rs"]
mod gptq;
#[path = "bench/kernels.rs"]
mod kernels;
#[path = "bench/models.rs"]
mod models;
#[path = "bench/prefill.rs"]
mod prefill;
#[path = "bench/quant.rs"]
mod quant;
#[path = "bench/report.rs"]
mod report;
#[path = "bench/util.rs"]
mod util;

use anyhow::Result;
use clap::Parser;
use report::{Row, Status};
use util::Ctx;

/// Benchmark candle-lowbit against stock candle (kernels, attention, end to end).
#[derive(Parser, Debug)]
pub struct Args {
    /// Run only rows whose name contains one of these substrings (comma-separated), e.g.
    /// `kernels`, `attention/gqa`, `e2e/candle-f16`, `floor` (kernel m values: --m). See --list.
    #[arg(long, value_delimiter = ',')]
    pub filter: Vec<String>,

    /// Print one JSON object per row (JSON Lines) on stdout as rows complete; the tables
    /// then go to stderr.
    #[arg(long)]
    pub json: bool,

    /// Timed samples per row (kernel and attention rows: batches of back-to-back calls;
    /// decode rows: iters + 3 single steps; prefill rows: always 3).
    #[arg(long, default_value_t = 9)]
    pub iters: usize,

    /// Tiny shapes everywhere: a smoke test that also runs on the CPU.
    #[arg(long)]
    pub quick: bool,

    /// The m values of the kernel rows (comma-separated) instead of the default list.
    #[arg(long, value_delimiter = ',')]
    pub m: Vec<usize>,

    /// The kernel rows' weight shapes `NxK` (comma-separated) instead of the Llama-2-7B ones,
    /// e.g. the Llama-2-70B projections `10240x8192,8192x8192,57344x8192,8192x28672`.
    #[arg(long, value_delimiter = ',', value_parser = parse_shape)]
    pub shapes: Vec<(usize, usize)>,

    /// Print the names of the rows the filter selects, run nothing.
    #[arg(long)]
    pub list: bool,

    /// Wall-clock budget in seconds: rows not started by then are recorded as SKIP
    /// (0 = no budget).
    #[arg(long, default_value_t = 420.0)]
    pub budget_s: f64,

    /// Run on the CPU even if a GPU is present (full sizes only with a narrow --filter).
    #[arg(long)]
    pub cpu: bool,

    /// A real model or checkpoint for the `model` section (as `generate --model`).
    #[arg(long)]
    pub model: Option<std::path::PathBuf>,

    /// The `model` section's weight format, quantized at load [default: as stored].
    #[arg(long)]
    pub quant: Option<candle_lowbit::WeightFormat>,

    #[command(flatten)]
    pub calib: common::CalibArgs,
}

/// `NxK` as `(n, k)`.
fn parse_shape(v: &str) -> Result<(usize, usize), String> {
    let (n, k) = v
        .split_once('x')
        .ok_or_else(|| format!("shape {v:?}: want NxK, e.g. 4096x11008"))?;
    let p = |t: &str| {
        t.parse::<usize>()
            .map_err(|e| format!("shape {v:?}: {e}"))
            .and_then(|x| {
                if x > 0 {
                    Ok(x)
                } else {
                    Err(format!("shape {v:?}: zero size"))
                }
            })
    };
    Ok((p(n)?, p(k)?))
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("bench: {e:#}");
            std::process::exit(2);
        }
    }
}

/// Ok(false) when a section stopped early on an unusable device.
fn run(args: &Args) -> Result<bool> {
    // The graph-ready device (event tracking off) for every row, stock ones included: our
    // decoder needs it, and stock candle loses only host overhead with it (conservative).
    let dev = candle_lowbit::graph::default_device(args.cpu)?;
    if !dev.is_cuda() && !args.quick && !args.list && !args.cpu {
        let why = if cfg!(feature = "cuda") {
            "no CUDA device was found"
        } else {
            "built without the cuda feature"
        };
        anyhow::bail!(
            "{why}; the full run needs the GPU. Use --quick for a CPU smoke test, or --list."
        );
    }
    let mut ctx = Ctx::new(dev, args)?;
    if !args.list {
        ctx.push(meta_row(&ctx, args));
        ctx.report.print_group("meta");
    }
    let sections = (|| -> Result<()> {
        kernels::run(&mut ctx)?;
        attention::run(&mut ctx)?;
        prefill::run(&mut ctx)?;
        ctx.report.print_group("attention");
        e2e::run(&mut ctx, e2e::Section::Floor)?;
        e2e::run(&mut ctx, e2e::Section::E2e)?;
        e2e::run(&mut ctx, e2e::Section::E2e70b)?;
        gptq::run(&mut ctx)?;
        if let Some(path) = &args.model {
            model_section(&mut ctx, args, path)?;
        }
        Ok(())
    })();
    for g in [
        "meta",
        "kernels",
        "attention",
        "floor",
        "e2e",
        "e2e70b",
        "gptq",
        "model",
    ] {
        ctx.report.print_group(g);
    }
    let count = |s: Status| ctx.report.rows.iter().filter(|r| r.status == s).count();
    eprintln!(
        "bench: {} rows in {:.0}s: {} ok, {} FAIL, {} OOM, {} ERR, {} SKIP",
        ctx.report.rows.len(),
        ctx.report.elapsed_s(),
        count(Status::Ok),
        count(Status::Fail),
        count(Status::Oom),
        count(Status::Err),
        count(Status::Skip)
    );
    if let Err(e) = sections {
        eprintln!("bench stopped early: {e:#}");
        return Ok(false);
    }
    Ok(true)
}

/// Load `--model` as `generate` would (quantizing with `--quant`, calibrating where the
/// format needs it) and run the `model` rows on it.
fn model_section(ctx: &mut Ctx, args: &Args, path: &std::path::Path) -> Result<()> {
    if ctx.list || !ctx.wants("model/") {
        return Ok(());
    }
    args.calib.check(args.quant)?;
    let source = candle_lowbit::model_files::ModelSource::from_path(path)?;
    let mut bars = common::Bars::new();
    let mut opts =
        candle_lowbit::loader::LoadOptions::new(ctx.dtype, &ctx.dev, args.quant, &mut bars);
    opts.quant_options = args.calib.quant_options();
    opts.calib = args.calib.source();
    let t0 = std::time::Instant::now();
    let loaded = candle_lowbit::loader::load(&source, opts)?;
    ctx.dev.synchronize()?;
    let load_s = t0.elapsed().as_secs_f64();
    e2e::run_model(ctx, loaded, load_s)
}

fn meta_row(ctx: &Ctx, args: &Args) -> Row {
    let (name, sms) = util::device_info(&ctx.dev);
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let row = Row::new("meta", "meta/run")
        .text("date_utc", utc_date(secs))
        .text("device", name)
        .num("sms", sms as f64)
        .text("dtype", format!("{:?}", ctx.dtype).to_lowercase())
        .text("candle", "0.11.1")
        .text("crate", env!("CARGO_PKG_VERSION"))
        .num("iters", ctx.iters as f64)
        .text("quick", args.quick.to_string())
        .num("w2416_bits", ctx.quant.w2416.bits)
        .num("w2416_outliers", ctx.quant.w2416.outliers)
        .opt("mem_used_GiB", util::mem_used(&ctx.dev).map(util::gib));
    match &ctx.ceiling.verified {
        Ok(()) => row,
        Err(e) => row.status(
            Status::Fail,
            format!("streaming-read ceiling disabled: {e}"),
        ),
    }
}

/// `YYYY-MM-DD HH:MM` (UTC) of a Unix time.
fn utc_date(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let (h, mi) = ((secs % 86_400) / 3600, (secs % 3600) / 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {h:02}:{mi:02}")
}
