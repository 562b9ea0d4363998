//! `Ledger`: the slot/version ledger behind one mutex (GIL released for long slot lists only).

use numpy::PyArray1;
use parking_lot::Mutex;
use pcache_core::{KeyId, ReadId, TaskId};
use pyo3::prelude::*;

use crate::convert::{detach_for, int_array, uint_array, with_slice, Indices};
use crate::errors::{invalid_input, IntoPy};

/// An int64 numpy array handed to Python.
type IntArray = Py<PyArray1<i64>>;
/// A uint64 numpy array handed to Python.
type UintArray = Py<PyArray1<u64>>;

/// What a claim found (see `pcache_core::ClaimOutcome`); int64 arrays.
#[pyclass(frozen, get_all, module = "omni_pcache._native")]
pub struct ClaimOutcome {
    /// Slots taken from an older in-transit task, which skips them when it writes.
    stolen_slots: Py<PyArray1<i64>>,
    /// The task each stolen slot was taken from.
    stolen_from: Py<PyArray1<i64>>,
    /// Slots a pending read captured that this claim moves on: keep their rows aside.
    preserve_slots: Py<PyArray1<i64>>,
    /// The version each preserved row had.
    preserve_versions: Py<PyArray1<u64>>,
    /// Where each preserved row is now: `SOURCE_POOL` or the in-transit task's id.
    preserve_from: Py<PyArray1<i64>>,
}

/// A registered pending read (see `pcache_core::ReadPlan`).
#[pyclass(frozen, module = "omni_pcache._native")]
pub struct ReadPlan {
    /// The read's id; release it when served.
    #[pyo3(get)]
    read_id: u64,
    /// Slots never written.
    #[pyo3(get)]
    num_absent: usize,
    /// Slots committed in the pool.
    #[pyo3(get)]
    num_from_pool: usize,
    /// The in-transit task ids among `sources`, ascending, each once.
    #[pyo3(get)]
    tasks: Vec<u64>,
    plan: pcache_core::ReadPlan,
}

#[pymethods]
impl ReadPlan {
    /// Per slot: `SOURCE_ABSENT` (-2), `SOURCE_POOL` (-1) or the in-transit task id (a new
    /// int64 array at each access; nothing per slot is kept for a read served from the pool
    /// alone).
    #[getter]
    fn sources(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        int_array(py, self.plan.source_codes())
    }

    /// Slots read.
    fn __len__(&self) -> usize {
        self.plan.len
    }
}

/// Hands a claim's outcome to Python (one shared empty array in the common case).
pub(crate) fn outcome(py: Python<'_>, out: pcache_core::ClaimOutcome) -> ClaimOutcome {
    if out.stolen_slots.is_empty() && out.preserve_slots.is_empty() {
        // The common case: nothing to report; share one empty array per dtype.
        let empty = int_array(py, Vec::new());
        return ClaimOutcome {
            stolen_slots: empty.clone_ref(py),
            stolen_from: empty.clone_ref(py),
            preserve_slots: empty,
            preserve_versions: uint_array(py, Vec::new()),
            preserve_from: int_array(py, Vec::new()),
        };
    }
    ClaimOutcome {
        stolen_slots: int_array(py, out.stolen_slots),
        stolen_from: int_array(py, out.stolen_from),
        preserve_slots: int_array(py, out.preserve_slots),
        preserve_versions: uint_array(py, out.preserve_versions),
        preserve_from: int_array(py, out.preserve_from),
    }
}

/// The slot/version ledger. Any thread; every call takes one short mutex (the GIL is released
/// only for long slot lists, see `convert::detach_for`).
#[pyclass(frozen, module = "omni_pcache._native")]
pub struct Ledger {
    inner: Mutex<pcache_core::Ledger>,
}

impl Ledger {
    /// The core ledger, locked (one short critical section; never held across a GIL wait).
    pub(crate) fn lock(&self) -> parking_lot::MutexGuard<'_, pcache_core::Ledger> {
        self.inner.lock()
    }

    /// `(positions, slots)` several tasks still own on `key_id` (see `owned_many`).
    pub(crate) fn owned_rows(
        &self,
        task_ids: &[u64],
        key_id: u32,
        offsets: &[i64],
    ) -> PyResult<(Vec<i64>, Vec<i64>)> {
        let tasks: Vec<TaskId> = task_ids.iter().copied().map(TaskId).collect();
        self.inner
            .lock()
            .owned_many(&tasks, KeyId(key_id), offsets)
            .py_err()
    }
}

/// A task id a claim may take: below 2**63, since the ledger reports a task as the source of
/// a row by its id as a non-negative int64, beside the negative pool and absent codes.
fn claiming_task(task_id: u64) -> PyResult<TaskId> {
    if task_id > i64::MAX as u64 {
        return Err(invalid_input(format!(
            "task id {task_id} is out of range [0, 2**63)"
        )));
    }
    Ok(TaskId(task_id))
}

#[pymethods]
impl Ledger {
    /// A ledger of `num_slots` slots (`num_blocks * block_size`) in blocks of the engine's
    /// KV `block_size` (whole blocks are summarised: faster, same results); zero slots or a
    /// zero block size raise `ConfigError`.
    #[new]
    #[pyo3(signature = (num_slots, block_size = 16))]
    fn new(num_slots: u32, block_size: u32) -> PyResult<Self> {
        Ok(Self {
            inner: Mutex::new(pcache_core::Ledger::new(num_slots, block_size).py_err()?),
        })
    }

    /// Registers a key and returns its id (0, 1, ...); `InvalidInputError` when its columns
    /// cannot be allocated.
    fn add_key(&self) -> PyResult<u32> {
        Ok(self.inner.lock().try_add_key().py_err()?.0)
    }

    /// Claims `slots` of key `key_id` for task `task_id` (appended to its row order).
    fn claim(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        key_id: u32,
        task_id: u64,
    ) -> PyResult<ClaimOutcome> {
        let idx = Indices::extract(slots, "slots")?;
        let view = idx.slice();
        let task = claiming_task(task_id)?;
        let out = detach_for(py, view.len(), || {
            with_slice!(view, |s| self.inner.lock().claim(s, KeyId(key_id), task))
        })
        .py_err()?;
        Ok(outcome(py, out))
    }

    /// The rows of `slots` on key `key_id` are gone and nothing replaces them (a step that did
    /// not give the key): a new version, slots absent; the outcome is a claim's (stolen
    /// slots, captured rows to keep aside). Refused as a whole.
    fn invalidate(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        key_id: u32,
    ) -> PyResult<ClaimOutcome> {
        let idx = Indices::extract(slots, "slots")?;
        let view = idx.slice();
        let out = detach_for(py, view.len(), || {
            with_slice!(view, |s| self.inner.lock().invalidate(s, KeyId(key_id)))
        })
        .py_err()?;
        Ok(outcome(py, out))
    }

    /// Claims one step's slots for several tasks at once: the first `counts[0]` slots for
    /// `task_ids[0]`, the next `counts[1]` for `task_ids[1]`, ... Refused as a whole.
    fn claim_many(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        counts: Vec<usize>,
        key_id: u32,
        task_ids: Vec<u64>,
    ) -> PyResult<ClaimOutcome> {
        let idx = Indices::extract(slots, "slots")?;
        let view = idx.slice();
        let tasks: Vec<TaskId> = task_ids
            .into_iter()
            .map(claiming_task)
            .collect::<PyResult<_>>()?;
        let out = detach_for(py, view.len(), || {
            with_slice!(view, |s| self.inner.lock().claim_many(
                s,
                &counts,
                KeyId(key_id),
                &tasks
            ))
        })
        .py_err()?;
        Ok(outcome(py, out))
    }

    /// `(positions, slots)` the task still owns on `key_id`: gather rows at `positions`,
    /// scatter them to `slots`.
    fn owned(&self, py: Python<'_>, task_id: u64, key_id: u32) -> PyResult<(IntArray, IntArray)> {
        let (positions, slots) = self
            .inner
            .lock()
            .owned(TaskId(task_id), KeyId(key_id))
            .py_err()?;
        Ok((int_array(py, positions), int_array(py, slots)))
    }

    /// `(positions, slots, first)` several tasks still own on `key_id`, each task's positions
    /// shifted by its offset, concatenated; `first` is where the positions start when they are
    /// one contiguous range (gather with a slice), else -1.
    fn owned_many(
        &self,
        py: Python<'_>,
        task_ids: Vec<u64>,
        key_id: u32,
        offsets: Vec<i64>,
    ) -> PyResult<(IntArray, IntArray, i64)> {
        let (positions, slots) = self.owned_rows(&task_ids, key_id, &offsets)?;
        let first = pcache_core::ledger::contiguous_from(&positions).unwrap_or(-1);
        Ok((int_array(py, positions), int_array(py, slots), first))
    }

    /// Commits several tasks in order (one writer batch): refused as a whole, nothing committed,
    /// when a task is unknown or listed twice. Returns the slots committed.
    fn commit_many(&self, task_ids: Vec<u64>) -> PyResult<usize> {
        let tasks: Vec<TaskId> = task_ids
            .into_iter()
            .map(claiming_task)
            .collect::<PyResult<_>>()?;
        self.inner.lock().commit_many(&tasks).py_err()
    }

    /// The task's rows landed: slots it still owns become committed. Returns how many.
    fn commit(&self, task_id: u64) -> PyResult<usize> {
        self.inner.lock().commit(TaskId(task_id)).py_err()
    }

    /// The task failed: slots it still owns become absent. Returns how many.
    fn abandon(&self, task_id: u64) -> PyResult<usize> {
        self.inner.lock().abandon(TaskId(task_id)).py_err()
    }

    /// `(sources, versions)` of `slots` now, without registering a read.
    fn peek(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        key_id: u32,
    ) -> PyResult<(IntArray, UintArray)> {
        let idx = Indices::extract(slots, "slots")?;
        let view = idx.slice();
        let (sources, versions) = detach_for(py, view.len(), || {
            with_slice!(view, |s| self.inner.lock().peek(s, KeyId(key_id)))
        })
        .py_err()?;
        Ok((int_array(py, sources), uint_array(py, versions)))
    }

    /// Plans a read: per slot its source; registered with the versions it captured until
    /// `release`.
    fn plan_read(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        key_id: u32,
    ) -> PyResult<ReadPlan> {
        let idx = Indices::extract(slots, "slots")?;
        let view = idx.slice();
        let plan = detach_for(py, view.len(), || {
            with_slice!(view, |s| self.inner.lock().plan_read(s, KeyId(key_id)))
        })
        .py_err()?;
        Ok(ReadPlan {
            read_id: plan.read.0,
            num_absent: plan.num_absent(),
            num_from_pool: plan.num_from_pool(),
            tasks: plan.tasks().into_iter().map(|t| t.0).collect(),
            plan,
        })
    }

    /// The version each position of a pending read captured, in its slot order (what rows
    /// kept aside for it are keyed by).
    fn captured_versions(&self, py: Python<'_>, read_id: u64) -> PyResult<UintArray> {
        let versions = self.inner.lock().captured_versions(ReadId(read_id));
        Ok(uint_array(py, versions.py_err()?))
    }

    /// Positions of the read whose captured version differs from ``versions`` there (a
    /// prefetch's vouched versions, 0 where none): the rows to read from the pool instead.
    /// ``versions`` is a C-contiguous 1-D ``uint64`` array (what ``prefetch_rows`` returns);
    /// anything else is an ``InvalidInputError`` naming what it got.
    fn unvouched(
        &self,
        py: Python<'_>,
        read_id: u64,
        versions: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyArray1<i64>>> {
        let Some(versions) = crate::convert::readonly_1d::<u64>(versions, "versions")? else {
            return Err(invalid_input(format!(
                "versions must be a 1-D uint64 array (a prefetch's vouched versions), got {}",
                crate::errors::describe(versions)
            )));
        };
        let versions = versions
            .as_slice()
            .map_err(|err| invalid_input(format!("versions: {err}")))?;
        let stale = self
            .inner
            .lock()
            .unvouched(ReadId(read_id), versions)
            .py_err()?;
        Ok(int_array(py, stale))
    }

    /// Positions of the read whose rows moved since it was planned.
    fn validate(&self, py: Python<'_>, read_id: u64) -> PyResult<Py<PyArray1<i64>>> {
        let moved = self.inner.lock().validate(ReadId(read_id)).py_err()?;
        Ok(int_array(py, moved))
    }

    /// Releases a pending read.
    fn release(&self, read_id: u64) -> PyResult<()> {
        self.inner.lock().release(ReadId(read_id)).py_err()
    }

    /// Pending reads holding each slot at its current version.
    fn readers(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        key_id: u32,
    ) -> PyResult<Py<PyArray1<i64>>> {
        let idx = Indices::extract(slots, "slots")?;
        let view = idx.slice();
        let counts = detach_for(py, view.len(), || {
            with_slice!(view, |s| self.inner.lock().readers(s, KeyId(key_id)))
        })
        .py_err()?;
        Ok(int_array(py, counts.into_iter().map(i64::from).collect()))
    }

    /// Slots per key.
    #[getter]
    fn num_slots(&self) -> u32 {
        self.inner.lock().num_slots()
    }

    /// Registered keys.
    #[getter]
    fn num_keys(&self) -> u32 {
        self.inner.lock().num_keys()
    }

    /// Host bytes of one registered key's columns (16 per slot, and a summary per block).
    #[getter]
    fn key_column_bytes(&self) -> usize {
        self.inner.lock().key_column_bytes()
    }

    /// Tasks with live claims.
    #[getter]
    fn num_tasks(&self) -> usize {
        self.inner.lock().num_tasks()
    }

    /// The block size whole blocks are summarised at.
    #[getter]
    fn block_size(&self) -> u32 {
        self.inner.lock().block_size()
    }

    /// Reads planned and not released.
    #[getter]
    fn num_pending_reads(&self) -> usize {
        self.inner.lock().num_pending_reads()
    }

    fn __repr__(&self) -> String {
        let l = self.inner.lock();
        format!(
            "Ledger(num_slots={}, block_size={}, num_keys={}, tasks={}, pending_reads={})",
            l.num_slots(),
            l.block_size(),
            l.num_keys(),
            l.num_tasks(),
            l.num_pending_reads()
        )
    }
}
