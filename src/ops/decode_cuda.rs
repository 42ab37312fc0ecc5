//! CUDA launchers of the decode ops (`cuda/decode.cu`, `cuda/decode_attention.cu`).
//! Shapes and dtypes are validated by the callers in `decode.rs`.

use super::{Heads, StepPositions};
use crate::kernels::{
    contiguous_view, dptr, dtype_suffix as suffix, launch_params, launch_pdl, raw_ptr, sm_count,
    with_positions, with_view, Arg,
};
use crate::kv::oaken::KvThr;
use crate::kv::KvCodec;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{DType, Layout, Result, Tensor, WithDType};
use half::{bf16, f16};

/// Threads per block of `attn_decode` (ATTN_THREADS in its header), and chunks of loads in
/// flight per lane (`UNROLL` of `DenseKv`, the rows the generic kernel reads, kv_codec.cuh).
const ATTN_THREADS: u32 = 128;
const ATTN_UNROLL: usize = 4;

/// Warps per block, keys per warp step and ring stages per warp of the tensor-core kernel
/// (kv4 and oaken), and query heads per KV head at most (TC_WARPS, TC_STEP, TC_STAGES,
/// ATTN_MAX_G in cuda/decode_attention.cu).
const TC_WARPS: usize = 4;
const TC_STEP: usize = 16;
const TC_STAGES: usize = 4;
const ATTN_MAX_G: usize = 8;

fn grid(x: usize, y: usize, z: usize, threads: u32, smem: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    }
}

pub(super) fn embed_gather(
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
    n: usize,
    h: usize,
    vocab: usize,
) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        n: usize,
        h: usize,
        vocab: usize,
    ) -> Result<CudaStorage> {
        let dev = s1.device();
        let stream = dev.cuda_stream();
        let table = contiguous_view::<T>(s1, l1, "table")?;
        let ids = contiguous_view::<u32>(s2, l2, "ids")?;
        let out = unsafe { dev.alloc::<T>(n * h)? };
        let name = format!("embed_gather_{}", suffix(T::DTYPE)?);
        let func = crate::kernels::func(dev, &name, &crate::kernels::modules::DECODE)?;
        if n > 0 {
            let ((tp, _g1), (ip, _g2), (op, _g3)) = (
                dptr(&table, &stream),
                dptr(&ids, &stream),
                dptr(&out, &stream),
            );
            let args = [
                tp,
                ip,
                op,
                Arg::I32(n as i32),
                Arg::I32(h as i32),
                Arg::I32(vocab as i32),
            ];
            unsafe { launch_pdl(&func, &stream, grid(n, 1, 1, 128, 0), &args) }?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    match s1.dtype() {
        DType::F32 => run::<f32>(s1, l1, s2, l2, n, h, vocab),
        DType::F16 => run::<f16>(s1, l1, s2, l2, n, h, vocab),
        DType::BF16 => run::<bf16>(s1, l1, s2, l2, n, h, vocab),
        dt => candle_core::bail!("embed_gather: unsupported dtype {dt:?}"),
    }
}

pub(super) fn silu_mul(
    s: &CudaStorage,
    l: &Layout,
    rows: usize,
    inter: usize,
) -> Result<CudaStorage> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        s: &CudaStorage,
        l: &Layout,
        rows: usize,
        inter: usize,
    ) -> Result<CudaStorage> {
        let dev = s.device();
        let stream = dev.cuda_stream();
        let gu = contiguous_view::<T>(s, l, "gu")?;
        let out = unsafe { dev.alloc::<T>(rows * inter)? };
        let func = crate::kernels::func(
            dev,
            &format!("silu_mul_{}", suffix(T::DTYPE)?),
            &crate::kernels::modules::DECODE,
        )?;
        let n = rows * inter;
        if n > 0 {
            let ((gp, _g1), (op, _g2)) = (dptr(&gu, &stream), dptr(&out, &stream));
            let args = [gp, op, Arg::I32(rows as i32), Arg::I32(inter as i32)];
            unsafe {
                launch_pdl(
                    &func,
                    &stream,
                    grid(n.div_ceil(256).min(65535), 1, 1, 256, 0),
                    &args,
                )
            }?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    match s.dtype() {
        DType::F32 => run::<f32>(s, l, rows, inter),
        DType::F16 => run::<f16>(s, l, rows, inter),
        DType::BF16 => run::<bf16>(s, l, rows, inter),
        dt => candle_core::bail!("silu_mul: unsupported dtype {dt:?}"),
    }
}

pub(super) fn rope_kv_append(
    heads: Heads,
    p: &StepPositions,
    s1: &mut CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> Result<()> {
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        heads: Heads,
        p: &StepPositions,
        s1: &mut CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        let dev = s1.device().clone();
        let dims = l1.shape().dims().to_vec();
        let (b, max_len, seq) = (dims[1], dims[3], l2.shape().dims()[1]);
        let qkv = contiguous_view::<T>(s2, l2, "qkv")?;
        let func = crate::kernels::func(
            &dev,
            &format!("rope_kv_{}", suffix(T::DTYPE)?),
            &crate::kernels::modules::DECODE,
        )?;
        let stream = dev.cuda_stream();
        let cache = s1.as_cuda_slice_mut::<T>()?;
        let half = cache.len() / 2;
        let (k, v) = cache.split_at_mut(half);
        let tables = [&p.cos, &p.sin, &p.pos, &p.pads];
        with_positions(tables, &stream, |[cp, sp, pp, dp]| {
            let (qp, _g1) = dptr(&qkv, &stream);
            let ((kp, _g6), (vp, _g7)) = (dptr(&k, &stream), dptr(&v, &stream));
            let ints = [seq, heads.nh, heads.nkv, heads.hd, max_len].map(|x| Arg::I32(x as i32));
            let mut args = vec![
                qp,
                Arg::Ptr(cp),
                Arg::Ptr(sp),
                Arg::Ptr(pp),
                Arg::Ptr(dp),
                kp,
                vp,
            ];
            args.extend(ints);
            let cfg = grid(seq, b, heads.nkv, (heads.hd / 2) as u32, 0);
            unsafe { launch_pdl(&func, &stream, cfg, &args) }
        })?;
        if l1.start_offset() != 0 {
            candle_core::bail!("rope_kv_append: cache must start at offset 0")
        }
        Ok(())
    }
    match s2.dtype() {
        DType::F32 => run::<f32>(heads, p, s1, l1, s2, l2),
        DType::F16 => run::<f16>(heads, p, s1, l1, s2, l2),
        DType::BF16 => run::<bf16>(heads, p, s1, l1, s2, l2),
        dt => candle_core::bail!("rope_kv_append: unsupported dtype {dt:?}"),
    }
}

/// Most keys per block for a cache of `max_len` rows (it sizes shared memory and fixes
/// the launch at `ceil(max_len / chunk)` blocks per KV head; each launch then spreads the
/// current keys over those blocks, at least `batch_rows` per block, see
/// cuda/decode_attention.cu): for short caches one round of loads (`batch_rows`, so every
/// block loads all its keys before waiting on the QKV projection), longer for long
/// caches (fewer partials to merge).
fn attn_chunk(max_len: usize, batch_rows: usize) -> usize {
    match max_len {
        0..=2048 => batch_rows.min(256),
        2049..=8192 => batch_rows.clamp(128, 256),
        _ => 256,
    }
}

/// `CANDLE_LOWBIT_ATTN_CHUNK`: overrides [`attn_chunk`] for dense caches (for measuring;
/// read once; a multiple of `batch_rows`, else ignored).
fn attn_chunk_override(batch_rows: usize) -> Option<usize> {
    static C: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let c = *C.get_or_init(|| {
        std::env::var("CANDLE_LOWBIT_ATTN_CHUNK")
            .ok()
            .and_then(|v| v.parse().ok())
    });
    c.filter(|&c: &usize| c > 0 && c % batch_rows.max(1) == 0)
}

/// Keys per block of the tensor-core kernel for caches of more than 8192 rows: the
/// cache split into as many chunks as keep `heads` (batch × KV heads) × chunks within one
/// wave of resident blocks (`slots`: [`tc_split_slots_per_sm`] per SM), at most [`TC_MAX_SPLITS`].
/// (Measured on kv4:) A block's
/// fixed work (the query, its partials, the merge) is paid per chunk and a second wave
/// of a few blocks costs a whole block time. H200, 32 KV heads of 128 at L = 16k, batch
/// 1, fixed chunks (µs at 256 / 512 / 1024 / 2048 / 4096 keys): 51.0 / 49.1 / 45.3 / 57.2 /
/// 92.0 (1024: 17 chunks, 544 blocks, one more than a wave); batch 8 317 / 267 / 242 / 232
/// / 230; batch 32 1266 / 1026 / 910 / 862 / 853; 8 KV heads, batch 1 41.3 / 31.0 / 39.9 /
/// 46.9 / 52.2, batch 8 145 / 110 / 86.6 / 84.8 / 102.
fn tc_long_chunk_for(max_len: usize, heads: usize, slots: usize) -> usize {
    let splits = (slots / heads.max(1)).clamp(1, TC_MAX_SPLITS);
    max_len.div_ceil(splits)
}

/// Most key chunks per KV head of the tensor-core kernel at long contexts (the last
/// block of a head merges them all).
const TC_MAX_SPLITS: usize = 32;

/// Block slots per SM that [`tc_long_chunk_for`] fills: kv4 one wave of its 4 resident
/// blocks per SM; oaken (3 resident) more than two waves, its blocks being longer (H200, 32
/// heads of 128, chunks of 16384 / 8192 / 4096 / 2048 keys: MHA L 16k batch 8 649 / 609 / 614 /
/// 605 µs, batch 32 2334 / 2331 / 2303 / 2328, 8 KV heads L 32k batch 8 500 / 410 / 395 / 382).
fn tc_split_slots_per_sm(codec: KvCodec) -> usize {
    match codec {
        KvCodec::Kv4 => 4,
        KvCodec::Oaken(_) => 8,
    }
}

/// `CANDLE_LOWBIT_TC_CHUNK`: overrides [`tc_long_chunk_for`] (for measuring; read once).
fn tc_long_chunk() -> Option<usize> {
    static C: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *C.get_or_init(|| {
        std::env::var("CANDLE_LOWBIT_TC_CHUNK")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&c: &usize| c >= 64 && c % 64 == 0)
    })
}

/// Blocks per thread-block cluster of `attn_decode` (ATTN_MAX_CLUSTER in its header): at
/// batch 1, a cache of up to this many key chunks merges through distributed shared memory (H200, 7B
/// f16 at ctx 128 in a 160-token cache: 3.69 ms/token against 3.72-3.76 with the global
/// merge, same run).
const ATTN_CLUSTER: usize = 8;

/// Blocks that share a KV head's `g` query heads in the generic kernel (`hsplit`, a power of
/// two dividing `g`): by default the most that keep the launch's `blocks` (per split) within
/// two per SM; `CANDLE_LOWBIT_ATTN_HSPLIT` (read once) forces a number (`1`: off). For the
/// Llama-2-70B shape (8 query heads per KV head, one block's serial work: ~21 µs of each
/// layer at ctx 128 on an H100).
fn attn_hsplit(g: usize, blocks: usize, sms: usize) -> usize {
    static H: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let mode = H.get_or_init(|| std::env::var("CANDLE_LOWBIT_ATTN_HSPLIT").ok());
    let fits = |h: usize| h.is_power_of_two() && g.is_multiple_of(h);
    match mode.as_deref() {
        None | Some("auto") => {
            let mut h = 1;
            while fits(2 * h) && blocks * 2 * h <= 2 * sms {
                h *= 2;
            }
            h
        }
        Some(v) => v.parse().ok().filter(|&h| fits(h)).unwrap_or(1),
    }
}

/// Whether to launch decode attention in thread-block clusters: the device runs them
/// (compute capability 9.0 or newer) and the environment does not set
/// `CANDLE_LOWBIT_CLUSTERS=0` (read once; then every merge goes through global memory).
fn clusters_supported(dev: &candle_core::CudaDevice) -> Result<bool> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| std::env::var("CANDLE_LOWBIT_CLUSTERS").is_ok_and(|v| v == "0")) {
        return Ok(false);
    }
    let major = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .map_err(candle_core::Error::wrap)?;
    Ok(major >= 9)
}

/// `AttnParams` of `cuda/decode_attention.cu`, field for field.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct AttnParams {
    qkv: u64,
    cos: u64,
    sin: u64,
    k: u64,
    v: u64,
    pos: u64,
    pads: u64,
    part_o: u64,
    part_ml: u64,
    counters: u64,
    out: u64,
    nh: i32,
    nkv: i32,
    hd: i32,
    max_len: i32,
    n_split: i32,
    chunk: i32,
    cluster: i32,
    rec: i32,
    hsplit: i32,
    scale: f32,
    pad: f32,
    kv_end: u64,
    thr_k: KvThr,
    thr_v: KvThr,
}

/// `append`: the kernel also writes row `pos` of the cache (RoPE'd K and V from `qkv`);
/// the cache storage `s2` must then be the whole contiguous cache tensor. `codec`: the
/// packed cache's encoding (`None`: dense rows of the run dtype).
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_attention(
    heads: Heads,
    p: &StepPositions,
    counters: &Tensor,
    (append, codec): (bool, Option<KvCodec>),
    s1: &CudaStorage,
    l1: &Layout,
    s2: &CudaStorage,
    l2: &Layout,
) -> Result<CudaStorage> {
    #[allow(clippy::too_many_arguments)]
    fn run<T: CudaDType + DeviceRepr + WithDType>(
        heads: Heads,
        p: &StepPositions,
        counters: &Tensor,
        (append, codec): (bool, Option<KvCodec>),
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
    ) -> Result<CudaStorage> {
        if append && (l2.start_offset() != 0 || !l2.is_contiguous()) {
            candle_core::bail!(
                "decode_attention: appending needs the whole contiguous cache, got {l2:?}"
            )
        }
        let dev = s1.device();
        let dims = l2.shape().dims().to_vec();
        let (b, max_len) = (dims[1], dims[3]);
        let Heads { nh, nkv, hd } = heads;
        let g = nh / nkv;
        // Packed caches (kv4, oaken) run on the tensor-core kernel (keys in steps of TC_STEP
        // per warp); dense ones on the generic kernel, in chunks of EPL values per lane with
        // ATTN_UNROLL chunks in flight (EPL, UNROLL of DenseKv in cuda/kv_codec.cuh).
        let tc = codec.is_some();
        let epl = 16 / T::DTYPE.size_in_bytes();
        let rec = codec.map_or(hd * T::DTYPE.size_in_bytes(), |c| c.rec_bytes(hd));
        if let Some(c) = codec.filter(|c| !c.attends(hd)) {
            candle_core::bail!(
                "decode_attention: {} needs head dim 64 or 128, got {hd}",
                c.name()
            )
        }
        let batch_rows = if tc {
            TC_WARPS * TC_STEP
        } else {
            (ATTN_THREADS as usize / (hd / epl)) * ATTN_UNROLL
        };
        let chunk = match (codec, tc_long_chunk()) {
            (Some(_), Some(c)) if max_len > 8192 => c,
            (Some(c), None) if max_len > 8192 => {
                tc_long_chunk_for(max_len, b * nkv, tc_split_slots_per_sm(c) * sm_count(dev)?)
            }
            (None, _) => {
                attn_chunk_override(batch_rows).unwrap_or_else(|| attn_chunk(max_len, batch_rows))
            }
            _ => attn_chunk(max_len, batch_rows),
        };
        let n_split = max_len.div_ceil(chunk);
        // Clusters only at batch 1 and where one cluster holds a KV head's whole cache.
        // Launched in clusters, the long-context launches (many chunks, global merge) ran
        // slower (H200, 7B f16: ctx 4k 4.93 against 4.72 ms/token, 16k 7.41 against 6.84),
        // and so did batches (8 / 32 / 64 at ctx 128: 5.04 / 7.64 / 11.0 ms per step
        // against 4.77 / 6.25 / 8.09); the launch shape cannot change with the context once
        // a graph holds it.
        let cluster =
            if b == 1 && n_split > 1 && n_split <= ATTN_CLUSTER && clusters_supported(dev)? {
                ATTN_CLUSTER
            } else {
                0
            };
        // The generic kernel in clusters (batch 1, a short cache) splits a KV head's query
        // heads over `hsplit` blocks, so that a group of 8 is not one block's serial work
        // (the KV head's keys are then read by each: from L2, the cache being short). In
        // clusters every merge stays in the cluster, so the per-KV-head counters are not
        // used (they hold b * nkv entries).
        let hsplit = if tc || cluster == 0 {
            1
        } else {
            attn_hsplit(g, nkv * n_split.next_multiple_of(cluster), sm_count(dev)?)
        };
        let g = g / hsplit;
        let smem = if tc {
            // q, then the warps' rings (a stage: K and V records of TC_STEP keys and 16
            // bytes of lead each), reused for the warps' outputs; Oaken's corrections after.
            let ring = TC_WARPS * TC_STAGES * 2 * (TC_STEP * rec + 16);
            let sparse = match codec {
                // score corrections, ΔV tiles (rows of hd + 8 f16), the K slot table
                Some(KvCodec::Oaken(_)) => {
                    TC_WARPS * TC_STEP * (ATTN_MAX_G * 4 + (hd + 8) * 2) + hd
                }
                _ => 0,
            };
            g * hd * 4 + ring.max(TC_WARPS * g * hd * 4) + sparse
        } else {
            (g * hd + g * chunk + ATTN_THREADS as usize * epl * g) * 4
        };
        let limit = if tc { 160 * 1024 } else { 48 * 1024 };
        if smem > limit {
            candle_core::bail!(
                "decode_attention: {smem} bytes of shared memory for {heads:?} (limit {limit})"
            )
        }
        let qkv = contiguous_view::<T>(s1, l1, "qkv")?;
        // Dense caches come as T, packed ones as u8: the kernel takes byte addresses.
        let stream = dev.cuda_stream();
        let dense = match codec {
            None => Some(contiguous_view::<T>(s2, l2, "cache")?),
            Some(_) => None,
        };
        let packed = match codec {
            Some(_) => Some(contiguous_view::<u8>(s2, l2, "cache")?),
            None => None,
        };
        let (k_addr, bytes, _g0) = match (&dense, &packed) {
            (Some(c), _) => {
                let (a, g) = raw_ptr(c, &stream);
                (a, c.len() * T::DTYPE.size_in_bytes(), g)
            }
            (_, Some(c)) => {
                let (a, g) = raw_ptr(c, &stream);
                (a, c.len(), g)
            }
            _ => candle_core::bail!("decode_attention: no cache view"),
        };
        if tc && k_addr % 16 != 0 {
            // The kernel copies records from the 16-byte boundary at or before them.
            candle_core::bail!(
                "decode_attention: a {} cache must start at a 16-byte boundary, got a view at byte offset {} ({l2:?})",
                codec.map_or("packed", |c| c.name()),
                l2.start_offset()
            )
        }
        let v_addr = k_addr + (bytes / 2) as u64;
        let part_o = unsafe { dev.alloc::<f32>(b * nh * n_split * hd)? };
        let part_ml = unsafe { dev.alloc::<f32>(b * nh * n_split * 2)? };
        let out = unsafe { dev.alloc::<T>(b * nh * hd)? };
        let name = format!(
            "attn_decode_{}_{}{}{}",
            suffix(T::DTYPE)?,
            codec.map_or("dense", |c| c.name()),
            if tc { format!("_h{hd}") } else { String::new() },
            if append { "_append" } else { "" },
        );
        let func = crate::kernels::func(dev, &name, &crate::kernels::modules::DECODE_ATTENTION)?;
        if smem > 48 * 1024 {
            func.set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(candle_core::Error::wrap)?;
        }
        let thr = |kv| codec.map(|c| c.thr(kv)).unwrap_or_default();
        let tables = [&p.cos, &p.sin, &p.pos, &p.pads];
        with_positions(tables, &stream, |[cp, sp, pp, dp]| {
            with_view::<u32, _>(counters, "counters", |cnt| {
                let (qp, _g1) = raw_ptr(&qkv, &stream);
                let ((po, _g8), (pm, _g9)) =
                    (raw_ptr(&part_o, &stream), raw_ptr(&part_ml, &stream));
                let ((np, _g10), (op, _g11)) = (raw_ptr(&cnt, &stream), raw_ptr(&out, &stream));
                let params = AttnParams {
                    qkv: qp,
                    cos: cp,
                    sin: sp,
                    k: k_addr,
                    v: v_addr,
                    pos: pp,
                    pads: dp,
                    part_o: po,
                    part_ml: pm,
                    counters: np,
                    out: op,
                    nh: nh as i32,
                    nkv: nkv as i32,
                    hd: hd as i32,
                    max_len: max_len as i32,
                    n_split: n_split as i32,
                    chunk: chunk as i32,
                    cluster: cluster as i32,
                    rec: rec as i32,
                    hsplit: hsplit as i32,
                    scale: 1f32 / (hd as f32).sqrt(),
                    pad: 0.0,
                    kv_end: k_addr + bytes as u64,
                    thr_k: thr(0),
                    thr_v: thr(1),
                };
                let x = if cluster == 0 {
                    n_split
                } else {
                    n_split.next_multiple_of(cluster)
                };
                let threads = if tc {
                    32 * TC_WARPS as u32
                } else {
                    ATTN_THREADS
                };
                let cfg = grid(x, nkv * hsplit, b, threads, smem as u32);
                unsafe { launch_params(&func, &stream, cfg, cluster as u32, &params) }
            })
        })?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }
    match s1.dtype() {
        DType::F32 => run::<f32>(heads, p, counters, (append, codec), s1, l1, s2, l2),
        DType::F16 => run::<f16>(heads, p, counters, (append, codec), s1, l1, s2, l2),
        DType::BF16 => run::<bf16>(heads, p, counters, (append, codec), s1, l1, s2, l2),
        dt => candle_core::bail!("decode_attention: unsupported dtype {dt:?}"),
    }
}

pub(super) fn advance_pos(s: &mut CudaStorage, l: &Layout, by: u32) -> Result<()> {
    let dev = s.device().clone();
    let stream = dev.cuda_stream();
    let func = crate::kernels::func(&dev, "advance_pos", &crate::kernels::modules::DECODE)?;
    let slice = s.as_cuda_slice_mut::<u32>()?;
    let view = slice.slice_mut(l.start_offset()..l.start_offset() + 1);
    let (vp, _g) = dptr(&view, &stream);
    unsafe { launch_pdl(&func, &stream, grid(1, 1, 1, 32, 0), &[vp, Arg::U32(by)]) }
}
