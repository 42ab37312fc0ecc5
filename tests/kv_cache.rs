//! The quantized KV caches on the CPU: the `kv4` and `oaken` row codecs on hand-made
//! vectors (values exactly at the thresholds, all-outlier and no-outlier rows, a segment
//! that overflows its sparse entries), their error bounds on random rows, the cache's
//! prefill and decode paths against attention over the same dequantized values, and
//! Oaken's calibration through a model.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_lowbit::kv::oaken::{self, Group, Thresholds};
use candle_lowbit::kv::{kv4, KvCodec, KvFormat, KvSpec, OakenFractions, OakenLayer, PackedKv};
use candle_lowbit::ops::{Heads, StepPositions};
use candle_lowbit::{Cache, KvCache, Llama};
use rand::{Rng, SeedableRng};
use std::sync::Arc;

fn thr() -> Thresholds {
    Thresholds::new([-2.0, -0.1, 0.125, 2.5]).unwrap()
}

/// The K record of `x` and its decoded values; the V record (other slot order, same
/// entries and header) must decode to the same values.
fn oaken_roundtrip(x: &[f32], t: &Thresholds) -> (Vec<u8>, Vec<f32>) {
    let hd = x.len();
    let (mut recs, mut outs) = (vec![], vec![]);
    for kv in [0, 1] {
        let mut rec = vec![0u8; oaken::rec_bytes(hd)];
        oaken::quantize_row(kv, x, &mut rec, &t.params());
        let mut out = vec![0f32; hd];
        oaken::dequantize_row(kv, &rec, &mut out, &t.params());
        recs.push(rec);
        outs.push(out);
    }
    assert_eq!(
        outs[0], outs[1],
        "oaken: K and V slot orders decode differently"
    );
    assert_eq!(
        recs[0][hd / 2..],
        recs[1][hd / 2..],
        "oaken: K and V entries differ"
    );
    (recs.swap_remove(0), outs.swap_remove(0))
}

fn counts(rec: &[u8], hd: usize) -> Vec<u8> {
    let meta = hd / 2 + 8 * oaken::segments(hd);
    (0..oaken::segments(hd))
        .map(|s| rec[meta + 6] >> (4 * s) & 15)
        .collect()
}

/// `(mid_step, outer_scale)` of a record, and the values that have a sparse entry.
fn record_params(rec: &[u8], hd: usize) -> (f32, f32, Vec<bool>) {
    let meta = hd / 2 + 8 * oaken::segments(hd);
    let f = |o: usize| half::f16::from_bits(u16::from_le_bytes([rec[o], rec[o + 1]])).to_f32();
    let mut sparse = vec![false; hd];
    for (seg, &n) in counts(rec, hd).iter().enumerate() {
        for k in 0..n as usize {
            let e = rec[hd / 2 + seg * 8 + k];
            sparse[seg * hd.min(64) + (e & 63) as usize] = true;
        }
    }
    (f(meta), f(meta + 4), sparse)
}

#[test]
fn oaken_groups_by_comparisons_with_thresholds_inclusive_for_outer_only() {
    let t = thr();
    assert_eq!(oaken::group(2.5, &t), Group::Outer);
    assert_eq!(oaken::group(-2.0, &t), Group::Outer);
    assert_eq!(oaken::group(2.4999, &t), Group::Middle);
    assert_eq!(oaken::group(0.125, &t), Group::Middle);
    assert_eq!(oaken::group(-0.1, &t), Group::Middle);
    assert_eq!(oaken::group(0.0, &t), Group::Inner);
    assert_eq!(oaken::group(0.12, &t), Group::Inner);
    assert!(Thresholds::new([0.0, 0.0, 1.0, 2.0]).is_err());
    assert!(Thresholds::new([0.0, 0.5, 1.0, f32::NAN]).is_err());
}

#[test]
fn oaken_encodes_thresholds_outliers_and_empty_rows() {
    let t = thr();
    let hd = 64;
    // Values exactly at every threshold, and one outer value far out on each side.
    let mut x = vec![0.5f32; hd];
    x[..6].copy_from_slice(&[2.5, -2.0, 0.125, -0.1, 9.0, -7.0]);
    let (rec, y) = oaken_roundtrip(&x, &t);
    assert_eq!(counts(&rec, hd), vec![4], "four outer values, no inner");
    for d in [0, 1, 4, 5] {
        assert!(
            (y[d] - x[d]).abs() <= 7.0 / 15.0 / 2.0 + 1e-3,
            "outer {d}: {} -> {}",
            x[d],
            y[d]
        );
    }
    // Middle values keep their side: at the inner thresholds they decode near them.
    assert!((y[2] - 0.125).abs() < 0.2 && y[2] >= 0.125, "{}", y[2]);
    assert!((y[3] + 0.1).abs() < 0.2 && y[3] <= -0.1, "{}", y[3]);
    // No outlier at all: no entries, every value middle.
    let x = vec![1.0f32; hd];
    let (rec, y) = oaken_roundtrip(&x, &t);
    assert_eq!(counts(&rec, hd), vec![0]);
    assert!(y.iter().all(|&v| (v - 1.0).abs() < 1e-3), "{y:?}");
    // All inner: 8 entries used, the rest demoted to the middle level at their side's
    // threshold (error at most the inner interval plus a step).
    let x: Vec<f32> = (0..hd)
        .map(|i| -0.09 + 0.2 * i as f32 / hd as f32)
        .collect();
    let (rec, y) = oaken_roundtrip(&x, &t);
    assert_eq!(counts(&rec, hd), vec![8]);
    for d in 0..hd {
        assert!(
            (y[d] - x[d]).abs() <= 0.225 + 1e-3,
            "inner {d}: {} -> {}",
            x[d],
            y[d]
        );
    }
    for d in 0..8 {
        assert!(
            (y[d] - x[d]).abs() <= 0.225 / 31.0,
            "sparse inner {d}: {} -> {}",
            x[d],
            y[d]
        );
    }
}

#[test]
fn oaken_segment_overflow_keeps_every_value() {
    let t = thr();
    // 128 values: segment 0 all outer (64 > 8 entries), segment 1 has two.
    let mut x = vec![0.7f32; 128];
    for (d, v) in x.iter_mut().enumerate().take(64) {
        *v = if d % 2 == 0 {
            3.0 + d as f32 / 16.0
        } else {
            -2.5 - d as f32 / 16.0
        };
    }
    x[64] = 4.0;
    x[127] = -3.0;
    let (rec, y) = oaken_roundtrip(&x, &t);
    assert_eq!(counts(&rec, 128), vec![8, 2]);
    // Demoted outer values widen the middle range: no value is clipped.
    let worst = x
        .iter()
        .zip(&y)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    let range = 7.0 + 2.5 + 4.0;
    assert!(worst <= range / 15.0, "worst error {worst}");
    assert!(y[0] > 2.5 && y[1] < -2.0, "{} {}", y[0], y[1]);
}

/// Random rows: kv4 within half a step; oaken's sparse values within half their group's
/// step, middle ones within a step (the side is kept: a value next to an inner threshold
/// may take the first level of its side), demoted inner ones within the gap and a step.
#[test]
fn codecs_error_within_their_steps_on_random_rows() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let t = OakenLayer::gaussian(1.0, OakenFractions::default())
        .unwrap()
        .k;
    let gap = t.inner_hi - t.inner_lo;
    for hd in [32, 64, 128] {
        for _ in 0..300 {
            // Mostly N(0, 1), a few large values.
            let x: Vec<f32> = (0..hd)
                .map(|_| {
                    let g: f32 = (0..12).map(|_| rng.gen_range(0.0f32..1.0)).sum::<f32>() - 6.0;
                    if rng.gen_range(0..50) == 0 {
                        g * 6.0
                    } else {
                        g
                    }
                })
                .collect();
            for kv in [0, 1] {
                if hd == 32 {
                    break;
                }
                let mut rec = vec![0u8; kv4::rec_bytes(hd)];
                kv4::quantize_row(kv, &x, &mut rec);
                let mut y = vec![0f32; hd];
                kv4::dequantize_row(kv, &rec, &mut y);
                let (mn, mx) = x
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                for d in 0..hd {
                    let e = (x[d] - y[d]).abs();
                    assert!(e <= (mx - mn) / 15.0 * 0.51 + 1e-2, "kv4 hd {hd}: {e}");
                }
            }
            let (rec, y) = oaken_roundtrip(&x, &t);
            let (step, os, sparse) = record_params(&rec, hd);
            for d in 0..hd {
                let e = (x[d] - y[d]).abs();
                let bound = match (oaken::group(x[d], &t), sparse[d]) {
                    (Group::Outer, true) => os * 0.51,
                    (Group::Inner, true) => gap / 31.0 * 0.51,
                    (Group::Inner, false) => gap + step,
                    _ => step * 1.01,
                };
                assert!(
                    e <= bound + 1e-3,
                    "oaken hd {hd} value {d}: {} -> {} ({bound})",
                    x[d],
                    y[d]
                );
            }
        }
    }
}

/// kv4's slot order (also Oaken's dense codes') is a permutation of the row, for K and V
/// at every head dim, and `element_slot` is its inverse.
#[test]
fn kv4_slot_order_is_a_permutation() {
    for hd in [32, 64, 128] {
        for kv in [0, 1] {
            let mut seen = vec![false; hd];
            for s in 0..hd {
                let d = kv4::slot_element(kv, hd, s);
                assert!(d < hd && !seen[d], "kv {kv} hd {hd}: slot {s} -> {d}");
                seen[d] = true;
                assert_eq!(
                    kv4::element_slot(kv, hd, d),
                    s,
                    "kv {kv} hd {hd}: element {d}"
                );
            }
        }
    }
    // The first K word of part 1 holds elements 2, 10, 18, 26, 3, 11, 19, 27.
    let first: Vec<usize> = (32..40).map(|s| kv4::slot_element(0, 128, s)).collect();
    assert_eq!(first, vec![2, 10, 18, 26, 3, 11, 19, 27]);
}

#[test]
fn bits_per_value_count_every_byte() {
    assert_eq!(KvFormat::Kv4.row_bytes(128, DType::F16), 68);
    assert_eq!(KvFormat::Oaken.row_bytes(128, DType::F16), 88);
    assert_eq!(KvFormat::Oaken.row_bytes(64, DType::F16), 48);
    assert!((KvFormat::Kv4.bits_per_value(128, DType::F16) - 4.25).abs() < 1e-12);
    assert!((KvFormat::Oaken.bits_per_value(128, DType::F16) - 5.5).abs() < 1e-12);
    let f16 = KvFormat::Dense.row_bytes(128, DType::F16) as f64;
    assert!(KvFormat::Kv4.row_bytes(128, DType::F16) as f64 / f16 <= 0.32);
    assert!(KvFormat::Oaken.row_bytes(128, DType::F16) as f64 / f16 <= 0.36);
}

fn positions(pads: &[u32], pos: u32, n: usize, hd: usize) -> Result<StepPositions> {
    let dev = Device::Cpu;
    let half = hd / 2;
    let mut cos = vec![0f32; n * half];
    let mut sin = vec![0f32; n * half];
    for p in 0..n {
        for j in 0..half {
            let a = p as f32 / 10_000f32.powf(2.0 * j as f32 / hd as f32);
            cos[p * half + j] = a.cos();
            sin[p * half + j] = a.sin();
        }
    }
    Ok(StepPositions {
        cos: Tensor::from_vec(cos, (n, half), &dev)?,
        sin: Tensor::from_vec(sin, (n, half), &dev)?,
        pos: Tensor::new(&[pos], &dev)?,
        pads: Tensor::new(pads, &dev)?,
    })
}

/// Prefill attention over the cache and the fused decode path (CPU reference) agree with
/// each other on the dequantized values, for both codecs, and are close to a dense cache.
#[test]
fn quantized_cache_paths_agree_on_cpu() -> Result<()> {
    let heads = Heads {
        nh: 6,
        nkv: 2,
        hd: 64,
    };
    let b = 2;
    for codec in [
        KvCodec::Kv4,
        KvCodec::Oaken(OakenLayer::gaussian(1.0, OakenFractions::default())?),
    ] {
        let mut q = KvCache::new(
            Arc::new(PackedKv::new(codec)),
            heads,
            24,
            DType::F32,
            &Device::Cpu,
        );
        let mut d = KvCache::of_format(KvFormat::Dense, heads, 24, DType::F32, &Device::Cpu)?;
        let pre = common::randn(3, &[b, 9, heads.qkv_width()], 1.0, DType::F32, &Device::Cpu)?;
        let p0 = positions(&[0, 2], 0, 24, heads.hd)?;
        q.append(&pre, 0, &p0)?;
        d.append(&pre, 0, &p0)?;
        assert_eq!(q.bytes(), 2 * b * 2 * 24 * codec.rec_bytes(64));
        let step = common::randn(4, &[b, 1, heads.qkv_width()], 1.0, DType::F32, &Device::Cpu)?;
        let p = positions(&[0, 2], 9, 24, heads.hd)?;
        let fused = q.append_attend_decode(&step, 9, &p)?.expect("fused path");
        let dense = d.append_attend_decode(&step, 9, &p)?.expect("fused path");
        // The same step through the generic path: rotate q, attend over 10 rows.
        let qr = step
            .narrow(2, 0, heads.nh * heads.hd)?
            .reshape((b, 1, heads.nh, heads.hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let (cos, sin) = (p.cos.narrow(0, 9, 1)?, p.sin.narrow(0, 9, 1)?);
        // Sequence 1 is left-padded by 2: its RoPE position is 7.
        let (cos1, sin1) = (p.cos.narrow(0, 7, 1)?, p.sin.narrow(0, 7, 1)?);
        let q0 = candle_nn::rotary_emb::rope(&qr.narrow(0, 0, 1)?, &cos, &sin)?;
        let q1 = candle_nn::rotary_emb::rope(&qr.narrow(0, 1, 1)?.contiguous()?, &cos1, &sin1)?;
        let qr = Tensor::cat(&[q0, q1], 0)?;
        let mask = candle_lowbit::kv::causal_mask(&[0, 2], 9, 1, &Device::Cpu)?;
        let generic = q.attend(&qr, 10, Some(&mask))?.transpose(1, 2)?.reshape((
            b,
            1,
            heads.nh * heads.hd,
        ))?;
        common::assert_close(&fused, &generic, 1e-4, 1e-4, codec.name())?;
        let (diff, _, _) = common::max_abs_diff(&fused, &dense)?;
        assert!(
            diff > 0.0 && diff < 0.5,
            "{}: vs dense {diff}",
            codec.name()
        );
    }
    Ok(())
}

/// The per-layer search: each layer's K and V thresholds are those a fixed calibration at
/// the picked fractions gives, the pick is the candidate of least encode error on the
/// sampled rows, and a one-candidate search equals the fixed rule.
#[test]
fn oaken_search_picks_per_layer_from_fixed_candidates() -> Result<()> {
    use candle_lowbit::calib::{oaken_thresholds, OakenChoice, Quiet};
    let cfg = candle_lowbit::Config {
        num_attention_heads: 2,
        num_key_value_heads: 1,
        ..common::tiny_config(3)
    };
    let w = common::random_weights(&cfg, 11, &Device::Cpu)?;
    let model = Llama::load(
        candle_nn::VarBuilder::from_tensors(w, DType::F32, &Device::Cpu),
        &cfg,
    )?;
    let windows: Vec<Vec<u32>> = (0..4u32)
        .map(|s| (0..48).map(|i| (i * 11 + s * 17) % 101).collect())
        .collect();
    let run = |choice: &OakenChoice| {
        oaken_thresholds(
            &model,
            &cfg,
            &windows,
            (2, DType::F32),
            (choice, false),
            &mut Quiet,
        )
    };
    let candidates = vec![
        OakenFractions {
            outer: 0.30,
            inner: 0.30,
        },
        OakenFractions {
            outer: 0.06,
            inner: 0.04,
        },
        OakenFractions {
            outer: 0.02,
            inner: 0.02,
        },
    ];
    let searched = run(&OakenChoice::Search {
        candidates: candidates.clone(),
        rows: 1 << 20,
    })?;
    assert_eq!(searched.picked.len(), 3);
    let fixed: Vec<_> = candidates
        .iter()
        .map(|&f| run(&OakenChoice::Fixed(f)))
        .collect::<candle_core::Result<_>>()?;
    assert!(fixed.iter().all(|c| c.picked.is_empty()));
    for (l, (layer, [pk, pv])) in searched.layers.iter().zip(&searched.picked).enumerate() {
        let ik = candidates
            .iter()
            .position(|c| c == pk)
            .expect("K pick is a candidate");
        let iv = candidates
            .iter()
            .position(|c| c == pv)
            .expect("V pick is a candidate");
        assert_eq!(layer.k, fixed[ik].layers[l].k, "layer {l} K");
        assert_eq!(layer.v, fixed[iv].layers[l].v, "layer {l} V");
    }
    // The wide 30 % / 30 % groups overflow the 8 sparse entries per segment: never the pick.
    assert!(searched.picked.iter().flatten().all(|p| p.outer < 0.3));
    let one = run(&OakenChoice::Search {
        candidates: vec![candidates[1]],
        rows: 64,
    })?;
    assert_eq!(one.layers, fixed[1].layers);
    Ok(())
}

/// Oaken's calibration through a model: thresholds per layer, increasing, and a cache built
/// from them runs the model with finite logits.
#[test]
fn oaken_calibration_runs_through_the_model() -> Result<()> {
    let cfg = candle_lowbit::Config {
        num_attention_heads: 1,
        num_key_value_heads: 1,
        ..common::tiny_config(2)
    };
    let w = common::random_weights(&cfg, 5, &Device::Cpu)?;
    let model = Llama::load(
        candle_nn::VarBuilder::from_tensors(w, DType::F32, &Device::Cpu),
        &cfg,
    )?;
    let windows: Vec<Vec<u32>> = (0..4u32)
        .map(|s| (0..32).map(|i| (i * 7 + s * 13) % 101).collect())
        .collect();
    let c = candle_lowbit::calib::oaken_thresholds(
        &model,
        &cfg,
        &windows,
        (2, DType::F32),
        (
            &candle_lowbit::calib::OakenChoice::Fixed(OakenFractions::default()),
            false,
        ),
        &mut candle_lowbit::calib::Quiet,
    )?;
    assert_eq!(c.layers.len(), 2);
    let mut cache = Cache::with_spec(40, &KvSpec::Oaken(c.layers), DType::F32, &cfg, &Device::Cpu)?;
    assert_eq!(cache.kv_format(), KvFormat::Oaken);
    let ids = Tensor::new(&[[3u32, 1, 4, 1, 5, 9, 2, 6]], &Device::Cpu)?;
    model.forward(&ids, 0, &mut cache)?;
    let logits = model.forward(&Tensor::new(&[[7u32]], &Device::Cpu)?, 8, &mut cache)?;
    assert!(logits
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|v| v.is_finite()));
    let err = KvSpec::from_format(KvFormat::Oaken)
        .unwrap_err()
        .to_string();
    assert!(err.contains("thresholds"), "{err}");
    Ok(())
}

/// Bad caches and head dims are rejected with the shapes named.
#[test]
fn bad_inputs_are_rejected_clearly() -> Result<()> {
    let dev = Device::Cpu;
    let heads = Heads {
        nh: 2,
        nkv: 1,
        hd: 32,
    };
    let qkv = common::randn(1, &[1, 3, heads.qkv_width()], 1.0, DType::F32, &dev)?;
    let p = positions(&[0], 0, 8, heads.hd)?;
    // kv4 takes head dims 64 and 128 only.
    let err = KvCache::new(
        Arc::new(PackedKv::new(KvCodec::Kv4)),
        heads,
        8,
        DType::F32,
        &dev,
    )
    .append(&qkv, 0, &p)
    .unwrap_err()
    .to_string();
    assert!(err.contains("head dim 32"), "{err}");
    // A cache of the wrong record size or dtype.
    let heads = Heads { hd: 64, ..heads };
    let qkv = common::randn(1, &[1, 3, heads.qkv_width()], 1.0, DType::F32, &dev)?;
    let p = positions(&[0], 0, 8, heads.hd)?;
    let bad = Tensor::zeros((2, 1, 1, 8, 40), DType::U8, &dev)?;
    let err = candle_lowbit::ops::kv_append(&bad, &qkv, heads, &p, KvCodec::Kv4, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected u8 [2, b, 1, max_len, 36]"), "{err}");
    let bad = Tensor::zeros((2, 1, 1, 8, 36), DType::F32, &dev)?;
    assert!(candle_lowbit::ops::kv_append(&bad, &qkv, heads, &p, KvCodec::Kv4, true).is_err());
    // Past the capacity.
    let mut c = KvCache::new(
        Arc::new(PackedKv::new(KvCodec::Kv4)),
        heads,
        2,
        DType::F32,
        &dev,
    );
    let err = c.append(&qkv, 0, &p).unwrap_err().to_string();
    assert!(err.contains("capacity of 2"), "{err}");
    Ok(())
}

/// Tied calibration quantiles (a layer of mostly exact zeros: both inner quantiles 0, as a
/// destroyed W4A4 model's V gave on the H200) become strictly increasing thresholds whose
/// rows still round-trip; all-equal quantiles stay an error.
#[test]
fn oaken_tied_quantiles_are_pulled_apart() -> Result<()> {
    let q = [-0.8856f64, 0.0, 0.0, 0.8252];
    let l = OakenLayer::from_quantiles(&q, &q)?;
    let t = l.k;
    assert!(t.outer_lo < t.inner_lo && t.inner_lo < t.inner_hi && t.inner_hi < t.outer_hi);
    assert_eq!(t.inner_lo, 0.0);
    assert!((t.inner_hi - 1e-3 * (0.8252 + 0.8856)).abs() < 1e-6);
    let mut x = vec![0f32; 64];
    x[3] = 0.5;
    x[9] = -1.5;
    x[20] = 1e-4;
    let (_, out) = oaken_roundtrip(&x, &t);
    for (a, b) in x.iter().zip(&out) {
        assert!(b.is_finite() && (a - b).abs() <= 0.1, "{a} -> {b}");
    }
    assert!(OakenLayer::from_quantiles(&[1.0; 4], &[1.0; 4]).is_err());
    Ok(())
}

/// The fused prefill attention's CPU reference against the candle-ops prompt path
/// (`KvCache::attend` with the causal mask) on the same cache: a second prompt chunk
/// after a cached first one, GQA, one sequence left-padded (its padding rows see only
/// themselves), f32.
#[test]
fn prefill_attention_reference_matches_the_candle_ops_path() -> Result<()> {
    use candle_lowbit::ops::{prefill_attention, rope_kv_append};
    let heads = Heads {
        nh: 6,
        nkv: 2,
        hd: 64,
    };
    let (cpu, pads, cap) = (Device::Cpu, [0u32, 3], 16);
    let mut d = KvCache::of_format(KvFormat::Dense, heads, cap, DType::F32, &cpu)?;
    let store = Tensor::zeros((2, 2, heads.nkv, cap, heads.hd), DType::F32, &cpu)?;
    for (seed, pos, seq) in [(5u64, 0usize, 7usize), (6, 7, 5)] {
        let qkv = common::randn(seed, &[2, seq, heads.qkv_width()], 1.0, DType::F32, &cpu)?;
        let p = positions(&pads, pos as u32, cap, heads.hd)?;
        d.append(&qkv, pos, &p)?;
        rope_kv_append(&store, &qkv, heads, &p)?;
        let len = pos + seq;
        let (k, v) = (
            store.get(0)?.narrow(2, 0, len)?,
            store.get(1)?.narrow(2, 0, len)?,
        );
        let fused = prefill_attention(&qkv, &k, &v, heads, &p, pos)?;
        // The model's candle-ops path: rotate q per row, attend with the causal mask.
        let ids: Vec<u32> = pads
            .iter()
            .flat_map(|&pad| (pos..len).map(move |r| (r as u32).saturating_sub(pad)))
            .collect();
        let ids = Tensor::new(ids, &cpu)?;
        let half = heads.hd / 2;
        let cos = p.cos.index_select(&ids, 0)?.reshape((2, seq, half))?;
        let sin = p.sin.index_select(&ids, 0)?.reshape((2, seq, half))?;
        let q = qkv
            .narrow(2, 0, heads.nh * heads.hd)?
            .reshape((2, seq, heads.nh, heads.hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?;
        let mask = candle_lowbit::kv::causal_mask(&pads.map(|x| x as usize), pos, seq, &cpu)?;
        let generic = d.attend(&q, len, Some(&mask))?.transpose(1, 2)?.reshape((
            2,
            seq,
            heads.nh * heads.hd,
        ))?;
        common::assert_close(&fused, &generic, 1e-5, 1e-4, &format!("chunk at {pos}"))?;
    }
    Ok(())
}
