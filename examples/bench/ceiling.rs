//! The streaming-read ceiling: how long a plain read of N bytes takes (16-byte loads,
//! `ops::stream_read`), timed exactly as the rows are (back-to-back, rotated past L2).
//! Each row is held against the ceiling for its own byte count.
//!
//! The buffers are views into one random pool (2 GiB; 16 MiB with `--quick`): a byte
//! count is read from `rotation(bytes)` disjoint views in turn. Counts larger than the
//! pool are timed on the whole pool and scaled linearly (the read rate is flat from
//! ~256 MB up: 4.2–4.4 TB/s on the H200, DESIGN.md §3).

use crate::util::{randn, rotation, time_batched};
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_lowbit::ops::{stream_read, stream_read_blocks};
use std::collections::HashMap;

pub struct Ceiling {
    pool: Option<Tensor>,
    pool_bytes: usize,
    sms: usize,
    cache: HashMap<usize, f64>,
    /// Whether the op matched its CPU reference (checked once, before any timing).
    pub verified: Result<(), String>,
}

impl Ceiling {
    pub fn new(dev: &Device, quick: bool) -> Result<Self> {
        let (_, sms) = crate::util::device_info(dev);
        let pool_bytes = if quick { 16 << 20 } else { 2 << 30 };
        let verified = verify(dev, sms)?;
        Ok(Self {
            pool: None,
            pool_bytes,
            sms,
            cache: HashMap::new(),
            verified,
        })
    }

    /// Median seconds to stream-read `bytes` (rounded up to 16), or None if the op
    /// failed its check.
    pub fn seconds(
        &mut self,
        dev: &Device,
        samples: usize,
        min_sample_s: f64,
        bytes: usize,
    ) -> Result<Option<f64>> {
        if self.verified.is_err() || bytes == 0 {
            return Ok(None);
        }
        let bytes = bytes.div_ceil(16) * 16;
        if let Some(&t) = self.cache.get(&bytes) {
            return Ok(Some(t));
        }
        if self.pool.is_none() {
            self.pool = Some(randn(&[self.pool_bytes / 2], 1.0, DType::F16, dev)?);
        }
        let Some(pool) = &self.pool else {
            anyhow::bail!("ceiling pool missing")
        };
        let read = bytes.min(self.pool_bytes);
        let n_views = rotation(read, 64).min(self.pool_bytes / read).max(1);
        let elems = read / 2;
        let views = (0..n_views)
            .map(|j| pool.narrow(0, j * elems, elems))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let blocks = stream_read_blocks(read, self.sms);
        let t = time_batched(dev, samples, min_sample_s, |i| {
            stream_read(&views[i % n_views], blocks).map(|_| ())
        })?;
        let secs = t.median * bytes as f64 / read as f64;
        self.cache.insert(bytes, secs);
        Ok(Some(secs))
    }
}

/// The op on the device against its CPU reference, on fresh random data of an odd size.
fn verify(dev: &Device, sms: usize) -> Result<Result<(), String>> {
    if !dev.is_cuda() {
        return Ok(Ok(()));
    }
    let elems = (1 << 20) + 40; // 2 MiB + 80 bytes: a partial grid pass and a partial unroll
    let x = randn(&[elems], 1.0, DType::F16, dev)?;
    let blocks = stream_read_blocks(elems * 2, sms);
    let got = stream_read(&x, blocks)?.to_vec1::<u32>()?;
    let want = stream_read(&x.to_device(&Device::Cpu)?, blocks)?.to_vec1::<u32>()?;
    Ok(if got == want {
        Ok(())
    } else {
        let bad = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        Err(format!(
            "stream_read differs from its CPU reference at block {bad}: {:#x} vs {:#x}",
            got[bad], want[bad]
        ))
    })
}
