//! `sample_random_cpu` and `sample_greedy_cpu`: the core's CPU sampler
//! (`ferryman_core::sampling`) for Python. Checks and converts the arrays, then samples with the
//! GIL released.

use ferryman_core::{argmax_rows, sample_rows, RowParams};
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

/// Greedy ids of every row of `logits` (float32 `[N, V]`, C-contiguous): int32 `[N]`, each row's
/// first index of its largest logit, or -1 where that logit is not finite; and how many rows
/// are -1.
#[pyfunction]
pub fn sample_greedy_cpu<'py>(
    py: Python<'py>,
    logits: PyReadonlyArray2<'py, f32>,
) -> PyResult<(Bound<'py, PyArray1<i32>>, usize)> {
    let (n, vocab) = (logits.shape()[0], logits.shape()[1]);
    let lg = logits.as_slice().map_err(|_| InvalidRequestError::new_err("logits must be C-contiguous"))?;
    if vocab == 0 {
        return Err(InvalidRequestError::new_err("logits have no columns"));
    }
    let mut out = vec![0i32; n];
    let num_bad = py.detach(|| argmax_rows(lg, vocab, &mut out));
    Ok((PyArray1::from_vec(py, out), num_bad))
}
