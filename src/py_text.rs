//! `TokenBytes`: each token's own bytes for Python (OpenAI's logprob `bytes`), from the core's
//! per-token table of a tokenizer.json. Immutable, so any thread may call it.

use ferryman_core::Tokenizer;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::py_errors::to_pyerr;

/// Token id -> the bytes that token adds to the text before UTF-8 decoding.
#[pyclass(name = "TokenBytes", module = "ferryman._core", frozen)]
pub struct PyTokenBytes {
    inner: Tokenizer,
}

#[pymethods]
impl PyTokenBytes {
    #[new]
    fn new(tokenizer_json: &str) -> PyResult<Self> {
        Ok(Self { inner: Tokenizer::from_bytes(tokenizer_json.as_bytes()).map_err(to_pyerr)? })
    }

    /// Empty for an id outside the vocabulary, negative or past u32 included.
    fn __call__<'py>(&self, py: Python<'py>, token_id: i64) -> Bound<'py, PyBytes> {
        let bytes = u32::try_from(token_id).map(|t| self.inner.token_bytes(t)).unwrap_or_default();
        PyBytes::new(py, &bytes)
    }
}
