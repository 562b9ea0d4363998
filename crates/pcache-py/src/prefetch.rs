//! `prefetch_rows`: a hit prefetch's gather of one key's committed rows, with the ledger's
//! word on each (`pcache_core::prefetch`), in one call that runs without the GIL (the
//! committer runs it during the engine's forward, whose Python it must not hold up).

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use pcache_core::prefetch::{copy_vouched, paired_runs};
use pcache_core::KeyId;

use crate::convert::{uint_array, IndexSlice, Indices};
use crate::errors::{invalid_input, IntoPy};
use crate::ledger::Ledger;

/// Owned int64 copies of an index array (read once checked: see `convert::Indices`).
fn owned(indices: &Indices<'_>) -> Vec<i64> {
    match indices.slice() {
        IndexSlice::I64(s) => s.to_vec(),
        IndexSlice::I32(s) => s.iter().map(|&v| i64::from(v)).collect(),
    }
}

/// The first id outside `[0, rows)`, with its position.
fn outside(ids: &[i64], rows: usize) -> Option<(usize, i64)> {
    ids.iter()
        .position(|&id| id < 0 || id as usize >= rows)
        .map(|at| (at, ids[at]))
}

/// Copies pool row `slots[i]` to row `dest[i]` of `out` for every `i` (one memory copy per run
/// of consecutive slots and rows) and returns, per slot, the version the ledger vouches the
/// copied row for on key `key_id`, else 0 (`pcache_core::prefetch`): the slot's row was
/// committed at that version both before and after the copy. Both arrays are C-contiguous
/// 2-D `uint8` with rows of the same byte width (byte views of the pool's and the output's
/// tensors). Raises `InvalidInputError`, having copied nothing, for arrays that are not,
/// `slots` and `dest` of different lengths, an id outside its array, or arrays that cannot be
/// borrowed (the same memory as both, a read-only `out`, a pool being written). The caller
/// holds the pool writer's lock, so no write runs meanwhile (`omni_pcache.committer`).
#[pyfunction]
pub fn prefetch_rows(
    py: Python<'_>,
    ledger: &Bound<'_, Ledger>,
    key_id: u32,
    pool: &Bound<'_, PyArray2<u8>>,
    slots: &Bound<'_, PyAny>,
    out: &Bound<'_, PyArray2<u8>>,
    dest: &Bound<'_, PyAny>,
) -> PyResult<Py<PyArray1<u64>>> {
    if !pool.is_c_contiguous() || !out.is_c_contiguous() {
        return Err(invalid_input(
            "prefetch_rows: pool and out must be C-contiguous".to_owned(),
        ));
    }
    let (pool_rows, row_bytes) = (pool.shape()[0], pool.shape()[1]);
    let out_rows = out.shape()[0];
    if out.shape()[1] != row_bytes {
        return Err(invalid_input(format!(
            "prefetch_rows: out rows of {} bytes from a pool of {row_bytes}-byte rows",
            out.shape()[1]
        )));
    }
    let (slots, dest) = (
        owned(&Indices::extract(slots, "slots")?),
        owned(&Indices::extract(dest, "dest")?),
    );
    if slots.len() != dest.len() {
        return Err(invalid_input(format!(
            "prefetch_rows: {} slots but {} output rows",
            slots.len(),
            dest.len()
        )));
    }
    for (what, ids, rows) in [("slot", &slots, pool_rows), ("output row", &dest, out_rows)] {
        if let Some((at, id)) = outside(ids, rows) {
            return Err(invalid_input(format!(
                "prefetch_rows: {what} {id} at position {at} is out of range [0, {rows})"
            )));
        }
    }
    // Borrow-checked: overlapping arrays, a read-only `out` or a pool being written are
    // refused here (as InvalidInputError, not a panic).
    let pool = pool
        .try_readonly()
        .map_err(|err| invalid_input(format!("prefetch_rows: pool: {err}")))?;
    let mut out = out
        .try_readwrite()
        .map_err(|err| invalid_input(format!("prefetch_rows: out: {err}")))?;
    let from = pool.as_slice().expect("checked C-contiguous");
    let to = out.as_slice_mut().expect("checked C-contiguous");
    let ledger = ledger.get();
    let key = KeyId(key_id);
    let versions = py
        .detach(move || {
            copy_vouched(
                || ledger.lock().peek(&slots, key),
                || {
                    for (slot, row, len) in paired_runs(&slots, &dest) {
                        let (at, to_at, bytes) =
                            (slot * row_bytes, row * row_bytes, len * row_bytes);
                        to[to_at..to_at + bytes].copy_from_slice(&from[at..at + bytes]);
                    }
                },
            )
        })
        .py_err()?;
    Ok(uint_array(py, versions))
}
