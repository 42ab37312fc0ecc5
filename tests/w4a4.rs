//! The W4A4 formats (`w4a4`, `fmpq`, `w4a4-rtn`): packing, the activation quantizer on
//! hand-made rows, the reorder, the forward against the dequantized product, errors on bad
//! shapes, and (cuda feature, on the H200: `.device/run w4a4`) the kernels against the CPU
//! references — the GEMM bit for bit in its integer part.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_lowbit::formats::w4a4::{
    blocks, pack_w4, pack_w8, quantize_activations, unpack_w4, unpack_w8, ActSpec, QuantAct,
    W4a4Weights, BLOCK,
};
use candle_lowbit::formats::{LinearWeights, QuantOptions};
use candle_lowbit::ops::{w4a4_quantize, ActSource};
use candle_lowbit::WeightFormat;
use common::{assert_close, randn};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::sync::Arc;

fn codes(seed: u64, len: usize, lo: i32, hi: i32) -> Vec<i8> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..len).map(|_| rng.gen_range(lo..=hi) as i8).collect()
}

fn spec(k: usize, kn: usize, perm: Option<Vec<u32>>, dev: &Device) -> Result<ActSpec> {
    Ok(ActSpec {
        k,
        kn,
        perm: perm.map(|p| Tensor::from_vec(p, k, dev)).transpose()?,
        per_token: false,
        clip4: 0.9,
        clip8: 1.0,
    })
}

fn shuffled(k: usize, seed: u64) -> Vec<u32> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut p: Vec<u32> = (0..k as u32).collect();
    for i in (1..k).rev() {
        p.swap(i, rng.gen_range(0..=i));
    }
    p
}

/// Activations `[rows, k]` with a few channels 30x larger (the outliers calibration finds).
fn outlier_inputs(seed: u64, rows: usize, k: usize, dev: &Device) -> Result<(Tensor, Vec<usize>)> {
    let x = randn(seed, &[rows, k], 1.0, DType::F32, dev)?;
    let hot: Vec<usize> = (0..k).filter(|c| c % 37 == 5).collect();
    let mut gain = vec![1f32; k];
    for &c in &hot {
        gain[c] = 30.0;
    }
    let g = Tensor::from_vec(gain, (1, k), dev)?;
    Ok((x.broadcast_mul(&g)?, hot))
}

fn hessian(x: &Tensor) -> Result<Tensor> {
    let rows = x.dim(0)? as f64;
    Ok((x.t()?.matmul(x)? / rows)?)
}

fn quantize(f: WeightFormat, w: &Tensor, x: &Tensor) -> Result<Box<dyn LinearWeights>> {
    let h = hessian(x)?;
    let opts = QuantOptions::default();
    Ok(f.spec().codec.quantize(f, w, Some(&h), &opts)?)
}

fn rel_err(y: &Tensor, r: &Tensor) -> Result<f64> {
    let d = (y - r)?.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    let n = r.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
    Ok((d / n).sqrt())
}

const FORMATS: [WeightFormat; 3] = [
    WeightFormat::W4a4,
    WeightFormat::Fmpq,
    WeightFormat::W4a4Rtn,
];

#[test]
fn packing_round_trips_and_rejects_out_of_range_codes() -> Result<()> {
    for (seed, &(n, k)) in [(3usize, 32usize), (5, 160), (2, 576), (7, 1536)]
        .iter()
        .enumerate()
    {
        let q = codes(seed as u64, n * k, -8, 7);
        let p = pack_w4(&q, n, k)?;
        assert_eq!(p.len(), n * k / 2);
        assert_eq!(unpack_w4(&p, n, k), q, "w4 [{n}, {k}]");
        let q8 = codes(seed as u64 + 9, n * k, -128, 127);
        assert_eq!(unpack_w8(&pack_w8(&q8, n, k)?, n, k), q8, "w8 [{n}, {k}]");
    }
    // The fragment order: byte j of thread t's word for chunk 0 holds columns 4t + j (high
    // nibble) and 16 + 4t + j (low nibble).
    let mut q = vec![0i8; 32];
    q[4 + 1] = 3; // t = 1, j = 1, high
    q[16 + 4 + 1] = -2; // t = 1, j = 1, low
    let p = pack_w4(&q, 1, 32)?;
    assert_eq!(p[4 + 1], 0x3E);
    assert_eq!(p.iter().filter(|&&b| b != 0).count(), 1);
    let mut bad = vec![0i8; 64];
    bad[10] = 8;
    let e = pack_w4(&bad, 1, 64).unwrap_err().to_string();
    assert!(e.contains("-8..=7"), "{e}");
    assert!(pack_w4(&[0; 48], 1, 48).is_err());
    Ok(())
}

#[test]
fn activation_quantizer_on_hand_made_rows() -> Result<()> {
    let dev = Device::Cpu;
    // k = 160: block 0 (128, INT4, clip 0.9), block 1 (32, the INT8 tail).
    let sp = spec(160, 128, None, &dev)?;
    let mut row = vec![0f32; 160];
    row[0] = 7.0; // absmax: scale 0.9 · 7 / 7 = 0.9, 7 / 0.9 = 7.8 clamps to 7
    row[1] = -7.0; // -7.8 rounds to -8, inside -8..=7
    row[2] = 0.45; // 0.5 ties to even: 0
    row[3] = 1.35; // 1.5 ties to even: 2
    row[4] = 2.25; // 2.5 ties to even: 2
    row[128] = 127.0; // tail absmax: scale 1, codes exact
    row[129] = -3.0;
    row[130] = 0.5; // ties to even: 0
    let (c, s) = quantize_activations(&row, 1, &sp);
    assert_eq!(s.len(), 2);
    assert_eq!(s[0], (0.9f32 * 7.0) / 7.0);
    assert_eq!(s[1], 1.0);
    assert_eq!(&c[..5], &[7, -8, 0, 2, 2]);
    assert_eq!(&c[128..131], &[127, -3, 0]);
    // A zero block: scale 0, codes 0. Per token: one scale, repeated.
    let zero = vec![0f32; 160];
    let (c, s) = quantize_activations(&zero, 1, &sp);
    assert!(c.iter().all(|&v| v == 0) && s == vec![0.0, 0.0]);
    let pt = ActSpec {
        per_token: true,
        kn: 160,
        clip4: 1.0,
        ..sp.clone()
    };
    let (c, s) = quantize_activations(&row, 1, &pt);
    assert_eq!(s, vec![127.0 / 7.0; 2]);
    assert_eq!(c[0], 0); // 7 / 18.14 = 0.39
    assert_eq!(c[128], 7);
    Ok(())
}

#[test]
fn reorder_round_trips() -> Result<()> {
    let dev = Device::Cpu;
    let (m, k) = (3, 288);
    let perm = shuffled(k, 4);
    let sp = Arc::new(ActSpec {
        clip4: 1.0,
        ..spec(k, 256, Some(perm.clone()), &dev)?
    });
    let x = randn(11, &[m, k], 1.0, DType::F32, &dev)?;
    let (_, a) = w4a4_quantize(ActSource::Plain(&x), &sp)?;
    // Channel j of the codes is input channel perm[j]: dequantized back in input order,
    // each value is within half a step of its block's scale.
    let back = a.dequantize()?;
    let (codes, scales) = a.parts()?;
    let xv = x.flatten_all()?.to_vec1::<f32>()?;
    let bv = back.flatten_all()?.to_vec1::<f32>()?;
    for i in 0..m {
        for j in 0..k {
            let c = perm[j] as usize;
            let s = scales[i * blocks(k) + j / BLOCK];
            assert!((xv[i * k + c] - bv[i * k + c]).abs() <= 0.5 * s + 1e-6);
            assert_eq!(
                f32::from(codes[i * k + j]) * s,
                bv[i * k + c],
                "token {i} channel {j}"
            );
        }
    }
    let mut sorted = perm.clone();
    sorted.sort();
    assert_eq!(sorted, (0..k as u32).collect::<Vec<_>>());
    Ok(())
}

/// The forward equals the product of the dequantized activations and weights (the same
/// numbers, summed in another order), for every format, odd shapes and m.
#[test]
fn forward_matches_the_dequantized_product() -> Result<()> {
    let dev = Device::Cpu;
    for (seed, &(n, k)) in [(40usize, 160usize), (48, 576), (24, 1536)]
        .iter()
        .enumerate()
    {
        let w = randn(
            seed as u64,
            &[n, k],
            1.0 / (k as f32).sqrt(),
            DType::F32,
            &dev,
        )?;
        let (cal, _) = outlier_inputs(seed as u64 + 50, 64, k, &dev)?;
        for f in FORMATS {
            let q = quantize(f, &w, &cal)?;
            let wd = q.dequantize()?;
            for m in [1usize, 5, 70] {
                let (x, _) = outlier_inputs(seed as u64 * 31 + m as u64, m, k, &dev)?;
                let y = q.forward(&x)?;
                let sp = spec_of(q.as_ref());
                let (_, a) = w4a4_quantize(ActSource::Plain(&x), &sp)?;
                let r = a.dequantize()?.matmul(&wd.t()?)?;
                let scale = r.abs()?.max_all()?.to_scalar::<f32>()?;
                assert_close(&y, &r, 1e-5 * scale, 1e-4, &format!("{f} [{n}, {k}] m {m}"))?;
            }
        }
    }
    Ok(())
}

fn spec_of(q: &dyn LinearWeights) -> Arc<ActSpec> {
    match q.input_encoding() {
        candle_lowbit::formats::InputEncoding::W4a4(s) => s,
        e => panic!("a W4A4 layer reads {e:?}"),
    }
}

/// Quantization error on Gaussian weights within each format's bound, and on inputs with
/// outlier channels: Atom's INT8 tail and FMPQ's INT8 blocks hold them (the ranking puts
/// them last) and beat round to nearest.
#[test]
fn outlier_channels_are_ranked_last_and_cut_the_error() -> Result<()> {
    let dev = Device::Cpu;
    let (n, k) = (256, 512);
    let w = randn(1, &[n, k], 1.0 / (k as f32).sqrt(), DType::F32, &dev)?;
    let (cal, hot) = outlier_inputs(2, 256, k, &dev)?;
    let (x, _) = outlier_inputs(3, 32, k, &dev)?;
    let exact = x.matmul(&w.t()?)?;
    let mut errs = vec![];
    for f in FORMATS {
        let q = quantize(f, &w, &cal)?;
        let e = rel_err(&q.forward(&x)?, &exact)?;
        assert!(e < f.spec().error_bound, "{f}: error {e}");
        let sp = spec_of(q.as_ref());
        if f != WeightFormat::W4a4Rtn {
            let perm = sp.perm_vec()?;
            let tail: Vec<usize> = perm[sp.kn..].iter().map(|&c| c as usize).collect();
            assert!(hot.iter().all(|c| tail.contains(c)), "{f}: tail {tail:?}");
            assert!(
                sp.kn < k && sp.kn.is_multiple_of(BLOCK),
                "{f}: kn {}",
                sp.kn
            );
        } else {
            assert!(sp.perm.is_none() && sp.kn == k && sp.per_token);
        }
        errs.push(e);
    }
    assert!(
        errs[0] < 0.5 * errs[2],
        "w4a4 {} vs rtn {}",
        errs[0],
        errs[2]
    );
    assert!(
        errs[1] < 0.5 * errs[2],
        "fmpq {} vs rtn {}",
        errs[1],
        errs[2]
    );
    // Atom's weights by clipped round to nearest instead of GPTQ: same ranking, in bound.
    let mut opts = QuantOptions::default();
    opts.w4a4.gptq = false;
    let f = WeightFormat::W4a4;
    let q = f
        .spec()
        .codec
        .quantize(f, &w, Some(&hessian(&cal)?), &opts)?;
    let e = rel_err(&q.forward(&x)?, &exact)?;
    assert!(
        e < f.spec().error_bound && e < 0.5 * errs[2],
        "w4a4 rtn-clip: error {e}"
    );
    Ok(())
}

#[test]
fn atom_outlier_count_rounds_to_whole_blocks() -> Result<()> {
    let dev = Device::Cpu;
    for (k, want_kn, want_w8) in [
        (576usize, 512usize, 64usize),
        (1536, 1408, 128),
        (512, 384, 128),
    ] {
        let w = randn(k as u64, &[16, k], 0.1, DType::F32, &dev)?;
        let (cal, _) = outlier_inputs(7, 64, k, &dev)?;
        let q = quantize(WeightFormat::W4a4, &w, &cal)?;
        assert_eq!(spec_of(q.as_ref()).kn, want_kn, "k {k}");
        let t = q.tensors()?;
        let w8 = t
            .iter()
            .find(|(n, _)| n == "w8")
            .map(|(_, t)| t.dims().to_vec());
        assert_eq!(w8, Some(vec![16, want_w8]), "k {k}");
        // Bits: 4-bit codes, 8-bit tail, f16 scales per block, the permutation.
        let bits = q.bytes() as f64 * 8.0 / (16 * k) as f64;
        let want = (4.0 * (k - want_w8) as f64 + 8.0 * want_w8 as f64) / k as f64
            + 16.0 * blocks(k) as f64 / k as f64
            + 32.0 / 16.0
            + 128.0 / (16 * k) as f64;
        assert!((bits - want).abs() < 1e-9, "k {k}: {bits} vs {want}");
    }
    Ok(())
}

/// The fused sources equal the unfused composition: the residual sum exactly, the codes
/// within one step where the norm's rounding differs.
#[test]
fn fused_sources_match_the_composition() -> Result<()> {
    let dev = Device::Cpu;
    let (m, k) = (4, 576);
    let sp = Arc::new(spec(k, 512, Some(shuffled(k, 9)), &dev)?);
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let x = randn(1, &[2, m / 2, k], 1.0, dt, &dev)?;
        let res = randn(2, &[2, m / 2, k], 1.0, dt, &dev)?;
        let g = randn(3, &[k], 0.3, DType::F32, &dev)?
            .affine(1.0, 1.0)?
            .to_dtype(dt)?;
        let (sum, a) = w4a4_quantize(
            ActSource::AddRmsNorm {
                x: &x,
                res: &res,
                w: &g,
                eps: 1e-5,
            },
            &sp,
        )?;
        let (want_sum, normed) = candle_lowbit::ops::add_rms_norm(&x, &res, &g, 1e-5)?;
        let sum = sum.expect("add mode returns the sum");
        assert_eq!(sum.dims(), x.dims());
        assert_close(&sum, &want_sum, 0.0, 0.0, &format!("{dt:?} sum"))?;
        let (_, want) = w4a4_quantize(ActSource::Plain(&normed), &sp)?;
        close_codes(&a, &want, &format!("{dt:?} add + rmsnorm"))?;
        let (_, a) = w4a4_quantize(
            ActSource::RmsNorm {
                x: &x,
                w: &g,
                eps: 1e-5,
            },
            &sp,
        )?;
        let n2 = candle_nn::ops::rms_norm(&x, &g, 1e-5)?;
        let (_, want) = w4a4_quantize(ActSource::Plain(&n2), &sp)?;
        close_codes(&a, &want, &format!("{dt:?} rmsnorm"))?;
        let gu = randn(4, &[m, 2 * k], 2.0, dt, &dev)?;
        let (_, a) = w4a4_quantize(ActSource::SiluMul(&gu), &sp)?;
        let h = candle_lowbit::ops::silu_mul(&gu)?;
        let (_, want) = w4a4_quantize(ActSource::Plain(&h), &sp)?;
        close_codes(&a, &want, &format!("{dt:?} silu·mul"))?;
        assert_eq!(a.dims, vec![m, k]);
    }
    Ok(())
}

/// Codes equal up to one step on at most 5 % of the values (bf16 rounds coarsely, so a
/// norm computed in another order moves values across rounding edges); scales within 1 %
/// (one bf16 step of the absmax).
fn close_codes(a: &QuantAct, b: &QuantAct, what: &str) -> Result<()> {
    let ((ca, sa), (cb, sb)) = (a.parts()?, b.parts()?);
    let off = ca.iter().zip(&cb).filter(|(x, y)| x != y).count();
    let far = ca
        .iter()
        .zip(&cb)
        .any(|(x, y)| (i32::from(*x) - i32::from(*y)).abs() > 1);
    anyhow::ensure!(!far && off * 20 <= ca.len(), "{what}: {off} codes differ");
    for (x, y) in sa.iter().zip(&sb) {
        anyhow::ensure!(
            (x - y).abs() <= 1e-2 * y.abs().max(1e-6),
            "{what}: scale {x} vs {y}"
        );
    }
    Ok(())
}

#[test]
fn bad_inputs_are_rejected_clearly() -> Result<()> {
    let dev = Device::Cpu;
    let w = randn(1, &[8, 100], 0.1, DType::F32, &dev)?;
    let e = WeightFormat::W4a4Rtn
        .spec()
        .codec
        .quantize(WeightFormat::W4a4Rtn, &w, None, &QuantOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("multiple of 32"), "{e}");
    let w = randn(1, &[8, 128], 0.1, DType::F32, &dev)?;
    let e = WeightFormat::W4a4
        .spec()
        .codec
        .quantize(WeightFormat::W4a4, &w, None, &QuantOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("calibration"), "{e}");
    let q = WeightFormat::W4a4Rtn.spec().codec.quantize(
        WeightFormat::W4a4Rtn,
        &w,
        None,
        &QuantOptions::default(),
    )?;
    let e = q
        .forward(&randn(2, &[3, 96], 1.0, DType::F32, &dev)?)
        .unwrap_err()
        .to_string();
    assert!(e.contains("in_dim 128"), "{e}");
    let other = Arc::new(spec(128, 0, None, &dev)?);
    let x = randn(2, &[3, 128], 1.0, DType::F32, &dev)?;
    let (_, a) = w4a4_quantize(ActSource::Plain(&x), &other)?;
    let e = q.forward_quantized(&a, DType::F32).unwrap_err().to_string();
    assert!(e.contains("INT8 from 0"), "{e}");
    let g = Tensor::ones(64, DType::F32, &dev)?;
    let e = w4a4_quantize(
        ActSource::RmsNorm {
            x: &x,
            w: &g,
            eps: 1e-5,
        },
        &other,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("norm weight"), "{e}");
    let e = W4a4Weights::new(
        WeightFormat::W4a4Rtn,
        (8, 128),
        spec(128, 128, None, &dev)?,
        Tensor::zeros((8, 32), DType::U8, &dev)?,
        None,
        Tensor::zeros((8, 1), DType::F16, &dev)?,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("'w4'") && e.contains("[8, 64]"), "{e}");
    Ok(())
}

/// A whole model in each format: finite logits, near the dense model's.
#[test]
fn a_model_runs_in_every_w4a4_format() -> Result<()> {
    let dev = Device::Cpu;
    let cfg = common::tiny_config(2);
    let vb = candle_nn::VarBuilder::from_tensors(
        common::random_weights(&cfg, 5, &dev)?,
        DType::F32,
        &dev,
    );
    let dense = candle_lowbit::Llama::load(vb, &cfg)?;
    let ids = Tensor::new(&[[1u32, 7, 3, 9, 4, 2, 8, 5]], &dev)?;
    let windows: Vec<Vec<u32>> = (0..4)
        .map(|i| (0..16).map(|j| ((i * 7 + j * 3) % 101) as u32).collect())
        .collect();
    let want = logits(&dense, &cfg, &ids)?;
    for f in FORMATS {
        let mut m = dense.clone();
        candle_lowbit::calib::quantize_model(
            &mut m,
            &cfg,
            f,
            &QuantOptions::default(),
            (&windows, &candle_lowbit::calib::CalibConfig::default()),
            DType::F32,
            &mut candle_lowbit::calib::Quiet,
        )?;
        let got = logits(&m, &cfg, &ids)?;
        let e = rel_err(&got, &want)?;
        assert!(e.is_finite() && e < 0.5, "{f}: logits off by {e}");
    }
    Ok(())
}

fn logits(m: &candle_lowbit::Llama, cfg: &candle_lowbit::Config, ids: &Tensor) -> Result<Tensor> {
    let mut cache = candle_lowbit::Cache::with_capacity(
        16,
        candle_lowbit::kv::KvFormat::Dense,
        DType::F32,
        cfg,
        ids.device(),
    )?;
    Ok(m.forward_all(ids, 0, &mut cache)?)
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use candle_lowbit::ops::{w4a4_matmul, w4a4_matmul_with, W4a4Kernel};

    fn gpu() -> Result<Device> {
        Ok(Device::new_cuda(0)?)
    }

    /// The quantizer kernel: codes and scales bit for bit with the CPU for plain inputs;
    /// within a step for the fused sources (their norms round in another order).
    #[test]
    fn quantizer_kernel_matches_cpu() -> Result<()> {
        let (cpu, dev) = (Device::Cpu, gpu()?);
        for (seed, &(m, k, kn, per_token)) in [
            (1usize, 160usize, 128usize, false),
            (3, 576, 512, false),
            (70, 1536, 1408, false),
            (5, 576, 576, true),
        ]
        .iter()
        .enumerate()
        {
            for perm in [None, Some(shuffled(k, seed as u64))] {
                let mk = |d: &Device| -> Result<Arc<ActSpec>> {
                    Ok(Arc::new(ActSpec {
                        per_token,
                        ..spec(k, kn, perm.clone(), d)?
                    }))
                };
                let (sc, sg) = (mk(&cpu)?, mk(&dev)?);
                for dt in [DType::F32, DType::F16, DType::BF16] {
                    let what = format!("m {m} k {k} perm {} {dt:?}", perm.is_some());
                    let (x, _) = outlier_inputs(seed as u64, m, k, &cpu)?;
                    let x = x.to_dtype(dt)?;
                    let (_, a) = w4a4_quantize(ActSource::Plain(&x), &sc)?;
                    let (_, b) = w4a4_quantize(ActSource::Plain(&x.to_device(&dev)?), &sg)?;
                    assert_eq!(a.parts()?, b.parts()?, "{what}: plain");
                    let res = randn(9, &[m, k], 1.0, dt, &cpu)?;
                    let g = randn(8, &[k], 0.3, DType::F32, &cpu)?
                        .affine(1.0, 1.0)?
                        .to_dtype(dt)?;
                    let src = |x: &Tensor, r: &Tensor, g: &Tensor| -> Result<(Tensor, QuantAct)> {
                        let (s, a) = w4a4_quantize(
                            ActSource::AddRmsNorm {
                                x,
                                res: r,
                                w: g,
                                eps: 1e-5,
                            },
                            if x.device().is_cuda() { &sg } else { &sc },
                        )?;
                        Ok((s.expect("sum"), a))
                    };
                    let (s1, a1) = src(&x, &res, &g)?;
                    let (s2, a2) = src(
                        &x.to_device(&dev)?,
                        &res.to_device(&dev)?,
                        &g.to_device(&dev)?,
                    )?;
                    assert_close(&s2.to_device(&cpu)?, &s1, 0.0, 0.0, &format!("{what}: sum"))?;
                    close_codes(&a2, &a1, &format!("{what}: add + rmsnorm"))?;
                    let gu = randn(4, &[m, 2 * k], 2.0, dt, &cpu)?;
                    let (_, a1) = w4a4_quantize(ActSource::SiluMul(&gu), &sc)?;
                    let (_, a2) = w4a4_quantize(ActSource::SiluMul(&gu.to_device(&dev)?), &sg)?;
                    close_codes(&a2, &a1, &format!("{what}: silu·mul"))?;
                }
            }
        }
        Ok(())
    }

    const KERNELS: [W4a4Kernel; 5] = [
        W4a4Kernel::Skinny,
        W4a4Kernel::Mma,
        W4a4Kernel::Wgmma { ctas_per_sm: 1 },
        W4a4Kernel::Wgmma { ctas_per_sm: 2 },
        W4a4Kernel::Tma,
    ];

    /// Every GEMM kernel this build has (skinny, mma.sync tiles, wgmma, warp-specialized TMA) with unit scales: the output is the integer sum itself,
    /// which must equal the CPU's exactly; every m up to 16 and larger ones, 4-bit only and
    /// with an 8-bit tail, odd shapes.
    #[test]
    fn gemm_integer_part_is_bit_exact() -> Result<()> {
        let (cpu, dev) = (Device::Cpu, gpu()?);
        let ms: Vec<usize> = (1..=17).chain([31, 33, 64, 65, 130, 257]).collect();
        for (seed, &(n, k, kn, tail8)) in [
            (8usize, 32usize, 32usize, false),
            (40, 160, 128, true),
            (136, 576, 512, true),
            (264, 1536, 1408, false),
            (130, 4096, 3968, true),
        ]
        .iter()
        .enumerate()
        {
            let s = spec(k, kn, None, &cpu)?;
            let mut wq = codes(seed as u64, n * k, -8, 7);
            if tail8 {
                let t8 = codes(seed as u64 + 1, n * k, -128, 127);
                for r in 0..n {
                    wq[r * k + kn..(r + 1) * k].copy_from_slice(&t8[r * k + kn..(r + 1) * k]);
                }
            }
            let ones = vec![1f32; n * blocks(k)];
            let wc =
                W4a4Weights::from_codes(WeightFormat::W4a4, s.clone(), &wq, &ones, tail8, &cpu)?;
            let sg = spec(k, kn, None, &dev)?;
            let wg =
                W4a4Weights::from_codes(WeightFormat::W4a4, sg.clone(), &wq, &ones, tail8, &dev)?;
            for &m in &ms {
                let aq = codes(seed as u64 * 100 + m as u64, m * k, -128, 127);
                let aq: Vec<u8> = aq
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| {
                        if i % k < kn {
                            c.clamp(-8, 7) as u8
                        } else {
                            c as u8
                        }
                    })
                    .collect();
                let at = Tensor::from_vec(aq, (m, k), &cpu)?;
                let sa = Tensor::ones((m, blocks(k)), DType::F32, &cpu)?;
                let a = QuantAct::from_parts(&at, &sa, Arc::new(s.clone()), DType::F32)?;
                let b = QuantAct::from_parts(
                    &at.to_device(&dev)?,
                    &sa.to_device(&dev)?,
                    Arc::new(sg.clone()),
                    DType::F32,
                )?;
                let want = w4a4_matmul(&a, &wc, DType::F32)?;
                for kernel in KERNELS.iter().filter(|kr| kr.available(m)) {
                    let got = w4a4_matmul_with(&b, &wg, DType::F32, *kernel)?.to_device(&cpu)?;
                    assert_close(
                        &got,
                        &want,
                        0.0,
                        0.0,
                        &format!("[{n}, {k}] tail8 {tail8} m {m} {kernel:?}"),
                    )?;
                }
            }
        }
        Ok(())
    }

    /// Quantized layers on the GPU against the CPU on the same packed weights, each format,
    /// output dtypes f32 / f16 / bf16.
    #[test]
    fn forward_matches_cpu() -> Result<()> {
        let (cpu, dev) = (Device::Cpu, gpu()?);
        for (seed, &(n, k)) in [(72usize, 576usize), (200, 1536)].iter().enumerate() {
            let w = randn(
                seed as u64,
                &[n, k],
                1.0 / (k as f32).sqrt(),
                DType::F32,
                &cpu,
            )?;
            let (cal, _) = outlier_inputs(seed as u64 + 1, 128, k, &cpu)?;
            for f in FORMATS {
                let q = quantize(f, &w, &cal)?;
                let mut by_name = std::collections::HashMap::new();
                for (name, t) in q.tensors()? {
                    by_name.insert(name, t.to_device(&dev)?);
                }
                let qg = f.spec().codec.rebuild(f, (n, k), &by_name)?;
                for m in [1usize, 7, 16, 40, 100, 300] {
                    for dt in [DType::F32, DType::F16, DType::BF16] {
                        let (x, _) = outlier_inputs(seed as u64 * 7 + m as u64, m, k, &cpu)?;
                        let x = x.to_dtype(dt)?;
                        let want = q.forward(&x)?.to_dtype(DType::F32)?;
                        let got = qg
                            .forward(&x.to_device(&dev)?)?
                            .to_device(&cpu)?
                            .to_dtype(DType::F32)?;
                        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
                        // The codes are the CPU's (the quantizer is bit-exact); what differs
                        // is the order of the f32 sums, and the output rounding.
                        let tol: f64 = if dt == DType::F32 { 1e-5 } else { 1e-2 };
                        let e = rel_err(&got, &want)?;
                        assert!(e < tol, "{f} [{n}, {k}] m {m} {dt:?}: rel {e}");
                        assert_close(&got, &want, 0.05 * scale, 0.0, &format!("{f} m {m} {dt:?}"))?;
                    }
                }
            }
        }
        Ok(())
    }
}
