//! Our Llama against stock candle on the CPU: exact-config random weights (tight
//! tolerance), ragged batches, and the real default model (same top-1 everywhere).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, IndexOp, Tensor};
use candle_lowbit::{Cache, KvFormat, Llama};
use candle_nn::VarBuilder;
use candle_transformers::models::llama as stock;
use common::{assert_close, random_weights, tiny_config};

fn models(layers: usize) -> Result<(Llama, stock::Llama, candle_lowbit::Config)> {
    let dev = Device::Cpu;
    let cfg = tiny_config(layers);
    let w = random_weights(&cfg, 7, &dev)?;
    let ours = Llama::load(VarBuilder::from_tensors(w.clone(), DType::F32, &dev), &cfg)?;
    let theirs = stock::Llama::load(VarBuilder::from_tensors(w, DType::F32, &dev), &cfg)?;
    Ok((ours, theirs, cfg))
}

fn ids(tokens: &[u32]) -> Result<Tensor> {
    Ok(Tensor::new(tokens, &Device::Cpu)?.unsqueeze(0)?)
}

/// Prefill then decode: logits equal stock `candle_transformers` llama at every step.
#[test]
fn logits_match_stock_llama() -> Result<()> {
    let (ours, theirs, cfg) = models(3)?;
    let dev = Device::Cpu;
    let mut c_ours = Cache::new(DType::F32, &cfg, &dev)?;
    let mut c_theirs = stock::Cache::new(true, DType::F32, &cfg, &dev)?;
    let prompt: Vec<u32> = (0..13).map(|i| (i * 7 + 3) % 101).collect();
    let a = ours.forward(&ids(&prompt)?, 0, &mut c_ours)?;
    let b = theirs.forward(&ids(&prompt)?, 0, &mut c_theirs)?;
    assert_close(&a, &b, 1e-4, 1e-4, "prefill logits")?;
    for (pos, step) in (prompt.len()..).zip(0..20u32) {
        let t = [(step * 13 + 5) % 101];
        let a = ours.forward(&ids(&t)?, pos, &mut c_ours)?;
        let b = theirs.forward(&ids(&t)?, pos, &mut c_theirs)?;
        assert_close(&a, &b, 1e-4, 1e-4, &format!("decode step {step}"))?;
    }
    Ok(())
}

/// `forward_all`'s position `i` equals the last-position logits of the prefix `0..=i`.
#[test]
fn forward_all_matches_prefixes() -> Result<()> {
    let (ours, _, cfg) = models(2)?;
    let dev = Device::Cpu;
    let prompt: Vec<u32> = (0..9).map(|i| (i * 11 + 1) % 101).collect();
    let mut cache = Cache::new(DType::F32, &cfg, &dev)?;
    let all = ours.forward_all(&ids(&prompt)?, 0, &mut cache)?;
    for i in [0, 4, 8] {
        cache.clear();
        let last = ours.forward(&ids(&prompt[..=i])?, 0, &mut cache)?;
        assert_close(
            &all.i((.., i, ..))?,
            &last,
            1e-5,
            1e-5,
            &format!("position {i}"),
        )?;
    }
    Ok(())
}

/// A left-padded batch of prompts of different lengths gives each prompt's own logits,
/// at prefill and through decode steps.
#[test]
fn ragged_batch_matches_single_prompts() -> Result<()> {
    let (ours, _, cfg) = models(2)?;
    let dev = Device::Cpu;
    let prompts: [Vec<u32>; 3] = [vec![5, 9, 2, 77, 31, 8], vec![44, 3], vec![1, 2, 3, 4]];
    let len = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let pads: Vec<usize> = prompts.iter().map(|p| len - p.len()).collect();
    let mut batch = vec![];
    for (p, &pad) in prompts.iter().zip(&pads) {
        batch.extend(std::iter::repeat_n(0u32, pad).chain(p.iter().copied()));
    }
    let mut cache = Cache::with_capacity(64, KvFormat::Dense, DType::F32, &cfg, &dev)?;
    cache.set_left_padding(&pads);
    let batched = ours.forward(&Tensor::from_vec(batch, (3, len), &dev)?, 0, &mut cache)?;
    let next = Tensor::new(&[[7u32], [8], [9]], &dev)?;
    let batched_step = ours.forward(&next, len, &mut cache)?;
    for (i, p) in prompts.iter().enumerate() {
        let mut single = Cache::with_capacity(64, KvFormat::Dense, DType::F32, &cfg, &dev)?;
        let want = ours.forward(&ids(p)?, 0, &mut single)?;
        assert_close(
            &batched.i(i)?,
            &want.i(0)?,
            1e-4,
            1e-4,
            &format!("prompt {i} prefill"),
        )?;
        let want = ours.forward(&ids(&[7 + i as u32])?, p.len(), &mut single)?;
        assert_close(
            &batched_step.i(i)?,
            &want.i(0)?,
            1e-4,
            1e-4,
            &format!("prompt {i} decode"),
        )?;
    }
    Ok(())
}

#[test]
fn clear_errors_on_bad_calls() -> Result<()> {
    let (ours, _, cfg) = models(1)?;
    let dev = Device::Cpu;
    let mut cache = Cache::with_capacity(8, KvFormat::Dense, DType::F32, &cfg, &dev)?;
    let err = ours
        .forward(&ids(&[1; 9])?, 0, &mut cache)
        .unwrap_err()
        .to_string();
    assert!(err.contains("exceed the context of 8"), "{err}");
    cache.set_left_padding(&[0, 1]);
    let err = ours
        .forward(&ids(&[1; 3])?, 0, &mut cache)
        .unwrap_err()
        .to_string();
    assert!(err.contains("2 sequences"), "{err}");
    Ok(())
}

/// The real default model: the same top-1 token as stock `quantized_llama` at every
/// position of a ≥64-token prompt. Stock returns only the last position, so it is fed one
/// token at a time. Two stock runs: with its weights dequantized to f32
/// (`CANDLE_DEQUANTIZE_ALL=1`, the same function as ours: must agree everywhere, tightly),
/// and on its default quantized path (whose matmuls also quantize the activations to
/// 8 bits: reported, and must agree at ≥ 95% of positions).
#[test]
fn real_model_top1_matches_quantized_llama() -> Result<()> {
    let Some(path) = common::default_model() else {
        return Ok(());
    };
    let dev = Device::Cpu;
    let src = candle_lowbit::model_files::ModelSource::Gguf(path);
    let loaded = common::load_dense(&src, DType::F32, &dev)?;
    let tokens = loaded
        .tokenizer
        .encode(common::LONG_PROMPT, false)
        .map_err(anyhow::Error::msg)?
        .get_ids()
        .to_vec();
    assert!(
        tokens.len() >= 64,
        "prompt has only {} tokens",
        tokens.len()
    );
    let mut cache = Cache::with_capacity(256, KvFormat::Dense, DType::F32, &loaded.config, &dev)?;
    let ours = loaded
        .model
        .forward_all(&ids(&tokens)?, 0, &mut cache)?
        .i(0)?;

    let (worst_q, mism_q) =
        common::compare_with_quantized_llama(&src, &tokens, &ours, &Device::Cpu)?;
    println!(
        "real model vs quantized_llama (quantized path): {} positions, largest |logit diff| {worst_q:.4}, top-1 differs at {mism_q:?}",
        tokens.len()
    );
    // Stock reads CANDLE_DEQUANTIZE_ALL once per thread: a fresh thread sees it set.
    let (worst, mism) = std::thread::scope(|s| {
        s.spawn(|| {
            std::env::set_var("CANDLE_DEQUANTIZE_ALL", "1");
            common::compare_with_quantized_llama(&src, &tokens, &ours, &Device::Cpu)
        })
        .join()
        .map_err(|_| anyhow::anyhow!("comparison thread panicked"))?
    })?;
    println!(
        "real model vs quantized_llama (dequantized f32): {} positions, largest |logit diff| {worst:.2e}",
        tokens.len()
    );
    assert!(
        mism.is_empty(),
        "top-1 differs at (pos, ours, stock): {mism:?}"
    );
    assert!(
        worst < 1e-2,
        "largest logit difference {worst} vs dequantized stock"
    );
    assert!(
        mism_q.len() * 20 <= tokens.len(),
        "top-1 differs from the quantized path at {mism_q:?}"
    );
    Ok(())
}
