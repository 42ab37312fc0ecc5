//! Section 2b: prefill attention (a prompt of L tokens attending causally over itself, one
//! layer, batch 1), rows `attention/prefill/{mha|gqa}/L{L}/{candle-ops|ours-fused}`.
//!
//! - `candle-ops`: the prompt path built of candle ops, as our Llama ran it before the fused
//!   kernel (and still runs it on the CPU): RoPE on q with run-dtype tables, `q·kᵀ` per KV
//!   head group over the cache, cast to f32, the additive causal mask, softmax, cast back,
//!   `·v`, transposed to `[b, L, nh hd]` (stock candle's llama does the same, with
//!   `repeat_kv` copies for GQA). The mask is built once, outside the timing, as the model
//!   builds it once per forward.
//! - `ours-fused`: `KvCache::attend_prefill`, one launch of `cuda/prefill_attention.cu`
//!   (RoPE on q, scores, mask and softmax in registers) over the same cache.
//!
//! Both read the same dense f16 cache, appended once before timing. `TFLOP/s` counts the
//! causal product's useful work, 2 · 2 · nh · hd · L (L + 1) / 2 FLOPs (H200 dense f16
//! tensor-core peak ≈ 990 TFLOP/s through wgmma; `mma.sync` reaches about two thirds).

use crate::attention::{positions, rope_tables};
use crate::report::{Row, Status};
use crate::util::{randn, rel_err, time_batched, Ctx};
use anyhow::Result;
use candle_core::Tensor;
use candle_lowbit::ops::Heads;
use candle_lowbit::{KvCache, KvFormat};

const MIN_SAMPLE_S: f64 = 2e-3;

pub fn run(ctx: &mut Ctx) -> Result<()> {
    let h = |nh, nkv, hd| Heads { nh, nkv, hd };
    let (shapes, lens) = if ctx.quick {
        (vec![("mha", h(4, 4, 64)), ("gqa", h(4, 2, 64))], vec![48])
    } else {
        (
            vec![("mha", h(32, 32, 128)), ("gqa", h(32, 8, 128))],
            vec![512, 2048, 8192],
        )
    };
    for (shape, heads) in shapes {
        for &len in &lens {
            let names = ["candle-ops", "ours-fused"]
                .map(|imp| format!("attention/prefill/{shape}/L{len}/{imp}"));
            ctx.run_case(
                "attention",
                names,
                &format!("prefill {shape} L={len}"),
                |c, w| run_case(c, heads, len, w),
            )?;
        }
    }
    Ok(())
}

fn run_case(ctx: &mut Ctx, heads: Heads, len: usize, wanted: &[String]) -> Result<()> {
    let (dev, dt) = (ctx.dev.clone(), ctx.dtype);
    let qkv = randn(&[1, len, heads.qkv_width()], 1.0, dt, &dev)?;
    let tables = rope_tables(len, heads.hd, &dev)?;
    let p = positions(&tables, 0, 1, &dev)?;
    let mut cache = KvCache::of_format(KvFormat::Dense, heads, len, dt, &dev)?;
    cache.append(&qkv, 0, &p)?;
    let (cos, sin) = (tables.0.to_dtype(dt)?, tables.1.to_dtype(dt)?);
    let mask = candle_lowbit::kv::causal_mask(&[0], 0, len, &dev)?;
    let candle_ops = || -> candle_core::Result<Tensor> {
        let q = qkv
            .narrow(2, 0, heads.nh * heads.hd)?
            .reshape((1, len, heads.nh, heads.hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?;
        cache
            .attend(&q, len, Some(&mask))?
            .transpose(1, 2)?
            .reshape((1, len, heads.nh * heads.hd))
    };
    let reference = candle_ops()?;
    let t_ops = time_batched(&dev, ctx.iters, MIN_SAMPLE_S, |_| candle_ops().map(|_| ()))?;
    let flops = 2.0 * (heads.nh * heads.hd) as f64 * (len * (len + 1)) as f64;
    let row = |imp: &str| {
        Row::new(
            "attention",
            &format!("attention/prefill/{}/L{len}/{imp}", shape_name(heads)),
        )
        .text(
            "heads",
            format!("{}q/{}kv x{}", heads.nh, heads.nkv, heads.hd),
        )
        .num("L", len as f64)
    };
    let name_ops = row("candle-ops").name.clone();
    if wanted.contains(&name_ops) {
        ctx.push(
            row("candle-ops")
                .num("us", t_ops.median * 1e6)
                .num("TFLOP/s", flops / t_ops.median / 1e12)
                .num("spread%", t_ops.spread_pct()),
        );
    }
    let name_ours = row("ours-fused").name.clone();
    if !wanted.contains(&name_ours) {
        return Ok(());
    }
    if let Some(why) = cache.no_fused_prefill() {
        ctx.push(row("ours-fused").status(Status::Skip, why));
        return Ok(());
    }
    let fused = || -> candle_core::Result<Tensor> {
        cache
            .attend_prefill(&qkv, 0, &p)?
            .ok_or_else(|| candle_core::Error::Msg("no fused prefill".into()))
    };
    let err = rel_err(&fused()?, &reference)?;
    if err.is_nan() || err > 1e-2 {
        ctx.push(row("ours-fused").num("err", err).status(
            Status::Fail,
            format!("rel err {err:.2e} > 1e-2 vs candle-ops"),
        ));
        return Ok(());
    }
    let t = time_batched(&dev, ctx.iters, MIN_SAMPLE_S, |_| fused().map(|_| ()))?;
    ctx.push(
        row("ours-fused")
            .num("us", t.median * 1e6)
            .num("TFLOP/s", flops / t.median / 1e12)
            .num("vs_candle", t_ops.median / t.median)
            .num("err", err)
            .num("spread%", t.spread_pct()),
    );
    Ok(())
}

fn shape_name(h: Heads) -> &'static str {
    if h.nh == h.nkv {
        "mha"
    } else {
        "gqa"
    }
}
