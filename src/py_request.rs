//! `RequestParams` for Python: the one record a request crosses into the core with, converted
//! and validated once, on construction (`ferryman_core::RequestParams::validate`).

use ferryman_core::{GrammarSpec, RequestParams, TextParams};
use pyo3::prelude::*;

use crate::py_errors::InvalidRequestError;

fn token_id(field: &str, t: i64) -> PyResult<u32> {
    if (0..=i32::MAX as i64).contains(&t) {
        Ok(t as u32)
    } else {
        Err(InvalidRequestError::new_err(format!("{field}: token id {t} out of range [0, 2**31)")))
    }
}

/// A request's stop conditions, EOS ids, `n`, priority and text options, validated on
/// construction; `Scheduler.add_request` takes it.
#[pyclass(name = "RequestParams", module = "ferryman._core", frozen)]
#[derive(Clone)]
pub struct PyRequestParams {
    pub inner: RequestParams,
}

#[pymethods]
impl PyRequestParams {
    #[new]
    #[pyo3(signature = (max_tokens, *, priority=0, eos_token_ids=Vec::new(), stop_token_ids=Vec::new(),
        ignore_eos=false, n=1, detokenize=false, stop=Vec::new(), skip_reading_prefix_cache=false,
        grammar_kind=None, grammar=String::new(), min_tokens=0, include_stop_str_in_output=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        max_tokens: i64,
        priority: i32,
        eos_token_ids: Vec<i64>,
        stop_token_ids: Vec<i64>,
        ignore_eos: bool,
        n: i64,
        detokenize: bool,
        stop: Vec<String>,
        skip_reading_prefix_cache: bool,
        grammar_kind: Option<String>,
        grammar: String,
        min_tokens: i64,
        include_stop_str_in_output: bool,
    ) -> PyResult<Self> {
        let ids = |field: &str, v: Vec<i64>| v.into_iter().map(|t| token_id(field, t)).collect::<PyResult<Vec<_>>>();
        if !detokenize && !stop.is_empty() {
            return Err(InvalidRequestError::new_err("stop strings need detokenize=True"));
        }
        let Ok(min_tokens) = usize::try_from(min_tokens) else {
            return Err(InvalidRequestError::new_err(format!("min_tokens must be >= 0, got {min_tokens}")));
        };
        let inner = RequestParams {
            max_tokens: usize::try_from(max_tokens).unwrap_or(0),
            priority,
            eos_token_ids: ids("eos_token_ids", eos_token_ids)?,
            stop_token_ids: ids("stop_token_ids", stop_token_ids)?,
            ignore_eos,
            n: u32::try_from(n).unwrap_or(0),
            text: detokenize.then_some(TextParams { stop, min_tokens, include_stop_str_in_output }),
            skip_reading_prefix_cache,
            grammar: grammar_kind.map(|kind| GrammarSpec { kind, data: grammar }),
        };
        inner.validate().map_err(|msg| {
            InvalidRequestError::new_err(match msg.as_str() {
                "max_tokens must be >= 1" => format!("{msg}, got {max_tokens}"),
                "n must be >= 1" => format!("{msg}, got {n}"),
                _ => msg,
            })
        })?;
        // min_tokens is checked here, not in `validate`: it counts without text too (EOS held back)
        if min_tokens > inner.max_tokens {
            let msg = format!("min_tokens ({min_tokens}) must be <= max_tokens ({})", inner.max_tokens);
            return Err(InvalidRequestError::new_err(msg));
        }
        Ok(Self { inner })
    }

    #[getter]
    fn max_tokens(&self) -> usize {
        self.inner.max_tokens
    }
    #[getter]
    fn priority(&self) -> i32 {
        self.inner.priority
    }
    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_token_ids.clone()
    }
    #[getter]
    fn stop_token_ids(&self) -> Vec<u32> {
        self.inner.stop_token_ids.clone()
    }
    #[getter]
    fn ignore_eos(&self) -> bool {
        self.inner.ignore_eos
    }
    #[getter]
    fn n(&self) -> u32 {
        self.inner.n
    }
    #[getter]
    fn detokenize(&self) -> bool {
        self.inner.text.is_some()
    }
    #[getter]
    fn skip_reading_prefix_cache(&self) -> bool {
        self.inner.skip_reading_prefix_cache
    }
    #[getter]
    fn grammar_kind(&self) -> Option<String> {
        self.inner.grammar.as_ref().map(|g| g.kind.clone())
    }
    #[getter]
    fn grammar(&self) -> String {
        self.inner.grammar.as_ref().map(|g| g.data.clone()).unwrap_or_default()
    }
    #[getter]
    fn stop(&self) -> Vec<String> {
        self.inner.text.as_ref().map(|t| t.stop.clone()).unwrap_or_default()
    }
    #[getter]
    fn min_tokens(&self) -> usize {
        self.inner.text.as_ref().map_or(0, |t| t.min_tokens)
    }
    #[getter]
    fn include_stop_str_in_output(&self) -> bool {
        self.inner.text.as_ref().is_some_and(|t| t.include_stop_str_in_output)
    }

    fn __repr__(&self) -> String {
        let p = &self.inner;
        format!(
            "RequestParams(max_tokens={}, priority={}, eos_token_ids={:?}, stop_token_ids={:?}, ignore_eos={}, \
             n={}, detokenize={}, stop={:?}, skip_reading_prefix_cache={}, grammar_kind={}, min_tokens={}, \
             include_stop_str_in_output={})",
            p.max_tokens,
            p.priority,
            p.eos_token_ids,
            p.stop_token_ids,
            if p.ignore_eos { "True" } else { "False" },
            p.n,
            if p.text.is_some() { "True" } else { "False" },
            self.stop(),
            if p.skip_reading_prefix_cache { "True" } else { "False" },
            p.grammar.as_ref().map_or("None".to_string(), |g| format!("'{}'", g.kind)),
            self.min_tokens(),
            if self.include_stop_str_in_output() { "True" } else { "False" },
        )
    }
}
