//! Streaming read: read every byte of a tensor with 16-byte loads and fold the words
//! with XOR, one `u32` per block. The bandwidth ceiling the benchmark holds each row
//! against (`examples/bench.rs`): a kernel that reads N bytes cannot beat this op on N
//! bytes. Kernel: `cuda/stream_read.cu`.
//!
//! The output depends on how words are split over blocks, so the op takes the block
//! count: uint4 word `i` (16 bytes) belongs to block `(i mod (blocks * THREADS)) /
//! THREADS`. The CPU reference folds the same words into the same blocks, so CPU and
//! CUDA outputs are bit-equal.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// Threads per block of the kernel (a multiple of 32).
pub const STREAM_READ_THREADS: usize = 256;

/// The op: input any contiguous tensor of u8/u32/f16/bf16/f32 whose byte length is a
/// multiple of 16 (and, on CUDA, whose data starts 16-byte aligned); output `[blocks]` u32.
#[derive(Debug, Clone, Copy)]
pub struct StreamRead {
    pub blocks: usize,
}

/// Reads all of `x` (see [`StreamRead`]); returns the per-block XOR, `[blocks]` u32.
pub fn stream_read(x: &Tensor, blocks: usize) -> Result<Tensor> {
    if !x.is_contiguous() {
        candle_core::bail!("stream_read: input {:?} must be contiguous", x.shape())
    }
    x.apply_op1_no_bwd(&StreamRead { blocks })
}

/// A block count that fills `sm_count` SMs (8 blocks of 256 threads each) without
/// launching blocks that would find no work in `n_bytes`.
pub fn stream_read_blocks(n_bytes: usize, sm_count: usize) -> usize {
    let words = n_bytes.div_ceil(16);
    words
        .div_ceil(STREAM_READ_THREADS)
        .clamp(1, sm_count.max(1) * 8)
}

/// XOR of all words of the per-block output: the same for every block count.
pub fn xor_fold(per_block: &[u32]) -> u32 {
    per_block.iter().fold(0, |a, &b| a ^ b)
}

fn check(layout: &Layout, dtype: DType, blocks: usize) -> Result<usize> {
    if !matches!(
        dtype,
        DType::U8 | DType::U32 | DType::F16 | DType::BF16 | DType::F32
    ) {
        candle_core::bail!("stream_read: unsupported dtype {dtype:?} (u8, u32, f16, bf16, f32)")
    }
    if layout.contiguous_offsets().is_none() {
        candle_core::bail!("stream_read: input {:?} must be contiguous", layout.shape())
    }
    let n_bytes = layout.shape().elem_count() * dtype.size_in_bytes();
    if n_bytes == 0 || !n_bytes.is_multiple_of(16) {
        candle_core::bail!(
            "stream_read: {n_bytes} bytes ({:?} {dtype:?}) is not a positive multiple of 16",
            layout.shape()
        )
    }
    if blocks == 0 || blocks > u32::MAX as usize {
        candle_core::bail!("stream_read: block count {blocks} out of range")
    }
    Ok(n_bytes)
}

fn cpu_bytes(s: &CpuStorage, layout: &Layout) -> Result<Vec<u8>> {
    let Some((a, b)) = layout.contiguous_offsets() else {
        candle_core::bail!("stream_read: input must be contiguous")
    };
    Ok(match s {
        CpuStorage::U8(v) => v[a..b].to_vec(),
        CpuStorage::U32(v) => v[a..b].iter().flat_map(|x| x.to_le_bytes()).collect(),
        CpuStorage::F16(v) => v[a..b]
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        CpuStorage::BF16(v) => v[a..b]
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        CpuStorage::F32(v) => v[a..b]
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        s => candle_core::bail!("stream_read: unsupported dtype {:?}", s.dtype()),
    })
}

/// The reference: fold 16-byte word `i` into block `(i mod (blocks * THREADS)) / THREADS`.
fn cpu_ref(bytes: &[u8], blocks: usize) -> Vec<u32> {
    let grid = blocks * STREAM_READ_THREADS;
    let mut out = vec![0u32; blocks];
    for (i, w16) in bytes.chunks_exact(16).enumerate() {
        let fold = w16.chunks_exact(4).fold(0u32, |a, w| {
            a ^ u32::from_le_bytes([w[0], w[1], w[2], w[3]])
        });
        out[(i % grid) / STREAM_READ_THREADS] ^= fold;
    }
    out
}

impl CustomOp1 for StreamRead {
    fn name(&self) -> &'static str {
        "stream-read"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        check(l, s.dtype(), self.blocks)?;
        let out = cpu_ref(&cpu_bytes(s, l)?, self.blocks);
        Ok((CpuStorage::U32(out), Shape::from(self.blocks)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::kernels::{contiguous_view, launch_err};
        use candle_core::cuda_backend::cudarc::driver::{
            DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
        };
        use candle_core::cuda_backend::{CudaDType, CudaStorage};
        use half::{bf16, f16};

        let n_bytes = check(l, s.dtype(), self.blocks)?;
        fn launch<T: CudaDType + DeviceRepr>(
            s: &CudaStorage,
            l: &Layout,
            blocks: usize,
            n_bytes: usize,
        ) -> Result<CudaStorage> {
            let dev = s.device();
            let src = contiguous_view::<T>(s, l, "stream_read input")?;
            let stream = dev.cuda_stream();
            let addr = {
                let (ptr, _sync) = src.device_ptr(&stream);
                ptr as usize
            };
            if addr % 16 != 0 {
                candle_core::bail!("stream_read: input data at {addr:#x} is not 16-byte aligned")
            }
            let out = unsafe { dev.alloc::<u32>(blocks)? };
            let func = crate::kernels::func(
                dev,
                "stream_read_xor",
                &crate::kernels::modules::STREAM_READ,
            )?;
            let cfg = LaunchConfig {
                grid_dim: (blocks as u32, 1, 1),
                block_dim: (STREAM_READ_THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            let n16 = (n_bytes / 16) as u64;
            let mut b = stream.launch_builder(&func);
            b.arg(&src).arg(&out).arg(&n16);
            unsafe { b.launch(cfg) }.map_err(launch_err)?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
        }
        let out = match s.dtype() {
            DType::U8 => launch::<u8>(s, l, self.blocks, n_bytes)?,
            DType::U32 => launch::<u32>(s, l, self.blocks, n_bytes)?,
            DType::F16 => launch::<f16>(s, l, self.blocks, n_bytes)?,
            DType::BF16 => launch::<bf16>(s, l, self.blocks, n_bytes)?,
            DType::F32 => launch::<f32>(s, l, self.blocks, n_bytes)?,
            dt => candle_core::bail!("stream_read: unsupported dtype {dt:?}"),
        };
        Ok((out, Shape::from(self.blocks)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_assigns_words_to_blocks_grid_stride() {
        // 3 blocks * 256 threads = 768 words per grid pass; 1000 words: block 0 gets words
        // 0..256 and 768..1000, block 1 256..512, block 2 512..768.
        let words: Vec<u32> = (0..4000u32).map(|i| i.wrapping_mul(2654435761)).collect();
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let out = cpu_ref(&bytes, 3);
        let fold =
            |r: std::ops::Range<usize>| words[r.start * 4..r.end * 4].iter().fold(0, |a, &b| a ^ b);
        assert_eq!(
            out,
            vec![
                fold(0..256) ^ fold(768..1000),
                fold(256..512),
                fold(512..768)
            ]
        );
        assert_eq!(xor_fold(&out), words.iter().fold(0, |a, &b| a ^ b));
    }
}
