//! Loading a GGUF Llama file: config from metadata, weights dequantized to the run dtype
//! under HF tensor names (so [`crate::llama::Llama::load`] reads them), tokenizer and chat
//! template from metadata.
//!
//! GGUF stores Q and K projections with rows permuted for interleaved RoPE (llama.cpp's
//! converter); they are permuted back to the HF layout here, so the model has one RoPE
//! convention whatever file it came from.

use crate::llama::Config;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Result, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// What a GGUF file holds, ready for `Llama::load`.
pub struct GgufLlama {
    pub config: Config,
    /// HF-named tensors in the run dtype, on the target device.
    pub tensors: HashMap<String, Tensor>,
    pub tokenizer: tokenizers::Tokenizer,
    pub chat_template: Option<String>,
    /// `general.name`, or the file name.
    pub name: String,
    /// Bits per weight of the file's own linear-layer tensors.
    pub file_bits_per_weight: f64,
}

fn md<'a>(ct: &'a Content, key: &str) -> Result<&'a Value> {
    ct.metadata
        .get(key)
        .ok_or_else(|| candle_core::Error::Msg(format!("GGUF metadata has no '{key}'")))
}

fn md_u32(ct: &Content, key: &str) -> Result<usize> {
    let v = md(ct, key)?;
    Ok(v.to_u32()
        .or_else(|_| v.to_u64().map(|x| x as u32))
        .or_else(|_| v.to_i32().map(|x| x as u32))? as usize)
}

/// The Llama config a GGUF file's metadata describes.
pub fn config_from_gguf(ct: &Content) -> Result<Config> {
    let arch = md(ct, "general.architecture")?.to_string()?.clone();
    if arch != "llama" {
        candle_core::bail!("GGUF architecture '{arch}' is not supported (only 'llama')")
    }
    let n_h = md_u32(ct, "llama.attention.head_count")?;
    let h = md_u32(ct, "llama.embedding_length")?;
    let vocab = match md(ct, "tokenizer.ggml.tokens") {
        Ok(v) => v.to_vec()?.len(),
        Err(_) => md_u32(ct, "llama.vocab_size")?,
    };
    let tied = !ct.tensor_infos.contains_key("output.weight");
    let eos = md_u32(ct, "tokenizer.ggml.eos_token_id")
        .ok()
        .map(|e| candle_transformers::models::llama::LlamaEosToks::Single(e as u32));
    Ok(Config {
        hidden_size: h,
        intermediate_size: md_u32(ct, "llama.feed_forward_length")?,
        vocab_size: vocab,
        num_hidden_layers: md_u32(ct, "llama.block_count")?,
        num_attention_heads: n_h,
        num_key_value_heads: md_u32(ct, "llama.attention.head_count_kv").unwrap_or(n_h),
        use_flash_attn: false,
        rms_norm_eps: md(ct, "llama.attention.layer_norm_rms_epsilon")?.to_f32()? as f64,
        rope_theta: md(ct, "llama.rope.freq_base")
            .and_then(|v| v.to_f32())
            .unwrap_or(10_000.),
        bos_token_id: md_u32(ct, "tokenizer.ggml.bos_token_id")
            .ok()
            .map(|x| x as u32),
        eos_token_id: eos,
        rope_scaling: None,
        max_position_embeddings: md_u32(ct, "llama.context_length").unwrap_or(4096),
        tie_word_embeddings: tied,
    })
}

/// GGUF name -> HF name, and for Q/K the head count to un-permute with.
fn hf_name(gguf: &str, cfg: &Config) -> Option<(String, Option<usize>)> {
    let simple = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(s) = simple {
        return Some((s.to_string(), None));
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, name) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (hf, heads) = match name {
        "attn_q.weight" => ("self_attn.q_proj.weight", Some(cfg.num_attention_heads)),
        "attn_k.weight" => ("self_attn.k_proj.weight", Some(cfg.num_key_value_heads)),
        "attn_v.weight" => ("self_attn.v_proj.weight", None),
        "attn_output.weight" => ("self_attn.o_proj.weight", None),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", None),
        "ffn_up.weight" => ("mlp.up_proj.weight", None),
        "ffn_down.weight" => ("mlp.down_proj.weight", None),
        "attn_norm.weight" => ("input_layernorm.weight", None),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}"), heads))
}

/// Undo llama.cpp's Q/K row permutation: `[heads, hd/2, 2, in] -> [heads, 2, hd/2, in]`.
fn unpermute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    if heads == 0 || out % (2 * heads) != 0 {
        candle_core::bail!("cannot un-permute a [{out}, {inp}] projection over {heads} heads")
    }
    w.reshape((heads, out / heads / 2, 2, inp))?
        .transpose(1, 2)?
        .reshape((out, inp))
}

/// Read a GGUF Llama file: weights dequantized to `dtype` on `device`.
pub fn load_gguf(path: &Path, dtype: DType, device: &Device) -> Result<GgufLlama> {
    let mut file = std::fs::File::open(path).map_err(|e| {
        candle_core::Error::Msg(format!("cannot open model file {}: {e}", path.display()))
    })?;
    let ct = Content::read(&mut file).map_err(|e| {
        candle_core::Error::Msg(format!(
            "{} is not a readable GGUF file: {e}",
            path.display()
        ))
    })?;
    let config = config_from_gguf(&ct)?;
    let tokenizer = crate::tokenizer::from_gguf(&ct)?;
    let chat_template = md(&ct, "tokenizer.chat_template")
        .ok()
        .and_then(|v| v.to_string().ok())
        .cloned();
    let name = md(&ct, "general.name")
        .ok()
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_else(|| {
            path.file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default()
        });

    let mut tensors = HashMap::new();
    let (mut lin_bytes, mut lin_n) = (0usize, 0usize);
    let mut names: Vec<&String> = ct.tensor_infos.keys().collect();
    names.sort();
    for gname in names {
        let Some((hname, heads)) = hf_name(gname, &config) else {
            continue;
        };
        let q = ct.tensor(&mut file, gname, &Device::Cpu).map_err(|e| {
            candle_core::Error::Msg(format!("{}: tensor {gname}: {e}", path.display()))
        })?;
        if q.shape().rank() == 2 && gname != "token_embd.weight" {
            lin_bytes += q.storage_size_in_bytes();
            lin_n += q.shape().elem_count();
        }
        let mut w = q.dequantize(&Device::Cpu)?;
        if let Some(heads) = heads {
            w = unpermute(&w, heads)?;
        }
        tensors.insert(hname, w.to_dtype(dtype)?.to_device(device)?);
    }
    if config.tie_word_embeddings {
        if let Some(info) = ct.tensor_infos.get("token_embd.weight") {
            let n = info.shape.elem_count();
            lin_bytes += n / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
            lin_n += n;
        }
    }
    Ok(GgufLlama {
        config,
        tensors,
        tokenizer,
        chat_template,
        name,
        file_bits_per_weight: lin_bytes as f64 * 8.0 / lin_n.max(1) as f64,
    })
}
