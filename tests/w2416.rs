//! `w2416` on the CPU: the tile layout packs and unpacks exactly, the quantizer on
//! hand-made cases (outliers taken out, 4-bit tiles where the error drops most, the bit
//! budget), error against f32, GPTQ against round to nearest, and the stored tensors
//! rebuilding the same weight. The GPU kernels against these references: `cuda_formats.rs`.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_lowbit::formats::w2416::{
    self, pack_codes, tile_cols, TileScales, Tiles, W2416Config, TILE_COLS, TILE_ROWS,
};
use candle_lowbit::formats::QuantOptions;
use candle_lowbit::gptq::{objective, GptqConfig};
use candle_lowbit::WeightFormat;
use common::randn;
use rand::{Rng, SeedableRng};

/// Random 4-bit flags with `h4` per block.
fn flags(r: usize, g: usize, h4: usize, rng: &mut rand::rngs::StdRng) -> Vec<bool> {
    let mut f = vec![false; r * g];
    for b in 0..r {
        let mut cols: Vec<usize> = (0..g).collect();
        for i in 0..h4 {
            let j = rng.gen_range(i..g);
            cols.swap(i, j);
            f[b * g + cols[i]] = true;
        }
    }
    f
}

#[test]
fn pack_unpack_exact_on_odd_shapes() -> Result<()> {
    let cpu = Device::Cpu;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for &(n, k, h4) in &[
        (32, 64, 0),
        (32, 64, 1),
        (96, 192, 1),
        (64, 576, 4),
        (160, 320, 5),
    ] {
        let (r, g) = (n / TILE_ROWS, tile_cols(k));
        let four = flags(r, g, h4, &mut rng);
        let codes: Vec<u8> = (0..n * k)
            .map(|i| {
                let f = four[(i / k / TILE_ROWS) * g + (i % k) / TILE_COLS];
                rng.gen_range(0..if f { 16 } else { 4 })
            })
            .collect();
        let ct = Tensor::from_vec(codes.clone(), (n, k), &cpu)?;
        let words = pack_codes(&ct, &four)?;
        assert_eq!(words.dims(), [n, 4 * (g + h4)]);
        let scales = TileScales::TwoLevel {
            codes: Tensor::zeros((n, 2 * g), DType::U8, &cpu)?,
            supers: Tensor::zeros((n, w2416::supers(k)), DType::F16, &cpu)?,
        };
        let t = Tiles::new((n, k), words, &four, scales, None)?;
        assert_eq!(t.unpack_ref()?, codes, "[{n}, {k}] h4 {h4}");
        assert_eq!(t.flags()?, four);
        assert_eq!(Tiles::flags_of_mask(&t.mask, n, k)?, four);
    }
    // Shapes that do not tile, and blocks with different 4-bit counts, are refused.
    let c = Tensor::zeros((33, 64), DType::U8, &cpu)?;
    assert!(pack_codes(&c, &[false]).is_err());
    let c = Tensor::zeros((64, 128), DType::U8, &cpu)?;
    let uneven = [true, false, false, false];
    let e = pack_codes(&c, &uneven).unwrap_err().to_string();
    assert!(e.contains("4-bit"), "{e}");
    Ok(())
}

/// A weight with a few huge entries in 2-bit tiles: they become outliers, their groups'
/// ranges are fitted without them, and the dequantized weight keeps them (f16 δ).
#[test]
fn outliers_are_taken_out_and_kept() -> Result<()> {
    let cpu = Device::Cpu;
    let (n, k) = (64, 256);
    let mut w = randn(3, &[n, k], 0.02, DType::F32, &cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let spikes = [(5usize, 70usize, 1.5f32), (40, 3, -2.0), (63, 255, 0.9)];
    for &(r, c, v) in &spikes {
        w[r * k + c] = v;
    }
    let wt = Tensor::from_vec(w.clone(), (n, k), &cpu)?;
    let cfg = W2416Config {
        bits: 2.4,
        outliers: 0.005,
        reorder: false,
    };
    let t = w2416::quantize(&wt, None, &cfg, None)?;
    let outl = t.outliers_ref()?;
    assert_eq!(
        t.outliers.as_ref().map(|o| o.per_block),
        Some(cfg.per_block(k))
    );
    let deq = t.dequantize_ref()?;
    for &(r, c, v) in &spikes {
        assert!(
            outl.iter().any(|&(rr, cc, _)| rr == r && cc == c),
            "spike at [{r}, {c}] not an outlier"
        );
        assert!(
            (deq[r * k + c] - v).abs() < 2e-3,
            "[{r}, {c}] {} vs {v}",
            deq[r * k + c]
        );
    }
    // Without outliers the spikes' groups lose their small weights: the error elsewhere in
    // those groups is far larger.
    let plain = w2416::quantize(
        &wt,
        None,
        &W2416Config {
            outliers: 0.0,
            ..cfg
        },
        None,
    )?;
    assert!(plain.outliers.is_none());
    let deq0 = plain.dequantize_ref()?;
    let group_err = |d: &[f32], r: usize, c: usize| -> f32 {
        let g0 = c / TILE_COLS * TILE_COLS;
        (g0..g0 + TILE_COLS)
            .filter(|&j| j != c)
            .map(|j| (d[r * k + j] - w[r * k + j]).powi(2))
            .sum()
    };
    for &(r, c, _) in &spikes {
        assert!(
            group_err(&deq, r, c) * 4.0 < group_err(&deq0, r, c),
            "[{r}, {c}]: group error {} with outliers, {} without",
            group_err(&deq, r, c),
            group_err(&deq0, r, c)
        );
    }
    Ok(())
}

/// Tile columns with wide weights, or with heavy Hessian weight, become 4-bit; the count
/// follows the budget, and the bytes stay under it.
#[test]
fn precision_follows_sensitivity_and_budget() -> Result<()> {
    let cpu = Device::Cpu;
    let (n, k) = (64, 512);
    let g = tile_cols(k);
    // Columns of tiles 2 and 5 ten times wider.
    let scale: Vec<f32> = (0..k)
        .map(|j| {
            if [2, 5].contains(&(j / TILE_COLS)) {
                1.0
            } else {
                0.1
            }
        })
        .collect();
    let w = randn(5, &[n, k], 1.0, DType::F32, &cpu)?.broadcast_mul(&Tensor::from_vec(
        scale,
        (1, k),
        &cpu,
    )?)?;
    let cfg = W2416Config {
        bits: 2.9,
        outliers: 0.0,
        reorder: false,
    };
    let h4 = cfg.h4(n, k);
    assert!(h4 >= 2, "budget 2.9 bits leaves {h4} 4-bit tiles of {g}");
    let t = w2416::quantize(&w, None, &cfg, None)?;
    assert_eq!(t.h4, h4);
    let four = t.flags()?;
    for b in 0..n / TILE_ROWS {
        assert!(
            four[b * g + 2] && four[b * g + 5],
            "block {b}: {:?}",
            &four[b * g..(b + 1) * g]
        );
    }
    let bits = t.bytes() as f64 * 8.0 / (n * k) as f64;
    assert!(
        bits <= cfg.bits + 1e-9,
        "{bits} bits over the budget {}",
        cfg.bits
    );
    // One more 4-bit tile per block would not fit.
    let tile_bits = (TILE_ROWS * 16 * 8) as f64 / (TILE_ROWS * k) as f64;
    assert!(
        h4 == g || bits + tile_bits > cfg.bits,
        "{bits} + {tile_bits} fits {}",
        cfg.bits
    );
    // A Hessian that weighs tile 0's inputs heavily moves a 4-bit tile there.
    let d: Vec<f32> = (0..k)
        .map(|j| if j < TILE_COLS { 1e4 } else { 1.0 })
        .collect();
    let h = Tensor::eye(k, DType::F32, &cpu)?.broadcast_mul(&Tensor::from_vec(d, (1, k), &cpu)?)?;
    let t = w2416::quantize(&w, Some(&h), &cfg, None)?;
    let four = t.flags()?;
    assert!(
        (0..n / TILE_ROWS).all(|b| four[b * g]),
        "tile 0 not 4-bit under its Hessian"
    );
    // Every stored byte is counted: codes, scales, supers, descriptors (no outliers).
    let expect = n * 16 * (g + h4) + n * 2 * g + n * 2 * w2416::supers(k) + (n / TILE_ROWS) * g * 4;
    assert_eq!(t.bytes(), expect);
    Ok(())
}

/// Reordering: salient input channels spread over every tile column (one in nine four
/// times wider) are gathered into the first columns, which the 4-bit tiles take; the weight
/// comes back in the input's order, the Hessian-weighted error falls well below the
/// unordered quantizer's, the column order costs 2 bytes per column and stays in the budget,
/// and the stored order rebuilds the same weight (a non-permutation is refused).
#[test]
fn reorder_gathers_salient_channels() -> Result<()> {
    let cpu = Device::Cpu;
    let (n, k) = (64, 576);
    let salient = |j: usize| j % 9 == 4;
    let scale: Vec<f32> = (0..k)
        .map(|j| if salient(j) { 1.0 } else { 0.25 })
        .collect();
    let w = randn(6, &[n, k], 1.0, DType::F32, &cpu)?.broadcast_mul(&Tensor::from_vec(
        scale,
        (1, k),
        &cpu,
    )?)?;
    let on = W2416Config {
        bits: 3.0,
        outliers: 0.0,
        reorder: true,
    };
    let off = W2416Config {
        reorder: false,
        ..on
    };
    let (a, b) = (
        w2416::quantize(&w, None, &on, None)?,
        w2416::quantize(&w, None, &off, None)?,
    );
    let order = a.perm.as_ref().expect("column order").order()?;
    assert!(b.perm.is_none());
    // The 64 salient channels fill the first tile column.
    assert!(
        order[..TILE_COLS].iter().all(|&c| salient(c as usize)),
        "first tile: {:?}",
        &order[..TILE_COLS]
    );
    let g = tile_cols(k);
    let four = a.flags()?;
    assert!((0..n / TILE_ROWS).all(|r| four[r * g]), "tile 0 not 4-bit");
    let err = |t: &Tiles| -> Result<f32> {
        Ok((t.dequantize(DType::F32)? - &w)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f32>()?)
    };
    let (ea, eb) = (err(&a)?, err(&b)?);
    assert!(ea < 0.8 * eb, "reordered error {ea} vs {eb}");
    assert_eq!(a.bytes(), a.clone().with_perm(None)?.bytes() + 2 * k);
    // The layer's forward takes x in the input's order.
    let x = randn(7, &[5, k], 1.0, DType::F32, &cpu)?;
    let l = w2416::W2416Weights::new(WeightFormat::W2416, a.clone());
    let y = candle_lowbit::formats::LinearWeights::forward(&l, &x)?;
    let want = x.matmul(&a.dequantize(DType::F32)?.t()?)?;
    let d = (y - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(d < 1e-4, "forward differs by {d}");
    assert!(a.bytes() as f64 * 8.0 / (n * k) as f64 <= on.bits + 1e-9);
    // Stored and rebuilt.
    let f = WeightFormat::W2416;
    let l = w2416::W2416Weights::new(f, a.clone());
    let mut map: std::collections::HashMap<String, Tensor> =
        candle_lowbit::formats::LinearWeights::tensors(&l)?
            .into_iter()
            .collect();
    let back = f.spec().codec.rebuild(f, (n, k), &map)?;
    assert_eq!(
        back.dequantize()?.flatten_all()?.to_vec1::<f32>()?,
        a.dequantize(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
    );
    let bad = vec![0u32; k / 2]; // every column reads channel 0
    map.insert("input.order".into(), Tensor::from_vec(bad, k / 2, &cpu)?);
    let e = f
        .spec()
        .codec
        .rebuild(f, (n, k), &map)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a permutation"), "{e}");
    Ok(())
}

/// Gaussian weights: w2416 within its bound and well under int2's error; GPTQ lowers the
/// objective under a correlated Hessian (measured 0.76× round to nearest here).
#[test]
fn error_and_gptq() -> Result<()> {
    let cpu = Device::Cpu;
    let (n, k) = (96, 512);
    let w = randn(11, &[n, k], 1.0 / (k as f32).sqrt(), DType::F32, &cpu)?;
    let x = randn(12, &[64, k], 1.0, DType::F32, &cpu)?;
    let y = x.matmul(&w.t()?)?;
    let rel = |q: &Tensor| -> Result<f64> {
        let e = (x.matmul(&q.t()?)? - &y)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f32>()?;
        let s = y.sqr()?.sum_all()?.to_scalar::<f32>()?;
        Ok((e / s).sqrt() as f64)
    };
    let opts = QuantOptions::default();
    let spec = WeightFormat::W2416.spec();
    let q = spec.codec.quantize(WeightFormat::W2416, &w, None, &opts)?;
    let e_w = rel(&q.dequantize()?)?;
    let e2 = rel(&WeightFormat::Int2
        .spec()
        .codec
        .quantize(WeightFormat::Int2, &w, None, &opts)?
        .dequantize()?)?;
    assert!(e_w < spec.error_bound, "w2416 error {e_w}");
    assert!(e_w < 0.8 * e2, "w2416 {e_w} vs int2 {e2}");
    // GPTQ on a correlated Hessian.
    let xs = randn(13, &[1024, k], 1.0, DType::F32, &cpu)?;
    let mix = randn(14, &[k, k], 0.3 / (k as f32).sqrt(), DType::F32, &cpu)?;
    let xs = (&xs + xs.matmul(&mix)?)?;
    let h = (xs.t()?.matmul(&xs)? / 1024.0)?;
    let rtn =
        WeightFormat::W2416
            .spec()
            .codec
            .quantize(WeightFormat::W2416, &w, Some(&h), &opts)?;
    let gptq = WeightFormat::W2416Gptq.spec().codec.quantize(
        WeightFormat::W2416Gptq,
        &w,
        Some(&h),
        &QuantOptions {
            gptq: GptqConfig::default(),
            ..QuantOptions::default()
        },
    )?;
    let (o_rtn, o_gptq) = (
        objective(&w, &rtn.dequantize()?, &h)?,
        objective(&w, &gptq.dequantize()?, &h)?,
    );
    assert!(
        o_gptq < 0.85 * o_rtn,
        "GPTQ objective {o_gptq} vs RTN {o_rtn}"
    );
    assert!(WeightFormat::W2416Gptq
        .spec()
        .codec
        .quantize(WeightFormat::W2416Gptq, &w, None, &opts)
        .is_err());
    Ok(())
}

/// The stored tensors rebuild the same weight; a wrong shape or a missing field is refused.
#[test]
fn tensors_rebuild() -> Result<()> {
    let cpu = Device::Cpu;
    let (n, k) = (64, 160); // a last tile of 32 real columns
    let w = randn(21, &[n, k], 0.05, DType::F32, &cpu)?;
    let f = WeightFormat::W2416;
    let q = f
        .spec()
        .codec
        .quantize(f, &w, None, &QuantOptions::default())?;
    let map: std::collections::HashMap<String, Tensor> = q.tensors()?.into_iter().collect();
    let back = f.spec().codec.rebuild(f, (n, k), &map)?;
    let (a, b) = (
        q.dequantize()?.flatten_all()?.to_vec1::<f32>()?,
        back.dequantize()?.flatten_all()?.to_vec1::<f32>()?,
    );
    assert_eq!(a, b);
    assert_eq!(q.dequantize()?.dims(), [n, k]);
    let e = ((q.dequantize()? - &w)?
        .sqr()?
        .mean_all()?
        .to_scalar::<f32>()?)
    .sqrt();
    assert!(e < 0.02, "rms error {e}");
    assert!(f.spec().codec.rebuild(f, (n, k + 64), &map).is_err());
    let mut missing = map.clone();
    missing.remove("supers");
    let e = f
        .spec()
        .codec
        .rebuild(f, (n, k), &missing)
        .unwrap_err()
        .to_string();
    assert!(e.contains("supers"), "{e}");
    Ok(())
}

/// The uniform formats' tiles hold the same weights as their own layout.
#[test]
fn uniform_tiles_match_uniform_layout() -> Result<()> {
    let cpu = Device::Cpu;
    for (f, bits) in [(WeightFormat::Int4, 4), (WeightFormat::Int2, 2)] {
        let (n, k) = (96, 576);
        let w = randn(31 + bits, &[n, k], 0.05, DType::F32, &cpu)?;
        let q = f
            .spec()
            .codec
            .quantize(f, &w, None, &QuantOptions::default())?;
        let map: std::collections::HashMap<String, Tensor> = q.tensors()?.into_iter().collect();
        let u = candle_lowbit::formats::uniform::UniformWeights::new(
            f,
            bits as u32,
            (n, k),
            map["qweight"].clone(),
            map["scales"].clone(),
            map["zeros"].clone(),
        )?;
        let t = u.to_tiles()?;
        // The tiles give back the stored layout exactly (what a tiled layer saves).
        let (codes, scales, zeros) = t.uniform_parts()?;
        assert_eq!(
            codes.flatten_all()?.to_vec1::<u8>()?,
            u.codes()?.flatten_all()?.to_vec1::<u8>()?,
            "{f}: codes"
        );
        for (a, b) in [(&scales, &map["scales"]), (&zeros, &map["zeros"])] {
            assert_eq!(
                a.flatten_all()?.to_vec1::<half::f16>()?,
                b.flatten_all()?.to_vec1::<half::f16>()?,
                "{f}: scales / zeros"
            );
        }
        let a = q.dequantize()?.flatten_all()?.to_vec1::<f32>()?;
        let b = t.dequantize_ref()?;
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            // The tiles round q·s + z to f16 once; the uniform layout keeps it in f32.
            assert!(
                (x - y).abs() <= 1e-3 * x.abs().max(1e-2),
                "{f} [{i}]: {x} vs {y}"
            );
        }
    }
    Ok(())
}

/// Random weights drawn directly in the format (the bench's models too large to quantize):
/// a valid layout with the budget's 4-bit share, distinct outlier columns per row inside
/// 2-bit tiles, and finite values.
#[test]
fn random_weights_are_a_valid_layout() -> Result<()> {
    let cpu = Device::Cpu;
    let (n, k) = (96, 1000);
    let cfg = W2416Config {
        outliers: 0.005,
        ..W2416Config::default()
    };
    let t = w2416::random(n, k, &cfg, 5, &cpu)?;
    assert_eq!(t.h4, cfg.h4(n, k));
    let order = t.perm.as_ref().expect("reordered by default").order()?;
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..k as u32).collect::<Vec<_>>());
    let four = t.flags()?;
    let g = tile_cols(k);
    // Reordered, as the quantizer places them: every row block's 4-bit tiles lead, the
    // boundary moved by at most 3 columns.
    for b in 0..n / TILE_ROWS {
        let row = &four[b * g..(b + 1) * g];
        assert_eq!(row.iter().filter(|&&f| f).count(), t.h4);
        assert!(
            row[..t.h4.saturating_sub(3)].iter().all(|&f| f),
            "block {b}: {row:?}"
        );
        assert!(
            row[(t.h4 + 3).min(g)..].iter().all(|&f| !f),
            "block {b}: {row:?}"
        );
    }
    let mut seen = std::collections::HashSet::new();
    for (row, col, d) in t.outliers_ref()? {
        if d.to_f32() == 0.0 {
            continue; // unused slots
        }
        assert!(
            !four[(row / TILE_ROWS) * g + col / TILE_COLS],
            "outlier in a 4-bit tile"
        );
        assert!(seen.insert((row, col)), "outlier [{row}, {col}] twice");
    }
    assert!(!seen.is_empty());
    let w = t.dequantize_ref()?;
    assert_eq!(w.len(), n * k);
    assert!(w.iter().all(|v| v.is_finite()));
    let f = WeightFormat::W2416;
    let l = f
        .spec()
        .codec
        .random(f, (n, k), &QuantOptions::default(), 5, &cpu);
    assert_eq!(l.expect("w2416 draws random weights")?.shape(), (n, k));
    Ok(())
}

/// The one-token GEMV's split (`ops::gemv_plan`, chosen on the host) at Llama-2-7B / 70B and
/// SmolLM2 shapes on 132 SMs: its shared memory fits one block (the kernel's 5 KiB of static
/// partial sums counted: the 70B down projection once asked for more and failed to launch),
/// one wave of blocks, and a block that takes several pairs gives every computing warp at
/// least as many chunks of each pair as its ring has stages (the ring is never two pairs ahead
/// of the pair being computed).
#[test]
fn gemv_plans_fit_one_block() {
    use candle_lowbit::ops::{gemv_plan, GV_CH, GV_STAGES};
    for (n, k, silu) in [
        (12288usize, 4096usize, false),
        (4096, 4096, false),
        (22016, 4096, true),
        (4096, 11008, false),
        (10240, 8192, false),
        (8192, 8192, false),
        (57344, 8192, true),
        (8192, 28672, false),
        (960, 576, false),
        (3072, 576, true),
        (576, 1536, false),
    ] {
        let r = n / 32;
        let np = if silu { r / 2 } else { r.div_ceil(2) };
        let nc = k.div_ceil(64).div_ceil(GV_CH);
        let p = gemv_plan(np, nc, 132, None, 0).unwrap_or_else(|| panic!("[{n}, {k}]: no split"));
        println!("[{n}, {k}] (SiLU·mul {silu}): {p:?}");
        assert!(p.smem + 5120 <= 227 * 1024, "[{n}, {k}]: {p:?}");
        assert!(
            p.ncl * p.ks <= 132,
            "[{n}, {k}]: {p:?} is more than one wave"
        );
        if np.div_ceil(p.ncl) > 1 {
            assert!(
                nc / p.ks / p.parts >= GV_STAGES,
                "[{n}, {k}]: {p:?} leaves a warp fewer chunks than stages"
            );
        }
    }
}
