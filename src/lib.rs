//! candle-lowbit: low-bit LLM inference for candle on NVIDIA GPUs.
//!
//! - [`QLinear`]: one linear-layer type over every weight format (dense, candle's GGML
//!   formats; the crate's own formats plug in here).
//! - [`KvCache`]: one KV-cache type over every KV format, preallocated and written in place.
//! - [`llama`]: a drop-in Llama whose linear layers and caches are those two types.
//! - [`graph::GraphDecoder`]: the decode step captured once and replayed as a CUDA graph.
//! - [`ops`]: candle `CustomOp`s, each with a CPU reference and a CUDA kernel from `cuda/`.

pub mod chat;
pub mod gguf;
pub mod graph;
pub mod kernels;
pub mod kv_cache;
pub mod linear;
pub mod loader;
pub mod model_files;
pub mod ops;
pub mod tokenizer;

#[path = "../models/llama.rs"]
pub mod llama;

pub use kv_cache::{KvCache, KvFormat};
pub use linear::{QLinear, WeightFormat};
pub use llama::{Cache, Config, Llama};
