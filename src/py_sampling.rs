//! `sample_cpu` (a step's samples) and `sample_random_cpu` (random rows): the core's CPU sampler
//! (`ferryman_core::sampling`) for Python. Checks and converts the arrays, then samples with the
//! GIL released.

use ferryman_core::{sample_rows, sample_step, RowParams};
use numpy::{PyArray1, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::py_errors::InvalidRequestError;

/// One token (int64) per entry of `rows`: a random sample of `logits[rows[i]]` under the i-th
/// entry of each parameter array. `logits` is float32 `[N, V]`, C-contiguous; every other array
/// is 1-D with one entry per sample.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn sample_random_cpu<'py>(
    py: Python<'py>,
    logits: PyReadonlyArray2<'py, f32>,
    rows: PyReadonlyArray1<'py, i64>,
    temperature: PyReadonlyArray1<'py, f32>,
    top_k: PyReadonlyArray1<'py, i64>,
    top_p: PyReadonlyArray1<'py, f32>,
    min_p: PyReadonlyArray1<'py, f32>,
    seeds: PyReadonlyArray1<'py, i64>,
    positions: PyReadonlyArray1<'py, i64>,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let (n, vocab) = (logits.shape()[0], logits.shape()[1]);
    let lg = logits.as_slice().map_err(|_| InvalidRequestError::new_err("logits must be C-contiguous"))?;
    let rows = rows.as_slice()?;
    let (t, k, p, m, s, pos) = (
        temperature.as_slice()?,
        top_k.as_slice()?,
        top_p.as_slice()?,
        min_p.as_slice()?,
        seeds.as_slice()?,
        positions.as_slice()?,
    );
    let len = rows.len();
    if vocab == 0 {
        return Err(InvalidRequestError::new_err("logits have no columns")); // as sample_cpu says
    }
    if [t.len(), k.len(), p.len(), m.len(), s.len(), pos.len()].iter().any(|&l| l != len) {
        return Err(InvalidRequestError::new_err("every parameter array needs one entry per row sampled"));
    }
    let mut at = Vec::with_capacity(len);
    let mut params = Vec::with_capacity(len);
    for i in 0..len {
        let row = usize::try_from(rows[i]).ok().filter(|&r| r < n);
        let row = row.ok_or_else(|| InvalidRequestError::new_err(format!("row {} out of range [0, {n})", rows[i])))?;
        if !(t[i] > 0.0 && t[i].is_finite()) {
            return Err(InvalidRequestError::new_err(format!("temperature {} of a random sample must be > 0", t[i])));
        }
        at.push(row);
        params.push(RowParams {
            temperature: t[i],
            top_k: k[i],
            top_p: p[i],
            min_p: m[i],
            seed: s[i],
            position: pos[i],
        });
    }
    let mut out = vec![0i64; len];
    py.detach(|| sample_rows(lg, vocab, &at, &params, &mut out));
    Ok(PyArray1::from_vec(py, out))
}

/// One token per sample of a step on the CPU, sample i from row i of `logits` (float32
/// `[N, V]`, C-contiguous): the argmax, or a random token where its batch row `rows[i]` has a
/// temperature > 0 (by-row columns `temperature` .. `seed`, each `[R]`, with the fork's seed
/// `seed + fork_seed_stride * seq_indices[i]` and the position `positions[i]`); -1 where the
/// row's largest logit is not finite. Returns the int32 ids and the number of -1 rows.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
pub fn sample_cpu<'py>(
    py: Python<'py>,
    logits: PyReadonlyArray2<'py, f32>,
    rows: PyReadonlyArray1<'py, i32>,
    seq_indices: PyReadonlyArray1<'py, i32>,
    positions: PyReadonlyArray1<'py, i32>,
    temperature: PyReadonlyArray1<'py, f32>,
    top_k: PyReadonlyArray1<'py, i64>,
    top_p: PyReadonlyArray1<'py, f32>,
    min_p: PyReadonlyArray1<'py, f32>,
    seed: PyReadonlyArray1<'py, i64>,
    fork_seed_stride: i64,
) -> PyResult<(Bound<'py, PyArray1<i32>>, usize)> {
    let (n, vocab) = (logits.shape()[0], logits.shape()[1]);
    let lg = logits.as_slice().map_err(|_| InvalidRequestError::new_err("logits must be C-contiguous"))?;
    if vocab == 0 {
        return Err(InvalidRequestError::new_err("logits have no columns"));
    }
    let (rows, forks, pos) = (rows.as_slice()?, seq_indices.as_slice()?, positions.as_slice()?);
    if [rows.len(), forks.len(), pos.len()].iter().any(|&l| l != n) {
        return Err(InvalidRequestError::new_err("rows, seq_indices and positions need one entry per logits row"));
    }
    let (t, k, p, m, s) =
        (temperature.as_slice()?, top_k.as_slice()?, top_p.as_slice()?, min_p.as_slice()?, seed.as_slice()?);
    let num_rows = t.len();
    if [k.len(), p.len(), m.len(), s.len()].iter().any(|&l| l != num_rows) {
        return Err(InvalidRequestError::new_err("every by-row column needs the same length"));
    }
    let mut params = Vec::with_capacity(n);
    for i in 0..n {
        let r = usize::try_from(rows[i]).ok().filter(|&r| r < num_rows);
        let r =
            r.ok_or_else(|| InvalidRequestError::new_err(format!("row {} out of range [0, {num_rows})", rows[i])))?;
        if !t[r].is_finite() {
            return Err(InvalidRequestError::new_err(format!("temperature {} of row {r} is not finite", t[r])));
        }
        params.push((t[r] > 0.0).then(|| RowParams {
            temperature: t[r],
            top_k: k[r],
            top_p: p[r],
            min_p: m[r],
            seed: s[r].wrapping_add(fork_seed_stride.wrapping_mul(i64::from(forks[i]))),
            position: i64::from(pos[i]),
        }));
    }
    let mut out = vec![0i32; n];
    let num_bad = py.detach(|| sample_step(lg, vocab, &params, &mut out));
    Ok((PyArray1::from_vec(py, out), num_bad))
}
