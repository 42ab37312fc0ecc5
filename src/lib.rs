//! candle-lowbit: low-bit LLM inference for candle on NVIDIA GPUs.
//!
//! - [`formats`]: every weight format (dense, candle's GGML formats, uniform int2/int3/int4
//!   with round to nearest or GPTQ), each one module plus one registry line.
//! - [`QLinear`]: one linear-layer type over every weight format.
//! - [`kv`]: one KV-cache type, [`KvCache`], over every KV encoding (dense, `kv4`, Oaken),
//!   preallocated and written in place; the decode attention reads quantized caches directly.
//! - [`llama`]: a drop-in Llama whose linear layers and caches are those two types.
//! - [`graph::GraphDecoder`]: the decode step captured once and replayed as a CUDA graph.
//! - [`ops`]: candle `CustomOp`s, each with a CPU reference and a CUDA kernel from `cuda/`.
//! - [`calib`], [`gptq`], [`checkpoint`]: calibration statistics, GPTQ over any format's
//!   group rule, and quantized checkpoints that load in seconds.

pub mod calib;
pub mod chat;
pub mod checkpoint;
pub mod formats;
pub mod gguf;
pub mod gptq;
pub mod graph;
pub mod kernels;
pub mod kv;
pub mod linear;
pub mod loader;
pub mod model_files;
pub mod ops;
pub mod tokenizer;

#[path = "../models/llama.rs"]
pub mod llama;

pub use formats::WeightFormat;
pub use kv::{KvCache, KvFormat, KvSpec};
pub use linear::QLinear;
pub use llama::{Cache, Config, Llama};
