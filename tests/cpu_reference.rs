//! CPU tests of the ops, dense `QLinear` and `KvCache` against plain references (the
//! weight formats: `tests/formats.rs`).

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Module, Tensor};
use candle_lowbit::kv::causal_mask;
use candle_lowbit::ops::{
    add_rms_norm, advance_pos, embed_gather, gemv, gemv_silu_mul, silu_mul, Heads, StepPositions,
};
use candle_lowbit::{KvCache, KvFormat, QLinear};
use common::{assert_close, randn};

const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (1, 576),
    (2, 33),
    (3, 64),
    (7, 1000),
    (17, 576),
    (300, 129),
];

/// The fused op against the unfused candle ops it replaces.
#[test]
fn add_rms_norm_matches_unfused() -> Result<()> {
    let dev = Device::Cpu;
    for (dtype, tol) in [
        (DType::F32, 1e-5f32),
        (DType::F16, 2e-3),
        (DType::BF16, 1.6e-2),
    ] {
        for (seed, &(rows, h)) in SHAPES.iter().enumerate() {
            let x = randn(seed as u64, &[rows, h], 1.0, dtype, &dev)?;
            let res = randn(100 + seed as u64, &[rows, h], 3.0, dtype, &dev)?;
            let w = randn(200 + seed as u64, &[h], 0.2, dtype, &dev)?.affine(1.0, 1.0)?;
            let (sum, norm) = add_rms_norm(&x, &res, &w, 1e-5)?;
            let want_sum = (&x + &res)?;
            let want_norm = candle_nn::ops::rms_norm(&want_sum, &w, 1e-5)?;
            assert_close(
                &sum,
                &want_sum,
                0.0,
                0.0,
                &format!("sum {dtype:?} {rows}x{h}"),
            )?;
            assert_close(
                &norm,
                &want_norm,
                tol,
                tol,
                &format!("norm {dtype:?} {rows}x{h}"),
            )?;
        }
    }
    Ok(())
}

#[test]
fn add_rms_norm_rejects_bad_input() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 8), DType::F32, &dev)?;
    let w = Tensor::ones(8, DType::F32, &dev)?;
    let err = add_rms_norm(&x, &Tensor::zeros((2, 9), DType::F32, &dev)?, &w, 1e-5).unwrap_err();
    assert!(err.to_string().contains("differ in shape"), "{err}");
    let err = add_rms_norm(&x, &x.to_dtype(DType::F16)?, &w, 1e-5).unwrap_err();
    assert!(err.to_string().contains("dtypes differ"), "{err}");
    let err = add_rms_norm(&x, &x, &Tensor::ones(7, DType::F32, &dev)?, 1e-5).unwrap_err();
    assert!(err.to_string().contains("must be [8]"), "{err}");
    Ok(())
}

#[test]
fn qlinear_dense_matches_candle_linear() -> Result<()> {
    let dev = Device::Cpu;
    let w = randn(1, &[37, 65], 0.3, DType::F32, &dev)?;
    let b = randn(2, &[37], 0.3, DType::F32, &dev)?;
    let lin = candle_nn::Linear::new(w.clone(), Some(b));
    let q = QLinear::from_linear(&lin)?;
    for shape in [vec![3, 65], vec![2, 5, 65], vec![1, 2, 3, 65]] {
        let x = randn(3, &shape, 1.0, DType::F32, &dev)?;
        assert_close(
            &q.forward(&x)?,
            &lin.forward(&x)?,
            1e-5,
            1e-5,
            "dense forward",
        )?;
    }
    let err = q
        .forward(&randn(4, &[3, 64], 1.0, DType::F32, &dev)?)
        .unwrap_err();
    assert!(err.to_string().contains("in_dim 65"), "{err}");
    Ok(())
}

#[test]
fn causal_mask_with_left_padding() -> Result<()> {
    let m = causal_mask(&[0, 2], 0, 4, &Device::Cpu)?;
    assert_eq!(m.dims(), &[2, 1, 4, 4]);
    let v = m.flatten_all()?.to_vec1::<f32>()?;
    let ok = |x: f32| x == 0.0;
    // Sequence 0: plain causal.
    for i in 0..4 {
        for j in 0..4 {
            assert_eq!(ok(v[i * 4 + j]), j <= i, "seq 0 q{i} k{j}");
        }
    }
    // Sequence 1: keys 0 and 1 are padding; padding queries see only themselves.
    for i in 0..4 {
        for j in 0..4 {
            let want = j == i || (j <= i && j >= 2);
            assert_eq!(ok(v[16 + i * 4 + j]), want, "seq 1 q{i} k{j}");
        }
    }
    Ok(())
}

/// Naive attention with repeated KV heads, for reference.
fn naive_attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
    let (_, n_h, _, hd) = q.dims4()?;
    let g = n_h / k.dim(1)?;
    let rep = |t: &Tensor| -> Result<Tensor> {
        let (b, n, l, d) = t.dims4()?;
        Ok(t.unsqueeze(2)?
            .expand((b, n, g, l, d))?
            .reshape((b, n * g, l, d))?)
    };
    let att = (q.matmul(&rep(k)?.t()?)? / (hd as f64).sqrt())?;
    let att = match mask {
        Some(m) => att.broadcast_add(m)?,
        None => att,
    };
    Ok(candle_nn::ops::softmax_last_dim(&att)?.matmul(&rep(v)?)?)
}

const HEADS: Heads = Heads {
    nh: 6,
    nkv: 2,
    hd: 16,
};

fn positions(pads: &[u32], pos: u32, max_pos: usize) -> Result<StepPositions> {
    let dev = Device::Cpu;
    let half = HEADS.hd / 2;
    let freqs: Vec<f32> = (0..half)
        .map(|i| 1f32 / 10_000f32.powf(2.0 * i as f32 / HEADS.hd as f32))
        .collect();
    let t = Tensor::arange(0u32, max_pos as u32, &dev)?
        .to_dtype(DType::F32)?
        .reshape((max_pos, 1))?;
    let theta = t.matmul(&Tensor::new(freqs.as_slice(), &dev)?.reshape((1, half))?)?;
    Ok(StepPositions {
        cos: theta.cos()?,
        sin: theta.sin()?,
        pos: Tensor::new(&[pos], &dev)?,
        pads: Tensor::new(pads, &dev)?,
    })
}

/// `[b, seq, (nh + 2 nkv) hd]` -> rotated q `[b, nh, seq, hd]`, rotated k and v `[b, nkv, seq, hd]`,
/// with candle's own ops (the unfused reference).
fn split_rotate(qkv: &Tensor, p: &StepPositions, pos: usize) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, seq, _) = qkv.dims3()?;
    let Heads { nh, nkv, hd } = HEADS;
    let part = |start: usize, n: usize| -> Result<Tensor> {
        Ok(qkv
            .narrow(2, start * hd, n * hd)?
            .reshape((b, seq, n, hd))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    let (cos, sin) = (p.cos.narrow(0, pos, seq)?, p.sin.narrow(0, pos, seq)?);
    let q = candle_nn::rotary_emb::rope(&part(0, nh)?, &cos, &sin)?;
    let k = candle_nn::rotary_emb::rope(&part(nh, nkv)?, &cos, &sin)?;
    Ok((q, k, part(nh + nkv, nkv)?))
}

/// Fused append + generic attention (prefill) and fused decode attention, against naive
/// attention over candle-rotated queries and keys.
#[test]
fn kv_cache_append_and_attend() -> Result<()> {
    let dev = Device::Cpu;
    let b = 2;
    let mut cache = KvCache::of_format(KvFormat::Dense, HEADS, 40, DType::F32, &dev)?;
    let qkv0 = randn(1, &[b, 5, HEADS.qkv_width()], 1.0, DType::F32, &dev)?;
    cache.append(&qkv0, 0, &positions(&[0, 0], 0, 40)?)?;
    let (q0, k0, v0) = split_rotate(&qkv0, &positions(&[0, 0], 0, 40)?, 0)?;
    let mask = causal_mask(&[0, 0], 0, 5, &dev)?;
    let want = naive_attention(&q0, &k0, &v0, Some(&mask))?;
    assert_close(
        &cache.attend(&q0, 5, Some(&mask))?,
        &want,
        1e-5,
        1e-5,
        "prefill attention",
    )?;
    // Three decode steps at positions 5, 6, 7 through the fused decode attention.
    let (mut ks, mut vs) = (vec![k0], vec![v0]);
    for step in 0..3usize {
        let pos = 5 + step;
        let p = positions(&[0, 0], pos as u32, 40)?;
        let qkv = randn(
            10 + step as u64,
            &[b, 1, HEADS.qkv_width()],
            1.0,
            DType::F32,
            &dev,
        )?;
        let (q, k, v) = split_rotate(&qkv, &p, pos)?;
        ks.push(k);
        vs.push(v);
        let want = naive_attention(&q, &Tensor::cat(&ks, 2)?, &Tensor::cat(&vs, 2)?, None)?;
        let want = want.transpose(1, 2)?.reshape((b, 1, HEADS.nh * HEADS.hd))?;
        // Step 0 appends and attends in two calls, the later ones in one.
        let got = if step == 0 {
            cache.append(&qkv, pos, &p)?;
            cache.attend_decode(&qkv, &p)?
        } else {
            cache.append_attend_decode(&qkv, pos, &p)?
        }
        .expect("the dense cache has a fused decode step for these heads");
        assert_close(&got, &want, 1e-5, 1e-5, &format!("decode step {step}"))?;
    }
    let err = cache
        .append(&qkv0, 38, &positions(&[0, 0], 38, 40)?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("capacity of 40"), "{err}");
    Ok(())
}

/// The fused ops' CPU references against candle's unfused ops.
#[test]
fn decode_ops_match_candle() -> Result<()> {
    let dev = Device::Cpu;
    let gu = randn(3, &[3, 2, 2 * 37], 2.0, DType::F32, &dev)?;
    let (g, u) = (gu.narrow(2, 0, 37)?, gu.narrow(2, 37, 37)?);
    assert_close(
        &silu_mul(&gu)?,
        &(candle_nn::ops::silu(&g)? * u)?,
        1e-6,
        1e-6,
        "silu_mul",
    )?;
    let table = randn(4, &[11, 9], 1.0, DType::F16, &dev)?;
    let ids = Tensor::new(&[3u32, 0, 10, 3], &dev)?;
    assert_close(
        &embed_gather(&table, &ids)?,
        &table.index_select(&ids, 0)?,
        0.0,
        0.0,
        "embed_gather",
    )?;
    let err = embed_gather(&table, &Tensor::new(&[11u32], &dev)?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("out of range"), "{err}");
    let pos = Tensor::new(&[7u32], &dev)?;
    advance_pos(&pos, 3)?;
    assert_eq!(pos.to_vec1::<u32>()?, vec![10]);
    Ok(())
}

/// The skinny matmul's CPU reference against candle's matmul, and the fused gate/up +
/// SiLU·mul against the pair it replaces (exactly: same sums, same roundings).
#[test]
fn gemv_references() -> Result<()> {
    let dev = Device::Cpu;
    for (dtype, tol) in [
        (DType::F32, 1e-5f32),
        (DType::F16, 2e-3),
        (DType::BF16, 1.6e-2),
    ] {
        for (si, &(m, n, k)) in [(1usize, 37usize, 64usize), (3, 10, 576), (8, 6, 8)]
            .iter()
            .enumerate()
        {
            let x = randn(80 + si as u64, &[m, k], 1.0, dtype, &dev)?;
            let w = randn(
                90 + si as u64,
                &[2 * n, k],
                1.0 / (k as f32).sqrt(),
                dtype,
                &dev,
            )?;
            let y = gemv(&x, &w, dtype)?;
            let mm = x
                .to_dtype(DType::F32)?
                .matmul(&w.to_dtype(DType::F32)?.t()?)?;
            assert_close(
                &y.to_dtype(DType::F32)?,
                &mm,
                tol,
                tol,
                &format!("gemv {dtype:?} m{m} n{} k{k}", 2 * n),
            )?;
            let fused = gemv_silu_mul(&x, &w)?;
            assert_close(
                &fused,
                &silu_mul(&y)?,
                0.0,
                0.0,
                &format!("gemv_silu_mul {dtype:?} m{m} n{n} k{k}"),
            )?;
        }
    }
    let x = randn(1, &[1, 64], 1.0, DType::F32, &dev)?;
    let err = gemv_silu_mul(&x, &randn(2, &[7, 64], 1.0, DType::F32, &dev)?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("even"), "{err}");
    let op = candle_lowbit::ops::Gemv {
        out: DType::F32,
        silu_mul: true,
    };
    let xh = x.to_dtype(DType::F16)?;
    let err = xh
        .apply_op2_no_bwd(&randn(3, &[8, 64], 1.0, DType::F16, &dev)?, &op)
        .unwrap_err()
        .to_string();
    assert!(err.contains("must be the input's"), "{err}");
    Ok(())
}
