//! `scatter_rows`: a step's rows copied into the host pool's slots (see
//! `pcache_core::row_scatter`), without the GIL; `write_step_rows`: the pool writer's whole
//! write of a run of one step's tasks (state transitions, owned rows, scatter) in one call.

use numpy::{PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use pcache_core::ledger::contiguous_from;
use pcache_core::row_scatter::{self, RowScatterError};

use crate::convert::{IndexSlice, Indices};
use crate::errors::invalid_input;
use crate::ledger::Ledger;
use crate::tasks::WriteTasks;

/// Copies row `i` of `rows` to row `slots[i]` of `pool`: both C-contiguous 2-D `uint8`
/// arrays with rows of the same byte width (the pool writer passes byte views of its torch
/// tensors), one copy per run of consecutive slots. Raises `InvalidInputError`, having
/// written nothing, for a slot outside the pool, a row count or width that does not match, an
/// array that is not C-contiguous (column-major included), the same array or overlapping
/// views as both, or a read-only pool. The pool's single writer calls it (see
/// `omni_pcache.pool`).
///
/// The copy always runs without the GIL, however short: a writer thread that held it here
/// would keep the engine thread waiting for it after each of the engine's own GIL releases
/// (measured: +1.3 ms per decode step of 256 requests when held).
#[pyfunction]
pub fn scatter_rows(
    py: Python<'_>,
    pool: &Bound<'_, PyArray2<u8>>,
    rows: &Bound<'_, PyArray2<u8>>,
    slots: &Bound<'_, PyAny>,
) -> PyResult<()> {
    // Row-major only: a column-major array is contiguous too, but its bytes are not rows.
    if !pool.is_c_contiguous() || !rows.is_c_contiguous() {
        return Err(invalid_input(
            "scatter_rows: pool and rows must be C-contiguous".to_owned(),
        ));
    }
    let row_bytes = pool.shape()[1];
    if rows.shape()[1] != row_bytes {
        return Err(invalid_input(format!(
            "scatter_rows: rows of {} bytes into a pool of {row_bytes}-byte rows",
            rows.shape()[1]
        )));
    }
    let indices = Indices::extract(slots, "slots")?;
    let wide: Vec<i64>;
    let slots: &[i64] = match indices.slice() {
        IndexSlice::I64(s) => s,
        IndexSlice::I32(s) => {
            wide = s.iter().map(|&v| i64::from(v)).collect();
            &wide
        }
    };
    // Borrow-checked: the same array twice, overlapping views of one array or a read-only
    // pool are refused here (as InvalidInputError, not a panic).
    let rows = rows
        .try_readonly()
        .map_err(|err| invalid_input(format!("scatter_rows: rows: {err}")))?;
    let mut pool = pool
        .try_readwrite()
        .map_err(|err| invalid_input(format!("scatter_rows: pool: {err}")))?;
    let rows = rows.as_slice().expect("checked C-contiguous");
    let pool = pool.as_slice_mut().expect("checked C-contiguous");
    py.detach(|| pcache_core::row_scatter::scatter_rows(pool, rows, row_bytes, slots))
        .map_err(|err| invalid_input(format!("scatter_rows: {err}")))
}

/// One key's rows of a step: its id, the step's staging page and the key's pool, both
/// C-contiguous `(rows, row_bytes)` uint8 arrays with rows of the same width.
type KeyRows<'py> = (u32, Bound<'py, PyArray2<u8>>, Bound<'py, PyArray2<u8>>);

/// Where one key's owned rows come from in the staging page: one span of it (every row still
/// owned, in page order), or gathered (a newer tenant took some of the tasks' slots).
enum Source {
    Span(std::ops::Range<usize>),
    Gathered(Vec<u8>),
}

/// One key's part of a step run's write, checked: its owned rows and the slots they go to.
struct KeyWrite {
    source: Source,
    slots: Vec<i64>,
}

/// Checks one key's page and pool and finds the rows the tasks still own (the ledger lock held
/// only for that lookup); `None` when there is nothing to copy.
fn plan_key(
    ledger: &Ledger,
    task_ids: &[u64],
    offsets: &[i64],
    (key_id, page, pool): &KeyRows<'_>,
) -> PyResult<Option<KeyWrite>> {
    let (positions, slots) = ledger.owned_rows(task_ids, *key_id, offsets)?;
    let row_bytes = pool.shape()[1];
    if slots.is_empty() || row_bytes == 0 {
        return Ok(None);
    }
    if !pool.is_c_contiguous() || !page.is_c_contiguous() || page.shape()[1] != row_bytes {
        return Err(invalid_input(format!(
            "write_step_rows: key#{key_id}: page and pool must be C-contiguous rows of {row_bytes} bytes"
        )));
    }
    let refused =
        |err: RowScatterError| invalid_input(format!("write_step_rows: key#{key_id}: {err}"));
    let page_rows = page.shape()[0];
    let source = match contiguous_from(&positions) {
        Some(first)
            if first >= 0
                && (first as usize)
                    .checked_add(slots.len())
                    .is_some_and(|end| end <= page_rows) =>
        {
            let at = first as usize * row_bytes;
            Source::Span(at..at + slots.len() * row_bytes)
        }
        _ => {
            let page = page
                .try_readonly()
                .map_err(|err| invalid_input(format!("write_step_rows: page: {err}")))?;
            let bytes = page.as_slice().expect("checked C-contiguous");
            Source::Gathered(
                row_scatter::gather_rows(bytes, row_bytes, &positions).map_err(refused)?,
            )
        }
    };
    let pool_bytes = pool.shape()[0] * row_bytes;
    row_scatter::check_scatter(pool_bytes, slots.len() * row_bytes, row_bytes, &slots)
        .map_err(refused)?;
    Ok(Some(KeyWrite { source, slots }))
}

/// Writes a run of one step's write tasks into the pool in one call (the pool's single writer:
/// the committer, or the engine thread writing a small step): the tasks go COPYING →
/// HOST_READY; for each key of `keys`, the rows they still own (the ledger says which: a newer
/// tenant's slots are skipped) are copied from the staging page, task `i`'s rows starting at
/// page row `offsets[i]`, into their pool slots, without the GIL; then HOST_READY → WRITTEN.
/// Returns the rows written per key. Committing them (under the cache's ledger lock) is the
/// caller's. A page or pool that does not fit (width, layout, a row or slot out of range) is
/// refused as `InvalidInputError` before anything changes; a refused transition raises
/// `TaskStateError`, leaving the tasks for the caller to fail.
#[pyfunction]
pub fn write_step_rows(
    py: Python<'_>,
    tasks: &Bound<'_, WriteTasks>,
    ledger: &Bound<'_, Ledger>,
    task_ids: Vec<u64>,
    offsets: Vec<i64>,
    keys: Vec<KeyRows<'_>>,
) -> PyResult<Vec<usize>> {
    // Every key checked (and a partly stolen run gathered) before anything changes.
    let plans = keys
        .iter()
        .map(|key| plan_key(ledger.get(), &task_ids, &offsets, key))
        .collect::<PyResult<Vec<_>>>()?;
    let tasks = tasks.get();
    tasks.copy_done_all(&task_ids)?;
    let mut written = Vec::with_capacity(keys.len());
    for ((key_id, page, pool), plan) in keys.iter().zip(plans) {
        let Some(KeyWrite { source, slots }) = plan else {
            written.push(0);
            continue;
        };
        let row_bytes = pool.shape()[1];
        let page = page
            .try_readonly()
            .map_err(|err| invalid_input(format!("write_step_rows: page: {err}")))?;
        let mut pool = pool
            .try_readwrite()
            .map_err(|err| invalid_input(format!("write_step_rows: pool: {err}")))?;
        let page = page.as_slice().expect("checked C-contiguous");
        let pool = pool.as_slice_mut().expect("checked C-contiguous");
        let rows = match &source {
            Source::Span(span) => &page[span.clone()],
            Source::Gathered(rows) => rows.as_slice(),
        };
        py.detach(|| row_scatter::scatter_rows(pool, rows, row_bytes, &slots))
            .map_err(|err| invalid_input(format!("write_step_rows: key#{key_id}: {err}")))?;
        written.push(slots.len());
    }
    tasks.written_all(&task_ids)?;
    Ok(written)
}
