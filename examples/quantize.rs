//! Quantize a model once and save it as a checkpoint that loads in seconds.
//!
//! ```text
//! cargo run --release --example quantize -- --quant int4-gptq --out smollm2-int4-gptq
//! cargo run --release --example generate -- --model smollm2-int4-gptq --prompt "Hi"
//! cargo run --release --features cuda --example quantize -- --quant int3-gptq --calib my.txt --out ck
//! ```
//!
//! The model comes from `--model` / `--model-id` as in `generate` (default: SmolLM2-135M
//! Instruct). Formats that need calibration (`*-gptq`) run GPTQ's sequential mode over
//! `--calib-samples` windows of `--calib-len` tokens of `--calib` (default: WikiText-2 test
//! from `../shared`, where it exists). The checkpoint (`candle_lowbit::checkpoint`) holds
//! every tensor of the format under the layers' HF names, a manifest with the format, its
//! version, the quantizer settings, the real bits per weight and the calibration text's
//! SHA-256, and the model's `config.json` and `tokenizer.json`. With `--kv-cache oaken` the
//! manifest also holds Oaken's per-layer KV thresholds, calibrated on the same text. After writing, the
//! checkpoint is loaded back and its logits on a short prompt compared bit for bit.

mod common;

use anyhow::{bail, Result};
use candle_core::Tensor;
use candle_lowbit::checkpoint::{self, SaveInfo};
use candle_lowbit::model_files::ModelSource;
use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Quantize a model with candle-lowbit and save it as a checkpoint")]
struct Args {
    #[command(flatten)]
    model: common::ModelArgs,

    /// The checkpoint directory to write (created if needed).
    #[arg(long)]
    out: PathBuf,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(format) = args.model.quant else {
        bail!("--quant FORMAT is required (--list-formats lists them)")
    };
    if let ModelSource::Checkpoint(_) = ModelSource::resolve(
        args.model.model.as_deref(),
        args.model.model_id.as_deref(),
        &args.model.revision,
    )? {
        bail!("--model is already a candle-lowbit checkpoint: quantize the model it was made from")
    }
    let s = common::load(&args.model)?;
    println!("{}", common::describe(&s)?);
    let l = &s.loaded;
    let info = SaveInfo {
        config: &l.config,
        tokenizer: &l.tokenizer,
        chat_template: l.chat_template.as_deref(),
        format,
        quantizer: args.model.calib.settings_json(format),
        calibration: l.calibration.clone(),
        kv_oaken: s.kv_oaken.as_ref().map(|o| o.calibration.clone()),
    };
    let t0 = Instant::now();
    let manifest = checkpoint::save(&l.model, &args.out, &info)?;
    let bytes = std::fs::metadata(args.out.join(checkpoint::WEIGHTS_FILE))?.len();
    if let Some(c) = s.kv_oaken.as_ref().map(|o| &o.calibration) {
        println!(
            "stored oaken KV thresholds for {} layers ({}, K {})",
            c.layers.len(),
            c.describe(),
            c.k_rope
        );
    }
    println!(
        "wrote {} ({:.1} MB, {} linear layers, {:.3} bits/weight) in {:.2}s",
        args.out.display(),
        bytes as f64 / 1e6,
        manifest.layers.len(),
        manifest.bits_per_weight,
        t0.elapsed().as_secs_f64()
    );
    verify(&s, &args.out)
}

/// Load the checkpoint back and compare its logits with the model in memory, bit for bit.
fn verify(s: &common::Session, dir: &std::path::Path) -> Result<()> {
    let t0 = Instant::now();
    let (back, _) = checkpoint::load(dir, &s.loaded.config, s.dtype, &s.device)?;
    s.device.synchronize()?;
    let secs = t0.elapsed().as_secs_f64();
    let ids = s
        .loaded
        .tokenizer
        .encode("The quick brown fox jumps over the lazy dog.", false)
        .map_err(anyhow::Error::msg)?;
    let ids = Tensor::new(ids.get_ids(), &s.device)?.unsqueeze(0)?;
    let logits = |m: &candle_lowbit::Llama| -> Result<Vec<f32>> {
        let mut cache = s.cache(64)?;
        Ok(m.forward(&ids, 0, &mut cache)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    let (a, b) = (logits(&s.loaded.model)?, logits(&back)?);
    if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
        bail!(
            "the reloaded checkpoint differs: logit {i} is {} in memory, {} reloaded",
            a[i],
            b[i]
        )
    }
    println!("reloaded in {secs:.2}s: logits bit-identical to the model in memory");
    Ok(())
}
