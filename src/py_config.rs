//! `SchedulerConfig` for Python: keyword construction with vLLM's defaults, read-only fields.

use ferryman_core::{Policy, PreemptionModeConfig, SchedulerConfig};
use pyo3::prelude::*;

use crate::py_errors::to_pyerr;

/// The scheduler's knobs; validated on construction.
#[pyclass(name = "SchedulerConfig", module = "ferryman._core", frozen)]
pub struct PySchedulerConfig {
    pub inner: SchedulerConfig,
}

#[pymethods]
impl PySchedulerConfig {
    #[new]
    #[pyo3(signature = (*, block_size=16, num_device_blocks=4096, num_host_blocks=0,
        max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=8192,
        enable_chunked_prefill=true, enable_prefix_caching=true, preemption_mode="auto",
        policy="fcfs", watermark=0.01, bytes_per_block=2097152.0, host_link_bytes_per_s=50e9,
        prefill_tokens_per_s=20000.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_size: usize,
        num_device_blocks: usize,
        num_host_blocks: usize,
        max_num_batched_tokens: usize,
        max_num_seqs: usize,
        max_model_len: usize,
        enable_chunked_prefill: bool,
        enable_prefix_caching: bool,
        preemption_mode: &str,
        policy: &str,
        watermark: f64,
        bytes_per_block: f64,
        host_link_bytes_per_s: f64,
        prefill_tokens_per_s: f64,
    ) -> PyResult<Self> {
        let inner = SchedulerConfig {
            block_size,
            num_device_blocks,
            num_host_blocks,
            max_num_batched_tokens,
            max_num_seqs,
            max_model_len,
            enable_chunked_prefill,
            enable_prefix_caching,
            preemption_mode: PreemptionModeConfig::parse(preemption_mode).map_err(to_pyerr)?,
            policy: Policy::parse(policy).map_err(to_pyerr)?,
            watermark,
            bytes_per_block,
            host_link_bytes_per_s,
            prefill_tokens_per_s,
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

    fn __repr__(&self) -> String {
        let c = &self.inner;
        format!(
            "SchedulerConfig(block_size={}, num_device_blocks={}, num_host_blocks={}, \
             max_num_batched_tokens={}, max_num_seqs={}, max_model_len={}, enable_chunked_prefill={}, \
             enable_prefix_caching={}, preemption_mode='{}', policy='{}', watermark={})",
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
            c.watermark
        )
    }
}
