//! candle `CustomOp`s. Each validates shapes, dtypes and contiguity; `cpu_fwd` is the
//! plain reference, `cuda_fwd` launches the PTX kernel of the same name family.

pub mod decode;
mod gemv;
pub mod kv_quant;
mod prefill;
mod rms_norm;
mod stream_read;
mod tiles;
mod tiles_gemv;
mod uniform;
mod w4a4;
#[cfg(feature = "cuda")]
mod w4a4_cuda;

pub use decode::{
    advance_pos, append_decode_attention, decode_attention, embed_gather, rope_kv_append, silu_mul,
    Heads, StepPositions,
};
pub use gemv::{gemv, gemv_ok, gemv_silu_mul, gemv_weight_ok, Gemv, GEMV_MAX_M};
pub use kv_quant::{kv_append, kv_dequantize};
pub use prefill::{prefill_attention, prefill_unsupported, PREFILL_HEAD_DIMS};
pub use rms_norm::{add_rms_norm, add_rms_norm_as, rms_norm_as, AddRmsNorm};
pub use stream_read::{stream_read, stream_read_blocks, xor_fold, StreamRead, STREAM_READ_THREADS};
#[doc(hidden)]
pub use tiles::force_gemm_tokens;
pub use tiles::{
    tiles_add, tiles_dequantize, tiles_forward, tiles_fuse_ok, tiles_fused, tiles_normed,
    tiles_plan, TILES_GEMM_MAX_M, TILES_MAX_M,
};
#[doc(hidden)]
pub use tiles_gemv::{force_gemv, gemv_plan, GemvPlan, GV_CH, GV_STAGES};
pub use uniform::{uniform_dequantize, uniform_pack};
pub use w4a4::{
    tensor_bytes, w4a4_matmul, w4a4_matmul_with, w4a4_quantize, ActSource, W4a4Kernel,
    W4A4_SKINNY_MAX_M,
};

/// The elements of a contiguous CPU tensor (the CPU references' input), or an error naming
/// `what` and its layout.
pub(crate) fn contiguous_slice<'a, T: candle_core::WithDType>(
    s: &'a candle_core::CpuStorage,
    l: &candle_core::Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s.as_slice::<T>()?[a..b]),
        None => candle_core::bail!("{what} must be contiguous, got {l:?}"),
    }
}
