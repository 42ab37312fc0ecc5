//! candle `CustomOp`s. Each validates shapes, dtypes and contiguity; `cpu_fwd` is the
//! plain reference, `cuda_fwd` launches the PTX kernel of the same name family.

pub mod decode;
mod gemv;
mod rms_norm;
mod stream_read;

pub use decode::{advance_pos, decode_attention, embed_gather, rope_kv_append, silu_mul, Heads, StepPositions};
pub use gemv::{gemv, gemv_ok, Gemv, GEMV_MAX_M};
pub use rms_norm::{add_rms_norm, AddRmsNorm};
pub use stream_read::{stream_read, stream_read_blocks, xor_fold, StreamRead, STREAM_READ_THREADS};
