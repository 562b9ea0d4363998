//! `WriteTasks`: the task table, the task state machine and the copy/completion queues.

use numpy::PyArray1;
use pcache_core::{
    CopyQueues, Escalation, Priority, Snapshot, TaskId, TaskState, TaskStateCell, TaskTable,
};
use pyo3::prelude::*;

use crate::convert::int_array;
use crate::errors::{invalid_input, IntoPy};

/// Write tasks and their queues. Any thread; state changes are lock-free compare-and-swaps.
#[pyclass(frozen, module = "omni_pcache._native")]
pub struct WriteTasks {
    table: TaskTable,
    /// Boxed: crossbeam's cache-padded lanes need 128-byte alignment, more than Python's
    /// object allocator guarantees for the pyclass itself.
    queues: Box<CopyQueues>,
}

/// Most tasks one `create_many` issues (far above any step's requests: a bound, not a budget).
const MAX_CREATE_MANY: usize = 1 << 24;

fn state_name(s: TaskState) -> &'static str {
    s.name()
}

impl WriteTasks {
    /// Applies one named edge of the state machine to task `task_id`.
    fn transition(
        &self,
        task_id: u64,
        edge: impl FnOnce(&TaskStateCell) -> pcache_core::Result<Snapshot>,
    ) -> PyResult<()> {
        edge(self.table.get(TaskId(task_id)).py_err()?.state())
            .map(drop)
            .py_err()
    }

    /// Issues `n` new tasks in PENDING; returns their ids (increasing).
    pub(crate) fn create_ids(&self, n: usize) -> Vec<u64> {
        (0..n).map(|_| self.table.create().id().0).collect()
    }

    /// Drops tasks just created by a call that was then refused (PENDING → FAILED, removed).
    pub(crate) fn discard_new(&self, task_ids: &[u64]) {
        for &id in task_ids {
            let _ = self.transition(id, TaskStateCell::fail);
            let _ = self.table.remove(TaskId(id));
        }
    }

    /// COPYING → HOST_READY for each task in order, stopping at the first refused transition.
    pub(crate) fn copy_done_all(&self, task_ids: &[u64]) -> PyResult<()> {
        task_ids
            .iter()
            .try_for_each(|&id| self.transition(id, TaskStateCell::copy_done))
    }

    /// Publishes each WRITTEN or FAILED task on the completion queue, in order. Refused as a
    /// whole (nothing published) when one is unknown, not WRITTEN or FAILED, already
    /// published or listed twice; only a task failed meanwhile by another thread between the
    /// check and its publication (a non-terminal one: the check refuses those) could stop it.
    pub(crate) fn complete_all(&self, task_ids: &[u64]) -> PyResult<()> {
        let tasks: Vec<_> = task_ids
            .iter()
            .map(|&id| self.table.get(TaskId(id)))
            .collect::<pcache_core::Result<_>>()
            .py_err()?;
        if let Some(err) = tasks
            .iter()
            .find_map(|t| t.state().publish_refusal(t.state().load()))
        {
            return Err(err).py_err();
        }
        if let Some(twice) = pcache_core::ids::first_repeat(task_ids) {
            return Err(invalid_input(format!(
                "task#{twice} is listed twice in one completion"
            )));
        }
        for task in tasks {
            task.state().mark_published().py_err()?;
            self.queues.complete(task.id());
        }
        Ok(())
    }

    /// HOST_READY → WRITTEN for each task in order, stopping at the first refused transition.
    pub(crate) fn written_all(&self, task_ids: &[u64]) -> PyResult<()> {
        task_ids
            .iter()
            .try_for_each(|&id| self.transition(id, TaskStateCell::written))
    }

    /// PENDING → QUEUED → COPYING for each task in order, with no queue entry (the pool's
    /// writer taking tasks it would otherwise queue and pop at once), stopping at the first
    /// refused transition.
    pub(crate) fn start_copy_now_all(&self, task_ids: &[u64]) -> PyResult<()> {
        task_ids
            .iter()
            .try_for_each(|&id| self.transition(id, TaskStateCell::start_copy_now))
    }

    /// Drops WRITTEN tasks from the table without publishing them on the completion queue
    /// (their writer closed them itself and nobody holds a record of them), stopping at the
    /// first refusal (an unknown or non-terminal task).
    pub(crate) fn forget_all(&self, task_ids: &[u64]) -> PyResult<()> {
        task_ids
            .iter()
            .try_for_each(|&id| self.table.remove(TaskId(id)).map(drop).py_err())
    }
}

#[pymethods]
impl WriteTasks {
    #[new]
    fn new() -> Self {
        Self {
            table: TaskTable::new(),
            queues: Box::new(CopyQueues::new()),
        }
    }

    /// Issues a new task in PENDING and returns its id.
    fn create(&self) -> u64 {
        self.table.create().id().0
    }

    /// Issues `n` new tasks in PENDING; returns their ids (increasing). At most
    /// `MAX_CREATE_MANY` at once.
    fn create_many(&self, n: usize) -> PyResult<Vec<u64>> {
        if n > MAX_CREATE_MANY {
            return Err(invalid_input(format!(
                "create_many({n}): at most {MAX_CREATE_MANY} tasks at once"
            )));
        }
        Ok(self.create_ids(n))
    }

    /// `enqueue` for several tasks, in order; stops at the first refusal (the ones before it
    /// stay queued).
    #[pyo3(signature = (task_ids, high=true))]
    fn enqueue_many(&self, task_ids: Vec<u64>, high: bool) -> PyResult<()> {
        task_ids.into_iter().try_for_each(|t| self.enqueue(t, high))
    }

    /// Drains the completion queue and drops those (WRITTEN or FAILED) tasks from the table;
    /// returns their ids, oldest first, as a list (the engine thread forgets each; a list
    /// costs it no numpy array per step). Every drained task is removed before a refusal (an id
    /// published twice) is raised, so none is lost.
    fn reap_completions(&self) -> PyResult<Vec<u64>> {
        let done = self.queues.drain_completions();
        let refused: Vec<_> = done
            .iter()
            .filter_map(|t| self.table.remove(*t).err())
            .collect();
        if let Some(err) = refused.into_iter().next() {
            return Err(err).py_err();
        }
        Ok(done.into_iter().map(|t| t.0).collect())
    }

    /// The task's state name (`"PENDING"`, ..., `"FAILED"`).
    fn state(&self, task_id: u64) -> PyResult<&'static str> {
        Ok(state_name(
            self.table
                .get(TaskId(task_id))
                .py_err()?
                .state()
                .load()
                .state(),
        ))
    }

    /// Whether the task was escalated.
    fn is_escalated(&self, task_id: u64) -> PyResult<bool> {
        Ok(self
            .table
            .get(TaskId(task_id))
            .py_err()?
            .state()
            .load()
            .is_escalated())
    }

    /// PENDING → QUEUED, into the high or low lane (the escalated lane if escalated before).
    #[pyo3(signature = (task_id, high=true))]
    fn enqueue(&self, task_id: u64, high: bool) -> PyResult<()> {
        let task = self.table.get(TaskId(task_id)).py_err()?;
        let priority = if high { Priority::High } else { Priority::Low };
        self.queues.push(task, priority).py_err()
    }

    /// Moves a task to the front of the queue; returns `"moved_to_front"`, `"flagged"`
    /// (PENDING: it will be queued first) or `"unchanged"` (already escalated, or COPYING
    /// or later: never re-queued).
    fn escalate(&self, task_id: u64) -> PyResult<&'static str> {
        let task = self.table.get(TaskId(task_id)).py_err()?;
        Ok(match self.queues.escalate(&task) {
            Escalation::MovedToFront => "moved_to_front",
            Escalation::Flagged => "flagged",
            Escalation::Unchanged => "unchanged",
        })
    }

    /// Claims the next queued task for copying (QUEUED → COPYING), escalated first, then
    /// high, then low; `None` when nothing is queued.
    fn pop(&self) -> Option<u64> {
        self.queues.pop().map(|t| t.id().0)
    }

    /// Claims up to `max` queued tasks for copying, in pop order (see `pop`); fewer when the
    /// queues run dry.
    fn pop_many(&self, max: usize) -> Vec<u64> {
        std::iter::from_fn(|| self.queues.pop())
            .take(max)
            .map(|t| t.id().0)
            .collect()
    }

    /// QUEUED → COPYING for one specific task (its queue entry goes stale). Of several
    /// racing callers exactly one succeeds; the others get `TaskStateError`.
    fn start_copy(&self, task_id: u64) -> PyResult<()> {
        self.transition(task_id, TaskStateCell::start_copy)
    }

    /// COPYING → HOST_READY.
    fn copy_done(&self, task_id: u64) -> PyResult<()> {
        self.transition(task_id, TaskStateCell::copy_done)
    }

    /// HOST_READY → WRITTEN.
    fn written(&self, task_id: u64) -> PyResult<()> {
        self.transition(task_id, TaskStateCell::written)
    }

    /// COPYING → HOST_READY for each task in order, stopping at the first refused transition.
    fn copy_done_many(&self, task_ids: Vec<u64>) -> PyResult<()> {
        self.copy_done_all(&task_ids)
    }

    /// HOST_READY → WRITTEN for each task in order, stopping at the first refused transition.
    fn written_many(&self, task_ids: Vec<u64>) -> PyResult<()> {
        self.written_all(&task_ids)
    }

    /// Publishes several WRITTEN or FAILED tasks on the completion queue, in order; refused as
    /// a whole (nothing published) when one cannot be.
    fn complete_many(&self, task_ids: Vec<u64>) -> PyResult<()> {
        self.complete_all(&task_ids)
    }

    /// Any non-terminal state → FAILED.
    fn fail(&self, task_id: u64) -> PyResult<()> {
        self.transition(task_id, TaskStateCell::fail)
    }

    /// Publishes a WRITTEN or FAILED task on the completion queue, once (a second publication
    /// is refused: the reader forgets each task it drains).
    fn complete(&self, task_id: u64) -> PyResult<()> {
        let task = self.table.get(TaskId(task_id)).py_err()?;
        task.state().mark_published().py_err()?;
        self.queues.complete(task.id());
        Ok(())
    }

    /// Every published completion, oldest first, as an int64 array.
    fn drain_completions(&self, py: Python<'_>) -> Py<PyArray1<i64>> {
        let ids = self
            .queues
            .drain_completions()
            .into_iter()
            .map(|t| t.0 as i64)
            .collect();
        int_array(py, ids)
    }

    /// Drops a WRITTEN or FAILED task from the table.
    fn remove(&self, task_id: u64) -> PyResult<()> {
        self.table.remove(TaskId(task_id)).map(drop).py_err()
    }

    /// `(task_id, state)` of every live task, by id: the "which task is stuck" diagnostic.
    fn states(&self) -> Vec<(u64, &'static str)> {
        self.table
            .states()
            .into_iter()
            .map(|(t, s)| (t.0, state_name(s)))
            .collect()
    }

    /// Entries in the copy lanes, stale ones included.
    #[getter]
    fn num_queue_entries(&self) -> usize {
        self.queues.num_entries()
    }

    fn __len__(&self) -> usize {
        self.table.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "WriteTasks(live={}, queue_entries={})",
            self.table.len(),
            self.queues.num_entries()
        )
    }
}
