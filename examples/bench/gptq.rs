//! Section 5: the quantizer's speed, on the bench's device.
//!
//! - `gptq/hinv/k=<k>/<impl>`: the inverse-Hessian factor GPTQ needs, of a random positive
//!   definite `[k, k]` at the widths of Llama-2-7B's layer inputs, two ways: `faer-f64`
//!   (`gptq::hinv_upper`: faer's Cholesky and triangular inverse on the host's cores, what
//!   the CPU reference uses) and `candle-f32` (`gptq::hinv_upper_t`: blocked on candle ops on
//!   the device, what the tensor GPTQ uses); `vs_faer` is faer's time over this one's.
//! - `gptq/<shape>/<format>/block`: GPTQ's sequential mode (`calib::quantize_model`) over
//!   two Llama-2-7B-shaped blocks (random f16 weights) on 128 windows of 2048 random tokens,
//!   timed by stage (embedding, the observed dense passes with their `XᵀX`, GPTQ of the four
//!   projections, the quantized pass that feeds the second block; the last block's outputs
//!   feed nothing); `block_s` is one block's share, and `est_7b_min` extrapolates to the
//!   whole model: 32 blocks calibrated and quantized, 31 propagated, plus the embedding of
//!   the windows and the head once.

use crate::models::{llama2_7b, random_weights, tiny};
use crate::report::Row;
use crate::util::{classify, token_ids, Ctx};
use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_lowbit::calib::{CalibConfig, Quiet};
use candle_lowbit::{Llama, WeightFormat};
use candle_nn::VarBuilder;
use std::time::Instant;

pub fn run(ctx: &mut Ctx) -> Result<()> {
    let widths = if ctx.quick {
        vec![256]
    } else {
        vec![4096, 11008]
    };
    for k in widths {
        let mut faer_s = None;
        for on_device in [false, true] {
            let imp = if on_device { "candle-f32" } else { "faer-f64" };
            let name = format!("gptq/hinv/k={k}/{imp}");
            if ctx.wants(&name) && !ctx.over_budget() {
                let row = Row::new("gptq", &name).table("GPTQ: inverse-Hessian factor");
                let row = hinv(ctx, k, on_device, row).map(|r| {
                    let s = r.get("s");
                    if !on_device {
                        faer_s = s;
                    }
                    r.opt("vs_faer", faer_s.zip(s).map(|(f, s)| f / s))
                });
                push(ctx, &name, row)?;
            }
        }
    }
    let f = WeightFormat::Int4Gptq;
    let (shape, samples, len) = if ctx.quick {
        ("tiny", 4, 64)
    } else {
        ("llama2-7b", 128, 2048)
    };
    let name = format!("gptq/{shape}/{f}/block");
    if ctx.wants(&name) {
        if ctx.over_budget() {
            ctx.skip_budget("gptq", &name);
        } else {
            let row = block(
                ctx,
                f,
                (samples, len),
                Row::new("gptq", &name).table("GPTQ: one block, sequential"),
            );
            push(ctx, &name, row)?;
        }
    }
    ctx.report.print_group("gptq");
    Ok(())
}

fn push(ctx: &mut Ctx, name: &str, row: Result<Row>) -> Result<()> {
    match row {
        Ok(r) => ctx.push(r),
        Err(e) => {
            let (status, note) = classify(&e);
            ctx.push(Row::new("gptq", name).status(status, note));
            ctx.check_device()?;
        }
    }
    Ok(())
}

/// A random `H = AᵀA / t` of width `k` (made on the device), then the factor timed (the
/// median of three).
fn hinv(ctx: &Ctx, k: usize, on_device: bool, row: Row) -> Result<Row> {
    let a = crate::util::randn(&[k + 512, k], 1.0, DType::F32, &ctx.dev)?;
    let h = (a.t()?.matmul(&a)? / (k + 512) as f64)?;
    let host = h
        .to_dtype(DType::F64)?
        .to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let mut v = vec![];
    for _ in 0..3 {
        ctx.dev.synchronize()?;
        let t0 = Instant::now();
        if on_device {
            candle_lowbit::gptq::hinv_upper_t(&h, 0.01)?;
            ctx.dev.synchronize()?;
        } else {
            candle_lowbit::gptq::hinv_upper(&host, k, 0.01)?;
        }
        v.push(t0.elapsed().as_secs_f64());
    }
    let t = crate::util::median(&mut v);
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1);
    Ok(row
        .num("k", k as f64)
        .num("s", t)
        .num("GFLOP/s", 2.0 * (k as f64).powi(3) / 3.0 / t / 1e9)
        .num("threads", threads as f64))
}

fn block(ctx: &Ctx, f: WeightFormat, (samples, len): (usize, usize), row: Row) -> Result<Row> {
    let mut cfg = if ctx.quick {
        tiny(1, len)
    } else {
        llama2_7b(len)
    };
    let layers = 2;
    cfg.num_hidden_layers = layers;
    let t0 = Instant::now();
    let w = random_weights(&cfg, ctx.dtype, &ctx.dev, 5)?;
    let mut model = Llama::load(VarBuilder::from_tensors(w, ctx.dtype, &ctx.dev), &cfg)?;
    let ids = token_ids(samples, len, cfg.vocab_size, 11, &ctx.dev)?;
    let windows: Vec<Vec<u32>> = (0..samples)
        .map(|i| Ok(ids.get(i)?.to_vec1::<u32>()?))
        .collect::<Result<_>>()?;
    let build_s = t0.elapsed().as_secs_f64();
    let cc = CalibConfig {
        samples,
        len,
        seed: 0,
        batch: 8,
    };
    let r = candle_lowbit::calib::quantize_model(
        &mut model,
        &cfg,
        f,
        &Default::default(),
        (&windows, &cc),
        ctx.dtype,
        &mut Quiet,
    )?;
    // The quantized block still computes something: its logits are finite.
    let probe = Tensor::new(&windows[0][..16.min(len)], &ctx.dev)?.unsqueeze(0)?;
    let mut cache = candle_lowbit::Cache::with_capacity(
        16,
        candle_lowbit::KvFormat::Dense,
        ctx.dtype,
        &cfg,
        &ctx.dev,
    )?;
    let finite = model
        .forward(&probe, 0, &mut cache)?
        .sum_all()?
        .to_scalar::<f32>()?
        .is_finite();
    let l = layers as f64;
    let (calib, quant, prop) = (
        r.calibrate_s / l,
        r.quantize_s / l,
        r.propagate_s / (l - 1.0),
    );
    let block_s = calib + quant + prop;
    let est = 32.0 * (calib + quant) + 31.0 * prop + r.embed_s + r.head_s;
    let row = row
        .num("tokens", r.tokens as f64)
        .num("build_s", build_s)
        .num("embed_s", r.embed_s)
        .num("calibrate_s", calib)
        .num("gptq_s", quant)
        .num("propagate_s", prop)
        .num("head_s", r.head_s)
        .num("block_s", block_s)
        .num("est_7b_min", est / 60.0);
    Ok(if finite {
        row
    } else {
        row.status(
            crate::report::Status::Fail,
            "the quantized block's logits are not finite",
        )
    })
}
