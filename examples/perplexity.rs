//! Perplexity of a text file (WikiText-2 test by default) under candle-lowbit's Llama.
//!
//! ```text
//! cargo run --release --features cuda --example perplexity -- --quant q4_0 --json
//! cargo run --example perplexity -- --cpu --max-tokens 4096 --compare
//! ```
//!
//! The text is tokenized whole (no special tokens) and cut into windows of `--ctx` tokens
//! starting every `--stride` tokens, as in Hugging Face's perplexity guide: a window scores
//! the tokens it adds past the previous window's end (all but its first token for the first
//! window, and for every window when stride = ctx), each predicted from the tokens before it
//! in the same window. The last window ends at the end of the text and may be shorter; it
//! is kept if it has at least 2 tokens (one token has nothing to score), so with stride =
//! ctx at most one trailing token goes unscored.
//!
//! `--compare` scores the same targets with stock candle, whose models return only the last
//! position's logits: each batch of windows is fed token by token in lockstep.
//!
//! `--windows A..B` scores only those windows, so a long run splits into parts (stock candle
//! on the CPU scores about 25 tokens/s at `--batch 8` on a 2-core machine: the full
//! WikiText-2 test set is hours). Each part's `--json` line carries `nll`, `tokens` (and
//! `stock_nll`, `stock_tokens`); the whole text's perplexity is `exp(sum nll / sum tokens)`
//! over the parts.

mod common;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, D};
use candle_lowbit::loader::StockModel;
use candle_lowbit::Cache;
use candle_nn::ops::log_softmax;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::time::Instant;
use tokenizers::Tokenizer;

#[derive(Parser, Debug)]
#[command(
    about = "Perplexity of a text file under candle-lowbit's Llama (optionally against stock candle)"
)]
struct Args {
    #[command(flatten)]
    model: common::ModelArgs,

    /// The text file to score.
    #[arg(long, default_value = "../shared/data/wikitext-2/test.txt")]
    text: PathBuf,

    /// Tokens per window.
    #[arg(long, default_value_t = 512)]
    ctx: usize,

    /// Tokens between window starts (1..=ctx) [default: ctx, non-overlapping windows].
    #[arg(long)]
    stride: Option<usize>,

    /// Use only the first N tokens of the text.
    #[arg(long)]
    max_tokens: Option<usize>,

    /// Windows per forward call.
    #[arg(long, default_value_t = 8)]
    batch: usize,

    /// Print one JSON line with the results (and nothing else on stdout).
    #[arg(long)]
    json: bool,

    /// Also score the same windows with stock candle.
    #[arg(long)]
    compare: bool,

    /// Score only windows `A..B` (0-based, B excluded) of the text's windows, to split a
    /// long run (stock candle on the CPU) into parts. `--json` then reports the summed
    /// negative log-likelihood and the token count, and the parts combine as
    /// `exp(sum nll / sum tokens)`.
    #[arg(long, value_parser = parse_range)]
    windows: Option<std::ops::Range<usize>>,
}

fn parse_range(s: &str) -> std::result::Result<std::ops::Range<usize>, String> {
    let (a, b) = s
        .split_once("..")
        .ok_or_else(|| format!("expected A..B, got {s:?}"))?;
    let parse = |t: &str| {
        t.trim()
            .parse::<usize>()
            .map_err(|_| format!("expected A..B with numbers, got {s:?}"))
    };
    let (a, b) = (parse(a)?, parse(b)?);
    if a >= b {
        return Err(format!("empty window range {a}..{b}"));
    }
    Ok(a..b)
}

/// `len` tokens from `begin`; targets are window positions `first_target..len`.
#[derive(Debug, Clone, Copy)]
struct Window {
    begin: usize,
    len: usize,
    first_target: usize,
}

/// Summed negative log-likelihood over `tokens` scored targets.
struct Score {
    nll: f64,
    tokens: usize,
    secs: f64,
}

impl Score {
    fn ppl(&self) -> f64 {
        (self.nll / self.tokens.max(1) as f64).exp()
    }

    fn tokens_per_sec(&self) -> f64 {
        self.tokens as f64 / self.secs.max(1e-9)
    }
}

/// The windows over `n` tokens (see the module docs).
fn windows(n: usize, ctx: usize, stride: usize) -> Vec<Window> {
    let (mut out, mut begin, mut prev_end) = (vec![], 0, 0);
    loop {
        let end = (begin + ctx).min(n);
        let len = end - begin;
        if len >= 2 {
            let first_target = len.saturating_sub(end - prev_end).max(1);
            out.push(Window {
                begin,
                len,
                first_target,
            });
        }
        if end == n {
            return out;
        }
        prev_end = end;
        begin += stride;
    }
}

/// Runs of up to `batch` consecutive windows of equal length.
fn batches(windows: &[Window], batch: usize) -> Vec<&[Window]> {
    windows
        .chunk_by(|a, b| a.len == b.len)
        .flat_map(|run| run.chunks(batch))
        .collect()
}

/// The text to score; an empty (or whitespace-only) file is an error.
fn read_text(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read text file {}", path.display()))?;
    if text.trim().is_empty() {
        bail!("text file {} is empty", path.display())
    }
    Ok(text)
}

/// The whole text's token ids (no special tokens), cut to `max_tokens`; at least 2.
fn tokenize(
    text: String,
    path: &Path,
    tok: &Tokenizer,
    max_tokens: Option<usize>,
) -> Result<Vec<u32>> {
    let mut ids = tok
        .encode(text, false)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    if let Some(m) = max_tokens {
        ids.truncate(m);
    }
    if ids.len() < 2 {
        bail!(
            "{} gives {} token(s) (after --max-tokens); perplexity needs at least 2",
            path.display(),
            ids.len()
        )
    }
    Ok(ids)
}

fn progress(len: usize, what: &str, label: &str) -> Result<ProgressBar> {
    let pb = ProgressBar::new(len as u64);
    let template =
        format!("{{msg:>5}} [{{bar:40}}] {{pos}}/{{len}} {what} {{elapsed}} (eta {{eta}})");
    pb.set_style(ProgressStyle::with_template(&template)?.progress_chars("=> "));
    pb.set_message(label.to_string());
    Ok(pb)
}

/// Sum of `-log p(target)` over rows of `logits` `[rows, vocab]` (f32), in f64.
fn nll_rows(logits: &Tensor, targets: &[u32]) -> Result<Vec<f64>> {
    let idx = Tensor::new(targets, logits.device())?.unsqueeze(1)?;
    let picked = log_softmax(logits, D::Minus1)?
        .gather(&idx, 1)?
        .squeeze(1)?;
    Ok(picked
        .to_vec1::<f32>()?
        .into_iter()
        .map(|x| -(x as f64))
        .collect())
}

/// Negative log-likelihood of one window's targets from its logits `[len, vocab]`.
fn window_nll(logits: &Tensor, tokens: &[u32], w: &Window) -> Result<f64> {
    let n = w.len - w.first_target;
    let targets = &tokens[w.begin + w.first_target..w.begin + w.len];
    Ok(
        nll_rows(&logits.narrow(0, w.first_target - 1, n)?, targets)?
            .iter()
            .sum(),
    )
}

/// `[b, len]` token ids of a batch of equal-length windows.
fn batch_ids(tokens: &[u32], batch: &[Window], device: &Device) -> Result<Tensor> {
    let len = batch[0].len;
    let ids: Vec<u32> = batch
        .iter()
        .flat_map(|w| tokens[w.begin..w.begin + len].iter().copied())
        .collect();
    Ok(Tensor::from_vec(ids, (batch.len(), len), device)?)
}

/// Our model: one `forward_all` per batch.
fn score_ours(
    s: &common::Session,
    cache: &mut Cache,
    tokens: &[u32],
    batches: &[&[Window]],
) -> Result<Score> {
    let pb = progress(batches.iter().map(|b| b.len()).sum(), "windows", "ours")?;
    let start = Instant::now();
    let (mut nll, mut scored) = (0f64, 0usize);
    for batch in batches {
        cache.clear();
        let logits = s
            .loaded
            .model
            .forward_all(&batch_ids(tokens, batch, &s.device)?, 0, cache)?;
        for (i, w) in batch.iter().enumerate() {
            nll += window_nll(&logits.get(i)?, tokens, w)?;
            scored += w.len - w.first_target;
        }
        pb.inc(batch.len() as u64);
    }
    s.device.synchronize()?;
    pb.finish_and_clear();
    Ok(Score {
        nll,
        tokens: scored,
        secs: start.elapsed().as_secs_f64(),
    })
}

/// Stock candle: step `t` feeds token `t` of every window of the batch at position `t` and
/// scores the windows whose token `t + 1` is a target.
fn score_stock(s: &common::Session, tokens: &[u32], batches: &[&[Window]]) -> Result<Score> {
    let mut stock = StockModel::load(&s.source, s.dtype, &s.device)?;
    let pb = progress(batches.iter().map(|b| b[0].len - 1).sum(), "steps", "stock")?;
    let start = Instant::now();
    let (mut nll, mut scored) = (0f64, 0usize);
    for batch in batches {
        stock.clear()?;
        for t in 0..batch[0].len - 1 {
            let ids: Vec<u32> = batch.iter().map(|w| tokens[w.begin + t]).collect();
            let logits = stock.forward(&Tensor::from_vec(ids, (batch.len(), 1), &s.device)?, t)?;
            if batch.iter().all(|w| t + 1 < w.first_target) {
                pb.inc(1);
                continue;
            }
            let targets: Vec<u32> = batch.iter().map(|w| tokens[w.begin + t + 1]).collect();
            for (w, x) in batch.iter().zip(nll_rows(&logits, &targets)?) {
                if t + 1 >= w.first_target {
                    nll += x;
                    scored += 1;
                }
            }
            pb.inc(1);
        }
    }
    s.device.synchronize()?;
    pb.finish_and_clear();
    Ok(Score {
        nll,
        tokens: scored,
        secs: start.elapsed().as_secs_f64(),
    })
}

fn print_human(s: &common::Session, ours: &Score, stock: Option<&Score>) {
    println!(
        "ours : ppl {:.4}  ({} tokens scored in {:.2} s, {:.1} tokens/s)",
        ours.ppl(),
        ours.tokens,
        ours.secs,
        ours.tokens_per_sec()
    );
    if let Some(st) = stock {
        println!(
            "stock: ppl {:.4}  ({} tokens scored in {:.2} s, {:.1} tokens/s) [{}]",
            st.ppl(),
            st.tokens,
            st.secs,
            st.tokens_per_sec(),
            common::stock_name(&s.source, s.dtype)
        );
        let rel = (ours.ppl() - st.ppl()).abs() / st.ppl() * 100.0;
        println!(
            "|ours - stock| / stock = {rel:.4} %   speed ours/stock = {:.2}x",
            st.secs / ours.secs.max(1e-9)
        );
    }
}

fn print_json(
    s: &common::Session,
    args: &Args,
    stride: usize,
    (windows, total_windows): (std::ops::Range<usize>, usize),
    ours: &Score,
    stock: Option<&Score>,
) -> Result<()> {
    let mut j = serde_json::json!({
        "ppl": ours.ppl(),
        "tokens": ours.tokens,
        "seconds": ours.secs,
        "model": s.loaded.name,
        "quant": s.loaded.format.name(),
        "bits_per_weight": s.loaded.model.bits_per_weight(),
        "block_bits_per_weight": s.loaded.model.block_bits_per_weight(),
        "head": s.loaded.model.lm_head().format_name(),
        "quantizer": args.model.calib.settings_json(s.loaded.format),
        "calibration": s.loaded.calibration.as_ref().map(|c| serde_json::json!({
            "file": c.file, "sha256": c.sha256, "samples": c.samples, "len": c.len, "seed": c.seed,
        })),
        "calibration_in_sample": in_sample(s, &args.text),
        "load_seconds": s.load_secs,
        "kv_cache": s.kv_cache.name(),
        "kv_bits_per_value": s.kv_cache.bits_per_value(
            s.loaded.config.hidden_size / s.loaded.config.num_attention_heads.max(1),
            s.dtype
        ),
        "kv_k_pre_rope": s.kv_k_pre_rope,
        "kv_oaken_fractions": s.kv_oaken.as_ref().map(|o| serde_json::json!(o.calibration.fractions)),
        "kv_oaken_picked": s.kv_oaken.as_ref().map(|o| serde_json::json!(o.calibration.picked)),
        "dtype": s.dtype.as_str(),
        "device": common::device_name(&s.device),
        "ctx": args.ctx,
        "stride": stride,
        "nll": ours.nll,
        "windows": [windows.start, windows.end],
        "total_windows": total_windows,
    });
    if let Some(st) = stock {
        j["stock_ppl"] = st.ppl().into();
        j["stock_seconds"] = st.secs.into();
        j["stock_nll"] = st.nll.into();
        j["stock_tokens"] = st.tokens.into();
        j["stock"] = common::stock_name(&s.source, s.dtype).into();
    }
    println!("{j}");
    Ok(())
}

/// Whether the model (its weights, or Oaken's KV thresholds calibrated at load) was
/// calibrated on the very text being scored (then the perplexity is in-sample, and every
/// table must say so).
fn in_sample(s: &common::Session, text: &Path) -> bool {
    let Ok(bytes) = std::fs::read(text) else {
        return false;
    };
    let sha = candle_lowbit::checkpoint::sha256_hex(&bytes);
    let weights = s.loaded.calibration.as_ref().map(|c| &c.sha256);
    let kv = s.kv_oaken.as_ref().and_then(|o| o.text_sha256.as_ref());
    weights.into_iter().chain(kv).any(|h| *h == sha)
}

fn check_args(args: &Args) -> Result<usize> {
    let stride = args.stride.unwrap_or(args.ctx);
    if args.ctx < 2 {
        bail!("--ctx must be at least 2, got {}", args.ctx)
    }
    if stride == 0 || stride > args.ctx {
        bail!("--stride must be in 1..={} (--ctx), got {stride}", args.ctx)
    }
    if args.batch == 0 {
        bail!("--batch must be at least 1")
    }
    Ok(stride)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let stride = check_args(&args)?;
    if !args.text.is_file() {
        bail!("text file {} does not exist", args.text.display())
    }
    let text = read_text(&args.text)?;
    let s = common::load(&args.model)?;
    let header = common::describe(&s)?;
    if args.json {
        eprintln!("{header}");
    } else {
        println!("{header}");
    }
    if in_sample(&s, &args.text) {
        eprintln!("note: the model was calibrated on this text: the perplexity is in-sample");
    }
    let tokens = tokenize(text, &args.text, &s.loaded.tokenizer, args.max_tokens)?;
    let all = windows(tokens.len(), args.ctx, stride);
    let part = args.windows.clone().unwrap_or(0..all.len());
    if part.end > all.len() {
        bail!(
            "--windows {}..{}: the text has {} windows of {} tokens",
            part.start,
            part.end,
            all.len(),
            args.ctx
        )
    }
    let ws = &all[part.clone()];
    let bs = batches(ws, args.batch);
    eprintln!(
        "{} tokens, {} windows of up to {} (stride {stride}), scoring windows {}..{} in {} batches",
        tokens.len(),
        all.len(),
        args.ctx,
        part.start,
        part.end,
        bs.len()
    );
    if args.ctx > s.loaded.config.max_position_embeddings {
        eprintln!(
            "warning: --ctx {} exceeds the model's {} positions",
            args.ctx, s.loaded.config.max_position_embeddings
        );
    }
    let mut cache = s.cache(args.ctx)?;
    let ours = score_ours(&s, &mut cache, &tokens, &bs)?;
    drop(cache);
    let stock = if args.compare {
        Some(score_stock(&s, &tokens, &bs)?)
    } else {
        None
    };
    if args.json {
        print_json(&s, &args, stride, (part, all.len()), &ours, stock.as_ref())
    } else {
        print_human(&s, &ours, stock.as_ref());
        Ok(())
    }
}
