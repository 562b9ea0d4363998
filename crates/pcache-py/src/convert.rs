//! Argument conversion: borrowed numpy index arrays and the GIL-release helper.

use numpy::{Element, PyArray1, PyArrayMethods, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid_input;

/// A 1-D integer index array borrowed from Python without copying (int64 or int32, as torch
/// and numpy produce them). Non-contiguous arrays are copied once, and so are arrays of
/// [`DETACH_AT`] indices or more, which calls read with the GIL released: another Python thread
/// could otherwise write the caller's array between a call's checks and its use of the indices
/// (numpy's borrow flags bind Rust code only), turning a checked index into an unchecked one.
pub enum Indices<'py> {
    I64(PyReadonlyArray1<'py, i64>),
    I32(PyReadonlyArray1<'py, i32>),
    Owned(Vec<i64>),
}

/// A slice view of [`Indices`], safe to use with the GIL released (see [`Indices`]).
#[derive(Clone, Copy)]
pub enum IndexSlice<'a> {
    I64(&'a [i64]),
    I32(&'a [i32]),
}

impl IndexSlice<'_> {
    /// Number of indices.
    pub fn len(&self) -> usize {
        match self {
            IndexSlice::I64(s) => s.len(),
            IndexSlice::I32(s) => s.len(),
        }
    }
}

/// Lists at least this long are handled with the GIL released.
pub const DETACH_AT: usize = 8192;

/// Runs `f` with the GIL released when it loops over `n >= DETACH_AT` items, else with the GIL
/// held. A release costs the caller more than a short call: another Python thread (the
/// committer, the engine thread) takes the GIL and keeps it until its next release point, which
/// can be milliseconds. No closure passed here takes the GIL, so holding it while waiting for a
/// core mutex cannot deadlock: a mutex holder never needs the GIL.
pub fn detach_for<T, F>(py: Python<'_>, n: usize, f: F) -> T
where
    F: pyo3::marker::Ungil + FnOnce() -> T,
    T: pyo3::marker::Ungil,
{
    if n >= DETACH_AT {
        py.detach(f)
    } else {
        f()
    }
}

/// `obj` borrowed as a read-only 1-D array of `T`; `Ok(None)` when it is not one (not an array,
/// another dtype or dimension). An `InvalidInputError` naming `what` when it is one but cannot be
/// borrowed: its memory is being written meanwhile by a native call running without the GIL (a
/// pool write, from another thread). (`extract::<PyReadonlyArray1>` would panic there.)
pub fn readonly_1d<'py, T: Element>(
    obj: &Bound<'py, PyAny>,
    what: &str,
) -> PyResult<Option<PyReadonlyArray1<'py, T>>> {
    let Ok(array) = obj.cast::<PyArray1<T>>() else {
        return Ok(None);
    };
    // A view at an odd byte offset (`np.frombuffer(buf, offset=1)`) holds elements Rust may not
    // read in place: an aligned copy is read instead.
    let array = if is_aligned(array) {
        array.clone()
    } else {
        array.call_method0("copy")?.cast_into::<PyArray1<T>>()?
    };
    array.try_readonly().map(Some).map_err(|err| {
        invalid_input(format!(
            "{what} cannot be read: {err} (its memory is being written by another thread)"
        ))
    })
}

/// Whether `array`'s data pointer is aligned for its element type (numpy's `aligned` flag,
/// for the first element; strides that are not multiples of it are copied as non-contiguous).
pub fn is_aligned<T: Element, D: numpy::ndarray::Dimension>(
    array: &Bound<'_, numpy::PyArray<T, D>>,
) -> bool {
    (array.data() as usize).is_multiple_of(std::mem::align_of::<T>())
}

impl<'py> Indices<'py> {
    /// Accepts a 1-D numpy array of int64/int32 (or a list of ints, converted by numpy).
    /// Anything else is an `InvalidInputError` naming the argument and what was wrong.
    pub fn extract(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        // Fast path: a contiguous int64 array (what the cache passes) needs no inspection.
        if let Some(a) = readonly_1d::<i64>(obj, what)? {
            return Ok(Self::contiguous_or_copy(a, Indices::I64));
        }
        let py = obj.py();
        let numpy_array = obj.is_instance(&py.import("numpy")?.getattr("ndarray")?)?;
        let array = if numpy_array {
            obj.clone()
        } else {
            let np = py.import("numpy")?;
            np.call_method1("asarray", (obj,))
                .map_err(|e| invalid_input(format!("{what} must be a 1-D integer array: {e}")))?
        };
        let ndim: usize = array.getattr("ndim")?.extract()?;
        // An empty Python list becomes float64 in numpy; treat it as an empty index array.
        let size: usize = array.getattr("size")?.extract()?;
        if ndim != 1 {
            return Err(invalid_input(format!(
                "{what} must be a 1-D integer array, got {ndim} dimensions"
            )));
        }
        if let Some(a) = readonly_1d::<i64>(&array, what)? {
            return Ok(Self::contiguous_or_copy(a, Indices::I64));
        }
        if let Some(a) = readonly_1d::<i32>(&array, what)? {
            return Ok(Self::contiguous_or_copy(a, Indices::I32));
        }
        if size == 0 && !numpy_array && !obj.hasattr("dtype")? {
            return Ok(Indices::Owned(Vec::new()));
        }
        let dtype = array.getattr("dtype")?.str()?.to_string();
        Err(invalid_input(format!(
            "{what} must be an int64 or int32 array, got dtype {dtype}"
        )))
    }

    fn contiguous_or_copy<T: numpy::Element + Copy + Into<i64>>(
        a: PyReadonlyArray1<'py, T>,
        wrap: impl FnOnce(PyReadonlyArray1<'py, T>) -> Indices<'py>,
    ) -> Indices<'py> {
        if a.is_contiguous() && a.len() < DETACH_AT {
            wrap(a)
        } else {
            Indices::Owned(a.as_array().iter().map(|&v| v.into()).collect())
        }
    }

    /// The borrowed slice.
    pub fn slice(&self) -> IndexSlice<'_> {
        match self {
            Indices::I64(a) => IndexSlice::I64(a.as_slice().expect("checked contiguous")),
            Indices::I32(a) => IndexSlice::I32(a.as_slice().expect("checked contiguous")),
            Indices::Owned(v) => IndexSlice::I64(v),
        }
    }
}

/// Evaluates `$body` with `$s` bound to the typed `&[T]` of an [`IndexSlice`], whichever
/// dtype it has. Take the slice (`Indices::slice`) before releasing the GIL.
macro_rules! with_slice {
    ($view:expr, |$s:ident| $body:expr) => {
        match $view {
            $crate::convert::IndexSlice::I64($s) => $body,
            $crate::convert::IndexSlice::I32($s) => $body,
        }
    };
}
pub(crate) use with_slice;

/// An int argument in `[0, max]`: an int or numpy integer, never a bool. Anything else is an
/// `InvalidInputError` naming the argument (PyO3's own conversion would raise a bare
/// `TypeError` or `OverflowError`).
pub fn uint_arg(value: &Bound<'_, PyAny>, what: &str, max: u64) -> PyResult<u64> {
    let refused = || {
        invalid_input(format!(
            "{what} must be an int in [0, {max}], got {}",
            crate::errors::repr_of(value)
        ))
    };
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(refused());
    }
    match value.extract::<i128>() {
        Ok(v) if (0..=i128::from(max)).contains(&v) => Ok(v as u64),
        _ => Err(refused()),
    }
}

/// Hands a `Vec<i64>` to Python as a numpy array without copying.
pub fn int_array(py: Python<'_>, v: Vec<i64>) -> Py<PyArray1<i64>> {
    numpy::IntoPyArray::into_pyarray(v, py).unbind()
}

/// Hands a `Vec<u64>` to Python as a numpy array without copying.
pub fn uint_array(py: Python<'_>, v: Vec<u64>) -> Py<PyArray1<u64>> {
    numpy::IntoPyArray::into_pyarray(v, py).unbind()
}
