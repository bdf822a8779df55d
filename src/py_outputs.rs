//! `SchedulerOutput` and `StepOutputs` for Python. Each `Vec` of the core's outputs becomes a
//! numpy array that takes ownership of the buffer (no copy) when Python first reads it, and the
//! same array object on every later read; pair lists become [k, 2] arrays. Wrapping is what costs
//! here (~0.3 µs per array on the CI machine kind, ~20 arrays a step, against ~60 ns for a getter
//! that returns the cached array), so a caller pays only for the arrays it reads: the forward
//! reads ten or so, a fake model or a CPU-side consumer fewer. Copying small arrays into
//! numpy-owned memory instead was no cheaper.

use ferryman_core::{FinishReason, SchedulerOutput, StepOutputs};
use numpy::{Element, PyArray1, PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyList;

/// A core value until Python first reads it, then the Python object made from it (cached).
enum Lazy<R, P> {
    Rust(R),
    Python(Py<P>),
}

impl<R: Default, P> Lazy<R, P> {
    fn get<'py>(
        &mut self,
        py: Python<'py>,
        wrap: impl FnOnce(Python<'py>, R) -> PyResult<Bound<'py, P>>,
    ) -> PyResult<Py<P>> {
        if let Lazy::Rust(v) = self {
            *self = Lazy::Python(wrap(py, std::mem::take(v))?.unbind());
        }
        match self {
            Lazy::Python(o) => Ok(o.clone_ref(py)),
            Lazy::Rust(_) => unreachable!("converted above"),
        }
    }
}

type Array<T> = Lazy<Vec<T>, PyArray1<T>>;
type Pairs = Lazy<Vec<[i32; 2]>, PyArray2<i32>>;

fn array<T: Element>(py: Python<'_>, v: Vec<T>) -> PyResult<Bound<'_, PyArray1<T>>> {
    Ok(PyArray1::from_vec(py, v))
}

fn pairs(py: Python<'_>, v: Vec<[i32; 2]>) -> PyResult<Bound<'_, PyArray2<i32>>> {
    let n = v.len();
    PyArray1::from_vec(py, v.into_flattened()).reshape([n, 2])
}

fn reasons(py: Python<'_>, v: Vec<Option<FinishReason>>) -> PyResult<Bound<'_, PyList>> {
    PyList::new(py, v.iter().map(|r| r.map(|r| r.as_str())))
}

/// One `#[pymethods]` block (pyo3 allows one per class): a getter per `Array` / `Pairs` field,
/// then the class's other methods.
macro_rules! pymethods_with_array_getters {
    ($cls:ident; arrays: $($a:ident: $t:ty),*; pairs: $($p:ident),*; $($rest:tt)*) => {
        #[pymethods]
        impl $cls {
            $(
                #[getter]
                fn $a(&mut self, py: Python<'_>) -> PyResult<Py<PyArray1<$t>>> {
                    self.$a.get(py, array)
                }
            )*
            $(
                #[getter]
                fn $p(&mut self, py: Python<'_>) -> PyResult<Py<PyArray2<i32>>> {
                    self.$p.get(py, pairs)
                }
            )*
            $($rest)*
        }
    };
}

/// The plan of one step; every array is C-contiguous. See `_core.pyi` for shapes and dtypes.
#[pyclass(name = "SchedulerOutput", module = "ferryman._core")]
pub struct PySchedulerOutput {
    req_ids: Array<i64>,
    rows: Array<i32>,
    rows_removed: Array<i32>,
    rows_added: Array<i32>,
    added_req_ids: Array<i64>,
    added_seq_indices: Array<i32>,
    table_rows: Array<i32>,
    table_cols: Array<i32>,
    table_blocks: Array<i32>,
    seq_indices: Array<i32>,
    input_ids: Array<i32>,
    qo_indptr: Array<i32>,
    seq_lens: Array<i32>,
    kv_indptr: Array<i32>,
    kv_last_page_len: Array<i32>,
    inflight_token_indices: Array<i32>,
    inflight_sample_indices: Array<i32>,
    logits_indices: Array<i64>,
    sample_req_ids: Array<i64>,
    sample_seq_indices: Array<i32>,
    sample_rows: Array<i32>,
    sample_positions: Array<i32>,
    blocks_to_swap_out: Pairs,
    blocks_to_swap_in: Pairs,
    blocks_to_copy: Pairs,
    preempted_req_ids: Array<i64>,
    finished_req_ids: Array<i64>,
    grammar_sample_indices: Array<i32>,
    grammar_masks: Array<u32>,
    #[pyo3(get)]
    grammar_mask_words: usize,
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
    // lengths read without making the arrays (`StepStats` needs only these)
    #[pyo3(get)]
    num_scheduled_seqs: usize,
    #[pyo3(get)]
    num_blocks_swapped_out: usize,
    #[pyo3(get)]
    num_blocks_swapped_in: usize,
    #[pyo3(get)]
    num_blocks_copied: usize,
}

impl PySchedulerOutput {
    pub fn new(o: SchedulerOutput) -> Self {
        let s = o.stats;
        Self {
            num_scheduled_seqs: o.rows.len(),
            num_blocks_swapped_out: o.blocks_to_swap_out.len(),
            num_blocks_swapped_in: o.blocks_to_swap_in.len(),
            num_blocks_copied: o.blocks_to_copy.len(),
            req_ids: Lazy::Rust(o.req_ids),
            rows: Lazy::Rust(o.rows),
            rows_removed: Lazy::Rust(o.rows_removed),
            rows_added: Lazy::Rust(o.rows_added),
            added_req_ids: Lazy::Rust(o.added_req_ids),
            added_seq_indices: Lazy::Rust(o.added_seq_indices),
            table_rows: Lazy::Rust(o.table_rows),
            table_cols: Lazy::Rust(o.table_cols),
            table_blocks: Lazy::Rust(o.table_blocks),
            seq_indices: Lazy::Rust(o.seq_indices),
            input_ids: Lazy::Rust(o.input_ids),
            qo_indptr: Lazy::Rust(o.qo_indptr),
            seq_lens: Lazy::Rust(o.seq_lens),
            kv_indptr: Lazy::Rust(o.kv_indptr),
            kv_last_page_len: Lazy::Rust(o.kv_last_page_len),
            inflight_token_indices: Lazy::Rust(o.inflight_token_indices),
            inflight_sample_indices: Lazy::Rust(o.inflight_sample_indices),
            logits_indices: Lazy::Rust(o.logits_indices),
            sample_req_ids: Lazy::Rust(o.sample_req_ids),
            sample_seq_indices: Lazy::Rust(o.sample_seq_indices),
            sample_rows: Lazy::Rust(o.sample_rows),
            sample_positions: Lazy::Rust(o.sample_positions),
            blocks_to_swap_out: Lazy::Rust(o.blocks_to_swap_out),
            blocks_to_swap_in: Lazy::Rust(o.blocks_to_swap_in),
            blocks_to_copy: Lazy::Rust(o.blocks_to_copy),
            preempted_req_ids: Lazy::Rust(o.preempted_req_ids),
            finished_req_ids: Lazy::Rust(o.finished_req_ids),
            grammar_sample_indices: Lazy::Rust(o.grammar_sample_indices),
            grammar_masks: Lazy::Rust(o.grammar_masks),
            grammar_mask_words: o.grammar_mask_words,
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
        }
    }
}

pymethods_with_array_getters!(PySchedulerOutput;
    arrays: req_ids: i64, seq_indices: i32, input_ids: i32, qo_indptr: i32, seq_lens: i32,
        kv_indptr: i32, kv_last_page_len: i32, logits_indices: i64,
        sample_req_ids: i64, sample_seq_indices: i32, sample_rows: i32, sample_positions: i32, preempted_req_ids: i64, finished_req_ids: i64, rows: i32,
        rows_removed: i32, rows_added: i32, added_req_ids: i64, added_seq_indices: i32, table_rows: i32,
        table_cols: i32, table_blocks: i32, inflight_token_indices: i32, inflight_sample_indices: i32,
        grammar_sample_indices: i32, grammar_masks: u32;
    pairs: blocks_to_swap_out, blocks_to_swap_in, blocks_to_copy;
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
);

/// The result of `update()`: one entry per sample, in `logits_indices` order.
#[pyclass(name = "StepOutputs", module = "ferryman._core")]
pub struct PyStepOutputs {
    req_ids: Array<i64>,
    seq_indices: Array<i32>,
    new_token_ids: Array<i32>,
    num_output_tokens: Array<u32>,
    finished_rows: Array<u32>,
    output_token_offsets: Array<u32>,
    output_token_ids: Array<i32>,
    stop_string_indices: Array<i32>,
    finish_reasons: Lazy<Vec<Option<FinishReason>>, PyList>,
    deltas: Lazy<(Vec<u8>, Vec<u32>), PyList>,
    output_texts: Lazy<(Vec<u8>, Vec<u32>), PyList>,
    len: usize,
    /// Rows whose token was applied (the others were dropped: `num_output_tokens` 0).
    #[pyo3(get)]
    num_generated: usize,
    /// Rows whose token is their sequence's first output token (`num_output_tokens` 1).
    #[pyo3(get)]
    num_first_tokens: usize,
}

impl PyStepOutputs {
    pub fn new(o: StepOutputs) -> Self {
        Self {
            len: o.new_token_ids.len(),
            num_generated: o.num_generated,
            num_first_tokens: o.num_output_tokens.iter().filter(|&&n| n == 1).count(),
            req_ids: Lazy::Rust(o.req_ids),
            seq_indices: Lazy::Rust(o.seq_indices),
            new_token_ids: Lazy::Rust(o.new_token_ids),
            num_output_tokens: Lazy::Rust(o.num_output_tokens),
            finished_rows: Lazy::Rust(o.finished_rows),
            output_token_offsets: Lazy::Rust(o.output_token_offsets),
            output_token_ids: Lazy::Rust(o.output_token_ids),
            stop_string_indices: Lazy::Rust(o.stop_string_indices),
            finish_reasons: Lazy::Rust(o.finish_reasons),
            deltas: Lazy::Rust((o.text, o.text_offsets)),
            output_texts: Lazy::Rust((o.output_text, o.output_text_offsets)),
        }
    }
}

/// The strings a UTF-8 buffer holds between consecutive offsets.
fn strings(py: Python<'_>, (buf, offsets): (Vec<u8>, Vec<u32>)) -> PyResult<Bound<'_, PyList>> {
    let text = std::str::from_utf8(&buf).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    PyList::new(py, offsets.windows(2).map(|w| &text[w[0] as usize..w[1] as usize]))
}

pymethods_with_array_getters!(PyStepOutputs;
    arrays: req_ids: i64, seq_indices: i32, new_token_ids: i32, num_output_tokens: u32, finished_rows: u32,
        output_token_offsets: u32, output_token_ids: i32, stop_string_indices: i32;
    pairs: ;
    #[getter]
    fn finish_reasons(&mut self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.finish_reasons.get(py, reasons)
    }
    /// [S] each row's new text ("" for rows without text).
    #[getter]
    fn deltas(&mut self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.deltas.get(py, strings)
    }
    /// [F] each finished sequence's whole text.
    #[getter]
    fn output_texts(&mut self, py: Python<'_>) -> PyResult<Py<PyList>> {
        self.output_texts.get(py, strings)
    }
    fn __len__(&self) -> usize {
        self.len
    }
);
