//! `StepIds` and `StagingSlots`: the exactly-once step ids and the staging-slot ring.

use std::time::Duration;

use pcache_core::staging::Holder;
use pcache_core::{StepId, TaskId};
use pyo3::prelude::*;

use crate::errors::{holder_tuple, invalid_input, IntoPy};

/// Exactly-once step ids. Any thread.
#[pyclass(frozen, module = "omni_pcache._native")]
pub struct StepIds {
    inner: pcache_core::StepIds,
}

#[pymethods]
impl StepIds {
    /// Ids are issued from `first` on (default 0).
    #[new]
    #[pyo3(signature = (first=0))]
    fn new(first: u64) -> PyResult<Self> {
        Ok(Self {
            inner: pcache_core::StepIds::starting_at(first).py_err()?,
        })
    }

    /// Issues the next step id (increasing).
    fn issue(&self) -> u64 {
        self.inner.issue().0
    }

    /// Consumes a step id; twice or never issued raises `StepIdError` listing outstanding ids.
    fn consume(&self, step_id: u64) -> PyResult<()> {
        self.inner.consume(StepId(step_id)).py_err()
    }

    /// Outstanding ids, oldest first.
    fn outstanding(&self) -> Vec<u64> {
        self.inner.outstanding().into_iter().map(|s| s.0).collect()
    }

    fn __len__(&self) -> usize {
        self.inner.num_outstanding()
    }
}

fn parse_holder(holder: (String, u64)) -> PyResult<Holder> {
    match holder.0.as_str() {
        "step" => Ok(Holder::Step(StepId(holder.1))),
        "task" => Ok(Holder::Task(TaskId(holder.1))),
        other => Err(invalid_input(format!(
            "holder kind must be 'step' or 'task', got {other:?}"
        ))),
    }
}

/// Holders of one kind (`"step"` or `"task"`) with these ids.
fn holders_of(kind: &str, ids: Vec<u64>) -> PyResult<Vec<Holder>> {
    ids.into_iter()
        .map(|id| parse_holder((kind.to_owned(), id)))
        .collect()
}

fn timeout(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds).map_err(|_| {
        invalid_input(format!(
            "timeout_s must be a finite number >= 0, got {seconds}"
        ))
    })
}

/// The staging-slot ring. Holders are `("step", step_id)` or `("task", task_id)` tuples.
/// Any thread; `claim` waits with the GIL released.
#[pyclass(frozen, module = "omni_pcache._native")]
pub struct StagingSlots {
    inner: pcache_core::StagingSlots,
}

impl StagingSlots {
    /// Adds `holder` to staging slot `slot`.
    pub(crate) fn hold_for(&self, slot: usize, holder: Holder) -> PyResult<()> {
        self.inner.hold(slot, holder).py_err()
    }

    /// Removes `holder` from staging slot `slot`; returns whether the slot became free.
    pub(crate) fn release_for(&self, slot: usize, holder: Holder) -> PyResult<bool> {
        self.inner.release(slot, holder).py_err()
    }
}

#[pymethods]
impl StagingSlots {
    /// `num_slots` free slots; zero raises `ConfigError`.
    #[new]
    fn new(num_slots: usize) -> PyResult<Self> {
        Ok(Self {
            inner: pcache_core::StagingSlots::new(num_slots).py_err()?,
        })
    }

    /// Takes the next free slot for `holder`, waiting up to `timeout_s` (0 = fail at once);
    /// raises `StagingTimeoutError` listing every slot's holders, or `CacheClosedError`.
    #[pyo3(signature = (holder, timeout_s=0.0))]
    fn claim(&self, py: Python<'_>, holder: (String, u64), timeout_s: f64) -> PyResult<usize> {
        let holder = parse_holder(holder)?;
        let timeout = timeout(timeout_s)?;
        py.detach(|| self.inner.claim(holder, timeout)).py_err()
    }

    /// Takes the next free slot for `holder` if one is free now, else returns `None` (the
    /// fast path of `claim`: no exception is built when the ring is full).
    fn try_claim(&self, holder: (String, u64)) -> PyResult<Option<usize>> {
        match self.inner.claim(parse_holder(holder)?, Duration::ZERO) {
            Ok(slot) => Ok(Some(slot)),
            Err(pcache_core::Error::StagingTimeout { .. }) => Ok(None),
            Err(other) => Err(other).py_err(),
        }
    }

    /// Adds a holder to a slot.
    fn hold(&self, slot: usize, holder: (String, u64)) -> PyResult<()> {
        self.inner.hold(slot, parse_holder(holder)?).py_err()
    }

    /// Adds several holders of one kind (`"step"` or `"task"`) to a slot.
    fn hold_many(&self, slot: usize, kind: String, ids: Vec<u64>) -> PyResult<()> {
        let holders = holders_of(&kind, ids)?;
        self.inner.hold_many(slot, &holders).py_err()
    }

    /// Removes several holders of one kind from a slot; returns whether it became free.
    /// Refused as a whole (nothing released) if one of them does not hold it.
    fn release_many(&self, slot: usize, kind: String, ids: Vec<u64>) -> PyResult<bool> {
        let holders = holders_of(&kind, ids)?;
        self.inner.release_many(slot, &holders).py_err()
    }

    /// Removes a holder; returns whether the slot became free.
    fn release(&self, slot: usize, holder: (String, u64)) -> PyResult<bool> {
        self.inner.release(slot, parse_holder(holder)?).py_err()
    }

    /// Holders of every slot.
    fn holders(&self) -> Vec<Vec<(&'static str, u64)>> {
        self.inner
            .holders()
            .iter()
            .map(|hs| hs.iter().map(holder_tuple).collect())
            .collect()
    }

    /// Slots with no holder.
    #[getter]
    fn num_free(&self) -> usize {
        self.inner.num_free()
    }

    /// Wakes every waiter with `CacheClosedError`; later claims raise it too. Idempotent.
    fn close(&self) {
        self.inner.close()
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.is_closed()
    }
}
