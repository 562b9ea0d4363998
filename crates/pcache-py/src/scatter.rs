//! `scatter_rows`: a step's rows copied into the host pool's slots (see
//! `pcache_core::row_scatter`), without the GIL; `write_step_rows`: the pool writer's whole
//! write of a run of one step's tasks (state transitions, owned rows, scatter) in one call.

use numpy::{PyArray2, PyArrayMethods, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use pcache_core::ledger::contiguous_from;
use pcache_core::row_scatter;

use pcache_core::{Holder, TaskId};

use crate::convert::{IndexSlice, Indices};
use crate::errors::{invalid_input, IntoPy};
use crate::ledger::Ledger;
use crate::registries::StagingSlots;
use crate::row_bytes::RowBytes;
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
    // (an owned copy, whatever its length: the copy below runs without the GIL, and the slots
    // are checked once and then used, so another thread must not be able to change them between)
    let slots: Vec<i64> = match indices.slice() {
        IndexSlice::I64(s) => s.to_vec(),
        IndexSlice::I32(s) => s.iter().map(|&v| i64::from(v)).collect(),
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
    py.detach(|| pcache_core::row_scatter::scatter_rows(pool, rows, row_bytes, &slots))
        .map_err(|err| invalid_input(format!("scatter_rows: {err}")))
}

/// One key's rows of a step: its id, where the rows are read (the step's staging page as a
/// `(rows, row_bytes)` uint8 array, or for `write_step_now` the caller's own array of any
/// dtype `RowBytes` takes) and the key's pool, a `(num_slots, row_bytes)` uint8 array; both
/// C-contiguous with rows of the same byte width.
type KeyRows<'py> = (u32, Bound<'py, PyAny>, Bound<'py, PyArray2<u8>>);

/// Closes a run of one step's written tasks in one call, the usual end of a write (the pool's
/// writer, under the cache's ledger lock, when no copy-on-write obligation is owed on them):
/// their rows are committed in the ledger (stolen slots excepted), each task's hold on staging
/// page `page` is dropped, and each is published on the completion queue. Returns the slots
/// committed. Stops at the first refusal (an unknown task, a holder that is not one, a task
/// not WRITTEN), raised as the typed error; the caller then fails the batch.
#[pyfunction]
pub fn close_step_writes(
    tasks: &Bound<'_, WriteTasks>,
    ledger: &Bound<'_, Ledger>,
    staging: &Bound<'_, StagingSlots>,
    page: usize,
    task_ids: Vec<u64>,
) -> PyResult<usize> {
    let committed = close_run(ledger.get(), staging.get(), page, &task_ids)?;
    tasks.get().complete_all(&task_ids)?;
    Ok(committed)
}

/// A run of WRITTEN tasks committed and their holds on staging page `page` dropped, stopping
/// at the first refusal; returns the slots committed.
fn close_run(
    ledger: &Ledger,
    staging: &StagingSlots,
    page: usize,
    task_ids: &[u64],
) -> PyResult<usize> {
    let owners: Vec<TaskId> = task_ids.iter().copied().map(TaskId).collect();
    let committed = ledger.lock().commit_many(&owners).py_err()?;
    for &task in &owners {
        staging.release_for(page, Holder::Task(task))?;
    }
    Ok(committed)
}

/// Where one key's owned rows come from in the staging page: one span of it (every row still
/// owned, in page order), or these positions (a newer tenant took some of the tasks' slots).
enum Source {
    Span(std::ops::Range<usize>),
    Positions(Vec<i64>),
}

/// One key's part of a step run's write, checked and borrowed: the rows' source and the pool
/// (their numpy borrows taken, so a read-only or doubly passed array is refused before
/// anything changes), the owned rows and the slots they go to.
struct KeyWrite<'py> {
    key_id: u32,
    row_bytes: usize,
    page: RowBytes<'py>,
    pool: PyReadwriteArray2<'py, u8>,
    source: Source,
    slots: Vec<i64>,
}

/// Checks one key's rows source (page) and pool, finds the rows the tasks still own (the
/// ledger lock held only for that lookup) and borrows both arrays; `None` when there is
/// nothing to copy.
fn plan_key<'py>(
    what: &str,
    ledger: &Ledger,
    task_ids: &[u64],
    offsets: &[i64],
    (key_id, page, pool): &KeyRows<'py>,
) -> PyResult<Option<KeyWrite<'py>>> {
    let (positions, slots) = ledger.owned_rows(task_ids, *key_id, offsets)?;
    let row_bytes = pool.shape()[1];
    let refused = |why: String| invalid_input(format!("{what}: key#{key_id}: {why}"));
    // (checked before anything else, with or without rows to copy: rows that could not be
    // written are refused even when this call has none to write)
    let page = RowBytes::borrow(page).map_err(|why| refused(format!("page: {why}")))?;
    if page.row_bytes() != Some(row_bytes) {
        let width = page
            .row_bytes()
            .map_or("more than usize::MAX".into(), |w| w.to_string());
        return Err(refused(format!(
            "page rows of {width} bytes into a pool of {row_bytes}-byte rows"
        )));
    }
    if slots.is_empty() || row_bytes == 0 {
        return Ok(None);
    }
    if !pool.is_c_contiguous() {
        return Err(refused(format!(
            "the pool must be C-contiguous rows of {row_bytes} bytes"
        )));
    }
    // (rows of `row_bytes` bytes in a real array: `page_rows * row_bytes` is its length)
    let page_rows = page.rows();
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
            row_scatter::check_gather(page_rows * row_bytes, row_bytes, &positions)
                .map_err(|err| refused(err.to_string()))?;
            Source::Positions(positions)
        }
    };
    row_scatter::check_scatter(
        pool.shape()[0] * row_bytes,
        slots.len() * row_bytes,
        row_bytes,
        &slots,
    )
    .map_err(|err| refused(err.to_string()))?;
    let pool = pool
        .try_readwrite()
        .map_err(|err| refused(format!("pool: {err}")))?;
    Ok(Some(KeyWrite {
        key_id: *key_id,
        row_bytes,
        page,
        pool,
        source,
        slots,
    }))
}

/// Writes a run of one step's write tasks into the pool in one call (the pool's single writer:
/// the committer, or the engine thread writing a small step): the tasks go COPYING →
/// HOST_READY; for each key of `keys`, the rows they still own (the ledger says which: a newer
/// tenant's slots are skipped) are copied from the staging page, task `i`'s rows starting at
/// page row `offsets[i]`, into their pool slots, without the GIL; then HOST_READY → WRITTEN.
/// Returns the rows written per key. Committing them (under the cache's ledger lock) is the
/// caller's. A page or pool that does not fit (width, layout, a row or slot out of range, a
/// read-only array, the same array twice) is refused as `InvalidInputError` before anything
/// changes; a refused transition raises
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
    let run = RowsRun {
        what: "write_step_rows",
        task_ids: &task_ids,
        offsets: &offsets,
        keys: &keys,
    };
    run.write(py, tasks.get(), ledger.get(), false)
}

/// One call's write of a run of a step's tasks: its name (for errors), the tasks, each one's
/// first page row, and the keys' pages and pools.
struct RowsRun<'a, 'py> {
    what: &'static str,
    task_ids: &'a [u64],
    offsets: &'a [i64],
    keys: &'a [KeyRows<'py>],
}

impl RowsRun<'_, '_> {
    /// Checks every key and borrows its arrays before anything changes; then the tasks go
    /// (PENDING → QUEUED →, with `start_now`) COPYING → HOST_READY, the owned rows are copied
    /// (without the GIL unless `start_now`: a small step written by its saver keeps it), and
    /// the tasks go WRITTEN. Returns the rows copied per key.
    fn write(
        &self,
        py: Python<'_>,
        tasks: &WriteTasks,
        ledger: &Ledger,
        start_now: bool,
    ) -> PyResult<Vec<usize>> {
        let plans = self
            .keys
            .iter()
            .map(|key| plan_key(self.what, ledger, self.task_ids, self.offsets, key))
            .collect::<PyResult<Vec<_>>>()?;
        if start_now {
            tasks.start_copy_now_all(self.task_ids)?;
        }
        tasks.copy_done_all(self.task_ids)?;
        let written = copy_planned_rows(py, self.what, plans, !start_now)?;
        tasks.written_all(self.task_ids)?;
        Ok(written)
    }
}

/// Copies each planned key's owned rows from the page into the pool, without the GIL when
/// `detach`; returns the rows copied per key (0 for a key with nothing to copy). `what` names
/// the call in an error.
fn copy_planned_rows(
    py: Python<'_>,
    what: &str,
    plans: Vec<Option<KeyWrite<'_>>>,
    detach: bool,
) -> PyResult<Vec<usize>> {
    let written = plans
        .iter()
        .map(|plan| plan.as_ref().map_or(0, |p| p.slots.len()))
        .collect();
    // Every key's slices are taken before the first copy releases the GIL: another Python
    // thread could otherwise make a later key's array non-contiguous in between.
    let mut plans = plans;
    let mut copies = Vec::with_capacity(plans.len());
    for plan in plans.iter_mut().flatten() {
        let KeyWrite {
            key_id,
            row_bytes,
            page,
            pool,
            source,
            slots,
        } = plan;
        let layout = |err| invalid_input(format!("{what}: key#{key_id}: {err}"));
        let page = page.bytes().map_err(layout)?;
        let pool = pool.as_slice_mut().map_err(layout)?;
        copies.push((*key_id, *row_bytes, page, pool, &*source, &*slots));
    }
    for (key_id, row_bytes, page, pool, source, slots) in copies {
        let mut copy = move || match source {
            Source::Span(span) => {
                row_scatter::scatter_rows(pool, &page[span.clone()], row_bytes, slots)
            }
            Source::Positions(positions) => {
                let rows = row_scatter::gather_rows(page, row_bytes, positions)?;
                row_scatter::scatter_rows(pool, &rows, row_bytes, slots)
            }
        };
        let copied = if detach { py.detach(copy) } else { copy() };
        copied.map_err(|err| invalid_input(format!("{what}: key#{key_id}: {err}")))?;
    }
    Ok(written)
}

/// A small step written by the thread that saved it, in one call, while it holds the pool
/// writer's lock (`Committer.hold_writer`): its new tasks (PENDING, just claimed by
/// `claim_step`) go straight to COPYING without a queue entry, their owned rows of each key
/// are copied from staging page `page` (task `i`'s rows at page row `offsets[i]`) into the
/// pool, then WRITTEN; their rows are committed, their holds on the page dropped, and they are
/// dropped from the task table, never published as completions (nobody holds a record of
/// them). The copies keep the GIL: the step is small (`CacheConfig.inline_write_bytes`), and
/// a release would hand the GIL to another thread for up to a switch interval.
///
/// Returns the rows written per key. Checks and refusals as `write_step_rows` (nothing changes
/// on an `InvalidInputError` about a page or pool); a refused transition, commit or release
/// raises the typed error with the tasks left where they stopped, for the caller to fail.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // (the Python call's arguments, one per thing it touches)
pub fn write_step_now(
    py: Python<'_>,
    tasks: &Bound<'_, WriteTasks>,
    ledger: &Bound<'_, Ledger>,
    staging: &Bound<'_, StagingSlots>,
    page: usize,
    task_ids: Vec<u64>,
    offsets: Vec<i64>,
    keys: Vec<KeyRows<'_>>,
) -> PyResult<Vec<usize>> {
    let run = RowsRun {
        what: "write_step_now",
        task_ids: &task_ids,
        offsets: &offsets,
        keys: &keys,
    };
    let (tasks, ledger) = (tasks.get(), ledger.get());
    let written = run.write(py, tasks, ledger, true)?;
    close_run(ledger, staging.get(), page, &task_ids)?;
    tasks.forget_all(&task_ids)?;
    Ok(written)
}
