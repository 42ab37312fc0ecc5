//! The formats layer on the CPU: the registry, candle's GGML formats against QMatMul, the
//! uniform int formats' packing and quantizer against their references, error bounds, bits
//! per weight, and every format's stored tensors round-tripping.

mod common;

use anyhow::Result;
use candle_core::quantized::GgmlDType as G;
use candle_core::{DType, Device, Module, Tensor};
use candle_lowbit::formats::{ggml, uniform, Epilogue};
use candle_lowbit::gptq::{round_to_nearest, round_to_nearest_ref, GroupRule};
use candle_lowbit::{QLinear, WeightFormat};
use common::{assert_close, randn};

fn rel_err(y: &Tensor, want: &Tensor) -> Result<f32> {
    Ok(((y - want)?.sqr()?.sum_all()?.to_scalar::<f32>()?
        / want.sqr()?.sum_all()?.to_scalar::<f32>()?)
    .sqrt())
}

#[test]
fn registry_names_parse_and_say_what_they_need() -> Result<()> {
    for f in WeightFormat::ALL {
        let s = f.spec();
        assert_eq!(s.name.parse::<WeightFormat>()?, *f, "{}", s.name);
        for a in s.aliases {
            assert_eq!(a.parse::<WeightFormat>()?, *f, "alias {a}");
        }
        assert!(s.error_bound > 0.0 && s.tolerance > 0.0, "{}", s.name);
        // GPTQ formats, and the W4A4 formats that rank channels by calibration.
        assert_eq!(
            f.needs_calibration(),
            s.name.ends_with("-gptq") || ["w4a4", "fmpq"].contains(&s.name),
            "{}",
            s.name
        );
        if let Some(twin) = s.stores_as {
            assert_eq!(format!("{}-gptq", twin.name()), s.name);
        }
    }
    assert_eq!("Q4K".parse::<WeightFormat>()?, WeightFormat::Q4K);
    assert_eq!("dense".parse::<WeightFormat>()?, WeightFormat::Dense);
    let err = "int5".parse::<WeightFormat>().unwrap_err().to_string();
    assert!(
        err.contains("int5") && err.contains("int3-gptq") && err.contains("q2k"),
        "{err}"
    );
    let timed: Vec<_> = WeightFormat::timed().collect();
    assert!(timed.contains(&WeightFormat::Int3) && !timed.contains(&WeightFormat::Int3Gptq));
    assert_eq!(
        ggml::ggml_dtype(WeightFormat::Q4K, 512),
        Some((G::Q4K, false))
    );
    assert_eq!(
        ggml::ggml_dtype(WeightFormat::Q4K, 576),
        Some((G::Q5_0, true))
    );
    assert_eq!(
        ggml::ggml_dtype(WeightFormat::Q2K, 576),
        Some((G::Q4_0, true))
    );
    assert_eq!(
        ggml::ggml_dtype(WeightFormat::Q4_0, 576),
        Some((G::Q4_0, false))
    );
    assert_eq!(ggml::ggml_dtype(WeightFormat::Int4, 576), None);
    Ok(())
}

/// Every GGML format against candle's own QMatMul on the same quantized weight, and
/// within its error bound of the f32 product.
#[test]
fn ggml_formats_match_qmatmul() -> Result<()> {
    let dev = Device::Cpu;
    let (n, k) = (48, 512);
    let w = randn(5, &[n, k], 0.05, DType::F32, &dev)?;
    let x = randn(6, &[7, k], 1.0, DType::F32, &dev)?;
    let exact = x.matmul(&w.t()?)?;
    let dense = QLinear::from_weight(w.clone(), None)?;
    for (fmt, bits) in [
        (WeightFormat::Q8_0, 8.5),
        (WeightFormat::Q4_1, 5.0),
        (WeightFormat::Q4_0, 4.5),
        (WeightFormat::Q4K, 4.5),
        (WeightFormat::Q3K, 3.4375),
        (WeightFormat::Q2K, 2.625),
    ] {
        let q = dense.quantize(fmt)?;
        assert_eq!(q.bits_per_weight(), bits, "{fmt} bits per weight");
        let y = q.forward(&x)?;
        let (dt, _) = ggml::ggml_dtype(fmt, k).unwrap();
        let qt = candle_core::quantized::QTensor::quantize(&w, dt)?;
        let want = candle_core::quantized::QMatMul::from_qtensor(qt)?.forward(&x)?;
        assert_close(&y, &want, 1e-6, 1e-6, &format!("{fmt} vs QMatMul"))?;
        let rel = rel_err(&y, &exact)?;
        assert!(
            (rel as f64) < fmt.spec().error_bound,
            "{fmt}: relative error {rel} over {}",
            fmt.spec().error_bound
        );
    }
    Ok(())
}

/// Pack then unpack is the identity for every width and odd k; a hand-made int3 row lands
/// in the documented bits (codes straddling words); codes too wide are rejected.
#[test]
fn uniform_pack_is_exact() -> Result<()> {
    let mut seed = 7u64;
    let mut next = move || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as u8
    };
    for bits in [2u32, 3, 4] {
        for &(n, k) in &[
            (1usize, 1usize),
            (3, 7),
            (2, 33),
            (5, 200),
            (4, 576),
            (1, 1000),
        ] {
            let codes: Vec<u8> = (0..n * k).map(|_| next() & ((1 << bits) - 1)).collect();
            let words = uniform::pack(&codes, n, k, bits)?;
            assert_eq!(words.len(), n * uniform::words_per_row(k, bits));
            assert_eq!(
                uniform::unpack(&words, n, k, bits),
                codes,
                "int{bits} [{n}, {k}]"
            );
            // The op (CPU: the same reference) on a tensor.
            let t = Tensor::from_vec(codes.clone(), (n, k), &Device::Cpu)?;
            assert_eq!(
                candle_lowbit::ops::uniform_pack(&t, bits)?
                    .flatten_all()?
                    .to_vec1::<u32>()?,
                words
            );
        }
    }
    // int3: codes 0..11 as 3-bit fields, LSB first: code 10 (= 2) takes bits 30, 31 of word 0
    // and bit 0 of word 1.
    let codes: Vec<u8> = (0..12).map(|j| (j % 8) as u8).collect();
    let words = uniform::pack(&codes, 1, 12, 3)?;
    let mut want = [0u64; 1];
    for (j, &c) in codes.iter().enumerate() {
        want[0] |= (c as u64) << (3 * j);
    }
    assert_eq!(words, vec![want[0] as u32, (want[0] >> 32) as u32]);
    let err = uniform::pack(&[4], 1, 1, 2).unwrap_err().to_string();
    assert!(err.contains("does not fit 2 bits"), "{err}");
    Ok(())
}

/// Round to nearest in tensor ops (what runs on the GPU) equals the scalar reference bit for
/// bit, partial last group included; the dequantized weight is `q · scale + zero`.
#[test]
fn uniform_rtn_matches_scalar_reference() -> Result<()> {
    let dev = Device::Cpu;
    for bits in [2u32, 3, 4] {
        let rule = uniform::UniformRule::new(bits);
        for &(n, k) in &[(1usize, 1usize), (5, 200), (3, 128), (7, 576)] {
            let w = randn(bits as u64 * 100 + k as u64, &[n, k], 0.3, DType::F32, &dev)?;
            let q = round_to_nearest(&w, &rule)?;
            let (codes, params) =
                round_to_nearest_ref(&w.flatten_all()?.to_vec1::<f32>()?, n, k, &rule);
            assert_eq!(
                q.codes.flatten_all()?.to_vec1::<u8>()?,
                codes,
                "int{bits} [{n}, {k}] codes"
            );
            assert_eq!(
                q.params.flatten_all()?.to_vec1::<f32>()?,
                params,
                "int{bits} [{n}, {k}] params"
            );
            let l =
                uniform::UniformWeights::from_codes(WeightFormat::Int4, bits, &q.codes, &q.params)?;
            let deq = candle_lowbit::formats::LinearWeights::dequantize(&l)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let g = uniform::groups(k);
            for (i, &v) in deq.iter().enumerate() {
                let (r, j) = (i / k, i % k);
                let p = &params[(r * g + j / uniform::GROUP) * 2..][..2];
                assert_eq!(v, codes[i] as f32 * p[0] + p[1], "int{bits} [{r}, {j}]");
            }
            // The rule's scalar form: fit + quantize give the same codes.
            let mut p = [0f32; 2];
            rule.fit(
                0,
                0,
                &w.flatten_all()?.to_vec1::<f32>()?[..k.min(128)],
                &mut p,
            );
            assert_eq!(&p[..], &params[..2]);
        }
    }
    Ok(())
}

/// The searched range never fits a group worse than min/max (squared error), and its tensor
/// form picks the same parameters as the scalar one.
#[test]
fn clipped_range_search() -> Result<()> {
    let dev = Device::Cpu;
    for bits in [2u32, 3, 4] {
        let (plain, clip) = (
            uniform::UniformRule::new(bits),
            uniform::UniformRule::clipped(bits),
        );
        let w = randn(60 + bits as u64, &[9, 300], 0.3, DType::F32, &dev)?;
        let (q0, q1) = (round_to_nearest(&w, &plain)?, round_to_nearest(&w, &clip)?);
        let v = w.flatten_all()?.to_vec1::<f32>()?;
        let (c1, p1) = round_to_nearest_ref(&v, 9, 300, &clip);
        assert_eq!(
            q1.codes.flatten_all()?.to_vec1::<u8>()?,
            c1,
            "int{bits} clipped codes"
        );
        assert_eq!(
            q1.params.flatten_all()?.to_vec1::<f32>()?,
            p1,
            "int{bits} clipped params"
        );
        let err = |q: &candle_lowbit::gptq::Quantized| -> Result<f32> {
            let l =
                uniform::UniformWeights::from_codes(WeightFormat::Int4, bits, &q.codes, &q.params)?;
            Ok(
                (candle_lowbit::formats::LinearWeights::dequantize(&l)? - &w)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f32>()?,
            )
        };
        let (e0, e1) = (err(&q0)?, err(&q1)?);
        println!("int{bits}: squared error min/max {e0:.4}, searched {e1:.4}");
        assert!(
            e1 <= e0,
            "int{bits}: searched range {e1} worse than min/max {e0}"
        );
    }
    Ok(())
}

/// Every int format within its error bound of the f32 product, with the bits per weight
/// the layout says (codes, f16 scale and zero per group of 128), odd k included.
#[test]
fn uniform_formats_error_and_bits() -> Result<()> {
    let dev = Device::Cpu;
    let x = randn(9, &[17, 512], 1.0, DType::F32, &dev)?;
    let w = randn(10, &[40, 512], 1.0 / (512f32).sqrt(), DType::F32, &dev)?;
    let exact = x.matmul(&w.t()?)?;
    for (fmt, bits) in [
        (WeightFormat::Int4, 4.25),
        (WeightFormat::Int3, 3.25),
        (WeightFormat::Int2, 2.25),
    ] {
        let q = QLinear::from_weight(w.clone(), None)?.quantize(fmt)?;
        assert_eq!(q.bits_per_weight(), bits, "{fmt}");
        let rel = rel_err(&q.forward(&x)?, &exact)? as f64;
        assert!(
            rel < fmt.spec().error_bound,
            "{fmt}: relative error {rel:.4} over {}",
            fmt.spec().error_bound
        );
        println!(
            "{fmt}: relative error {rel:.4} (bound {})",
            fmt.spec().error_bound
        );
    }
    // k = 576 (the default model's hidden size): 4 groups of 128 and one of 64; int3 rows
    // of 576 codes take 54 words.
    let w = randn(11, &[3, 576], 0.1, DType::F32, &dev)?;
    let q = QLinear::from_weight(w, None)?.quantize(WeightFormat::Int3)?;
    assert_eq!(q.weight_bytes(), 3 * (54 * 4 + 5 * 4));
    Ok(())
}

/// A GPTQ format cannot quantize without a Hessian, and says what to do.
#[test]
fn gptq_format_without_calibration_is_an_error() -> Result<()> {
    let w = randn(1, &[8, 128], 0.1, DType::F32, &Device::Cpu)?;
    let err = QLinear::from_weight(w, None)?
        .quantize(WeightFormat::Int3Gptq)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("int3-gptq needs calibration") && err.contains("--calib"),
        "{err}"
    );
    Ok(())
}

/// Every format's stored tensors rebuild the same layer: same bytes, bit-identical output;
/// so does a deep copy. Missing or misshapen fields are named.
#[test]
fn every_format_round_trips_its_tensors() -> Result<()> {
    let dev = Device::Cpu;
    let (n, k) = (32, 512); // tiled formats take rows in blocks of 32
    let w = randn(3, &[n, k], 0.05, DType::F32, &dev)?;
    let x = randn(4, &[5, k], 1.0, DType::F32, &dev)?;
    let h = {
        let a = randn(5, &[64, k], 1.0, DType::F32, &dev)?;
        (a.t()?.matmul(&a)? / 64.0)?
    };
    let dense = QLinear::from_weight(w, None)?;
    for &f in WeightFormat::ALL {
        let q = dense.quantize_with(f, Some(&h), &Default::default())?;
        let tensors = q.weights().tensors()?;
        for (name, t) in tensors
            .iter()
            .filter(|(name, _)| !name.starts_with("input."))
        {
            assert_eq!(t.dim(0)?, n, "{f}: field {name} must have the rows first");
        }
        let map = tensors.iter().cloned().collect();
        let back = QLinear::new(f.spec().codec.rebuild(f, (n, k), &map)?, None);
        let copy = q.deep_copy()?;
        assert_eq!(back.weight_bytes(), q.weight_bytes(), "{f}");
        for other in [&back, &copy] {
            let (a, b) = (
                q.forward(&x)?.flatten_all()?.to_vec1::<f32>()?,
                other.forward(&x)?.flatten_all()?.to_vec1::<f32>()?,
            );
            assert!(
                a.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()),
                "{f}: rebuilt layer differs"
            );
        }
        let mut broken = map.clone();
        let first = tensors[0].0.clone();
        broken.remove(&first);
        let err = f
            .spec()
            .codec
            .rebuild(f, (n, k), &broken)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&first), "{f}: {err}");
        let err = f
            .spec()
            .codec
            .rebuild(f, (n + 1, k), &map)
            .unwrap_err()
            .to_string();
        assert!(err.contains(&format!("{}", n + 1)), "{f}: {err}");
    }
    Ok(())
}

/// On the CPU no fused path applies, and the plan says why; the unfused compositions run.
#[test]
fn plans_name_the_paths_not_taken() -> Result<()> {
    let w = randn(1, &[16, 64], 0.1, DType::F32, &Device::Cpu)?;
    let d = QLinear::from_weight(w.clone(), None)?;
    assert!(d.plan().silu_mul.as_ref().unwrap_err().contains("CUDA"));
    let q = d.quantize(WeightFormat::Q8_0)?;
    for e in Epilogue::ALL {
        assert!(
            q.plan()
                .epilogue(e)
                .as_ref()
                .unwrap_err()
                .contains("QMatMul"),
            "{e:?}"
        );
    }
    let x = randn(2, &[3, 64], 1.0, DType::F32, &Device::Cpu)?;
    let y = d.forward_silu_mul(&x)?;
    assert_close(
        &y,
        &candle_lowbit::ops::silu_mul(&d.forward(&x)?)?,
        0.0,
        0.0,
        "unfused silu_mul",
    )?;
    Ok(())
}
