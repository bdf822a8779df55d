//! `SchedulerOutput` and `StepOutputs` for Python: each `Vec` of the core's outputs becomes a
//! numpy array that takes ownership of the buffer (no copy); pair lists become [k, 2] arrays.

use ferryman_core::{SchedulerOutput, StepOutputs};
use numpy::{PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyList;

/// The plan of one step; every array is C-contiguous. See `_core.pyi` for shapes and dtypes.
#[pyclass(name = "SchedulerOutput", module = "ferryman._core", frozen)]
pub struct PySchedulerOutput {
    #[pyo3(get)]
    req_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    seq_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    input_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    qo_indptr: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    kv_indptr: Py<PyArray1<i32>>,
    #[pyo3(get)]
    kv_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    kv_last_page_len: Py<PyArray1<i32>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    #[pyo3(get)]
    logits_indices: Py<PyArray1<i64>>,
    #[pyo3(get)]
    sample_req_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    sample_seq_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    blocks_to_swap_out: Py<PyArray2<i32>>,
    #[pyo3(get)]
    blocks_to_swap_in: Py<PyArray2<i32>>,
    #[pyo3(get)]
    blocks_to_copy: Py<PyArray2<i32>>,
    #[pyo3(get)]
    preempted_req_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    finished_req_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    step: u64,
    #[pyo3(get)]
    num_scheduled_tokens: usize,
    #[pyo3(get)]
    num_prefill_tokens: usize,
    #[pyo3(get)]
    token_budget_left: usize,
    #[pyo3(get)]
    num_free_device_blocks: usize,
    #[pyo3(get)]
    num_free_host_blocks: usize,
    #[pyo3(get)]
    num_running: usize,
    #[pyo3(get)]
    num_waiting: usize,
    #[pyo3(get)]
    num_swapped: usize,
    #[pyo3(get)]
    num_preemptions: usize,
    #[pyo3(get)]
    schedule_ns: u64,
}

fn arr<T: numpy::Element>(py: Python<'_>, v: Vec<T>) -> Py<PyArray1<T>> {
    PyArray1::from_vec(py, v).unbind()
}

fn pairs(py: Python<'_>, v: Vec<[i32; 2]>) -> PyResult<Py<PyArray2<i32>>> {
    let n = v.len();
    Ok(PyArray1::from_vec(py, v.into_flattened()).reshape([n, 2])?.unbind())
}

impl PySchedulerOutput {
    pub fn new(py: Python<'_>, o: SchedulerOutput) -> PyResult<Self> {
        let s = o.stats;
        Ok(Self {
            req_ids: arr(py, o.req_ids),
            seq_indices: arr(py, o.seq_indices),
            input_ids: arr(py, o.input_ids),
            positions: arr(py, o.positions),
            qo_indptr: arr(py, o.qo_indptr),
            seq_lens: arr(py, o.seq_lens),
            kv_indptr: arr(py, o.kv_indptr),
            kv_indices: arr(py, o.kv_indices),
            kv_last_page_len: arr(py, o.kv_last_page_len),
            slot_mapping: arr(py, o.slot_mapping),
            logits_indices: arr(py, o.logits_indices),
            sample_req_ids: arr(py, o.sample_req_ids),
            sample_seq_indices: arr(py, o.sample_seq_indices),
            blocks_to_swap_out: pairs(py, o.blocks_to_swap_out)?,
            blocks_to_swap_in: pairs(py, o.blocks_to_swap_in)?,
            blocks_to_copy: pairs(py, o.blocks_to_copy)?,
            preempted_req_ids: arr(py, o.preempted_req_ids),
            finished_req_ids: arr(py, o.finished_req_ids),
            step: s.step,
            num_scheduled_tokens: s.num_scheduled_tokens,
            num_prefill_tokens: s.num_prefill_tokens,
            token_budget_left: s.token_budget_left,
            num_free_device_blocks: s.num_free_device_blocks,
            num_free_host_blocks: s.num_free_host_blocks,
            num_running: s.num_running,
            num_waiting: s.num_waiting,
            num_swapped: s.num_swapped,
            num_preemptions: s.num_preemptions,
            schedule_ns: s.schedule_ns,
        })
    }
}

#[pymethods]
impl PySchedulerOutput {
    fn __repr__(&self) -> String {
        format!(
            "SchedulerOutput(step={}, num_scheduled_tokens={}, num_running={}, num_waiting={}, num_swapped={}, \
             num_preemptions={})",
            self.step,
            self.num_scheduled_tokens,
            self.num_running,
            self.num_waiting,
            self.num_swapped,
            self.num_preemptions
        )
    }
}

/// The result of `update()`: one entry per sample, in `logits_indices` order.
#[pyclass(name = "StepOutputs", module = "ferryman._core", frozen)]
pub struct PyStepOutputs {
    #[pyo3(get)]
    req_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    seq_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    new_token_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    finish_reasons: Py<PyList>,
    len: usize,
}

impl PyStepOutputs {
    pub fn new(py: Python<'_>, o: StepOutputs) -> PyResult<Self> {
        let n = o.new_token_ids.len();
        let reasons = PyList::new(py, o.finish_reasons.iter().map(|r| r.map(|r| r.as_str())))?;
        Ok(Self {
            req_ids: arr(py, o.req_ids),
            seq_indices: arr(py, o.seq_indices),
            new_token_ids: arr(py, o.new_token_ids),
            finish_reasons: reasons.unbind(),
            len: n,
        })
    }
}

#[pymethods]
impl PyStepOutputs {
    fn __len__(&self) -> usize {
        self.len
    }
}
