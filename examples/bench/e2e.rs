//! Sections 3 and 4: end to end (`e2e`, Llama-2-7B shape) and the host-side floor
//! (`floor`, the same 32 layers at tiny widths), random weights, every configuration.
//!
//! Per configuration (models in `models.rs`): `load` (build time, weight bytes), `check`
//! (our dense-weight configurations against stock's logits on the same weights),
//! `prefill<N>` (one forward of N tokens from an empty cache: tokens/s),
//! `decode-ctx<C>` (batch 1 after C prompt tokens: ms per token) and `decode-b<B>`
//! (batch B after a 128-token prompt: tokens/s). A decode step is what a generation loop
//! does: one token per sequence through the model (stock: `forward`; ours: the graph
//! decoder, CUDA-graph replay where it can, the `mode` column says), argmax on the
//! device, the tokens read back to the host for the next step. `async_ms`: the same steps
//! issued back to back without reading tokens back (device time where it exceeds the host's). Prompts are prefilled in chunks of 512 tokens with a
//! synchronize after each chunk (untimed). Peak memory is sampled during each row's
//! untimed prefill (the prefill row's warm-up run; the decode rows' prompt): device
//! memory in use, total − free, every millisecond.

use crate::models::{llama2_7b, tiny, Engine, Spec};
use crate::quant::Prototypes;
use crate::report::{Row, Status};
use crate::util::{classify, gib, median, token_ids, Ctx, MemSampler};
use anyhow::Result;
use candle_core::{Tensor, D};
use candle_lowbit::WeightFormat;
use std::collections::HashMap;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Section {
    E2e,
    Floor,
    /// Llama-2-70B's shape in the formats that can draw their weights directly (no f16
    /// copy of the model fits): batch-1 decode.
    E2e70b,
}

#[derive(Debug, Clone, Copy)]
enum Metric {
    Load,
    Check,
    Prefill(usize),
    Decode { ctx: usize, batch: usize },
}

impl Metric {
    fn name(&self, batch_ctx: usize) -> String {
        match self {
            Self::Load => "load".into(),
            Self::Check => "check".into(),
            Self::Prefill(n) => format!("prefill{n}"),
            Self::Decode { ctx, batch: 1 } => format!("decode-ctx{ctx}"),
            Self::Decode { ctx, batch } if *ctx == batch_ctx => format!("decode-b{batch}"),
            Self::Decode { ctx, batch } => format!("decode-ctx{ctx}-b{batch}"),
        }
    }
}

struct Plan {
    group: &'static str,
    cfg: candle_lowbit::Config,
    metrics: Vec<Metric>,
    batch_ctx: usize,
    chunk: usize,
}

fn plan(section: Section, quick: bool) -> Plan {
    let (group, batch_ctx) = match section {
        Section::E2e => ("e2e", if quick { 16 } else { 128 }),
        Section::Floor => ("floor", if quick { 16 } else { 128 }),
        Section::E2e70b => ("e2e70b", if quick { 16 } else { 128 }),
    };
    let mut metrics = vec![Metric::Load, Metric::Check];
    let (cfg, chunk) = match (section, quick) {
        (Section::E2e, false) => {
            metrics.extend([512, 2048, 8192].map(Metric::Prefill));
            metrics.extend([128, 1024, 4096, 16384].map(|ctx| Metric::Decode { ctx, batch: 1 }));
            metrics.extend([8, 32, 64].map(|batch| Metric::Decode {
                ctx: batch_ctx,
                batch,
            }));
            metrics.push(Metric::Decode {
                ctx: 32768,
                batch: 16,
            });
            (llama2_7b(16384 + 512), 512)
        }
        (Section::E2e, true) => {
            metrics.extend([16, 48].map(Metric::Prefill));
            metrics.extend([8, 40].map(|ctx| Metric::Decode { ctx, batch: 1 }));
            metrics.extend([2, 3].map(|batch| Metric::Decode {
                ctx: batch_ctx,
                batch,
            }));
            (tiny(2, 256), 16)
        }
        (Section::E2e70b, q) => {
            metrics.pop(); // no stock logits to check against
            metrics.push(Metric::Decode {
                ctx: batch_ctx,
                batch: 1,
            });
            (
                if q {
                    tiny(2, 256)
                } else {
                    crate::models::llama2_70b(1024)
                },
                128,
            )
        }
        (Section::Floor, q) => {
            metrics.push(Metric::Decode {
                ctx: batch_ctx,
                batch: 1,
            });
            (tiny(if q { 4 } else { 32 }, 1024), 512)
        }
    };
    Plan {
        group,
        cfg,
        metrics,
        batch_ctx,
        chunk,
    }
}

/// What the stock configuration measured, for the ratios and the logits check.
#[derive(Default)]
struct Baseline {
    tok_s: HashMap<String, f64>,
    logits: Option<Tensor>,
}

/// The `model` section: a real model from `--model` (a checkpoint, a GGUF file, a HF
/// directory), loaded by the loader as `generate` loads it (`load`: its load time, any
/// quantization at load included), then checked and timed as the e2e rows are.
pub fn run_model(ctx: &mut Ctx, loaded: candle_lowbit::loader::Loaded, load_s: f64) -> Result<()> {
    let spec = Spec::Loaded(loaded.format);
    let cfg = loaded.config.clone();
    let group = "model";
    let name = loaded.name.replace(['/', ' '], "_");
    let mut metrics = vec![Metric::Load, Metric::Check];
    if ctx.quick {
        metrics.extend([
            Metric::Prefill(16),
            Metric::Decode { ctx: 16, batch: 1 },
            Metric::Decode { ctx: 16, batch: 2 },
        ]);
    } else {
        metrics.extend([
            Metric::Prefill(512),
            Metric::Decode { ctx: 128, batch: 1 },
            Metric::Decode { ctx: 128, batch: 8 },
        ]);
    }
    let batch_ctx = if ctx.quick { 16 } else { 128 };
    let wanted: Vec<(Metric, String)> = metrics
        .iter()
        .map(|m| {
            (
                *m,
                format!("{group}/{name}/{}/{}", spec.name(), m.name(batch_ctx)),
            )
        })
        .filter(|(_, n)| ctx.wants(n))
        .collect();
    let p = Plan {
        group,
        cfg: cfg.clone(),
        metrics,
        batch_ctx,
        chunk: 512,
    };
    let mut e = Engine::loaded(loaded.model, &cfg, ctx.dtype, &ctx.dev);
    run_config(
        ctx,
        &p,
        spec,
        &mut e,
        load_s,
        &wanted,
        &mut Baseline::default(),
    )?;
    ctx.report.print_group(group);
    Ok(())
}

pub fn run(ctx: &mut Ctx, section: Section) -> Result<()> {
    let p = plan(section, ctx.quick);
    let mut protos = Prototypes::new(&ctx.dev, &ctx.quant);
    let mut base = Baseline::default();
    let specs = match section {
        // The formats whose codec draws random weights directly; dense cannot fit.
        Section::E2e70b => WeightFormat::timed()
            .filter(|f| {
                f.spec()
                    .codec
                    .random(
                        *f,
                        (32, 64),
                        &Default::default(),
                        0,
                        &candle_core::Device::Cpu,
                    )
                    .is_some()
            })
            .map(|f| Spec::Ours(f, candle_lowbit::KvFormat::Dense))
            .collect(),
        _ => Spec::all(),
    };
    for spec in specs {
        let names: Vec<(Metric, String)> = p
            .metrics
            .iter()
            .map(|m| {
                (
                    *m,
                    format!("{}/{}/{}", p.group, spec.name(), m.name(p.batch_ctx)),
                )
            })
            .collect();
        let wanted: Vec<(Metric, String)> =
            names.into_iter().filter(|(_, n)| ctx.wants(n)).collect();
        if wanted.is_empty() {
            continue;
        }
        if ctx.over_budget() {
            wanted.iter().for_each(|(_, n)| ctx.skip_budget(p.group, n));
            continue;
        }
        eprintln!("{}: building {}", p.group, spec.name());
        let t0 = Instant::now();
        // Stock llama's loader unwraps internally (a failed allocation panics): contain it.
        let engine =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match (section, spec) {
                (Section::E2e70b, Spec::Ours(w, kv)) => {
                    Engine::build_direct(w, kv, &p.cfg, ctx.dtype, &ctx.dev, &mut protos)
                }
                _ => Engine::build(spec, &p.cfg, ctx.dtype, &ctx.dev, &mut protos, 42),
            }))
            .unwrap_or_else(|_| {
                Err(anyhow::anyhow!(
                    "building {} panicked (see stderr)",
                    spec.name()
                ))
            });
        let build_s = t0.elapsed().as_secs_f64();
        match engine {
            Ok(mut e) => run_config(ctx, &p, spec, &mut e, build_s, &wanted, &mut base)?,
            Err(err) => {
                let (status, note) = classify(&err);
                wanted
                    .iter()
                    .for_each(|(_, n)| ctx.push(Row::new(p.group, n).status(status, note.clone())));
                ctx.check_device()?;
            }
        }
        ctx.dev.synchronize()?;
    }
    ctx.report.print_group(p.group);
    Ok(())
}

fn run_config(
    ctx: &mut Ctx,
    p: &Plan,
    spec: Spec,
    e: &mut Engine,
    build_s: f64,
    wanted: &[(Metric, String)],
    base: &mut Baseline,
) -> Result<()> {
    for (m, name) in wanted {
        if ctx.over_budget() {
            ctx.skip_budget(p.group, name);
            continue;
        }
        let table = match m {
            Metric::Load | Metric::Check => "load and check",
            Metric::Prefill(_) => "prefill",
            Metric::Decode { .. } => "decode",
        };
        let row = Row::new(p.group, name)
            .table(table)
            .text("config", spec.name());
        let r = match m {
            Metric::Load => Ok(row
                .num(
                    if matches!(spec, Spec::Loaded(_)) {
                        "load_s"
                    } else {
                        "build_s"
                    },
                    build_s,
                )
                .opt("weights_GiB", e.weight_bytes().map(gib))
                .opt("mem_GiB", crate::util::mem_used(&ctx.dev).map(gib))),
            Metric::Check => check(ctx, p, spec, e, row, base),
            Metric::Prefill(n) => prefill(ctx, p, e, *n, row),
            Metric::Decode { ctx: c, batch } => {
                decode(ctx, p, e, *c, *batch, row).and_then(|r| with_floor(ctx, p, e, r))
            }
        };
        let row = match r {
            Ok(row) => with_ratio(row, spec, m.name(p.batch_ctx), base),
            Err(err) => {
                let (status, note) = classify(&err);
                Row::new(p.group, name)
                    .table(table)
                    .text("config", spec.name())
                    .status(status, note)
            }
        };
        let failed = matches!(row.status, Status::Oom | Status::Err | Status::Fail);
        ctx.push(row);
        if failed {
            ctx.check_device()?;
        }
    }
    Ok(())
}

/// Adds `vs_candle` (tokens/s over stock's on the same row); records stock's figures.
fn with_ratio(row: Row, spec: Spec, metric: String, base: &mut Baseline) -> Row {
    let Some(tok_s) = row.get("tok/s") else {
        return row;
    };
    if matches!(spec, Spec::Stock) {
        base.tok_s.insert(metric, tok_s);
        return row.num("vs_candle", 1.0);
    }
    let r = base.tok_s.get(&metric).map(|s| tok_s / s);
    row.opt("vs_candle", r)
}

/// Stock: record the logits of a 16-token prompt. Ours with dense weights: compare with
/// them. Every configuration of ours: two decode steps through the decoder (graph
/// capture, then replay) against the same steps through eager `forward` (bit-equal).
fn check(
    ctx: &Ctx,
    p: &Plan,
    spec: Spec,
    e: &mut Engine,
    row: Row,
    base: &mut Baseline,
) -> Result<Row> {
    let ids = token_ids(1, 16, p.cfg.vocab_size, 7, &ctx.dev)?;
    e.reset(32)?;
    let logits = e.forward(&ids, 0)?;
    let row = match spec {
        Spec::Stock => {
            base.logits = Some(logits);
            return Ok(row.status(Status::Ok, "reference logits"));
        }
        Spec::QLlama(_) => {
            return Ok(row.status(
                Status::Skip,
                "prototype weights (values differ from stock's by design)",
            ))
        }
        Spec::Loaded(_) => row,
        Spec::Ours(candle_lowbit::WeightFormat::Dense, _) => match &base.logits {
            Some(want) => {
                let err = crate::util::rel_err(&logits, want)?;
                let same = next_ids(&logits)? == next_ids(want)?;
                let row = row
                    .num("logits_err", err)
                    .text("top1", if same { "same" } else { "differs" });
                if err.is_nan() || err > 0.1 {
                    return Ok(row.status(Status::Fail, "logits differ from stock's by > 10%"));
                }
                row
            }
            None => row,
        },
        Spec::Ours(..) => row,
    };
    let (eager, graph) = (two_steps(e, &ids, false)?, two_steps(e, &ids, true)?);
    let same = eager.flatten_all()?.to_vec1::<f32>()? == graph.flatten_all()?.to_vec1::<f32>()?;
    let row = row
        .num("graph_err", crate::util::rel_err(&graph, &eager)?)
        .text("mode", e.mode());
    Ok(if same {
        row
    } else {
        row.status(Status::Fail, "decoder steps differ from eager forward")
    })
}

/// Prefill `ids` `[1, 16]`, then two greedy steps (through the decoder if `decoder`);
/// the second step's logits.
fn two_steps(e: &mut Engine, ids: &Tensor, decoder: bool) -> Result<Tensor> {
    e.reset(32)?;
    let mut logits = e.forward(ids, 0)?;
    for pos in [16, 17] {
        let tokens = next_ids(&logits)?;
        logits = if decoder {
            e.step(&tokens, pos)?.copy()?
        } else {
            e.forward(&Tensor::from_vec(tokens, (1, 1), ids.device())?, pos)?
        };
    }
    Ok(logits)
}

/// Token ids of the argmax of `logits` `[b, vocab]`, read back to the host.
fn next_ids(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?)
}

fn prefill(ctx: &Ctx, p: &Plan, e: &mut Engine, n: usize, row: Row) -> Result<Row> {
    let ids = token_ids(1, n, p.cfg.vocab_size, n as u64, &ctx.dev)?;
    let mem = MemSampler::start(&ctx.dev);
    e.reset(n + 1)?;
    next_ids(&e.forward(&ids, 0)?)?;
    let peak = mem.stop();
    let mut v = vec![];
    for _ in 0..3 {
        e.reset(n + 1)?;
        ctx.dev.synchronize()?;
        let t0 = Instant::now();
        next_ids(&e.forward(&ids, 0)?)?;
        v.push(t0.elapsed().as_secs_f64());
    }
    let t = median(&mut v);
    Ok(row
        .num("tokens", n as f64)
        .num("ms", t * 1e3)
        .num("tok/s", n as f64 / t)
        .opt("peak_GiB", peak.map(gib)))
}

/// DESIGN.md's reference DRAM read rate (§3: streaming reads of 256 MB and more ran at
/// 4.2–4.4 TB/s on the H200; §6: report against ≈ 4.3 TB/s). The lean-decode issue states
/// its weight-read floor at this rate (7B: 13.5 GB at ≈ 4.3 TB/s ≈ 3.1 ms).
const REFERENCE_READ_BYTES_PER_S: f64 = 4.3e12;

/// Adds the weight-read floor of a decode row: the streaming-read ceiling for the bytes a
/// step must read (every linear weight, and K and V of every cached token in the engine's KV format),
/// measured in this run, `floor_ms`, and how close the row comes to it, `of_floor` (floor /
/// measured); and the same bytes at the reference rate, `floor_ref_ms` and `of_floor_ref`.
/// The measured ceiling is the stricter one (our 2 GiB single-launch read runs faster than
/// the reference rate: 4.47–4.56 TB/s on the H200 in the runs of 2026-12-01).
fn with_floor(ctx: &mut Ctx, p: &Plan, e: &Engine, row: Row) -> Result<Row> {
    let (Some(ms), Some(c), Some(b)) = (row.get("ms/step"), row.get("ctx"), row.get("batch"))
    else {
        return Ok(row);
    };
    let cfg = &p.cfg;
    let hd = cfg.hidden_size / cfg.num_attention_heads;
    let kv = 2
        * cfg.num_hidden_layers
        * (b as usize)
        * (c as usize)
        * cfg.num_key_value_heads
        * e.kv_row_bytes(hd);
    let bytes = e.linear_bytes(cfg)? + kv;
    let dev = ctx.dev.clone();
    let floor = ctx.ceiling.seconds(&dev, ctx.iters, 2e-3, bytes)?;
    let reference = bytes as f64 / REFERENCE_READ_BYTES_PER_S;
    Ok(row
        .num("read_GB", bytes as f64 / 1e9)
        .opt("floor_ms", floor.map(|f| f * 1e3))
        .opt("of_floor", floor.map(|f| f * 1e3 / ms))
        .num("floor_ref_ms", reference * 1e3)
        .num("of_floor_ref", reference * 1e3 / ms))
}

fn decode(ctx: &Ctx, p: &Plan, e: &mut Engine, c: usize, b: usize, row: Row) -> Result<Row> {
    let steps = ctx.iters.max(4) + 3;
    let warm = 2;
    let max_len = c + warm + 2 * steps + 1;
    if max_len > e.max_positions() {
        return Ok(row.status(
            Status::Skip,
            format!(
                "{max_len} positions exceed the model's {}",
                e.max_positions()
            ),
        ));
    }
    // Prompts of more than DIRECT_FILL tokens in all are not prefilled: the caches are
    // written from random K and V directly (ours only; `prompt` column).
    const DIRECT_FILL: usize = 65_536;
    let direct = b * c > DIRECT_FILL;
    if direct && !e.fills_directly() {
        return Ok(row.status(
            Status::Skip,
            format!("a {b} x {c}-token prompt is only written directly into our caches"),
        ));
    }
    let mem = MemSampler::start(&ctx.dev);
    let mut ids = if direct {
        e.fill_random(max_len, b, c)?;
        ctx.dev.synchronize()?;
        token_ids(b, 1, p.cfg.vocab_size, (c * 131 + b) as u64, &ctx.dev)?
            .flatten_all()?
            .to_vec1::<u32>()?
    } else {
        e.reset(max_len)?;
        let prompt = token_ids(b, c, p.cfg.vocab_size, (c * 131 + b) as u64, &ctx.dev)?;
        let mut logits = None;
        let chunk = e.prefill_chunk(b, p.chunk);
        for s in (0..c).step_by(chunk) {
            let len = chunk.min(c - s);
            logits = Some(e.forward(&prompt.narrow(1, s, len)?.contiguous()?, s)?);
            ctx.dev.synchronize()?;
        }
        let Some(logits) = logits else {
            anyhow::bail!("empty prompt")
        };
        next_ids(&logits)?
    };
    // Peak memory is that of the prefill: the sampler stops before any decode step (graph
    // capture happens in the first one, and the timed steps run without its driver calls).
    let peak = mem.stop();
    let mut v = vec![];
    for i in 0..warm + steps {
        let t0 = Instant::now();
        ids = next_ids(&e.step(&ids, c + i)?)?;
        if i >= warm {
            v.push(t0.elapsed().as_secs_f64());
        }
    }
    let t = median(&mut v);
    // The same steps without reading the tokens back (the host runs ahead of the GPU):
    // the device-side time per step where it exceeds the host's.
    ctx.dev.synchronize()?;
    let t0 = Instant::now();
    for i in 0..steps {
        e.step(&ids, c + warm + steps + i)?;
    }
    ctx.dev.synchronize()?;
    let pipelined = t0.elapsed().as_secs_f64() / steps as f64;
    let at = c + warm + 2 * steps;
    crate::util::profile_step(&ctx.dev, || e.step(&ids, at).map(|_| ()))?;
    Ok(row
        .num("ctx", c as f64)
        .num("batch", b as f64)
        .num("ms/step", t * 1e3)
        .num("async_ms", pipelined * 1e3)
        .num("tok/s", b as f64 / t)
        .opt("peak_GiB", peak.map(gib))
        .text("prompt", if direct { "random K, V" } else { "prefill" })
        .text("mode", e.mode()))
}
