//! GPTQ (Frantar et al., 2022), generic over a format's per-group quantization rule.
//!
//! For a weight `W` `[n, k]` and its input Hessian `H = XᵀX / count` `[k, k]`, GPTQ
//! quantizes the columns one at a time and spreads each column's error over the columns
//! not yet quantized, minimizing `tr((W − Q) H (W − Q)ᵀ)` instead of `‖W − Q‖²`:
//!
//! 1. dead inputs (`H[i, i] = 0`) get `H[i, i] = 1` and `W[:, i] = 0`;
//! 2. with activation order, columns go in order of decreasing `H[i, i]`, and each group's
//!    parameters are fitted once from the original weights ("static groups": the stored
//!    layout stays plain groups of consecutive columns, no index table); without it,
//!    columns go left to right and a group's parameters are fitted from the updated weights
//!    when its first column comes up;
//! 3. `H += damp · mean(diag H) · I`; `U` = the upper Cholesky factor of `H⁻¹`
//!    (`H⁻¹ = UᵀU`), computed as `R⁻¹` from the flipped factorization `H = R Rᵀ` (one
//!    Cholesky and one triangular inverse): [`hinv_upper`] with faer (f64, the host's
//!    cores) for the reference, [`hinv_upper_t`] blocked on candle ops (f32, the weight's
//!    device) for the tensor version; where the factorization fails the dampening is
//!    raised tenfold, at most three times, and the result says so;
//! 4. in blocks of `block` columns ("lazy batch updates"): for each column `j`, `q =
//!    quant(w_j)`, `e = (w_j − q) / U[j, j]`, and `w_l −= e · U[j, l]` for the later
//!    columns of the block; after the block, the columns past it get the block's errors at
//!    once (`W[:, i2:] −= E · U[i1:i2, i2:]`).
//!
//! Rows are independent given `U`. Two implementations of the same steps:
//! [`gptq_ref`], plain loops in f64 over host memory (rows split over threads), and
//! [`gptq_tensor`], candle tensor ops in f32 on the weight's device (the GPU for large
//! models), working on `Wᵀ` so that a column is a contiguous row. They agree to rounding:
//! the codes match except where a value sits within rounding of a decision boundary (f32
//! against f64 sums in another order), which the tests bound.
//!
//! The rule ([`GroupRule`]) is the only format-specific part: `int2`…`int4` plug in their
//! min/max groups; the mixed 2/4/16-bit and W4A4 formats plug in theirs.

use candle_core::{DType, Device, Result, Tensor};

/// GPTQ settings. Defaults: 1 % dampening, blocks of 128, activation order on (measured
/// necessary on the default model: DESIGN.md §2).
#[derive(Debug, Clone, PartialEq)]
pub struct GptqConfig {
    /// Dampening as a fraction of the mean Hessian diagonal.
    pub damp: f64,
    /// Columns per lazy batch update.
    pub block: usize,
    /// Quantize columns in order of decreasing Hessian diagonal (static groups), times the
    /// rule's [`GroupRule::order_weight`] (1 unless the rule's precision varies by column).
    pub act_order: bool,
    /// Fit each group's range by a search for the least squared error instead of min/max
    /// (where the format's rule has one: `UniformRule::clipped`).
    pub clip: bool,
}

impl Default for GptqConfig {
    fn default() -> Self {
        Self {
            damp: 0.01,
            block: 128,
            act_order: true,
            clip: true,
        }
    }
}

/// A format's per-group quantization rule: group parameters fitted from a group's weights,
/// and a code and its dequantized value for one weight under them. Given twice, as plain
/// scalar functions (for [`gptq_ref`]) and as tensor ops (for [`gptq_tensor`] and
/// [`round_to_nearest`]); the two must compute the same numbers.
pub trait GroupRule: Sync {
    /// Columns per group along k (the last group of a row may be shorter).
    fn group_size(&self) -> usize;
    /// Parameters per (row, group), e.g. 2: scale and zero.
    fn params(&self) -> usize;
    /// Fit the parameters `p` (`params()` values) of row `row`'s group `group` from its
    /// current weights `w`.
    fn fit(&self, row: usize, group: usize, w: &[f32], p: &mut [f32]);
    /// The code of weight `x` at (`row`, `col`) under parameters `p`, and the value it
    /// stands for.
    fn quantize(&self, row: usize, col: usize, p: &[f32], x: f32) -> (u8, f32);
    /// [`GroupRule::fit`] for all rows at once: `wt` `[width, n]` (the group's columns as
    /// rows) → parameters `[params(), n]` f32.
    fn fit_t(&self, group: usize, wt: &Tensor) -> Result<Tensor>;
    /// [`GroupRule::quantize`] for `c` columns starting at `col` (all in one group), as
    /// rows: `wt` `[c, n]` f32, `p` `[params(), n]` → (codes u8 `[c, n]`, values f32 `[c, n]`).
    fn quantize_t(&self, col: usize, wt: &Tensor, p: &Tensor) -> Result<(Tensor, Tensor)>;
    /// A factor on column `col`'s activation-order key (its Hessian diagonal): where the
    /// rule's precision varies by column (`w2416`), the mean squared step of its groups, so
    /// that the columns whose rounding costs most go first and the finer ones, quantized
    /// later, take up their error.
    fn order_weight(&self, col: usize) -> f64 {
        let _ = col;
        1.0
    }
}

/// A quantized weight: codes u8 `[n, k]`, the rule's parameters f32 `[n, groups, P]`, and
/// the values the rule gave every weight f32 `[n, k]` (what the codes stand for; where a
/// rule keeps a weight exactly, an outlier, the weight as it stood when quantized).
#[derive(Debug, Clone)]
pub struct Quantized {
    pub codes: Tensor,
    pub params: Tensor,
    pub values: Tensor,
}

/// What [`gptq`] returns: the weight, and the dampening that was used.
#[derive(Debug, Clone)]
pub struct GptqOutput {
    pub quantized: Quantized,
    /// The dampening fraction used (above the configured one where the factorization
    /// needed more).
    pub damp: f64,
}

/// Groups of `size` over `k` columns: `(start, width)` of each.
fn group_spans(k: usize, size: usize) -> Vec<(usize, usize)> {
    (0..k)
        .step_by(size.max(1))
        .map(|s| (s, size.min(k - s)))
        .collect()
}

/// Round to nearest with `rule` (no Hessian), in tensor ops on `w`'s device.
pub fn round_to_nearest(w: &Tensor, rule: &dyn GroupRule) -> Result<Quantized> {
    let (n, k) = w.dims2()?;
    let wt = w.to_dtype(DType::F32)?.t()?.contiguous()?;
    let (mut codes, mut params, mut values) = (vec![], vec![], vec![]);
    for (g, (start, width)) in group_spans(k, rule.group_size()).into_iter().enumerate() {
        let part = wt.narrow(0, start, width)?;
        let p = rule.fit_t(g, &part)?;
        let (c, v) = rule.quantize_t(start, &part, &p)?;
        codes.push(c);
        values.push(v);
        params.push(p);
    }
    let codes = Tensor::cat(&codes, 0)?.t()?.contiguous()?;
    let values = Tensor::cat(&values, 0)?.t()?.contiguous()?;
    let params = Tensor::stack(&params, 0)?
        .permute((2, 0, 1))?
        .contiguous()?;
    if codes.dims() != [n, k] {
        candle_core::bail!(
            "round to nearest: codes {:?} for a [{n}, {k}] weight",
            codes.dims()
        )
    }
    Ok(Quantized {
        codes,
        params,
        values,
    })
}

/// The scalar reference of [`round_to_nearest`]: codes `[n, k]` and parameters `[n, groups, P]`.
pub fn round_to_nearest_ref(
    w: &[f32],
    n: usize,
    k: usize,
    rule: &dyn GroupRule,
) -> (Vec<u8>, Vec<f32>) {
    let spans = group_spans(k, rule.group_size());
    let np = rule.params();
    let (mut codes, mut params) = (vec![0u8; n * k], vec![0f32; n * spans.len() * np]);
    for r in 0..n {
        for (g, &(start, width)) in spans.iter().enumerate() {
            let p = &mut params[(r * spans.len() + g) * np..][..np];
            rule.fit(r, g, &w[r * k + start..r * k + start + width], p);
            for c in start..start + width {
                codes[r * k + c] = rule.quantize(r, c, p, w[r * k + c]).0;
            }
        }
    }
    (codes, params)
}

/// `U` with `(H + λI)⁻¹ = UᵀU` (upper triangular), `H` `[k, k]` row-major f64, in place of
/// nothing: returns `U` row-major and the dampening fraction used. `λ = damp · mean(diag H)`,
/// raised tenfold (at most three times) where the factorization fails.
pub fn hinv_upper(h: &[f64], k: usize, damp: f64) -> Result<(Vec<f64>, f64)> {
    use faer::linalg::triangular_inverse::invert_lower_triangular;
    use faer::{Mat, Par, Side};
    if h.len() != k * k {
        candle_core::bail!("gptq: a Hessian of {} values is not [{k}, {k}]", h.len())
    }
    let mean_diag = (0..k).map(|i| h[i * k + i]).sum::<f64>() / k.max(1) as f64;
    let mut frac = damp;
    for _ in 0..4 {
        let lambda = frac * mean_diag;
        // The flipped matrix J H J (J reverses the order): its lower factor M gives H = R Rᵀ
        // with R = J M J upper, and U = R⁻¹ = J M⁻¹ J.
        let flipped = Mat::<f64>::from_fn(k, k, |i, j| {
            let (a, b) = (k - 1 - i, k - 1 - j);
            h[a * k + b] + if a == b { lambda } else { 0.0 }
        });
        if let Ok(llt) = flipped.llt(Side::Lower) {
            let mut minv = Mat::<f64>::zeros(k, k);
            invert_lower_triangular(minv.as_mut(), llt.L(), Par::rayon(0));
            let mut u = vec![0f64; k * k];
            for i in 0..k {
                for j in i..k {
                    u[i * k + j] = minv[(k - 1 - i, k - 1 - j)];
                }
            }
            if u.iter().all(|x| x.is_finite()) {
                return Ok((u, frac));
            }
        }
        frac *= 10.0;
    }
    candle_core::bail!(
        "gptq: the [{k}, {k}] Hessian is not positive definite even with {frac:.0e} dampening"
    )
}

/// Column order and dead columns (from the Hessian's diagonal), shared by both
/// implementations.
struct Order {
    perm: Vec<usize>,
    dead: Vec<bool>,
}

fn order(diag: &[f64], rule: &dyn GroupRule, cfg: &GptqConfig) -> Result<Order> {
    if cfg.block == 0 {
        candle_core::bail!("gptq: block must be at least 1")
    }
    let dead: Vec<bool> = diag.iter().map(|&d| d == 0.0).collect();
    let mut perm: Vec<usize> = (0..diag.len()).collect();
    if cfg.act_order {
        let key = |i: usize| {
            if dead[i] {
                1.0
            } else {
                diag[i] * rule.order_weight(i)
            }
        };
        perm.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
    }
    Ok(Order { perm, dead })
}

/// The reference's Hessian: dead inputs' diagonal set to 1, permuted, row-major f64.
fn permuted(h: &[f32], k: usize, o: &Order) -> Vec<f64> {
    let mut hp = vec![0f64; k * k];
    for (i, &pi) in o.perm.iter().enumerate() {
        for (j, &pj) in o.perm.iter().enumerate() {
            hp[i * k + j] = if pi == pj && o.dead[pi] {
                1.0
            } else {
                h[pi * k + pj] as f64
            };
        }
    }
    hp
}

/// The diagonal of a square tensor, on the host.
fn diag_of(t: &Tensor) -> Result<Vec<f64>> {
    let k = t.dim(0)?;
    let idx = Tensor::arange_step(0u32, (k * k) as u32, (k + 1) as u32, t.device())?;
    let d = t
        .flatten_all()?
        .index_select(&idx, 0)?
        .to_dtype(DType::F64)?;
    d.to_device(&Device::Cpu)?.to_vec1::<f64>()
}

/// [`hinv_upper`] in candle tensor ops (f32) on `h`'s device: a blocked right-looking
/// Cholesky of the flipped matrix and a blocked triangular inverse, both in blocks of 128
/// whose own factor and inverse come from faer on the host; everything else is matmuls on
/// the device. Measured against [`hinv_upper`] (faer, f64, the host's cores) by the bench
/// (`gptq/hinv`), which is why the tensor GPTQ uses it.
pub fn hinv_upper_t(h: &Tensor, damp: f64) -> Result<(Tensor, f64)> {
    let k = h.dim(0)?;
    if h.dims() != [k, k] {
        candle_core::bail!("gptq: a Hessian {:?} is not square", h.shape())
    }
    let dev = h.device().clone();
    let h = h.to_dtype(DType::F32)?;
    let mean_diag = diag_of(&h)?.iter().sum::<f64>() / k.max(1) as f64;
    let rev = Tensor::from_vec((0..k as u32).rev().collect::<Vec<_>>(), k, &dev)?;
    let flipped = h.index_select(&rev, 0)?.index_select(&rev, 1)?;
    let eye = Tensor::eye(k, DType::F32, &dev)?;
    let mut frac = damp;
    for _ in 0..4 {
        let a = (&flipped + (&eye * (frac * mean_diag))?)?;
        if let Some(m) = cholesky_lower_t(&a)? {
            let minv = invert_lower_t(&m)?;
            let u = minv.index_select(&rev, 0)?.index_select(&rev, 1)?;
            return Ok((u, frac));
        }
        frac *= 10.0;
    }
    candle_core::bail!(
        "gptq: the [{k}, {k}] Hessian is not positive definite even with {frac:.0e} dampening"
    )
}

/// Block size of the tensor factorizations.
const TB: usize = 128;

/// A square block on the host as a faer matrix (f64).
fn host_block(t: &Tensor) -> Result<faer::Mat<f64>> {
    let b = t.dim(0)?;
    let v = t
        .to_dtype(DType::F64)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    Ok(faer::Mat::from_fn(b, b, |i, j| v[i * b + j]))
}

fn to_tensor(m: faer::MatRef<'_, f64>, dev: &Device) -> Result<Tensor> {
    let (r, c) = (m.nrows(), m.ncols());
    let v: Vec<f32> = (0..r)
        .flat_map(|i| (0..c).map(move |j| m[(i, j)] as f32))
        .collect();
    Tensor::from_vec(v, (r, c), dev)
}

fn lower_inverse(l: faer::MatRef<'_, f64>) -> faer::Mat<f64> {
    let mut inv = faer::Mat::<f64>::zeros(l.nrows(), l.ncols());
    faer::linalg::triangular_inverse::invert_lower_triangular(inv.as_mut(), l, faer::Par::Seq);
    inv
}

/// The lower Cholesky factor of `a` `[k, k]` (f32, symmetric), or `None` where `a` is not
/// positive definite.
fn cholesky_lower_t(a: &Tensor) -> Result<Option<Tensor>> {
    let (k, dev) = (a.dim(0)?, a.device().clone());
    let mut rest = a.clone();
    let mut cols = vec![];
    for j in (0..k).step_by(TB) {
        let b = TB.min(k - j);
        let Ok(llt) = host_block(&rest.narrow(0, 0, b)?.narrow(1, 0, b)?)?.llt(faer::Side::Lower)
        else {
            return Ok(None);
        };
        let l11 = to_tensor(llt.L(), &dev)?;
        let mut col = vec![l11];
        if j + b < k {
            let m = k - j - b;
            let l11_inv_t = to_tensor(lower_inverse(llt.L()).as_ref(), &dev)?
                .t()?
                .contiguous()?;
            let l21 = rest
                .narrow(0, b, m)?
                .narrow(1, 0, b)?
                .contiguous()?
                .matmul(&l11_inv_t)?;
            let a22 = rest.narrow(0, b, m)?.narrow(1, b, m)?;
            rest = (a22 - l21.matmul(&l21.t()?)?)?.contiguous()?;
            col.push(l21);
        }
        let mut col = Tensor::cat(&col, 0)?;
        if j > 0 {
            col = Tensor::cat(&[Tensor::zeros((j, b), DType::F32, &dev)?, col], 0)?;
        }
        cols.push(col);
    }
    let l = Tensor::cat(&cols, 1)?;
    Ok(if l.sum_all()?.to_scalar::<f32>()?.is_finite() {
        Some(l)
    } else {
        None
    })
}

/// The inverse of lower triangular `l` `[k, k]` (f32), by block rows: `X_ii = L_ii⁻¹`,
/// `X[i, :i] = −L_ii⁻¹ · L[i, :i] · X[:i, :i]`.
fn invert_lower_t(l: &Tensor) -> Result<Tensor> {
    let (k, dev) = (l.dim(0)?, l.device().clone());
    let mut rows: Vec<Tensor> = vec![];
    let mut done: Option<Tensor> = None; // X[:i, :i]
    for i in (0..k).step_by(TB) {
        let b = TB.min(k - i);
        let lii_inv = to_tensor(
            lower_inverse(host_block(&l.narrow(0, i, b)?.narrow(1, i, b)?)?.as_ref()).as_ref(),
            &dev,
        )?;
        let mut row = vec![];
        if let Some(x) = &done {
            let li = l.narrow(0, i, b)?.narrow(1, 0, i)?.contiguous()?;
            row.push((lii_inv.matmul(&li.matmul(x)?)? * -1.0)?);
        }
        row.push(lii_inv);
        if i + b < k {
            row.push(Tensor::zeros((b, k - i - b), DType::F32, &dev)?);
        }
        rows.push(Tensor::cat(&row, 1)?);
        let all = Tensor::cat(&rows, 0)?;
        done = Some(all.narrow(1, 0, i + b)?.contiguous()?);
    }
    Tensor::cat(&rows, 0)
}

/// Check shapes and the rule's group/block fit; returns `(n, k)`.
fn check(w: &Tensor, h: &Tensor, rule: &dyn GroupRule, cfg: &GptqConfig) -> Result<(usize, usize)> {
    let (n, k) = w.dims2()?;
    if h.dims() != [k, k] {
        candle_core::bail!(
            "gptq: Hessian {:?} for a weight {:?} (want [{k}, {k}])",
            h.shape(),
            w.shape()
        )
    }
    if !cfg.act_order && !cfg.block.is_multiple_of(rule.group_size()) {
        candle_core::bail!(
            "gptq: without activation order the block ({}) must be a multiple of the group ({})",
            cfg.block,
            rule.group_size()
        )
    }
    Ok((n, k))
}

/// GPTQ of `w` `[n, k]` under Hessian `h` `[k, k]`: [`gptq_ref`] on the CPU, [`gptq_tensor`]
/// elsewhere.
pub fn gptq(w: &Tensor, h: &Tensor, rule: &dyn GroupRule, cfg: &GptqConfig) -> Result<GptqOutput> {
    match w.device() {
        Device::Cpu => gptq_ref(w, h, rule, cfg),
        _ => gptq_tensor(w, h, rule, cfg),
    }
}

fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()
}

/// The plain reference: f64 loops over host memory, rows split over threads.
pub fn gptq_ref(
    w: &Tensor,
    h: &Tensor,
    rule: &dyn GroupRule,
    cfg: &GptqConfig,
) -> Result<GptqOutput> {
    let (n, k) = check(w, h, rule, cfg)?;
    let hv = host_f32(h)?;
    let prep = order(
        &(0..k).map(|i| hv[i * k + i] as f64).collect::<Vec<_>>(),
        rule,
        cfg,
    )?;
    let (u, damp) = hinv_upper(&permuted(&hv, k, &prep), k, cfg.damp)?;
    let mut wv = host_f32(w)?;
    for r in 0..n {
        for (c, &d) in prep.dead.iter().enumerate() {
            if d {
                wv[r * k + c] = 0.0;
            }
        }
    }
    let spans = group_spans(k, rule.group_size());
    let np = rule.params();
    let (mut codes, mut params) = (vec![0u8; n * k], vec![0f32; n * spans.len() * np]);
    let mut values = vec![0f32; n * k];
    let threads = std::thread::available_parallelism()
        .map(|t| t.get())
        .unwrap_or(1)
        .min(n.max(1));
    let rows_per = n.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let work = wv
            .chunks(rows_per * k)
            .zip(codes.chunks_mut(rows_per * k))
            .zip(values.chunks_mut(rows_per * k))
            .zip(params.chunks_mut(rows_per * spans.len() * np));
        for (chunk, (((wr, cr), vr), pr)) in work.enumerate() {
            let (prep, u, spans) = (&prep, &u, &spans);
            s.spawn(move || {
                let rows = wr
                    .chunks(k)
                    .zip(cr.chunks_mut(k))
                    .zip(vr.chunks_mut(k))
                    .zip(pr.chunks_mut(spans.len() * np));
                for (i, (((w_row, c_row), v_row), p_row)) in rows.enumerate() {
                    let out = (chunk * rows_per + i, c_row, v_row, p_row);
                    gptq_row(w_row, out, (prep, u, spans), rule, cfg);
                }
            });
        }
    });
    let dev = w.device();
    let codes = Tensor::from_vec(codes, (n, k), &Device::Cpu)?.to_device(dev)?;
    let values = Tensor::from_vec(values, (n, k), &Device::Cpu)?.to_device(dev)?;
    let params = Tensor::from_vec(params, (n, spans.len(), np), &Device::Cpu)?.to_device(dev)?;
    Ok(GptqOutput {
        quantized: Quantized {
            codes,
            params,
            values,
        },
        damp,
    })
}

/// One row of [`gptq_ref`]: `w` row `row`'s weights (original column order); its `codes`,
/// `values` and `p` (`[groups, P]`) written in the original order.
fn gptq_row(
    w: &[f32],
    (row, codes, values, p): (usize, &mut [u8], &mut [f32], &mut [f32]),
    (prep, u, spans): (&Order, &[f64], &[(usize, usize)]),
    rule: &dyn GroupRule,
    cfg: &GptqConfig,
) {
    let k = w.len();
    let (gs, np) = (rule.group_size(), rule.params());
    if cfg.act_order {
        for (g, &(start, width)) in spans.iter().enumerate() {
            rule.fit(
                row,
                g,
                &w[start..start + width],
                &mut p[g * np..(g + 1) * np],
            );
        }
    }
    // The row in processing order, updated as columns are quantized.
    let mut x: Vec<f64> = prep.perm.iter().map(|&c| w[c] as f64).collect();
    let mut err = vec![0f64; cfg.block];
    for i1 in (0..k).step_by(cfg.block) {
        let i2 = (i1 + cfg.block).min(k);
        for i in i1..i2 {
            let col = prep.perm[i];
            let g = col / gs;
            if !cfg.act_order && col == spans[g].0 {
                let vals: Vec<f32> = x[i..i + spans[g].1].iter().map(|&v| v as f32).collect();
                rule.fit(row, g, &vals, &mut p[g * np..(g + 1) * np]);
            }
            let (c, q) = rule.quantize(row, col, &p[g * np..(g + 1) * np], x[i] as f32);
            codes[col] = c;
            values[col] = q;
            let e = (x[i] - q as f64) / u[i * k + i];
            err[i - i1] = e;
            for (xl, ul) in x[i + 1..i2].iter_mut().zip(&u[i * k + i + 1..i * k + i2]) {
                *xl -= e * ul;
            }
        }
        for i in i1..i2 {
            let e = err[i - i1];
            for (xl, ul) in x[i2..].iter_mut().zip(&u[i * k + i2..(i + 1) * k]) {
                *xl -= e * ul;
            }
        }
    }
}

/// The same algorithm in candle tensor ops (f32) on the weight's device, on `Wᵀ` `[k, n]`.
pub fn gptq_tensor(
    w: &Tensor,
    h: &Tensor,
    rule: &dyn GroupRule,
    cfg: &GptqConfig,
) -> Result<GptqOutput> {
    let (n, k) = check(w, h, rule, cfg)?;
    let dev = w.device().clone();
    let h = h.to_dtype(DType::F32)?;
    let prep = order(&diag_of(&h)?, rule, cfg)?;
    let fix: Vec<f32> = prep
        .dead
        .iter()
        .map(|&d| if d { 1.0 } else { 0.0 })
        .collect();
    let fix =
        Tensor::eye(k, DType::F32, &dev)?.broadcast_mul(&Tensor::from_vec(fix, (1, k), &dev)?)?;
    let perm_t = Tensor::from_vec(
        prep.perm.iter().map(|&c| c as u32).collect::<Vec<_>>(),
        k,
        &dev,
    )?;
    let hp = (h + fix)?
        .index_select(&perm_t, 0)?
        .index_select(&perm_t, 1)?;
    let (u, damp) = hinv_upper_t(&hp, cfg.damp)?;
    let u_diag = diag_of(&u)?;
    let alive: Vec<f32> = prep
        .dead
        .iter()
        .map(|&d| if d { 0.0 } else { 1.0 })
        .collect();
    let wt = w
        .to_dtype(DType::F32)?
        .t()?
        .broadcast_mul(&Tensor::from_vec(alive, (k, 1), &dev)?)?
        .contiguous()?;
    let spans = group_spans(k, rule.group_size());
    let mut params: Vec<Option<Tensor>> = vec![None; spans.len()];
    if cfg.act_order {
        for (g, &(start, width)) in spans.iter().enumerate() {
            params[g] = Some(rule.fit_t(g, &wt.narrow(0, start, width)?)?);
        }
    }
    let x = wt.index_select(&perm_t, 0)?.contiguous()?;
    let codes = Tensor::zeros((k, n), DType::U8, &dev)?;
    let values = Tensor::zeros((k, n), DType::F32, &dev)?;
    for i1 in (0..k).step_by(cfg.block) {
        let cnt = cfg.block.min(k - i1);
        let blk = x.narrow(0, i1, cnt)?.contiguous()?;
        let ut = u
            .narrow(0, i1, cnt)?
            .narrow(1, i1, cnt)?
            .t()?
            .contiguous()?; // [cnt, cnt]: row j = U[i1.., i1 + j]
        let err = Tensor::zeros((cnt, n), DType::F32, &dev)?;
        for i in 0..cnt {
            let col = prep.perm[i1 + i];
            let g = col / rule.group_size();
            // Column i of the block with the updates from the block's earlier columns.
            let xi = blk.narrow(0, i, 1)?;
            let xi = if i == 0 {
                xi
            } else {
                (xi - ut
                    .narrow(0, i, 1)?
                    .narrow(1, 0, i)?
                    .matmul(&err.narrow(0, 0, i)?)?)?
            };
            if !cfg.act_order && col == spans[g].0 {
                let width = spans[g].1;
                let later = blk.narrow(0, i, width)?;
                let upd = if i == 0 {
                    later
                } else {
                    (later
                        - ut.narrow(0, i, width)?
                            .narrow(1, 0, i)?
                            .matmul(&err.narrow(0, 0, i)?)?)?
                };
                params[g] = Some(rule.fit_t(g, &upd)?);
            }
            let Some(pg) = params[g].as_ref() else {
                candle_core::bail!("gptq: group {g} has no parameters")
            };
            let (c, q) = rule.quantize_t(col, &xi, pg)?;
            let d = u_diag[i1 + i];
            err.slice_set(&((xi - &q)? / d)?, 0, i)?;
            codes.slice_set(&c, 0, i1 + i)?;
            values.slice_set(&q, 0, i1 + i)?;
        }
        if i1 + cnt < k {
            let rest = x.narrow(0, i1 + cnt, k - i1 - cnt)?;
            let ub = u
                .narrow(0, i1, cnt)?
                .narrow(1, i1 + cnt, k - i1 - cnt)?
                .t()?
                .contiguous()?; // [rest, cnt] (candle's CUDA matmul takes no offset views here)
            x.slice_set(&(rest - ub.matmul(&err)?)?, 0, i1 + cnt)?;
        }
    }
    let mut inv = vec![0u32; k];
    for (i, &c) in prep.perm.iter().enumerate() {
        inv[c] = i as u32;
    }
    let inv = Tensor::from_vec(inv, k, &dev)?;
    let codes = codes.index_select(&inv, 0)?.t()?.contiguous()?;
    let values = values.index_select(&inv, 0)?.t()?.contiguous()?;
    let params = params.into_iter().collect::<Option<Vec<_>>>();
    let Some(params) = params else {
        candle_core::bail!("gptq: a group was never fitted")
    };
    let params = Tensor::stack(&params, 0)?
        .permute((2, 0, 1))?
        .contiguous()?;
    Ok(GptqOutput {
        quantized: Quantized {
            codes,
            params,
            values,
        },
        damp,
    })
}

/// `tr((W − Q) H (W − Q)ᵀ)`: the objective GPTQ minimizes (f64 on the host).
pub fn objective(w: &Tensor, q: &Tensor, h: &Tensor) -> Result<f64> {
    let d = (w.to_dtype(DType::F64)? - q.to_dtype(DType::F64)?)?;
    let hd = d.matmul(&h.to_dtype(DType::F64)?)?;
    (hd * d)?
        .sum_all()?
        .to_device(&Device::Cpu)?
        .to_scalar::<f64>()
}
