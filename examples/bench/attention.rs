//! Section 2: decode attention (one new token per sequence) over a cache of L tokens.
//!
//! - `candle-f16`: stock `candle_transformers` llama's step, op for op: RoPE on q and the
//!   new k, `Tensor::cat` the new key/value onto the f16 cache, `repeat_kv`, cast to f32,
//!   `q·kᵀ/√d`, softmax, `·v`, cast back. (The grown cache it returns is dropped, so every
//!   step sees L.)
//! - `ours-kv<format>`: our `KvCache` in every `KvFormat::ALL`, as our Llama's decode step
//!   calls it: `append_attend_decode` (RoPE on q and k, write k and v at row L — encoded,
//!   for a quantized cache — and attention over L + 1 rows read directly from the cache:
//!   one launch on CUDA); `append` then the generic `attend` where the fused kernel does
//!   not take the head geometry. Oaken runs with the thresholds of N(0, 1), the
//!   distribution of the case's keys and values.
//!
//! Both start from the same keys: ours appends raw keys (rotated on the way in), stock's
//! cache holds the same keys rotated by candle's `rope`. Ours is checked against the stock
//! output (computed one sequence at a time) before it is timed. Where stock's step would
//! need a tensor of 2³² elements or more (32k tokens × batch 32), candle 0.11 cannot run
//! it whole and its row is SKIP with that reason. Bytes counted: the cache that must be read, K and V over
//! L + 1 tokens in the row's format (f16 for stock). Caches below 256 MiB are rotated
//! over several copies.

use crate::report::{Row, Status};
use crate::util::{classify, nbytes, randn, rel_err, rotation, time_batched, Ctx, Timing};
use anyhow::Result;
use candle_core::{DType, Tensor};
use candle_lowbit::ops::{Heads, StepPositions};
use candle_lowbit::{KvCache, KvFormat, KvSpec};

const MIN_SAMPLE_S: f64 = 2e-3;

/// A head configuration and its name in the row names.
#[derive(Debug, Clone, Copy)]
struct Shape {
    name: &'static str,
    h: Heads,
}

/// Everything a case's rows share.
struct Case {
    h: Heads,
    len: usize,
    b: usize,
    /// The new token's fused projection `[b, 1, (nh + 2 nkv) hd]` (q, k, v unrotated).
    qkv_new: Tensor,
    /// Stock's inputs for the same token: rotated q `[b, nh, 1, hd]`, rotated k and v
    /// `[b, nkv, 1, hd]`.
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    /// Stock's cache (keys rotated) `[b, nkv, L, hd]`, where stock candle can run the case.
    stock_kv: Option<(Tensor, Tensor)>,
    /// Run-dtype RoPE tables for stock's `rope` at position L, `[1, hd/2]`.
    cos_l: Tensor,
    sin_l: Tensor,
    /// Stock's output for every sequence, computed one sequence at a time `[b, 1, nh hd]`.
    y_ref: Tensor,
}

/// candle 0.11 launches its element-wise kernels with a `u32` element count
/// (`LaunchConfig::for_num_elems(n as u32)`): a tensor of 2³² elements or more is silently
/// cut short or fails with CUDA_ERROR_INVALID_VALUE. Stock's widest tensor in a step is
/// the f32 copy of the repeated keys, `[b, nh, L + 1, hd]`. `None` if stock can run.
fn stock_limit(h: Heads, len: usize, b: usize) -> Option<String> {
    let n = b * h.nh * (len + 1) * h.hd;
    (n >= 1usize << 32).then(|| {
        format!(
            "not run: stock's repeated f32 keys would hold {n} elements (>= 2^32), past candle 0.11's u32 launch size"
        )
    })
}

pub fn run(ctx: &mut Ctx) -> Result<()> {
    let shape = |name, nh, nkv, hd| Shape {
        name,
        h: Heads { nh, nkv, hd },
    };
    let (shapes, lens, batches) = if ctx.quick {
        (
            vec![shape("mha", 4, 4, 32), shape("gqa", 4, 2, 32)],
            vec![64, 200],
            vec![1, 2],
        )
    } else {
        (
            vec![shape("mha", 32, 32, 128), shape("gqa", 32, 8, 128)],
            vec![1024, 4096, 16384, 32768],
            vec![1, 8, 32],
        )
    };
    // Plus the decode step's own attention at the bench's `e2e` context (128): the
    // Llama-2-7B shape and the Llama-2-70B one (64 query heads over 8 KV heads), batch 1.
    let steps = if ctx.quick {
        vec![]
    } else {
        vec![
            (shape("mha", 32, 32, 128), 128),
            (shape("gqa64", 64, 8, 128), 128),
        ]
    };
    let mut cases = Vec::new();
    for s in &shapes {
        for &len in &lens {
            for &b in &batches {
                cases.push((s, len, b));
            }
        }
    }
    cases.extend(steps.iter().map(|(s, l)| (s, *l, 1)));
    for (s, len, b) in cases {
        let names: Vec<String> = std::iter::once(name(s.name, len, b, "candle-f16"))
            .chain(
                KvFormat::ALL
                    .iter()
                    .map(|f| name(s.name, len, b, &ours_name(*f))),
            )
            .collect();
        let label = format!("{} L={len} batch={b}", s.name);
        ctx.run_case("attention", names, &label, |c, w| run_case(c, s, len, b, w))?;
    }
    Ok(())
}

fn name(shape: &str, len: usize, b: usize, imp: &str) -> String {
    format!("attention/{shape}/L{len}/b{b}/{imp}")
}

fn ours_name(f: KvFormat) -> String {
    format!("ours-kv{}", f.name())
}

/// Stock candle llama's attention for one decode step (`seq_len == 1`: no mask), from
/// the unrotated q and k of the new token, over the rotated cache `kc`, `vc`.
fn stock_step(c: &Case, kc: &Tensor, vc: &Tensor) -> candle_core::Result<Tensor> {
    stock_attn(
        c.h,
        (&c.q, &c.k_new, &c.v_new),
        (&c.cos_l, &c.sin_l),
        kc,
        vc,
    )
}

fn stock_attn(
    h: Heads,
    (q, k_new, v_new): (&Tensor, &Tensor, &Tensor),
    (cos_l, sin_l): (&Tensor, &Tensor),
    kc: &Tensor,
    vc: &Tensor,
) -> candle_core::Result<Tensor> {
    let q = candle_nn::rotary_emb::rope(q, cos_l, sin_l)?;
    let k_new = candle_nn::rotary_emb::rope(k_new, cos_l, sin_l)?;
    let k = Tensor::cat(&[kc, &k_new], 2)?.contiguous()?;
    let v = Tensor::cat(&[vc, v_new], 2)?.contiguous()?;
    let k = candle_transformers::utils::repeat_kv(k, h.nh / h.nkv)?;
    let v = candle_transformers::utils::repeat_kv(v, h.nh / h.nkv)?;
    let in_dtype = q.dtype();
    let q = q.to_dtype(DType::F32)?;
    let k = k.to_dtype(DType::F32)?;
    let v = v.to_dtype(DType::F32)?;
    let att = (q.matmul(&k.t()?)? / (h.hd as f64).sqrt())?;
    let att = candle_nn::ops::softmax_last_dim(&att)?;
    att.matmul(&v.contiguous()?)?.to_dtype(in_dtype)
}

/// f32 RoPE tables `[n_pos, hd/2]` (theta 10000, the HF "rotate half" convention both
/// candle's `rope` and our kernels use).
pub(crate) fn rope_tables(
    n_pos: usize,
    hd: usize,
    dev: &candle_core::Device,
) -> Result<(Tensor, Tensor)> {
    let freqs: Vec<f32> = (0..hd)
        .step_by(2)
        .map(|i| 1f32 / 10_000f32.powf(i as f32 / hd as f32))
        .collect();
    let t = Tensor::arange(0u32, n_pos as u32, dev)?
        .to_dtype(DType::F32)?
        .reshape((n_pos, 1))?;
    let theta = t.matmul(&Tensor::new(freqs.as_slice(), dev)?.reshape((1, hd / 2))?)?;
    Ok((theta.cos()?, theta.sin()?))
}

/// Device positions for a step at cache row `pos`.
pub(crate) fn positions(
    tables: &(Tensor, Tensor),
    pos: usize,
    b: usize,
    dev: &candle_core::Device,
) -> Result<StepPositions> {
    Ok(StepPositions {
        cos: tables.0.clone(),
        sin: tables.1.clone(),
        pos: Tensor::new(&[pos as u32], dev)?,
        pads: Tensor::zeros(b, DType::U32, dev)?,
    })
}

/// Our caches (capacity L + 1, `n` distinct copies) holding the raw keys `k` and values
/// `v` `[b, nkv, L, hd]`, appended as fused-projection chunks of up to 2048 tokens (the q
/// part zeros: `append` does not read it).
fn our_caches(
    ctx: &Ctx,
    f: KvFormat,
    h: Heads,
    (k, v): (&Tensor, &Tensor),
    tables: &(Tensor, Tensor),
    n: usize,
) -> Result<Vec<KvCache>> {
    let (b, nkv, l, hd) = k.dims4()?;
    anyhow::ensure!(
        nkv == h.nkv && hd == h.hd,
        "keys {:?} do not match {h:?}",
        k.shape()
    );
    let nh = h.nh;
    // The keys and values are N(0, 1): Oaken's thresholds are that distribution's.
    let enc = KvSpec::uncalibrated(f, 1)?.encoding(0)?;
    let mut caches: Vec<KvCache> = (0..n)
        .map(|_| KvCache::new(enc.clone(), h, l + 1, ctx.dtype, &ctx.dev))
        .collect();
    for s in (0..l).step_by(2048) {
        let len = 2048.min(l - s);
        let part = |t: &Tensor| -> candle_core::Result<Tensor> {
            t.narrow(2, s, len)?
                .transpose(1, 2)?
                .reshape((b, len, nkv * hd))
        };
        let q_part = Tensor::zeros((b, len, nh * hd), ctx.dtype, &ctx.dev)?;
        let qkv = Tensor::cat(&[&q_part, &part(k)?, &part(v)?], 2)?.contiguous()?;
        let p = positions(tables, s, b, &ctx.dev)?;
        for cache in caches.iter_mut() {
            cache.append(&qkv, s, &p)?;
        }
    }
    Ok(caches)
}

/// Our caches of one format, or why they could not be built.
type OurCaches = Vec<(KvFormat, Result<Vec<KvCache>>)>;

/// The case's inputs (see [`Case`]) and our caches, built before stock's rotated copy of
/// the keys so that the raw keys can be dropped early (the 32k × 32 case is ~70 GB). The
/// reference output is stock's computation one sequence at a time (no tensor reaches
/// candle's 2³²-element limit), so ours is checked even where stock cannot run whole.
fn build_case(
    ctx: &Ctx,
    h: Heads,
    len: usize,
    b: usize,
    n_ours: usize,
) -> Result<(Case, OurCaches, StepPositions)> {
    let (dev, dt) = (ctx.dev.clone(), ctx.dtype);
    let tables = rope_tables(len + 1, h.hd, &dev)?;
    let k_raw = randn(&[b, h.nkv, len, h.hd], 1.0, dt, &dev)?;
    let vc = randn(&[b, h.nkv, len, h.hd], 1.0, dt, &dev)?;
    let qkv_new = randn(&[b, 1, h.qkv_width()], 1.0, dt, &dev)?;
    let mut ours = vec![];
    for f in KvFormat::ALL {
        ours.push((*f, our_caches(ctx, *f, h, (&k_raw, &vc), &tables, n_ours)));
    }
    let cos = tables.0.to_dtype(dt)?;
    let sin = tables.1.to_dtype(dt)?;
    let (cos_n, sin_n) = (cos.narrow(0, 0, len)?, sin.narrow(0, 0, len)?);
    let split = |start: usize, n: usize| -> candle_core::Result<Tensor> {
        qkv_new
            .narrow(2, start * h.hd, n * h.hd)?
            .reshape((b, 1, n, h.hd))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k_new, v_new) = (
        split(0, h.nh)?,
        split(h.nh, h.nkv)?,
        split(h.nh + h.nkv, h.nkv)?,
    );
    let (cos_l, sin_l) = (cos.narrow(0, len, 1)?, sin.narrow(0, len, 1)?);
    let mut rows = vec![];
    for i in 0..b {
        let row = |t: &Tensor| t.narrow(0, i, 1);
        let kc_i = candle_nn::rotary_emb::rope(&row(&k_raw)?.contiguous()?, &cos_n, &sin_n)?;
        let y = stock_attn(
            h,
            (&row(&q)?, &row(&k_new)?, &row(&v_new)?),
            (&cos_l, &sin_l),
            &kc_i,
            &row(&vc)?,
        )?;
        rows.push(y.transpose(1, 2)?.reshape((1, 1, h.nh * h.hd))?);
    }
    let y_ref = Tensor::cat(&rows, 0)?;
    let stock_kv = match stock_limit(h, len, b) {
        None => Some((candle_nn::rotary_emb::rope(&k_raw, &cos_n, &sin_n)?, vc)),
        Some(_) => None,
    };
    drop(k_raw);
    let case = Case {
        h,
        len,
        b,
        q,
        k_new,
        v_new,
        qkv_new: qkv_new.clone(),
        stock_kv,
        cos_l,
        sin_l,
        y_ref,
    };
    let p = positions(&tables, len, b, &dev)?;
    Ok((case, ours, p))
}

fn run_case(ctx: &mut Ctx, s: &Shape, len: usize, b: usize, wanted: &[String]) -> Result<()> {
    let h = s.h;
    // Our copies: enough to exceed 256 MiB together (f16 estimate of one cache).
    let one_f16 = 2 * b * h.nkv * (len + 1) * h.hd * ctx.dtype.size_in_bytes();
    let (case, ours, p) = build_case(ctx, h, len, b, rotation(one_f16, 16))?;
    // The stock row always runs where it can (every ratio needs it); shown if wanted.
    let stock_name = name(s.name, len, b, "candle-f16");
    let stock = run_stock(ctx, &case);
    let stock_t = stock.as_ref().ok().map(|(t, _)| t.median);
    if wanted.contains(&stock_name) {
        let row = match stock {
            Ok((t, bytes)) => timed_row(ctx, &stock_name, &case, t, bytes, None, stock_t)?,
            Err(e) => match stock_limit(h, len, b) {
                Some(why) => base_row(&stock_name, &case).status(Status::Skip, why),
                None => {
                    let (status, note) = classify(&e);
                    base_row(&stock_name, &case).status(status, note)
                }
            },
        };
        ctx.push(row);
    }
    for (f, caches) in ours {
        let n = name(s.name, len, b, &ours_name(f));
        if !wanted.contains(&n) {
            continue;
        }
        let row = match caches.and_then(|c| run_ours(ctx, &case, c, &p, &case.y_ref, tolerance(f)))
        {
            Ok((Some(t), bytes, err)) => timed_row(ctx, &n, &case, t, bytes, Some(err), stock_t)?,
            Ok((None, _, err)) => base_row(&n, &case).num("err", err).status(
                Status::Fail,
                format!("rel err {err:.2e} > {:.0e} vs stock", tolerance(f)),
            ),
            Err(e) => {
                let (status, note) = classify(&e);
                base_row(&n, &case).status(status, note)
            }
        };
        let failed = row.status != Status::Ok;
        ctx.push(row);
        if failed {
            ctx.check_device()?;
        }
    }
    Ok(())
}

fn base_row(name: &str, c: &Case) -> Row {
    Row::new("attention", name)
        .text("heads", format!("{}q/{}kv x{}", c.h.nh, c.h.nkv, c.h.hd))
        .num("L", c.len as f64)
        .num("batch", c.b as f64)
}

fn timed_row(
    ctx: &mut Ctx,
    name: &str,
    c: &Case,
    timing: Timing,
    bytes: usize,
    err: Option<f64>,
    stock_t: Option<f64>,
) -> Result<Row> {
    let dev = ctx.dev.clone();
    let t = timing.median;
    let ceil = ctx.ceiling.seconds(&dev, ctx.iters, MIN_SAMPLE_S, bytes)?;
    Ok(base_row(name, c)
        .num("us", t * 1e6)
        .num("GB/s", bytes as f64 / t / 1e9)
        .opt("vs_candle", stock_t.map(|s| s / t))
        .opt("ceil_us", ceil.map(|x| x * 1e6))
        .opt("of_ceil", ceil.map(|x| x / t))
        .opt("err", err)
        .num("spread%", timing.spread_pct())
        .num("MB", bytes as f64 / 1e6))
}

/// Seconds per stock step, and the f16 K+V bytes over L + 1 tokens.
fn run_stock(ctx: &Ctx, c: &Case) -> Result<(Timing, usize)> {
    let Some((kc, vc)) = &c.stock_kv else {
        anyhow::bail!("stock candle cannot run this case")
    };
    let y = stock_step(c, kc, vc)?
        .transpose(1, 2)?
        .reshape(c.y_ref.shape())?;
    let err = rel_err(&y, &c.y_ref)?;
    anyhow::ensure!(
        err < 1e-3,
        "stock's whole-batch output differs from its per-sequence output: rel err {err:.2e}"
    );
    let one = nbytes(kc) + nbytes(vc);
    let r = rotation(one, 16);
    let mut kcs = vec![kc.clone()];
    let mut vcs = vec![vc.clone()];
    for _ in 1..r {
        kcs.push(kc.copy()?);
        vcs.push(vc.copy()?);
    }
    let t = time_batched(&ctx.dev, ctx.iters, MIN_SAMPLE_S, |i| {
        stock_step(c, &kcs[i % r], &vcs[i % r]).map(|_| ())
    })?;
    Ok((t, one + nbytes(&c.k_new) + nbytes(&c.v_new)))
}

/// Dense caches must match stock to f16 rounding; a quantized cache is held to a sanity
/// bound only (its accuracy is measured by perplexity, not here).
fn tolerance(f: KvFormat) -> f64 {
    match f {
        KvFormat::Dense => 1e-2,
        #[allow(unreachable_patterns)]
        _ => 0.25,
    }
}

/// Our decode step on one cache: append the new token at row L, attend over L + 1.
fn our_step(c: &Case, cache: &mut KvCache, p: &StepPositions) -> candle_core::Result<Tensor> {
    if let Some(y) = cache.append_attend_decode(&c.qkv_new, c.len, p)? {
        return Ok(y);
    }
    cache.append(&c.qkv_new, c.len, p)?;
    let (h, b) = (c.h, c.b);
    let q = candle_nn::rotary_emb::rope(&c.q, &c.cos_l, &c.sin_l)?;
    let y = cache.attend(&q, c.len + 1, None)?;
    y.transpose(1, 2)?.reshape((b, 1, h.nh * h.hd))
}

/// `(seconds per step or None if the check failed, bytes read, rel err vs stock)`.
fn run_ours(
    ctx: &Ctx,
    c: &Case,
    mut caches: Vec<KvCache>,
    p: &StepPositions,
    y_ref: &Tensor,
    tol: f64,
) -> Result<(Option<Timing>, usize, f64)> {
    let r = caches.len();
    anyhow::ensure!(r > 0, "no caches");
    let y = our_step(c, &mut caches[r - 1], p)?;
    let err = rel_err(&y, y_ref)?;
    let bytes = caches[0].bytes();
    if err.is_nan() || err > tol {
        return Ok((None, bytes, err));
    }
    let t = time_batched(&ctx.dev, ctx.iters, MIN_SAMPLE_S, |i| {
        our_step(c, &mut caches[i % r], p).map(|_| ())
    })?;
    Ok((Some(t), bytes, err))
}
