//! Text generation with candle-lowbit's Llama, streaming tokens as they come.
//!
//! ```text
//! cargo run --release --features cuda --example generate -- --quant q4_0 --prompt "Hi"
//! cargo run --example generate -- --cpu --sample-len 20 --compare
//! ```
//!
//! `--compare` also runs stock candle (`quantized_llama` for a GGUF file, `llama` for a HF
//! directory) greedily on the same prompt tokens and prints both texts and speeds.

mod common;

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};
use candle_lowbit::graph::GraphDecoder;
use candle_lowbit::loader::{Loaded, StockModel};
use candle_lowbit::model_files::ModelSource;
use candle_transformers::generation::{LogitsProcessor, Sampling};
use clap::Parser;
use std::io::Write;
use std::time::Instant;
use tokenizers::Tokenizer;

#[derive(Parser, Debug)]
#[command(about = "Generate text with candle-lowbit's Llama (optionally against stock candle)")]
struct Args {
    #[command(flatten)]
    model: common::ModelArgs,

    /// The user message (wrapped in the model's chat template unless --no-chat-template).
    #[arg(long, default_value = "Explain what a GPU is in two sentences.")]
    prompt: String,

    /// The most tokens to generate.
    #[arg(long, default_value_t = 128)]
    sample_len: usize,

    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,

    /// Nucleus sampling probability cutoff (with --temperature > 0).
    #[arg(long)]
    top_p: Option<f64>,

    /// Seed of the sampler.
    #[arg(long, default_value_t = 299792458)]
    seed: u64,

    /// Use the prompt as raw text, without the model's chat template.
    #[arg(long)]
    no_chat_template: bool,

    /// Also run stock candle on the same prompt (greedy, both) and compare.
    #[arg(long)]
    compare: bool,

    /// KV-cache capacity in tokens [default: min(max_position_embeddings, 4096)].
    #[arg(long)]
    max_context: Option<usize>,

    /// Keep generating past end-of-sequence tokens (for long runs).
    #[arg(long)]
    ignore_eos: bool,

    /// Check that every step's logits are finite (stop with an error at the first that
    /// is not).
    #[arg(long)]
    check_finite: bool,
}

/// One generation: the sampled tokens (a final eos included) and the timings.
struct Run {
    tokens: Vec<u32>,
    n_prompt: usize,
    prompt_secs: f64,
    decode_secs: f64,
}

impl Run {
    fn prompt_tps(&self) -> f64 {
        self.n_prompt as f64 / self.prompt_secs.max(1e-9)
    }

    /// Tokens from single-token decode steps (the first one comes from the prefill).
    fn decode_tps(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_secs.max(1e-9)
    }

    fn text(&self, tok: &Tokenizer, eos: &[u32]) -> Result<String> {
        let ids: Vec<u32> = self
            .tokens
            .iter()
            .copied()
            .filter(|t| !eos.contains(t))
            .collect();
        tok.decode(&ids, true).map_err(anyhow::Error::msg)
    }
}

/// Prefill `prompt` in one call to `step(ids, pos)` (logits `[1, vocab]`), then decode
/// token by token until `sample_len` tokens or an eos. `on_token` sees every non-eos token.
#[allow(clippy::too_many_arguments)]
fn generate(
    mut step: impl FnMut(&[u32], usize) -> candle_core::Result<Tensor>,
    prompt: &[u32],
    sample_len: usize,
    eos: &[u32],
    sampler: &mut LogitsProcessor,
    device: &Device,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
    check_finite: bool,
) -> Result<Run> {
    let start = Instant::now();
    let mut logits = step(prompt, 0)?;
    let mut tokens = Vec::with_capacity(sample_len);
    let (mut prompt_secs, mut decode_start) = (0.0, start);
    while tokens.len() < sample_len {
        if check_finite {
            let v = logits.flatten_all()?.to_vec1::<f32>()?;
            if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                bail!("step {}: logit {i} is {} (not finite)", tokens.len(), v[i])
            }
        }
        let next = sampler.sample(&logits.squeeze(0)?)?;
        if tokens.is_empty() {
            device.synchronize()?;
            prompt_secs = start.elapsed().as_secs_f64();
            decode_start = Instant::now();
        }
        tokens.push(next);
        if eos.contains(&next) {
            break;
        }
        on_token(next)?;
        if tokens.len() < sample_len {
            logits = step(&[next], prompt.len() + tokens.len() - 1)?;
        }
    }
    device.synchronize()?;
    let decode_secs = decode_start.elapsed().as_secs_f64();
    Ok(Run {
        tokens,
        n_prompt: prompt.len(),
        prompt_secs,
        decode_secs,
    })
}

/// Whether a GGUF file asks for a BOS token (`tokenizer.ggml.add_bos_token`).
fn gguf_wants_bos(source: &ModelSource) -> bool {
    let ModelSource::Gguf(path) = source else {
        return false;
    };
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let Ok(ct) = candle_core::quantized::gguf_file::Content::read(&mut f) else {
        return false;
    };
    ct.metadata
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(false)
}

/// The prompt's token ids. With a chat template the rendered text carries its own markers
/// (BOS included where the template wants one), so no special tokens are added. Without
/// one, a `tokenizer.json` adds what its post-processor says, and a GGUF file gets a BOS
/// when its metadata asks for one.
fn prompt_ids(
    loaded: &Loaded,
    source: &ModelSource,
    prompt: &str,
    use_template: bool,
) -> Result<Vec<u32>> {
    let tok = &loaded.tokenizer;
    let name = |id: Option<&u32>| id.and_then(|&i| tok.id_to_token(i)).unwrap_or_default();
    if let (true, Some(tmpl)) = (use_template, &loaded.chat_template) {
        let (bos, eos) = (
            name(loaded.config.bos_token_id.as_ref()),
            name(loaded.eos.first()),
        );
        let text = candle_lowbit::chat::render_user_prompt(tmpl, prompt, &bos, &eos)?;
        return Ok(tok
            .encode(text, false)
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .to_vec());
    }
    let mut ids = tok
        .encode(prompt, true)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    if let Some(bos) = loaded.config.bos_token_id {
        if gguf_wants_bos(source) && ids.first() != Some(&bos) {
            ids.insert(0, bos);
        }
    }
    Ok(ids)
}

fn sampler(args: &Args, greedy: bool) -> LogitsProcessor {
    let sampling = match (greedy || args.temperature <= 0.0, args.top_p) {
        (true, _) => Sampling::ArgMax,
        (false, None) => Sampling::All {
            temperature: args.temperature,
        },
        (false, Some(p)) => Sampling::TopP {
            p,
            temperature: args.temperature,
        },
    };
    LogitsProcessor::from_sampling(args.seed, sampling)
}

/// Our model, streaming its text to stdout.
fn run_ours(s: &common::Session, prompt: &[u32], args: &Args, max_ctx: usize) -> Result<Run> {
    let l = &s.loaded;
    let mut cache = s.cache(max_ctx)?;
    // Warm-up (kernel loading, cuBLAS set-up) outside the timings, as for stock below: two
    // tokens, so that both the prefill matmuls (cuBLAS) and the batch-1 ones (our skinny
    // matmul, the output head) are loaded before the prompt is timed, then one decode-sized
    // step, so that the decode kernels (attention over the cache) are loaded before the
    // generation is timed.
    let warm = &prompt[..prompt.len().min(2)];
    l.model
        .forward(&Tensor::new(warm, &s.device)?.unsqueeze(0)?, 0, &mut cache)?;
    l.model.forward(
        &Tensor::new(&warm[..1], &s.device)?.unsqueeze(0)?,
        warm.len(),
        &mut cache,
    )?;
    // Prefill through `forward`; each decode step is one replay of a captured CUDA graph
    // (eager on the CPU).
    let mut decoder = GraphDecoder::new(&l.model, 1, &s.device)?;
    let step = |ids: &[u32], pos: usize| match (ids.len(), pos) {
        (1, p) if p > 0 => decoder.step(&l.model, &mut cache, ids, pos),
        _ => l
            .model
            .forward(&Tensor::new(ids, &s.device)?.unsqueeze(0)?, pos, &mut cache),
    };
    let mut stream = l.tokenizer.decode_stream(false);
    let mut stdout = std::io::stdout();
    let mut emit = |id: u32| -> Result<()> {
        if let Some(text) = stream.step(id).map_err(anyhow::Error::msg)? {
            write!(stdout, "{text}")?;
            stdout.flush()?;
        }
        Ok(())
    };
    let mut sampler = sampler(args, args.compare);
    let eos: &[u32] = if args.ignore_eos { &[] } else { &l.eos };
    let run = generate(
        step,
        prompt,
        args.sample_len,
        eos,
        &mut sampler,
        &s.device,
        &mut emit,
        args.check_finite,
    )?;
    println!();
    Ok(run)
}

/// What fits the device's free memory in the chosen weight and KV formats: tokens of
/// context × batch (the weights are already loaded; activations and scratch not counted).
fn print_capacity(s: &common::Session) -> Result<()> {
    let Some((free, total)) = candle_lowbit::kernels::device_memory(&s.device)? else {
        return Ok(());
    };
    let c = &s.loaded.config;
    let hd = c.hidden_size / c.num_attention_heads.max(1);
    let per_token =
        2 * c.num_hidden_layers * c.num_key_value_heads * s.kv_cache.row_bytes(hd, s.dtype);
    let tokens = free / per_token.max(1);
    let ctx = c.max_position_embeddings;
    println!(
        "kv cache {}: {per_token} bytes per token over {} layers; {:.1} of {:.1} GiB free hold {tokens} tokens: context {ctx} x batch {}, context 4096 x batch {}",
        s.kv_cache,
        c.num_hidden_layers,
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64,
        tokens / ctx.max(1),
        tokens / 4096
    );
    Ok(())
}

/// Stock candle on the same files and prompt tokens, greedy, silent.
fn run_stock(s: &common::Session, prompt: &[u32], args: &Args) -> Result<Run> {
    eprintln!("running {} ...", common::stock_name(&s.source, s.dtype));
    let mut stock = StockModel::load(&s.source, s.dtype, &s.device)?;
    stock.forward(
        &Tensor::new(&prompt[..prompt.len().min(1)], &s.device)?.unsqueeze(0)?,
        0,
    )?;
    stock.clear()?;
    let step =
        |ids: &[u32], pos: usize| stock.forward(&Tensor::new(ids, &s.device)?.unsqueeze(0)?, pos);
    let mut sampler = sampler(args, true);
    generate(
        step,
        prompt,
        args.sample_len,
        &s.loaded.eos,
        &mut sampler,
        &s.device,
        &mut |_| Ok(()),
        false,
    )
}

fn print_speeds(run: &Run) {
    println!(
        "{} prompt tokens: {:.1} tokens/s ({:.3} s) | {} tokens generated: {:.1} tokens/s",
        run.n_prompt,
        run.prompt_tps(),
        run.prompt_secs,
        run.tokens.len(),
        run.decode_tps()
    );
}

/// Where two token sequences first differ, if they do.
fn first_difference(a: &[u32], b: &[u32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

fn print_comparison(s: &common::Session, ours: &Run, stock: &Run) -> Result<()> {
    let (tok, eos) = (&s.loaded.tokenizer, &s.loaded.eos);
    let token = |run: &Run, i: usize| match run.tokens.get(i) {
        Some(&id) => format!("{id} {:?}", tok.id_to_token(id).unwrap_or_default()),
        None => "end".to_string(),
    };
    println!(
        "\n==== comparison (greedy, {} prompt tokens)",
        ours.n_prompt
    );
    println!(
        "---- ours: weights {}, kv cache {}",
        common::weights_label(s),
        s.kv_cache
    );
    println!("{}", ours.text(tok, eos)?);
    println!("---- {}", common::stock_name(&s.source, s.dtype));
    println!("{}", stock.text(tok, eos)?);
    println!("----");
    println!(
        "{:<12} {:>12} {:>12} {:>12}",
        "tokens/s", "ours", "stock", "ours/stock"
    );
    let (p_o, p_s) = (ours.prompt_tps(), stock.prompt_tps());
    let (g_o, g_s) = (ours.decode_tps(), stock.decode_tps());
    println!(
        "{:<12} {p_o:>12.1} {p_s:>12.1} {:>11.2}x",
        "prompt",
        p_o / p_s.max(1e-9)
    );
    println!(
        "{:<12} {g_o:>12.1} {g_s:>12.1} {:>11.2}x",
        "generation",
        g_o / g_s.max(1e-9)
    );
    match first_difference(&ours.tokens, &stock.tokens) {
        None => println!("generated tokens: identical ({} tokens)", ours.tokens.len()),
        Some(i) => println!(
            "generated tokens differ at position {i} of {}/{}: ours {}, stock {}",
            ours.tokens.len(),
            stock.tokens.len(),
            token(ours, i),
            token(stock, i)
        ),
    }
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.sample_len == 0 {
        bail!("--sample-len must be at least 1")
    }
    let s = common::load(&args.model)?;
    println!("{}", common::describe(&s)?);
    if args.compare && args.temperature > 0.0 {
        eprintln!(
            "--compare runs both models greedily: --temperature {} ignored",
            args.temperature
        );
    }
    let max_ctx = args
        .max_context
        .unwrap_or(s.loaded.config.max_position_embeddings.min(4096));
    let prompt = prompt_ids(&s.loaded, &s.source, &args.prompt, !args.no_chat_template)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens")
    }
    if prompt.len() + args.sample_len > max_ctx {
        bail!(
            "the prompt has {} tokens and --sample-len is {}: {} tokens do not fit the context of {max_ctx} \
             (raise --max-context or lower --sample-len)",
            prompt.len(),
            args.sample_len,
            prompt.len() + args.sample_len
        )
    }
    print_capacity(&s)?;
    let ours = run_ours(&s, &prompt, &args, max_ctx)?;
    print_speeds(&ours);
    if args.compare {
        let stock = run_stock(&s, &prompt, &args)?;
        print_comparison(&s, &ours, &stock)?;
    }
    Ok(())
}
