//! Quantized checkpoints: quantize a model once, load it again in seconds.
//!
//! A checkpoint is a directory:
//!
//! - `model.safetensors`: every tensor of every linear layer's format under the layer's HF
//!   name (`model.layers.0.self_attn.q_proj.qweight`, `….scales`, …: a dense layer's one
//!   tensor is `….weight`, as in a HF checkpoint), the output head as `lm_head.*` (also
//!   when the config ties it to the embedding: a quantized head is its own matrix), and the
//!   embedding and norms in the model's dtype. The fused projections of the model (QKV,
//!   gate/up) are split back into their HF parts along the rows, and stacked again at load.
//! - its safetensors metadata: one entry, [`METADATA_KEY`], a JSON [`Manifest`]: the crate
//!   and its version, the checkpoint layout version, the format and its layout version, the
//!   quantizer settings, the real bits per weight, the calibration text's SHA-256, and each
//!   linear layer's format, layout version and shape.
//! - `config.json` (HF Llama), `tokenizer.json`, and `tokenizer_config.json` with the chat
//!   template where the model has one.
//!
//! Loading checks everything before it builds anything: a truncated file, an unknown format
//! or layout version, a missing tensor or one whose shape does not fit the config is an
//! error naming the file, the tensor and the shapes, and no model is returned.

use crate::formats::WeightFormat;
use crate::linear::QLinear;
use crate::llama::{Config, Llama, Slot, WeightSource};
use candle_core::{DType, Device, Result, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The safetensors metadata key holding the [`Manifest`].
pub const METADATA_KEY: &str = "candle_lowbit";
/// The layout of a checkpoint directory and its manifest.
pub const CHECKPOINT_VERSION: u32 = 1;
/// The weights file inside a checkpoint directory.
pub const WEIGHTS_FILE: &str = "model.safetensors";

/// One linear layer as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerEntry {
    pub format: String,
    pub version: u32,
    /// `[out, in]`.
    pub shape: [usize; 2],
}

/// The calibration a checkpoint was quantized with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibInfo {
    /// The text file's name (not its path).
    pub file: String,
    /// SHA-256 of the file's bytes.
    pub sha256: String,
    pub samples: usize,
    pub len: usize,
    pub seed: u64,
}

/// What a checkpoint says about itself (stored as JSON under [`METADATA_KEY`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    /// `candle-lowbit`.
    pub writer: String,
    pub writer_version: String,
    pub checkpoint_version: u32,
    /// The format of the model's blocks (`--quant`).
    pub format: String,
    pub format_version: u32,
    /// The quantizer's settings, as the tool that wrote it recorded them.
    pub quantizer: serde_json::Value,
    /// Over every linear layer (the head included), every byte counted.
    pub bits_per_weight: f64,
    /// Over the blocks' linear layers (the head left out).
    pub block_bits_per_weight: f64,
    pub calibration: Option<CalibInfo>,
    /// The dtype the dense tensors are stored in.
    pub dtype: String,
    /// Every linear layer (HF name without `.weight`) → its format and shape.
    pub layers: BTreeMap<String, LayerEntry>,
    /// Oaken KV-cache thresholds, where the checkpoint was written with `--kv-cache oaken`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_oaken: Option<crate::kv::oaken::OakenCalibration>,
}

impl Manifest {
    /// The blocks' format.
    pub fn weight_format(&self) -> Result<WeightFormat> {
        self.format.parse()
    }
}

fn err(file: &Path, what: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("{}: {what}", file.display()))
}

/// SHA-256 of `bytes`, in hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Whether `dir` holds a candle-lowbit checkpoint (reads only the safetensors header).
pub fn is_checkpoint(dir: &Path) -> bool {
    read_header_metadata(&dir.join(WEIGHTS_FILE)).is_ok_and(|m| m.contains_key(METADATA_KEY))
}

fn read_header_metadata(file: &Path) -> std::io::Result<HashMap<String, String>> {
    use std::io::Read;
    let mut f = std::fs::File::open(file)?;
    let mut n = [0u8; 8];
    f.read_exact(&mut n)?;
    let n = u64::from_le_bytes(n) as usize;
    if n > 100 << 20 {
        return Err(std::io::Error::other("header too large"));
    }
    let mut header = vec![0u8; n];
    f.read_exact(&mut header)?;
    let json: serde_json::Value = serde_json::from_slice(&header).map_err(std::io::Error::other)?;
    let md = json
        .get("__metadata__")
        .and_then(|m| m.as_object())
        .cloned()
        .unwrap_or_default();
    Ok(md
        .into_iter()
        .filter_map(|(k, v)| v.as_str().map(|s| (k, s.to_string())))
        .collect())
}

/// One linear layer of the model and the HF-named parts `(name, rows)` it is stored as.
type StoredLayer = (Vec<(String, usize)>, QLinear);

/// The HF name of every linear layer of `model` with its rows, per stored layer: blocks'
/// slots split into their parts, then the head.
fn stored_layers(model: &Llama, cfg: &Config) -> Result<Vec<StoredLayer>> {
    let mut v = vec![];
    for layer in 0..model.num_layers() {
        for slot in Slot::ALL {
            v.push((slot.parts(cfg, layer), model.linear(layer, slot)?.clone()));
        }
    }
    v.push((
        vec![("lm_head".to_string(), cfg.vocab_size)],
        model.lm_head().clone(),
    ));
    Ok(v)
}

/// Fields named `input.*` describe a layer's input (a W4A4 layer's channel permutation),
/// not its rows: every part stacked on that input stores them whole, and loading keeps one.
fn is_input_field(field: &str) -> bool {
    field.starts_with("input.")
}

/// What [`save`] needs besides the model.
pub struct SaveInfo<'a> {
    pub config: &'a Config,
    pub tokenizer: &'a tokenizers::Tokenizer,
    pub chat_template: Option<&'a str>,
    pub format: WeightFormat,
    pub quantizer: serde_json::Value,
    pub calibration: Option<CalibInfo>,
    /// Oaken KV-cache thresholds to store with the model.
    pub kv_oaken: Option<crate::kv::oaken::OakenCalibration>,
}

/// Write `model` as a checkpoint into `dir` (created if needed; the weights file is
/// written under a temporary name and renamed, so a failed save leaves no half file).
pub fn save(model: &Llama, dir: &Path, info: &SaveInfo) -> Result<Manifest> {
    if dir.exists() && !dir.is_dir() {
        candle_core::bail!("--out {} exists and is not a directory", dir.display())
    }
    std::fs::create_dir_all(dir).map_err(|e| err(dir, format!("cannot create: {e}")))?;
    let mut tensors: Vec<(String, Tensor)> = vec![];
    let mut layers = BTreeMap::new();
    let dense = model.dense_tensors();
    let dtype = dense.first().map(|(_, t)| t.dtype()).unwrap_or(DType::F32);
    for (name, t) in dense {
        tensors.push((name, t.to_device(&Device::Cpu)?));
    }
    for (parts, lin) in stored_layers(model, info.config)? {
        let fields = lin.weights().tensors()?;
        let mut row = 0;
        for (part, rows) in &parts {
            for (field, t) in &fields {
                if is_input_field(field) {
                    // A property of the layer's input: whole in every part.
                    tensors.push((format!("{part}.{field}"), t.to_device(&Device::Cpu)?));
                    continue;
                }
                if t.dim(0)? != lin.shape().0 {
                    candle_core::bail!(
                        "{part}: field {field} {:?} does not have the layer's rows first",
                        t.shape()
                    )
                }
                tensors.push((
                    format!("{part}.{field}"),
                    t.narrow(0, row, *rows)?.to_device(&Device::Cpu)?,
                ));
            }
            let spec = lin.format().spec();
            let entry = LayerEntry {
                format: spec.name.into(),
                version: spec.version,
                shape: [*rows, lin.shape().1],
            };
            layers.insert(part.clone(), entry);
            row += rows;
        }
    }
    let manifest = Manifest {
        writer: env!("CARGO_PKG_NAME").into(),
        writer_version: env!("CARGO_PKG_VERSION").into(),
        checkpoint_version: CHECKPOINT_VERSION,
        format: info.format.name().into(),
        format_version: info.format.spec().version,
        quantizer: info.quantizer.clone(),
        bits_per_weight: model.bits_per_weight(),
        block_bits_per_weight: model.block_bits_per_weight(),
        calibration: info.calibration.clone(),
        dtype: dtype.as_str().into(),
        layers,
        kv_oaken: info.kv_oaken.clone(),
    };
    let json = serde_json::to_string(&manifest).map_err(|e| err(dir, format!("manifest: {e}")))?;
    let md = HashMap::from([(METADATA_KEY.to_string(), json)]);
    let file = dir.join(WEIGHTS_FILE);
    let tmp = dir.join(format!("{WEIGHTS_FILE}.part"));
    safetensors::serialize_to_file(tensors.iter().map(|(k, t)| (k.as_str(), t)), Some(md), &tmp)
        .map_err(|e| err(&tmp, format!("cannot write: {e}")))?;
    std::fs::rename(&tmp, &file)
        .map_err(|e| err(&file, format!("cannot rename into place: {e}")))?;
    write_side_files(dir, info)?;
    Ok(manifest)
}

fn write_side_files(dir: &Path, info: &SaveInfo) -> Result<()> {
    let write = |name: &str, text: String| {
        let p = dir.join(name);
        std::fs::write(&p, text).map_err(|e| err(&p, format!("cannot write: {e}")))
    };
    write("config.json", config_json(info.config).to_string())?;
    let tok = dir.join("tokenizer.json");
    info.tokenizer
        .save(&tok, false)
        .map_err(|e| err(&tok, format!("cannot write: {e}")))?;
    if let Some(t) = info.chat_template {
        write(
            "tokenizer_config.json",
            serde_json::json!({ "chat_template": t }).to_string(),
        )?;
    }
    Ok(())
}

/// A HF `config.json` for `cfg` (what `LlamaConfig` reads back).
pub fn config_json(cfg: &Config) -> serde_json::Value {
    use crate::llama::{Llama3RopeType, LlamaEosToks};
    let eos = match &cfg.eos_token_id {
        Some(LlamaEosToks::Single(e)) => serde_json::json!(e),
        Some(LlamaEosToks::Multiple(v)) => serde_json::json!(v),
        None => serde_json::Value::Null,
    };
    let rope_scaling = cfg.rope_scaling.as_ref().map(|r| {
        serde_json::json!({
            "factor": r.factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings,
            "rope_type": match r.rope_type { Llama3RopeType::Llama3 => "llama3", Llama3RopeType::Default => "default" },
        })
    });
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    })
}

/// A checkpoint's weights file, read whole and checked, as a [`WeightSource`].
pub struct Checkpoint {
    file: PathBuf,
    /// Every stored tensor (host memory), by name.
    tensors: HashMap<String, Tensor>,
    /// The field names stored for each layer name (`{layer}.{field}`).
    fields: HashMap<String, Vec<String>>,
    pub manifest: Manifest,
    dtype: DType,
    device: Device,
}

impl Checkpoint {
    /// Read `dir`'s weights file and manifest; dense tensors will load in `dtype` on `device`.
    pub fn open(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        use candle_core::safetensors::Load;
        let file = dir.join(WEIGHTS_FILE);
        let bytes = std::fs::read(&file).map_err(|e| err(&file, format!("cannot read: {e}")))?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
            err(
                &file,
                format!("not a readable safetensors file (truncated?): {e}"),
            )
        })?;
        let (_, md) = safetensors::SafeTensors::read_metadata(&bytes)
            .map_err(|e| err(&file, format!("unreadable header: {e}")))?;
        let Some(json) = md.metadata().as_ref().and_then(|m| m.get(METADATA_KEY)) else {
            return Err(err(
                &file,
                format!("no '{METADATA_KEY}' metadata: not a candle-lowbit checkpoint"),
            ));
        };
        let manifest: Manifest = serde_json::from_str(json)
            .map_err(|e| err(&file, format!("unreadable manifest: {e}")))?;
        if manifest.checkpoint_version != CHECKPOINT_VERSION {
            return Err(err(
                &file,
                format!(
                    "checkpoint layout version {} (written by {} {}); this build reads version {CHECKPOINT_VERSION}",
                    manifest.checkpoint_version, manifest.writer, manifest.writer_version
                ),
            ));
        }
        let mut tensors = HashMap::new();
        let mut fields: HashMap<String, Vec<String>> = HashMap::new();
        for (name, view) in st.tensors() {
            let t = view
                .load(&Device::Cpu)
                .map_err(|e| err(&file, format!("tensor '{name}': {e}")))?;
            // `{part}.{field}`, where a field may be `input.{name}` (see `is_input_field`).
            let split = match name.rsplit_once('.') {
                Some((head, last)) => match head.rsplit_once('.') {
                    Some((part, "input")) => Some((part, &name[part.len() + 1..])),
                    _ => Some((head, last)),
                },
                None => None,
            };
            if let Some((layer, field)) = split {
                fields
                    .entry(layer.to_string())
                    .or_default()
                    .push(field.to_string());
            }
            tensors.insert(name, t);
        }
        let me = Self {
            file,
            tensors,
            fields,
            manifest,
            dtype,
            device: device.clone(),
        };
        me.check_layers()?;
        Ok(me)
    }

    /// Every layer's format is known and of this build's layout version.
    fn check_layers(&self) -> Result<()> {
        self.manifest
            .weight_format()
            .map_err(|e| err(&self.file, e.to_string()))?;
        for (name, e) in &self.manifest.layers {
            let f: WeightFormat = e
                .format
                .parse()
                .map_err(|x| err(&self.file, format!("layer {name}: {x}")))?;
            if f.spec().version != e.version {
                return Err(err(
                    &self.file,
                    format!(
                        "layer {name}: {} layout version {}; this build reads version {}",
                        f,
                        e.version,
                        f.spec().version
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Tensor `name` on the device, its dims checked against `dims` where given.
    fn stored(&self, name: &str, dims: Option<&[usize]>) -> Result<Tensor> {
        let Some(t) = self.tensors.get(name) else {
            return Err(err(
                &self.file,
                format!("no tensor '{name}' (incomplete, or for another model)"),
            ));
        };
        if let Some(d) = dims {
            if t.dims() != d {
                return Err(err(
                    &self.file,
                    format!("tensor '{name}' is {:?}, the config wants {d:?}", t.dims()),
                ));
            }
        }
        t.to_device(&self.device)
    }

    /// The fields stored for layer `part` (`{part}.{field}`), by field name.
    fn fields(&self, part: &str) -> Result<HashMap<String, Tensor>> {
        let names = self.fields.get(part).map(Vec::as_slice).unwrap_or_default();
        names
            .iter()
            .map(|f| Ok((f.clone(), self.stored(&format!("{part}.{f}"), None)?)))
            .collect()
    }
}

impl WeightSource for Checkpoint {
    fn tensor(&self, name: &str, dims: &[usize]) -> Result<Tensor> {
        self.stored(name, Some(dims))?.to_dtype(self.dtype)
    }

    fn linear(&self, parts: &[(String, usize)], in_dim: usize) -> Result<QLinear> {
        let mut format: Option<WeightFormat> = None;
        let mut stacked: HashMap<String, Vec<Tensor>> = HashMap::new();
        for (part, rows) in parts {
            let Some(e) = self.manifest.layers.get(part) else {
                return Err(err(
                    &self.file,
                    format!("the manifest lists no layer '{part}'"),
                ));
            };
            if e.shape != [*rows, in_dim] {
                return Err(err(
                    &self.file,
                    format!(
                        "layer '{part}' is {:?}, the config wants [{rows}, {in_dim}]",
                        e.shape
                    ),
                ));
            }
            let f: WeightFormat = e.format.parse()?;
            if format.is_some_and(|g| g != f) {
                return Err(err(
                    &self.file,
                    format!("layer '{part}' is {f}, but the parts stacked with it are not"),
                ));
            }
            format = Some(f);
            for (field, t) in self.fields(part)? {
                if is_input_field(&field) {
                    // Shared by the parts stacked on one input: keep the first, check the rest.
                    match stacked.get(&field).and_then(|v| v.first()) {
                        Some(first) if first.dims() != t.dims() => {
                            return Err(err(
                                &self.file,
                                format!(
                                    "tensor '{part}.{field}' is {:?}, the part before it has {:?}",
                                    t.dims(),
                                    first.dims()
                                ),
                            ))
                        }
                        Some(_) => {}
                        None => {
                            stacked.insert(field, vec![t]);
                        }
                    }
                    continue;
                }
                if t.dims().first() != Some(rows) {
                    return Err(err(
                        &self.file,
                        format!(
                            "tensor '{part}.{field}' is {:?}, want {rows} rows first",
                            t.dims()
                        ),
                    ));
                }
                stacked.entry(field).or_default().push(t);
            }
        }
        let Some(format) = format else {
            candle_core::bail!("checkpoint: a linear layer of no parts")
        };
        let fields = stacked
            .into_iter()
            .map(|(k, v)| {
                Ok((
                    k,
                    if v.len() == 1 {
                        v[0].clone()
                    } else {
                        Tensor::cat(&v, 0)?
                    },
                ))
            })
            .collect::<Result<HashMap<_, _>>>()?;
        let rows = parts.iter().map(|(_, r)| r).sum();
        let names: Vec<&str> = parts.iter().map(|(p, _)| p.as_str()).collect();
        let w = format
            .spec()
            .codec
            .rebuild(format, (rows, in_dim), &fields)
            .map_err(|e| err(&self.file, format!("layer {}: {e}", names.join(" + "))))?;
        let lin = QLinear::new(w, None);
        if format == WeightFormat::Dense {
            // Dense weights load in the run dtype, as the embedding and norms do.
            let w = lin.weights().tensors()?.remove(0).1.to_dtype(self.dtype)?;
            return QLinear::from_weight(w, None);
        }
        Ok(lin)
    }

    fn lm_head(&self, cfg: &Config, _embed: &Tensor) -> Result<QLinear> {
        self.linear(&[("lm_head".to_string(), cfg.vocab_size)], cfg.hidden_size)
    }
}

/// Load the model in checkpoint `dir` with `cfg` (its `config.json`), dense tensors in
/// `dtype` on `device`.
pub fn load(dir: &Path, cfg: &Config, dtype: DType, device: &Device) -> Result<(Llama, Manifest)> {
    let ck = Checkpoint::open(dir, dtype, device)?;
    let model = Llama::load_from(&ck, cfg)?;
    Ok((model, ck.manifest))
}
