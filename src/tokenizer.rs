//! A `tokenizers::Tokenizer` built from GGUF metadata (byte-level BPE, `tokenizer.ggml.model
//! = gpt2`, as Llama-3, SmolLM and most recent Llama-family GGUFs use).

use candle_core::quantized::gguf_file::Content;
use candle_core::Result;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

fn strings(ct: &Content, key: &str) -> Result<Vec<String>> {
    let Some(v) = ct.metadata.get(key) else {
        candle_core::bail!("GGUF metadata has no '{key}'")
    };
    v.to_vec()?.iter().map(|s| s.to_string().cloned()).collect()
}

fn err(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(format!("building the GGUF tokenizer: {e}"))
}

/// Build the tokenizer a GGUF file describes. Control tokens (type 3) become special
/// tokens, so chat markers such as `<|im_start|>` encode to one id.
pub fn from_gguf(ct: &Content) -> Result<Tokenizer> {
    let model = ct
        .metadata
        .get("tokenizer.ggml.model")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    if model != "gpt2" {
        candle_core::bail!(
            "GGUF tokenizer model '{model}' is not supported (only byte-level BPE 'gpt2'); pass a tokenizer.json instead"
        )
    }
    let tokens = strings(ct, "tokenizer.ggml.tokens")?;
    let merges = strings(ct, "tokenizer.ggml.merges")?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| err(format!("bad merge '{m}'")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(err)?;
    let mut tok = Tokenizer::new(bpe);

    let pre = ct
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    let byte_level = ByteLevel::new(false, true, true);
    let pre_tok: PreTokenizerWrapper = if pre == "smollm" {
        Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
    } else {
        byte_level.into()
    };
    tok.with_pre_tokenizer(Some(pre_tok));
    tok.with_decoder(Some(ByteLevelDecoder::default()));

    if let Some(types) = ct.metadata.get("tokenizer.ggml.token_type") {
        let specials: Vec<AddedToken> = types
            .to_vec()?
            .iter()
            .zip(tokens.iter())
            .filter(|(t, _)| t.to_i32().map(|x| x == 3).unwrap_or(false))
            .map(|(_, s)| AddedToken::from(s.clone(), true))
            .collect();
        tok.add_special_tokens(specials).map_err(err)?;
    }
    Ok(tok)
}
