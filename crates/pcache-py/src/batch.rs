//! `check_batch`: a step's request ids, token counts and slot mapping checked in one call (see
//! `pcache_core::batch`), with what the cache keeps of them built as Python objects here.

use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyInt, PyList, PyString, PyTuple};

use crate::convert::{int_array, readonly_1d};
use crate::errors::{invalid_input, repr_of};

/// What `check_batch` returns: `(n, slots, rows, claim_req_ids, claim_starts, claim_counts)`.
type Checked<'py> = (
    usize,
    Py<PyArray1<i64>>,
    Bound<'py, PyDict>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
    Bound<'py, PyList>,
);

/// A token count: an int (or anything with `__index__`, numpy integers included), never a bool.
fn count_of(value: &Bound<'_, PyAny>, req_id: &Bound<'_, PyAny>) -> PyResult<usize> {
    let is_bool = value.is_instance_of::<PyBool>();
    let count = if is_bool {
        None
    } else {
        value.extract::<i64>().ok().filter(|&c| c >= 0)
    };
    count.map(|c| c as usize).ok_or_else(|| {
        let req = repr_of(req_id);
        let got = repr_of(value);
        // (an int, or a numpy integer through `__index__`, too large for 64 bits)
        let index = value.call_method0("__index__").ok().filter(|_| !is_bool);
        let huge = index.is_some_and(|i| i.is_instance_of::<PyInt>() && i.gt(0).unwrap_or(false));
        invalid_input(if huge {
            format!("num_scheduled_tokens of {req} is {got}: more tokens than any step holds")
        } else {
            format!("num_scheduled_tokens of {req} must be an int >= 0, got {got}")
        })
    })
}

/// Checks one step's batch and returns `(n, slots, rows, claim_req_ids, claim_starts,
/// claim_counts)`: the scheduled token count; the slot mapping's first `n` ids as a new int64
/// array; ``{req_id: (first row, rows)}``; and, in batch order, the requests with rows this step
/// with their first rows and counts (new lists). `req_ids` and `counts` are iterables of equal
/// length; `slot_mapping` a 1-D int64 or int32 numpy array, else `None` is returned and the
/// caller passes it again as int64. Raises `InvalidInputError` for the first problem (lengths,
/// a count that is not an int >= 0, more tokens than `capacity`, a short mapping, a slot out of
/// `[0, num_slots)` or named twice, a request id that is not a `str` or is there twice),
/// having built nothing.
#[pyfunction]
pub fn check_batch<'py>(
    py: Python<'py>,
    req_ids: &Bound<'py, PyAny>,
    counts: &Bound<'py, PyAny>,
    slot_mapping: &Bound<'py, PyAny>,
    capacity: usize,
    num_slots: u32,
) -> PyResult<Option<Checked<'py>>> {
    let reqs = PyList::new(py, req_ids.try_iter()?.collect::<PyResult<Vec<_>>>()?)?;
    // (a str that is not valid UTF-8, a lone surrogate, is refused too: the delivery table
    // keys requests by their UTF-8 text)
    let is_id = |r: &Bound<'_, PyAny>| r.cast::<PyString>().is_ok_and(|s| s.to_str().is_ok());
    if let Some((i, req)) = reqs.iter().enumerate().find(|(_, r)| !is_id(r)) {
        let got = repr_of(&req);
        return Err(invalid_input(format!(
            "StepBatch.req_ids holds request ids (str, valid UTF-8), got {got} at position {i}"
        )));
    }
    let raw_counts = counts.try_iter()?.collect::<PyResult<Vec<_>>>()?;
    if reqs.len() != raw_counts.len() {
        return Err(invalid_input(format!(
            "{} req_ids but {} num_scheduled_tokens",
            reqs.len(),
            raw_counts.len()
        )));
    }
    let counts: Vec<usize> = raw_counts
        .iter()
        .zip(reqs.iter())
        .map(|(value, req)| count_of(value, &req))
        .collect::<PyResult<_>>()?;
    let checked = if let Some(a) = readonly_1d::<i64>(slot_mapping, "slot_mapping")? {
        check_mapping(&counts, a, capacity, num_slots)
    } else if let Some(a) = readonly_1d::<i32>(slot_mapping, "slot_mapping")? {
        check_mapping(&counts, a, capacity, num_slots)
    } else {
        return Ok(None);
    };
    let batch = checked.map_err(|err| invalid_input(err.to_string()))?;
    // Each request once, with its rows (the core's starts).
    let rows = PyDict::new(py);
    for (i, ((req, &count), &start)) in reqs.iter().zip(&counts).zip(&batch.starts).enumerate() {
        if rows.contains(&req)? {
            let first = reqs.index(&req)?;
            return Err(invalid_input(format!(
                "req_ids has duplicates: {} at positions {first} and {i} (each request once per step)",
                repr_of(&req)
            )));
        }
        rows.set_item(&req, PyTuple::new(py, [start, count])?)?;
    }
    let (claim_reqs, claim_starts, claim_counts) = if counts.contains(&0) {
        // Only requests with rows this step write or read rows.
        let with_rows: Vec<usize> = (0..counts.len()).filter(|&i| counts[i] > 0).collect();
        (
            PyList::new(
                py,
                with_rows
                    .iter()
                    .map(|&i| reqs.get_item(i).expect("in range")),
            )?,
            PyList::new(py, with_rows.iter().map(|&i| batch.starts[i]))?,
            PyList::new(py, with_rows.iter().map(|&i| counts[i]))?,
        )
    } else {
        (
            reqs,
            PyList::new(py, &batch.starts)?,
            PyList::new(py, &counts)?,
        )
    };
    Ok(Some((
        batch.n,
        int_array(py, batch.slots),
        rows,
        claim_reqs,
        claim_starts,
        claim_counts,
    )))
}

/// The core check over a numpy slot array (copied first when it is not contiguous).
fn check_mapping<T: numpy::Element + pcache_core::slot_runs::RawSlot>(
    counts: &[usize],
    mapping: PyReadonlyArray1<'_, T>,
    capacity: usize,
    num_slots: u32,
) -> Result<pcache_core::batch::BatchRows, pcache_core::batch::BatchError> {
    if mapping.is_contiguous() {
        let slice = mapping.as_slice().expect("checked contiguous");
        pcache_core::batch::check_batch(counts, slice, capacity, num_slots)
    } else {
        let owned: Vec<T> = mapping.as_array().iter().copied().collect();
        pcache_core::batch::check_batch(counts, &owned, capacity, num_slots)
    }
}
