//! The graph decoder against eager `forward`: bit-identical logits step after step.
//! On the CPU the decoder runs its step eagerly (same code path minus capture); with the
//! cuda feature the same test replays a captured CUDA graph on the GPU.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use candle_lowbit::graph::{GraphDecoder, Mode};
use candle_lowbit::{Cache, KvFormat, KvSpec, Llama, WeightFormat};
use candle_nn::VarBuilder;

/// Prefill `prompts` (batch), then `steps` greedy decode steps through `forward` and
/// through the decoder, asserting bit-equal logits at every step; the model's layers in
/// `format` (round to nearest; formats that need calibration through `calib` on a few
/// windows of ids).
fn replay_matches_eager(
    dev: &Device,
    dtype: DType,
    steps: usize,
    format: WeightFormat,
) -> Result<Mode> {
    replay_with_kv(dev, dtype, steps, format, KvFormat::Dense)
}

/// As [`replay_matches_eager`] with the KV cache in `kv` (quantized caches: one head of 64,
/// Oaken with the thresholds of N(0, 1)).
fn replay_with_kv(
    dev: &Device,
    dtype: DType,
    steps: usize,
    format: WeightFormat,
    kv: KvFormat,
) -> Result<Mode> {
    let cfg = match kv {
        KvFormat::Dense => common::tiny_config(4),
        _ => candle_lowbit::Config {
            num_attention_heads: 1,
            num_key_value_heads: 1,
            ..common::tiny_config(4)
        },
    };
    let spec = KvSpec::uncalibrated(kv, cfg.num_hidden_layers)?;
    let w = common::random_weights(&cfg, 21, &Device::Cpu)?;
    let w = w
        .into_iter()
        .map(|(k, v)| Ok((k, v.to_device(dev)?)))
        .collect::<Result<_>>()?;
    let mut model = Llama::load(VarBuilder::from_tensors(w, dtype, dev), &cfg)?;
    if format.needs_calibration() {
        // GPTQ and the channel-ranking formats: a few calibration windows of token ids.
        let windows: Vec<Vec<u32>> = (0..4)
            .map(|i| (0..16).map(|t| ((t * 7 + i * 11) % 101) as u32).collect())
            .collect();
        candle_lowbit::calib::quantize_model(
            &mut model,
            &cfg,
            format,
            &Default::default(),
            (&windows, &candle_lowbit::calib::CalibConfig::default()),
            dtype,
            &mut candle_lowbit::calib::Quiet,
        )?;
    } else {
        model.quantize(format)?;
    }
    let prompt = Tensor::new(&[[5u32, 9, 2, 77, 31, 8, 4], [44, 3, 1, 1, 9, 60, 2]], dev)?;
    let cap = 7 + steps + 1;
    let mut eager_cache = Cache::with_spec(cap, &spec, dtype, &cfg, dev)?;
    let mut graph_cache = Cache::with_spec(cap, &spec, dtype, &cfg, dev)?;
    eager_cache.set_left_padding(&[0, 2]);
    graph_cache.set_left_padding(&[0, 2]);
    let mut logits = model.forward(&prompt, 0, &mut eager_cache)?;
    model.forward(&prompt, 0, &mut graph_cache)?;
    let mut decoder = GraphDecoder::new(&model, 2, dev)?;
    for step in 0..steps {
        let tokens = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        let pos = 7 + step;
        logits = model.forward(
            &Tensor::new(tokens.as_slice(), dev)?.unsqueeze(1)?,
            pos,
            &mut eager_cache,
        )?;
        let replayed = decoder.step(&model, &mut graph_cache, &tokens, pos)?;
        let (a, b) = (
            logits.flatten_all()?.to_vec1::<f32>()?,
            replayed.flatten_all()?.to_vec1::<f32>()?,
        );
        if let Some(i) = (0..a.len()).find(|&i| a[i].to_bits() != b[i].to_bits()) {
            anyhow::bail!(
                "step {step}: logit {i} eager {} vs decoder {} ({:?})",
                a[i],
                b[i],
                decoder.mode()
            );
        }
    }
    Ok(decoder.mode().clone())
}

#[test]
fn decoder_matches_eager_cpu() -> Result<()> {
    for f in [WeightFormat::Dense, WeightFormat::Int4] {
        let mode = replay_matches_eager(&Device::Cpu, DType::F32, 24, f)?;
        assert!(matches!(mode, Mode::Eager(_)), "{f}: {mode:?}");
    }
    Ok(())
}

#[cfg(feature = "cuda")]
#[test]
fn graph_replay_matches_eager_gpu_256_steps() -> Result<()> {
    let dev = candle_lowbit::graph::cuda_device(0)?;
    for dtype in [DType::F16, DType::F32] {
        let mode = replay_matches_eager(&dev, dtype, 256, WeightFormat::Dense)?;
        println!("{dtype:?}: 256 steps bit-identical, mode {mode:?}");
        assert_eq!(
            mode,
            Mode::Graph,
            "{dtype:?}: the decoder did not replay a graph"
        );
    }
    Ok(())
}

/// Every format that says it is graph-safe replays a captured graph bit-identically to eager.
#[cfg(feature = "cuda")]
#[test]
fn graph_replay_matches_eager_gpu_every_format() -> Result<()> {
    let dev = candle_lowbit::graph::cuda_device(0)?;
    for f in WeightFormat::timed().filter(|f| f.spec().graph_safe) {
        let mode = replay_matches_eager(&dev, DType::F16, 64, f)?;
        println!("{f}: 64 steps bit-identical, mode {mode:?}");
        assert_eq!(mode, Mode::Graph, "{f}: the decoder did not replay a graph");
    }
    Ok(())
}

/// The quantized KV caches replay a captured graph bit-identically to eager.
#[cfg(feature = "cuda")]
#[test]
fn graph_replay_matches_eager_gpu_quantized_kv() -> Result<()> {
    let dev = candle_lowbit::graph::cuda_device(0)?;
    for kv in [KvFormat::Kv4, KvFormat::Oaken] {
        // W4A4 with a 4-bit cache: COMET's W4A4KV4.
        for f in [WeightFormat::Dense, WeightFormat::Int4, WeightFormat::W4a4] {
            let mode = replay_with_kv(&dev, DType::F16, 64, f, kv)?;
            println!("{f} kv {kv}: 64 steps bit-identical, mode {mode:?}");
            assert_eq!(
                mode,
                Mode::Graph,
                "{f} kv {kv}: the decoder did not replay a graph"
            );
        }
    }
    Ok(())
}

#[test]
fn decoder_matches_eager_cpu_quantized_kv() -> Result<()> {
    for kv in [KvFormat::Kv4, KvFormat::Oaken] {
        let mode = replay_with_kv(&Device::Cpu, DType::F32, 12, WeightFormat::Dense, kv)?;
        assert!(matches!(mode, Mode::Eager(_)), "kv {kv}: {mode:?}");
    }
    Ok(())
}
