//! The streaming-read op (the benchmark's bandwidth ceiling): the CPU reference on its
//! own, and the CUDA kernel bit-equal to it (cuda feature).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_lowbit::ops::{stream_read, stream_read_blocks, xor_fold};

/// Seeded pseudo-random u32 words (never zeros: an unread word must change the result).
fn words(n: usize, seed: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2654435761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x
        })
        .collect()
}

#[test]
fn cpu_reference_folds_every_word_for_any_block_count() -> Result<()> {
    let w = words(4 * 1003, 7);
    let want = w.iter().fold(0, |a, &b| a ^ b);
    let t = Tensor::from_vec(w.clone(), w.len(), &Device::Cpu)?;
    for blocks in [1, 2, 3, 5, 64] {
        let out = stream_read(&t, blocks)?;
        assert_eq!(out.dims(), [blocks]);
        assert_eq!(xor_fold(&out.to_vec1::<u32>()?), want, "blocks {blocks}");
    }
    // Flipping one bit anywhere changes the result.
    let mut w2 = w.clone();
    w2[4 * 1003 - 1] ^= 1 << 9;
    let out = stream_read(&Tensor::from_vec(w2, w.len(), &Device::Cpu)?, 3)?;
    assert_ne!(xor_fold(&out.to_vec1::<u32>()?), want);
    Ok(())
}

#[test]
fn cpu_reference_same_bytes_same_result_across_dtypes() -> Result<()> {
    let w = words(64, 3);
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    let a = stream_read(&Tensor::from_vec(w.clone(), 64, &Device::Cpu)?, 1)?.to_vec1::<u32>()?;
    let b = stream_read(&Tensor::from_vec(bytes, 256, &Device::Cpu)?, 1)?.to_vec1::<u32>()?;
    assert_eq!(a, b);
    Ok(())
}

#[test]
fn rejects_lengths_not_a_multiple_of_16_bytes() -> Result<()> {
    let t = Tensor::zeros(7, DType::F16, &Device::Cpu)?;
    assert!(stream_read(&t, 1).is_err());
    assert!(stream_read(&Tensor::zeros(8, DType::F16, &Device::Cpu)?, 0).is_err());
    Ok(())
}

#[test]
fn suggested_block_count_is_bounded() {
    assert_eq!(stream_read_blocks(16, 132), 1);
    assert_eq!(stream_read_blocks(16 * 256 * 3, 132), 3);
    assert_eq!(stream_read_blocks(1 << 30, 132), 132 * 8);
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_cpu_reference() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    // Odd sizes: not a multiple of the grid, fewer words than threads, a partial unroll.
    for (seed, n_words) in [
        (1u32, 4usize),
        (2, 4 * 255),
        (3, 4 * 1000 + 4 * 3),
        (4, 4 * (1 << 20) + 4 * 17),
    ] {
        let w = words(n_words, seed);
        let cpu = Tensor::from_vec(w, n_words, &Device::Cpu)?;
        let dev_t = cpu.to_device(&gpu)?;
        for blocks in [1, 7, stream_read_blocks(n_words * 4, 132)] {
            let want = stream_read(&cpu, blocks)?.to_vec1::<u32>()?;
            let got = stream_read(&dev_t, blocks)?.to_vec1::<u32>()?;
            assert_eq!(got, want, "{n_words} words, {blocks} blocks");
        }
    }
    // f16 data (the benchmark's buffers), read through its bytes.
    let h = Tensor::randn(0f32, 1., 4096 * 3, &gpu)?.to_dtype(DType::F16)?;
    let want = stream_read(&h.to_device(&Device::Cpu)?, 5)?.to_vec1::<u32>()?;
    assert_eq!(stream_read(&h, 5)?.to_vec1::<u32>()?, want);
    Ok(())
}
