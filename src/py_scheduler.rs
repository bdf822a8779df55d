//! `Scheduler` for Python: argument checking and conversion around `ferryman_core::Scheduler`.

use ferryman_core::{FinishReason, Scheduler, Tokenizer};
use numpy::{AllowTypeChange, PyArray1, PyArrayLike1, PyArrayMethods, ToPyArray};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyInt};

use crate::py_config::PySchedulerConfig;
use crate::py_errors::{to_pyerr, InvalidRequestError};
use crate::py_outputs::{PySchedulerOutput, PyStepOutputs};
use crate::py_request::PyRequestParams;

/// The per-step scheduler and KV block manager. Two calls cross per step: `schedule()` and
/// `update()`.
#[pyclass(name = "Scheduler", module = "ferryman._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

/// A request id: an integer in [0, 2**63). Any other integer (negative, or one pyo3's conversion
/// would call an overflow) is `InvalidRequestError`; a non-integer stays a `TypeError`, as
/// Python's own calls say.
fn req_id_of(req_id: &Bound<'_, PyAny>) -> PyResult<u64> {
    match req_id.extract::<u64>() {
        Ok(id) if id <= i64::MAX as u64 => Ok(id),
        Err(e) if !req_id.is_instance_of::<PyInt>() => Err(e),
        _ => Err(InvalidRequestError::new_err(format!("req_id must be an integer in [0, 2**63), got {req_id}"))),
    }
}

fn seq_index_of(seq_index: i64) -> PyResult<u32> {
    u32::try_from(seq_index).map_err(|_| {
        InvalidRequestError::new_err(format!("seq_index must be an integer in [0, 2**32), got {seq_index}"))
    })
}

fn token_of(req_id: u64, t: i64) -> PyResult<u32> {
    if (0..=i32::MAX as i64).contains(&t) {
        Ok(t as u32)
    } else {
        Err(InvalidRequestError::new_err(format!("request {req_id}: token id {t} out of range [0, 2**31)")))
    }
}

/// Sampled ids given as anything but a contiguous int32 array (another array, a list, a torch
/// tensor): through `numpy.asarray`, integers only (floats are refused, not truncated), each
/// within int32 (not wrapped); an integer too large for numpy is refused too.
fn token_ids(ids: &Bound<'_, PyAny>) -> PyResult<Vec<i32>> {
    let py = ids.py();
    let arr = py.import("numpy")?.call_method1("asarray", (ids,)).map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) {
            InvalidRequestError::new_err(format!("sampled token ids out of range: {e}"))
        } else {
            e
        }
    })?;
    if arr.getattr("size")?.extract::<usize>()? == 0 {
        return Ok(Vec::new()); // numpy makes [] a float array: no ids, whatever the dtype
    }
    let kind: String = arr.getattr("dtype")?.getattr("kind")?.extract()?;
    if kind == "O" {
        return Err(InvalidRequestError::new_err(
            "sampled token ids out of range, or not numbers (numpy holds them as objects)",
        ));
    }
    if kind != "i" && kind != "u" {
        return Err(InvalidRequestError::new_err(format!(
            "sampled token ids must be integers, got dtype kind {kind:?}"
        )));
    }
    let wide = arr.extract::<PyArrayLike1<'_, i64, AllowTypeChange>>()?;
    wide.as_array()
        .iter()
        .map(|&t| {
            i32::try_from(t).map_err(|_| InvalidRequestError::new_err(format!("sampled token id {t} out of range")))
        })
        .collect()
}

#[pymethods]
impl PyScheduler {
    #[new]
    fn new(config: &PySchedulerConfig) -> PyResult<Self> {
        Ok(Self { inner: Scheduler::new(config.inner.clone()).map_err(to_pyerr)? })
    }

    /// The configuration this scheduler was built with.
    #[getter]
    fn config(&self) -> PySchedulerConfig {
        PySchedulerConfig { inner: self.inner.config().clone() }
    }

    /// Detokenizes requests' output from now on (`tokenizer_json`: a tokenizer.json's content).
    fn set_tokenizer(&mut self, tokenizer_json: &str) -> PyResult<()> {
        self.inner.set_tokenizer(Tokenizer::from_bytes(tokenizer_json.as_bytes()).map_err(to_pyerr)?);
        Ok(())
    }

    /// Queues a request: its prompt and its parameters (`RequestParams`, validated when built).
    fn add_request(
        &mut self,
        req_id: &Bound<'_, PyAny>,
        prompt_token_ids: Vec<i64>,
        params: &PyRequestParams,
    ) -> PyResult<()> {
        let id = req_id_of(req_id)?;
        let prompt = prompt_token_ids.into_iter().map(|t| token_of(id, t)).collect::<PyResult<Vec<_>>>()?;
        self.inner.add_request(id, prompt, params.inner.clone()).map_err(to_pyerr)
    }

    /// Plans one step.
    fn schedule(&mut self) -> PyResult<PySchedulerOutput> {
        let out = self.inner.schedule().map_err(to_pyerr)?;
        Ok(PySchedulerOutput::new(out))
    }

    /// Applies one sampled token per entry of the last `logits_indices`.
    fn update(&mut self, sampled_token_ids: &Bound<'_, PyAny>) -> PyResult<PyStepOutputs> {
        // a contiguous int32 array (what the engine passes) is copied out as it is: a few hundred
        // ids, cheaper than numpy's borrow tracking, which takes a shared lock and a hash map
        // entry per call; anything else (strided, another dtype, a list) through numpy
        let contiguous = sampled_token_ids.cast::<PyArray1<i32>>().ok().and_then(|a| a.to_vec().ok());
        let tokens = match contiguous {
            Some(tokens) => tokens,
            None => token_ids(sampled_token_ids)?,
        };
        Ok(PyStepOutputs::new(self.inner.update(&tokens).map_err(to_pyerr)?))
    }

    /// Aborts a request (all its sequences); False if it is not live.
    fn abort_request(&mut self, req_id: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.inner.abort_request(req_id_of(req_id)?))
    }

    /// Finishes a live request (or one fork) for a reason found outside the core.
    #[pyo3(signature = (req_id, reason, seq_index=None))]
    fn finish_request(&mut self, req_id: &Bound<'_, PyAny>, reason: &str, seq_index: Option<i64>) -> PyResult<()> {
        let seq_index = seq_index.map(seq_index_of).transpose()?;
        let reason = match reason {
            "stop" => FinishReason::Stop,
            "length" => FinishReason::Length,
            "abort" => FinishReason::Abort,
            other => return Err(to_pyerr(ferryman_core::CoreError::InvalidFinishReason(other.to_string()))),
        };
        self.inner.finish_request(req_id_of(req_id)?, reason, seq_index).map_err(to_pyerr)
    }

    fn has_unfinished_requests(&self) -> bool {
        self.inner.has_unfinished_requests()
    }

    /// Cumulative counters and current gauges.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let c = self.inner.counters();
        let cur = self.inner.current();
        let cfg = self.inner.config();
        for (k, v) in [
            ("num_steps", c.num_steps),
            ("num_requests_added", c.num_requests_added),
            ("num_requests_finished", c.num_requests_finished),
            ("num_scheduled_tokens", c.num_scheduled_tokens),
            ("num_generated_tokens", c.num_generated_tokens),
            ("num_preemptions_recompute", c.num_preemptions_recompute),
            ("num_preemptions_swap", c.num_preemptions_swap),
            ("num_swap_fallbacks", c.num_swap_fallbacks),
            ("num_blocks_swapped_out", c.num_blocks_swapped_out),
            ("num_blocks_swapped_in", c.num_blocks_swapped_in),
            ("num_blocks_copied", c.num_blocks_copied),
            ("num_tokens_recomputed", c.num_tokens_recomputed),
            ("prefix_cache_queries", c.prefix_cache_queries),
            ("prefix_cache_hits", c.prefix_cache_hits),
            ("num_events", c.num_events),
            ("num_forks_aborted", c.num_forks_aborted),
            ("num_blocks_kept_on_swap", c.num_blocks_kept_on_swap),
            ("num_swap_prefix_lost", c.num_swap_prefix_lost),
            ("num_blocks_swap_dropped", c.num_blocks_swap_dropped),
            ("scheduler_ns", c.scheduler_ns),
            ("num_grammar_masks", c.num_grammar_masks),
            ("grammar_mask_ns", c.grammar_mask_ns),
            ("num_grammar_errors", c.num_grammar_errors),
        ] {
            d.set_item(k, v)?;
        }
        d.set_item("num_preemptions", c.num_preemptions_recompute + c.num_preemptions_swap)?;
        for (k, v) in [
            ("num_running", cur.num_running),
            ("num_waiting", cur.num_waiting),
            ("num_swapped", cur.num_swapped),
            ("num_free_device_blocks", cur.num_free_device_blocks),
            ("num_free_host_blocks", cur.num_free_host_blocks),
            ("num_device_blocks", cfg.num_device_blocks),
            ("num_host_blocks", cfg.num_host_blocks),
            ("num_cached_blocks", self.inner.num_cached_blocks()),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Preemption events since the last call, oldest first, as dicts.
    fn drain_events<'py>(&mut self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.inner
            .drain_events()
            .into_iter()
            .map(|e| {
                let d = PyDict::new(py);
                d.set_item("step", e.step)?;
                d.set_item("req_id", e.req_id)?;
                d.set_item("seq_index", e.seq_index)?;
                d.set_item("mode", e.mode.as_str())?;
                d.set_item("reason", e.reason.as_str())?;
                d.set_item("for_req_id", e.for_req_id)?;
                d.set_item("num_blocks_freed", e.num_blocks_freed)?;
                d.set_item("bytes_to_move", e.bytes_to_move)?;
                d.set_item("num_tokens_to_recompute", e.num_tokens_to_recompute)?;
                d.set_item("swap_cost_s", e.swap_cost_s)?;
                d.set_item("recompute_cost_s", e.recompute_cost_s)?;
                d.set_item("token_budget_left", e.token_budget_left)?;
                d.set_item("num_free_device_blocks", e.num_free_device_blocks)?;
                d.set_item("num_free_host_blocks", e.num_free_host_blocks)?;
                d.set_item("num_preemptions", e.num_preemptions)?;
                Ok(d)
            })
            .collect()
    }

    /// Verifies the whole state (docs/design.md §5); raises EngineError naming the first violation.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(to_pyerr)
    }

    /// The output token ids so far of a live sequence (int32), or None.
    #[pyo3(signature = (req_id, seq_index=0))]
    fn output_token_ids<'py>(
        &self,
        py: Python<'py>,
        req_id: &Bound<'py, PyAny>,
        seq_index: i64,
    ) -> PyResult<Option<Bound<'py, PyArray1<i32>>>> {
        Ok(self.inner.output_token_ids(req_id_of(req_id)?, seq_index_of(seq_index)?).map(|t| t.to_pyarray(py)))
    }

    /// The text released so far by a live sequence (its deltas'), or None.
    #[pyo3(signature = (req_id, seq_index=0))]
    fn output_text(&self, req_id: &Bound<'_, PyAny>, seq_index: i64) -> PyResult<Option<String>> {
        Ok(self.inner.output_text(req_id_of(req_id)?, seq_index_of(seq_index)?).map(str::to_owned))
    }

    /// The device block table of a live sequence, or None (debugging and tests).
    #[pyo3(signature = (req_id, seq_index=0))]
    fn block_table(&self, req_id: &Bound<'_, PyAny>, seq_index: i64) -> PyResult<Option<Vec<u32>>> {
        Ok(self.inner.block_table(req_id_of(req_id)?, seq_index_of(seq_index)?))
    }
}
