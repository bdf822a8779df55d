//! `SchedulerConfig` for Python: keyword construction (defaults from the core's
//! `SchedulerConfig::default()`), read-only fields.

use ferryman_core::{Policy, PreemptionModeConfig, SchedulerConfig};
use pyo3::prelude::*;

use crate::py_errors::{to_pyerr, InvalidRequestError};

/// A size or count from Python: a negative one is an `InvalidRequestError` naming it (not the
/// `OverflowError` of converting it to an unsigned integer).
fn count(field: &str, v: Option<i64>) -> PyResult<Option<usize>> {
    v.map(|n| usize::try_from(n).map_err(|_| InvalidRequestError::new_err(format!("{field} must be >= 0, got {n}"))))
        .transpose()
}

/// The scheduler's knobs; validated on construction.
#[pyclass(name = "SchedulerConfig", module = "ferryman._core", frozen)]
pub struct PySchedulerConfig {
    pub inner: SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    /// Every keyword is optional; a missing one takes the core's default
    /// (`SchedulerConfig::default()`, the one place the core declares them).
    #[new]
    #[pyo3(signature = (*, block_size=None, num_device_blocks=None, num_host_blocks=None,
        max_num_batched_tokens=None, max_num_seqs=None, max_model_len=None,
        enable_chunked_prefill=None, enable_prefix_caching=None, preemption_mode=None,
        policy=None, watermark=None, bytes_per_block=None, host_link_bytes_per_s=None,
        prefill_tokens_per_s=None, async_scheduling=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_size: Option<i64>,
        num_device_blocks: Option<i64>,
        num_host_blocks: Option<i64>,
        max_num_batched_tokens: Option<i64>,
        max_num_seqs: Option<i64>,
        max_model_len: Option<i64>,
        enable_chunked_prefill: Option<bool>,
        enable_prefix_caching: Option<bool>,
        preemption_mode: Option<&str>,
        policy: Option<&str>,
        watermark: Option<f64>,
        bytes_per_block: Option<f64>,
        host_link_bytes_per_s: Option<f64>,
        prefill_tokens_per_s: Option<f64>,
        async_scheduling: Option<bool>,
    ) -> PyResult<Self> {
        let d = SchedulerConfig::default();
        let inner = SchedulerConfig {
            block_size: count("block_size", block_size)?.unwrap_or(d.block_size),
            num_device_blocks: count("num_device_blocks", num_device_blocks)?.unwrap_or(d.num_device_blocks),
            num_host_blocks: count("num_host_blocks", num_host_blocks)?.unwrap_or(d.num_host_blocks),
            max_num_batched_tokens: count("max_num_batched_tokens", max_num_batched_tokens)?
                .unwrap_or(d.max_num_batched_tokens),
            max_num_seqs: count("max_num_seqs", max_num_seqs)?.unwrap_or(d.max_num_seqs),
            max_model_len: count("max_model_len", max_model_len)?.unwrap_or(d.max_model_len),
            enable_chunked_prefill: enable_chunked_prefill.unwrap_or(d.enable_chunked_prefill),
            enable_prefix_caching: enable_prefix_caching.unwrap_or(d.enable_prefix_caching),
            preemption_mode: match preemption_mode {
                Some(s) => PreemptionModeConfig::parse(s).map_err(to_pyerr)?,
                None => d.preemption_mode,
            },
            policy: match policy {
                Some(s) => Policy::parse(s).map_err(to_pyerr)?,
                None => d.policy,
            },
            watermark: watermark.unwrap_or(d.watermark),
            bytes_per_block: bytes_per_block.unwrap_or(d.bytes_per_block),
            host_link_bytes_per_s: host_link_bytes_per_s.unwrap_or(d.host_link_bytes_per_s),
            prefill_tokens_per_s: prefill_tokens_per_s.unwrap_or(d.prefill_tokens_per_s),
            async_scheduling: async_scheduling.unwrap_or(d.async_scheduling),
        };
        inner.validate().map_err(to_pyerr)?;
        Ok(Self { inner })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.inner.block_size
    }
    #[getter]
    fn num_device_blocks(&self) -> usize {
        self.inner.num_device_blocks
    }
    #[getter]
    fn num_host_blocks(&self) -> usize {
        self.inner.num_host_blocks
    }
    #[getter]
    fn max_num_batched_tokens(&self) -> usize {
        self.inner.max_num_batched_tokens
    }
    #[getter]
    fn max_num_seqs(&self) -> usize {
        self.inner.max_num_seqs
    }
    #[getter]
    fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }
    #[getter]
    fn enable_chunked_prefill(&self) -> bool {
        self.inner.enable_chunked_prefill
    }
    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.inner.enable_prefix_caching
    }
    #[getter]
    fn preemption_mode(&self) -> &'static str {
        self.inner.preemption_mode.as_str()
    }
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy.as_str()
    }
    #[getter]
    fn watermark(&self) -> f64 {
        self.inner.watermark
    }
    #[getter]
    fn bytes_per_block(&self) -> f64 {
        self.inner.bytes_per_block
    }
    #[getter]
    fn host_link_bytes_per_s(&self) -> f64 {
        self.inner.host_link_bytes_per_s
    }
    #[getter]
    fn prefill_tokens_per_s(&self) -> f64 {
        self.inner.prefill_tokens_per_s
    }
    #[getter]
    fn async_scheduling(&self) -> bool {
        self.inner.async_scheduling
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(block_size={}, num_device_blocks={}, num_host_blocks={}, \
             max_num_batched_tokens={}, max_num_seqs={}, max_model_len={}, enable_chunked_prefill={}, \
             enable_prefix_caching={}, preemption_mode='{}', policy='{}', watermark={}, async_scheduling={})",
            c.block_size,
            c.num_device_blocks,
            c.num_host_blocks,
            c.max_num_batched_tokens,
            c.max_num_seqs,
            c.max_model_len,
            if c.enable_chunked_prefill { "True" } else { "False" },
            if c.enable_prefix_caching { "True" } else { "False" },
            c.preemption_mode.as_str(),
            c.policy.as_str(),
            c.watermark,
            if c.async_scheduling { "True" } else { "False" }
        )
    }
}
