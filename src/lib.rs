//! ferryman._core: the PyO3 binding of `ferryman-core`. Translation only — types in, arrays
//! out, errors mapped in `py_errors.rs` — no scheduling policy lives here.

mod py_config;
mod py_errors;
mod py_outputs;
mod py_request;
mod py_sampling;
mod py_scheduler;
mod py_text;

use pyo3::prelude::*;

/// The extension's own allocations (each step's output arrays, request state) come from
/// mimalloc: glibc's allocator gave the freed step buffers back to the OS and page-faulted them
/// in again every step, about a fifth of the core's time (`examples/replay` under `perf`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The `ferryman._core` extension module.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<py_config::PySchedulerConfig>()?;
    m.add_class::<py_scheduler::PyScheduler>()?;
    m.add_class::<py_request::PyRequestParams>()?;
    m.add_class::<py_outputs::PySchedulerOutput>()?;
    m.add_class::<py_outputs::PyStepOutputs>()?;
    m.add_class::<py_text::PyTokenBytes>()?;
    m.add_function(wrap_pyfunction!(py_sampling::sample_random_cpu, m)?)?;
    m.add_function(wrap_pyfunction!(py_sampling::sample_cpu, m)?)?;
    py_errors::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
