//! The one place `CoreError` becomes a Python exception (polars' pattern): caller mistakes are
//! `InvalidRequestError(ValueError)`, a misuse of the step protocol or a broken invariant is
//! `EngineError(RuntimeError)`.

use ferryman_core::CoreError;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

create_exception!(_core, InvalidRequestError, PyValueError, "A request or argument the core rejects.");
create_exception!(_core, EngineError, PyRuntimeError, "The step protocol was misused, or the core found a bug.");

/// Maps every `CoreError` variant to its Python exception.
pub fn to_pyerr(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::InvalidConfig(_)
        | CoreError::DuplicateRequest(_)
        | CoreError::UnknownRequest(_)
        | CoreError::InvalidRequest { .. }
        | CoreError::RequestTooLong { .. }
        | CoreError::RequestTooLarge { .. }
        | CoreError::BatchSizeMismatch { .. }
        | CoreError::InvalidFinishReason(_)
        | CoreError::Tokenizer(_) => InvalidRequestError::new_err(msg),
        CoreError::OutOfOrder(_) | CoreError::InvariantViolated(_) => EngineError::new_err(msg),
    }
}

/// Adds the exception classes to the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add("EngineError", py.get_type::<EngineError>())?;
    Ok(())
}
