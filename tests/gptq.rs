//! GPTQ on the CPU: the reference against round to nearest (H = I: equal; a real H: a
//! lower objective), the tensor-op version against the reference, the inverse-Hessian
//! factor, dead inputs, and bad input.

mod common;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use candle_lowbit::formats::uniform::{UniformRule, UniformWeights};
use candle_lowbit::formats::LinearWeights;
use candle_lowbit::gptq::{
    gptq_ref, gptq_tensor, hinv_upper, objective, round_to_nearest, GptqConfig, Quantized,
};
use candle_lowbit::WeightFormat;
use common::randn;

/// A Hessian with structure: inputs mixed across channels, a few channels 10x louder.
fn hessian(seed: u64, k: usize, tokens: usize) -> Result<Tensor> {
    let dev = Device::Cpu;
    let z = randn(seed, &[tokens, k], 1.0, DType::F32, &dev)?;
    let mix = (randn(seed + 1, &[k, k], 1.0 / (k as f32).sqrt(), DType::F32, &dev)?
        + (Tensor::eye(k, DType::F32, &dev)? * 0.3)?)?;
    let loud: Vec<f32> = (0..k)
        .map(|i| if i % 17 == 3 { 10.0 } else { 1.0 })
        .collect();
    let x = z
        .matmul(&mix)?
        .broadcast_mul(&Tensor::new(loud.as_slice(), &dev)?)?;
    Ok((x.t()?.matmul(&x)? / tokens as f64)?)
}

fn dequant(q: &Quantized, bits: u32) -> Result<Tensor> {
    Ok(UniformWeights::from_codes(WeightFormat::Int4, bits, &q.codes, &q.params)?.dequantize()?)
}

fn codes(q: &Quantized) -> Result<Vec<u8>> {
    Ok(q.codes.flatten_all()?.to_vec1::<u8>()?)
}

/// With H = I no error propagates: GPTQ is round to nearest, codes and parameters exactly,
/// in both implementations, with and without activation order.
#[test]
fn identity_hessian_is_round_to_nearest() -> Result<()> {
    let (n, k) = (13, 300);
    let w = randn(1, &[n, k], 0.2, DType::F32, &Device::Cpu)?;
    let h = Tensor::eye(k, DType::F32, &Device::Cpu)?;
    for bits in [2, 3, 4] {
        let rule = UniformRule::new(bits);
        let rtn = round_to_nearest(&w, &rule)?;
        for act_order in [false, true] {
            let cfg = GptqConfig {
                act_order,
                ..Default::default()
            };
            for (what, q) in [
                ("ref", gptq_ref(&w, &h, &rule, &cfg)?),
                ("tensor", gptq_tensor(&w, &h, &rule, &cfg)?),
            ] {
                let q = q.quantized;
                assert_eq!(
                    codes(&q)?,
                    codes(&rtn)?,
                    "int{bits} {what} act_order {act_order}: codes"
                );
                let (a, b) = (
                    q.params.flatten_all()?.to_vec1::<f32>()?,
                    rtn.params.flatten_all()?.to_vec1::<f32>()?,
                );
                assert_eq!(a, b, "int{bits} {what} act_order {act_order}: params");
            }
        }
    }
    Ok(())
}

/// On a Hessian of correlated inputs GPTQ's objective tr((W−Q)H(W−Q)ᵀ) is well below round
/// to nearest's: under half with activation order (static groups) at every width, and
/// below it in plain order at 3 and 4 bits. (At 2 bits in plain order the groups fitted
/// on updated weights clip the later columns' updates, and the objective can end above
/// RTN's: the reason activation order with static groups is the default.)
#[test]
fn gptq_objective_below_rtn() -> Result<()> {
    let (n, k) = (37, 300);
    let w = randn(2, &[n, k], 0.2, DType::F32, &Device::Cpu)?;
    let h = hessian(3, k, 2000)?;
    for bits in [2, 3, 4] {
        let rule = UniformRule::new(bits);
        let rtn = objective(&w, &dequant(&round_to_nearest(&w, &rule)?, bits)?, &h)?;
        for act_order in [false, true] {
            let cfg = GptqConfig {
                act_order,
                ..Default::default()
            };
            let g = objective(
                &w,
                &dequant(&gptq_ref(&w, &h, &rule, &cfg)?.quantized, bits)?,
                &h,
            )?;
            println!(
                "int{bits} act_order {act_order}: GPTQ objective {g:.4} = {:.3} x RTN's {rtn:.4}",
                g / rtn
            );
            let bound = if act_order {
                0.5
            } else if bits > 2 {
                0.9
            } else {
                f64::INFINITY
            };
            assert!(
                g < bound * rtn,
                "int{bits} act_order {act_order}: GPTQ {g} not below {bound} x RTN {rtn}"
            );
        }
    }
    Ok(())
}

/// The tensor-op GPTQ (f32, what runs on the GPU) against the f64 reference: codes agree
/// except where a value sits within rounding of a decision boundary (then by one step),
/// and the objectives agree within 1 %.
#[test]
fn tensor_gptq_agrees_with_reference() -> Result<()> {
    let (n, k) = (29, 333);
    let w = randn(4, &[n, k], 0.2, DType::F32, &Device::Cpu)?;
    let h = hessian(5, k, 1500)?;
    for bits in [2, 3, 4] {
        let rule = UniformRule::new(bits);
        for act_order in [false, true] {
            let cfg = GptqConfig {
                act_order,
                block: 128,
                ..Default::default()
            };
            let (a, b) = (
                gptq_ref(&w, &h, &rule, &cfg)?.quantized,
                gptq_tensor(&w, &h, &rule, &cfg)?.quantized,
            );
            let (ca, cb) = (codes(&a)?, codes(&b)?);
            let differ = ca.iter().zip(&cb).filter(|(x, y)| x != y).count();
            let worst = ca
                .iter()
                .zip(&cb)
                .map(|(x, y)| (*x as i32 - *y as i32).abs())
                .max()
                .unwrap_or(0);
            let (oa, ob) = (
                objective(&w, &dequant(&a, bits)?, &h)?,
                objective(&w, &dequant(&b, bits)?, &h)?,
            );
            println!(
                "int{bits} act_order {act_order}: {differ} of {} codes differ (by at most {worst}); objective {oa:.5} vs {ob:.5}",
                ca.len()
            );
            assert!(
                differ * 100 <= ca.len(),
                "int{bits}: {differ} of {} codes differ",
                ca.len()
            );
            assert!(
                ((oa - ob) / oa).abs() < 0.01,
                "int{bits}: objectives {oa} vs {ob}"
            );
        }
    }
    Ok(())
}

/// `hinv_upper` returns U with UᵀU (H + λI) = I, U upper triangular.
#[test]
fn hinv_upper_is_the_cholesky_factor_of_the_inverse() -> Result<()> {
    let k = 50;
    let h = hessian(6, k, 400)?
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let (u, damp) = hinv_upper(&h, k, 0.01)?;
    assert_eq!(damp, 0.01);
    let lambda = 0.01 * (0..k).map(|i| h[i * k + i]).sum::<f64>() / k as f64;
    for i in 0..k {
        for j in 0..i {
            assert_eq!(u[i * k + j], 0.0, "U[{i}, {j}] below the diagonal");
        }
    }
    for i in 0..k {
        for j in 0..k {
            // (UᵀU (H + λI))[i, j]
            let mut s = 0.0;
            for l in 0..k {
                let utu: f64 = (0..k).map(|m| u[m * k + i] * u[m * k + l]).sum();
                s += utu * (h[l * k + j] + if l == j { lambda } else { 0.0 });
            }
            let want = if i == j { 1.0 } else { 0.0 };
            assert!((s - want).abs() < 1e-8, "UᵀU(H+λI)[{i}, {j}] = {s}");
        }
    }
    Ok(())
}

/// The blocked tensor-op factor (f32) equals faer's (f64) to f32 rounding, odd k included.
#[test]
fn tensor_hinv_matches_faer() -> Result<()> {
    for k in [1usize, 77, 300] {
        let h = hessian(9 + k as u64, k, 2 * k + 10)?;
        let hv = h.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        let (u, d1) = hinv_upper(&hv, k, 0.01)?;
        let (ut, d2) = candle_lowbit::gptq::hinv_upper_t(&h, 0.01)?;
        assert_eq!(d1, d2);
        let ut = ut.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
        let scale = u.iter().fold(0f64, |m, x| m.max(x.abs()));
        let worst = u
            .iter()
            .zip(&ut)
            .map(|(a, b)| (a - b).abs())
            .fold(0f64, f64::max);
        assert!(
            worst < 1e-4 * scale,
            "k={k}: worst |diff| {worst:.2e} (scale {scale:.2e})"
        );
    }
    Ok(())
}

/// A dead input (H[i, i] = 0) is quantized as the weight 0 would be; nothing else moves.
#[test]
fn dead_inputs_are_zeroed() -> Result<()> {
    let (n, k) = (6, 128);
    let w = randn(7, &[n, k], 0.2, DType::F32, &Device::Cpu)?;
    let h = hessian(8, k, 500)?;
    let mask: Vec<f32> = (0..k).map(|i| if i == 5 { 0.0 } else { 1.0 }).collect();
    let m = Tensor::new(mask.as_slice(), &Device::Cpu)?;
    let h = h
        .broadcast_mul(&m.unsqueeze(0)?)?
        .broadcast_mul(&m.unsqueeze(1)?)?;
    let rule = UniformRule::new(4);
    for q in [
        gptq_ref(&w, &h, &rule, &GptqConfig::default())?,
        gptq_tensor(&w, &h, &rule, &GptqConfig::default())?,
    ] {
        let d = dequant(&q.quantized, 4)?;
        let col = d.narrow(1, 5, 1)?.flatten_all()?.to_vec1::<f32>()?;
        let p = q
            .quantized
            .params
            .narrow(1, 0, 1)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (r, v) in col.iter().enumerate() {
            let step = p[2 * r];
            assert!(
                v.abs() <= step / 2.0 + 1e-6,
                "row {r}: dead column dequantizes to {v} (step {step})"
            );
        }
    }
    Ok(())
}

#[test]
fn bad_input_is_rejected() -> Result<()> {
    let w = randn(1, &[4, 64], 0.2, DType::F32, &Device::Cpu)?;
    let rule = UniformRule::new(4);
    let err = gptq_ref(
        &w,
        &Tensor::eye(63, DType::F32, &Device::Cpu)?,
        &rule,
        &GptqConfig::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("[64, 64]"), "{err}");
    let cfg = GptqConfig {
        act_order: false,
        block: 96,
        ..Default::default()
    };
    let err =
        gptq_tensor(&w, &Tensor::eye(64, DType::F32, &Device::Cpu)?, &rule, &cfg).unwrap_err();
    assert!(err.to_string().contains("multiple of the group"), "{err}");
    let neg = (Tensor::eye(64, DType::F32, &Device::Cpu)? * -1.0)?;
    let err = gptq_ref(&w, &neg, &rule, &GptqConfig::default()).unwrap_err();
    assert!(err.to_string().contains("not positive definite"), "{err}");
    Ok(())
}
