//! The one place where core errors become Python exceptions.
//!
//! The exception classes live in `omni_pcache.errors` (plain Python, so they can also derive
//! from `ValueError` and carry docstrings); this module looks them up and attaches the
//! structured fields of each error as attributes (`task_id`, `outstanding`, `holders`, ...).

use pcache_core::staging::Holder;
use pcache_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyList;

/// Converts a core result into a Python result.
pub trait IntoPy<T> {
    /// Maps the error, if any, to its Python exception.
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for Result<T, Error> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}

/// A Python `(kind, id)` tuple for a staging holder: `("step", 3)` or `("task", 7)`.
pub fn holder_tuple(h: &Holder) -> (&'static str, u64) {
    match h {
        Holder::Step(s) => ("step", s.0),
        Holder::Task(t) => ("task", t.0),
    }
}

/// Builds an `omni_pcache.errors.<class_name>` exception with `message` and attributes.
pub fn raise(class_name: &str, message: String, attrs: Vec<(&str, Py<PyAny>)>) -> PyErr {
    Python::attach(|py| {
        let build = || -> PyResult<PyErr> {
            let cls = py.import("omni_pcache.errors")?.getattr(class_name)?;
            let exc = cls.call1((message.clone(),))?;
            for (name, value) in attrs {
                exc.setattr(name, value)?;
            }
            Ok(PyErr::from_value(exc))
        };
        build().unwrap_or_else(|e| e)
    })
}

/// Maps every core error variant to its exception class. Exhaustive on purpose: a new
/// variant does not compile until it is mapped here.
pub fn to_pyerr(err: Error) -> PyErr {
    let message = err.to_string();
    Python::attach(|py| {
        let int = |v: u64| v.into_pyobject(py).expect("int").into_any().unbind();
        match &err {
            Error::IllegalTransition { task, from, to } => raise(
                "TaskStateError",
                message,
                vec![
                    ("task_id", int(task.0)),
                    (
                        "from_state",
                        from.name()
                            .into_pyobject(py)
                            .expect("str")
                            .into_any()
                            .unbind(),
                    ),
                    (
                        "to_state",
                        to.name()
                            .into_pyobject(py)
                            .expect("str")
                            .into_any()
                            .unbind(),
                    ),
                ],
            ),
            Error::UnknownTask { task } | Error::DuplicateTask { task } => {
                raise("InvalidInputError", message, vec![("task_id", int(task.0))])
            }
            Error::StepAlreadyConsumed { step, outstanding }
            | Error::UnknownStep { step, outstanding } => {
                let ids: Vec<u64> = outstanding.iter().map(|s| s.0).collect();
                let list = PyList::new(py, ids).expect("list").into_any().unbind();
                raise(
                    "StepIdError",
                    message,
                    vec![("step_id", int(step.0)), ("outstanding", list)],
                )
            }
            Error::StagingTimeout { holders, .. } => {
                let per_slot: Vec<Vec<(&str, u64)>> = holders
                    .iter()
                    .map(|hs| hs.iter().map(holder_tuple).collect())
                    .collect();
                let list = per_slot
                    .into_pyobject(py)
                    .expect("list")
                    .into_any()
                    .unbind();
                raise("StagingTimeoutError", message, vec![("holders", list)])
            }
            Error::StagingClosed => raise("CacheClosedError", message, vec![]),
            Error::InvalidConfig { .. } => raise("ConfigError", message, vec![]),
            Error::SlotOutOfRange { .. }
            | Error::BlockOutOfRange { .. }
            | Error::DuplicateSlot { .. }
            | Error::UnknownKey { .. }
            | Error::UnknownRead { .. }
            | Error::StagingSlotOutOfRange { .. }
            | Error::NotAHolder { .. }
            | Error::InvalidInput { .. } => raise("InvalidInputError", message, vec![]),
        }
    })
}

/// An `InvalidInputError` raised by the binding itself (argument conversion).
pub fn invalid_input(message: String) -> PyErr {
    raise("InvalidInputError", message, vec![])
}

/// What `value` is, for an error message, never its contents (which may be long): `"a 2-D
/// array of dtype float16"` for a numpy array, else its type's name with an article (`"a list"`,
/// `"an int"`).
pub fn describe(value: &Bound<'_, PyAny>) -> String {
    use numpy::{PyUntypedArray, PyUntypedArrayMethods};
    if let Ok(array) = value.cast::<PyUntypedArray>() {
        return format!("a {}-D array of dtype {}", array.ndim(), array.dtype());
    }
    let name = value
        .get_type()
        .name()
        .map_or_else(|_| "?".to_owned(), |n| n.to_string());
    let article = if name.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    format!("{article} {name}")
}

/// The repr of a Python value, for an error message (empty if the repr itself raises).
pub fn repr_of(value: &Bound<'_, PyAny>) -> String {
    value.repr().map(|r| r.to_string()).unwrap_or_default()
}
