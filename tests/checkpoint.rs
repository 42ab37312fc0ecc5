//! Quantized checkpoints on the CPU: a bit-exact round trip for every format, and a clear
//! error (file, tensor, shapes) for each kind of bad checkpoint.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_lowbit::calib::{self, CalibConfig, Quiet};
use candle_lowbit::checkpoint::{self, SaveInfo, WEIGHTS_FILE};
use candle_lowbit::kv::oaken::OakenCalibration;
use candle_lowbit::kv::{OakenFractions, OakenLayer};
use candle_lowbit::llama::Slot;
use candle_lowbit::{Cache, KvFormat, Llama, WeightFormat};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};

/// A fresh directory under the system's temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p =
            std::env::temp_dir().join(format!("candle-lowbit-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tokenizer() -> Result<tokenizers::Tokenizer> {
    let vocab = (0..101).map(|i| (format!("t{i}"), i as u32)).collect();
    let wl = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(vocab)
        .unk_token("t0".into())
        .build();
    Ok(tokenizers::Tokenizer::new(wl.map_err(anyhow::Error::msg)?))
}

fn model(cfg: &candle_lowbit::Config) -> Result<Llama> {
    let w = common::random_weights(cfg, 9, &Device::Cpu)?;
    Ok(Llama::load(
        VarBuilder::from_tensors(w, DType::F32, &Device::Cpu),
        cfg,
    )?)
}

fn quantized(cfg: &candle_lowbit::Config, f: WeightFormat) -> Result<Llama> {
    let mut m = model(cfg)?;
    let ws: Vec<Vec<u32>> = (0..4)
        .map(|i| (0..16).map(|t| ((t * 5 + i * 13) % 101) as u32).collect())
        .collect();
    let cc = CalibConfig {
        samples: 4,
        len: 16,
        seed: 0,
        batch: 2,
    };
    calib::quantize_model(
        &mut m,
        cfg,
        f,
        &Default::default(),
        (&ws, &cc),
        DType::F32,
        &mut Quiet,
    )?;
    Ok(m)
}

fn save(m: &Llama, cfg: &candle_lowbit::Config, f: WeightFormat, dir: &Path) -> Result<()> {
    let tok = tokenizer()?;
    let info = SaveInfo {
        config: cfg,
        tokenizer: &tok,
        chat_template: Some("{{ messages }}"),
        format: f,
        quantizer: serde_json::json!({ "test": true }),
        calibration: None,
        kv_oaken: Some(oaken_calibration(cfg)?),
    };
    checkpoint::save(m, dir, &info)?;
    Ok(())
}

/// Oaken thresholds for every layer of `cfg` (distinct per layer, so a mix-up shows).
fn oaken_calibration(cfg: &candle_lowbit::Config) -> Result<OakenCalibration> {
    let layers = (0..cfg.num_hidden_layers)
        .map(|l| OakenLayer::gaussian(1.0 + l as f32, OakenFractions::default()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(OakenCalibration {
        fractions: OakenFractions::default(),
        k_rope: "post-rope".into(),
        layers,
        picked: vec![],
    })
}

fn logits(m: &Llama, cfg: &candle_lowbit::Config) -> Result<Vec<f32>> {
    let mut c = Cache::with_capacity(16, KvFormat::Dense, DType::F32, cfg, &Device::Cpu)?;
    let ids = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6]], &Device::Cpu)?;
    Ok(m.forward_all(&ids, 0, &mut c)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Save then load is the identity for every format: every stored tensor, every logit.
#[test]
fn round_trip_is_bit_exact_for_every_format() -> Result<()> {
    // An MLP of 128 (candle's CPU q4_1 / q5_0 kernels take rows of an even number of blocks).
    let cfg = candle_lowbit::Config {
        intermediate_size: 128,
        ..common::tiny_config(2)
    };
    for &f in WeightFormat::ALL {
        let m = quantized(&cfg, f)?;
        let dir = TempDir::new(f.name());
        save(&m, &cfg, f, &dir.0)?;
        assert!(checkpoint::is_checkpoint(&dir.0));
        let (back, manifest) = checkpoint::load(&dir.0, &cfg, DType::F32, &Device::Cpu)?;
        assert_eq!(manifest.weight_format()?, f);
        assert_eq!(manifest.bits_per_weight, m.bits_per_weight());
        assert_eq!(manifest.layers.len(), 2 * 7 + 1);
        assert_eq!(manifest.kv_oaken, Some(oaken_calibration(&cfg)?));
        for layer in 0..2 {
            for slot in Slot::ALL {
                let (a, b) = (m.linear(layer, slot)?, back.linear(layer, slot)?);
                assert_eq!(a.format(), b.format());
                for ((name, x), (_, y)) in
                    a.weights().tensors()?.iter().zip(&b.weights().tensors()?)
                {
                    let (x, y) = (
                        x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                        y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
                    );
                    assert_eq!(bits(&x), bits(&y), "{f}: layer {layer} {slot:?} {name}");
                }
            }
        }
        assert_eq!(
            bits(&logits(&m, &cfg)?),
            bits(&logits(&back, &cfg)?),
            "{f}: logits"
        );
        // The loader reads it as a model directory, format from the manifest.
        let src = candle_lowbit::model_files::ModelSource::from_path(&dir.0)?;
        assert!(matches!(
            src,
            candle_lowbit::model_files::ModelSource::Checkpoint(_)
        ));
        let loaded = common::load_dense(&src, DType::F32, &Device::Cpu)?;
        assert_eq!(loaded.format, f);
        assert_eq!(loaded.chat_template.as_deref(), Some("{{ messages }}"));
        if f != WeightFormat::Dense {
            let mut quiet = Quiet;
            let mut o = candle_lowbit::loader::LoadOptions::new(
                DType::F32,
                &Device::Cpu,
                Some(WeightFormat::Dense),
                &mut quiet,
            );
            o.quant_options = Default::default();
            let err = candle_lowbit::loader::load(&src, o)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                err.contains(&format!("holds a {f} checkpoint")) && err.contains("disagrees"),
                "{err}"
            );
        }
    }
    Ok(())
}

/// Rewrite the manifest of `file` in place with `edit`.
fn edit_manifest(file: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> Result<()> {
    let bytes = std::fs::read(file)?;
    let n = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n])?;
    let md = header["__metadata__"]["candle_lowbit"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut manifest: serde_json::Value = serde_json::from_str(&md)?;
    edit(&mut manifest);
    header["__metadata__"]["candle_lowbit"] = serde_json::Value::String(manifest.to_string());
    let mut h = header.to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(file, out)?;
    Ok(())
}

fn load_err(dir: &Path, cfg: &candle_lowbit::Config) -> String {
    match checkpoint::load(dir, cfg, DType::F32, &Device::Cpu) {
        Ok(_) => "loaded".into(),
        Err(e) => e.to_string(),
    }
}

/// Each kind of bad checkpoint gets its own clear error, naming the file and what is wrong.
#[test]
fn bad_checkpoints_are_rejected_clearly() -> Result<()> {
    let cfg = common::tiny_config(2);
    let m = quantized(&cfg, WeightFormat::Int4)?;
    let fresh = |tag: &str| -> Result<TempDir> {
        let d = TempDir::new(tag);
        save(&m, &cfg, WeightFormat::Int4, &d.0)?;
        Ok(d)
    };
    let file = |d: &TempDir| d.0.join(WEIGHTS_FILE);

    let d = fresh("truncated")?;
    let bytes = std::fs::read(file(&d))?;
    std::fs::write(file(&d), &bytes[..bytes.len() / 2])?;
    let e = load_err(&d.0, &cfg);
    assert!(
        e.contains("model.safetensors") && e.contains("truncated"),
        "{e}"
    );

    let d = fresh("format")?;
    edit_manifest(&file(&d), |m| {
        m["layers"]["model.layers.1.mlp.down_proj"]["format"] = "int5".into()
    })?;
    let e = load_err(&d.0, &cfg);
    assert!(
        e.contains("model.layers.1.mlp.down_proj") && e.contains("unknown weight format 'int5'"),
        "{e}"
    );

    let d = fresh("version")?;
    edit_manifest(&file(&d), |m| {
        m["layers"]["model.layers.0.self_attn.q_proj"]["version"] = 99.into()
    })?;
    let e = load_err(&d.0, &cfg);
    assert!(
        e.contains("q_proj") && e.contains("layout version 99"),
        "{e}"
    );

    let d = fresh("ckversion")?;
    edit_manifest(&file(&d), |m| m["checkpoint_version"] = 7.into())?;
    let e = load_err(&d.0, &cfg);
    assert!(e.contains("checkpoint layout version 7"), "{e}");

    let d = fresh("shape")?;
    let other = candle_lowbit::Config {
        intermediate_size: 128,
        ..cfg.clone()
    };
    let e = load_err(&d.0, &other);
    assert!(
        e.contains("model.layers.0.mlp.gate_proj")
            && e.contains("[96, 64]")
            && e.contains("[128, 64]"),
        "{e}"
    );

    let d = fresh("missing")?;
    let mut tensors = candle_core::safetensors::load(file(&d), &Device::Cpu)?;
    tensors.remove("model.layers.1.self_attn.o_proj.scales");
    let md = std::collections::HashMap::from([(
        "candle_lowbit".to_string(),
        serde_json::to_string(
            &checkpoint::Checkpoint::open(&d.0, DType::F32, &Device::Cpu)?.manifest,
        )?,
    )]);
    let list: Vec<(String, Tensor)> = tensors.into_iter().collect();
    safetensors::serialize_to_file(
        list.iter().map(|(k, t)| (k.as_str(), t)),
        Some(md),
        &file(&d),
    )?;
    let e = load_err(&d.0, &cfg);
    assert!(
        e.contains("model.layers.1.self_attn.o_proj") && e.contains("'scales'"),
        "{e}"
    );

    let d = TempDir::new("plain");
    std::fs::create_dir_all(&d.0)?;
    candle_core::safetensors::save(
        &std::collections::HashMap::from([(
            "x".to_string(),
            Tensor::zeros(3, DType::F32, &Device::Cpu)?,
        )]),
        file(&d),
    )?;
    assert!(!checkpoint::is_checkpoint(&d.0));
    let e = load_err(&d.0, &cfg);
    assert!(e.contains("not a candle-lowbit checkpoint"), "{e}");
    Ok(())
}

/// The real default model: int4 (round to nearest) through `quantize`'s path, saved, and
/// loaded back (timed; the bit-exact logits are the round trip's proof on real weights).
#[test]
fn real_model_checkpoint_round_trip() -> Result<()> {
    let Some(path) = common::default_model() else {
        return Ok(());
    };
    let src = candle_lowbit::model_files::ModelSource::Gguf(path);
    let mut quiet = Quiet;
    let opts = candle_lowbit::loader::LoadOptions::new(
        DType::F32,
        &Device::Cpu,
        Some(WeightFormat::Int4),
        &mut quiet,
    );
    let l = candle_lowbit::loader::load(&src, opts)?;
    let dir = TempDir::new("real");
    let info = SaveInfo {
        config: &l.config,
        tokenizer: &l.tokenizer,
        chat_template: l.chat_template.as_deref(),
        format: WeightFormat::Int4,
        quantizer: serde_json::json!({}),
        calibration: None,
        kv_oaken: None,
    };
    checkpoint::save(&l.model, &dir.0, &info)?;
    let t0 = std::time::Instant::now();
    let (back, _) = checkpoint::load(&dir.0, &l.config, DType::F32, &Device::Cpu)?;
    println!(
        "real model int4 checkpoint loaded in {:.2}s",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(
        bits(&logits(&l.model, &l.config)?),
        bits(&logits(&back, &l.config)?)
    );
    Ok(())
}
