//! The table of live write tasks: issues [`TaskId`]s and resolves them to [`Task`]s.
//!
//! Lookups take a short mutex (a hash-map probe, never held across a wait or a copy);
//! state changes then happen lock-free on the task's own atomic word.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::ids::TaskId;
use crate::task_state::{TaskState, TaskStateCell};

/// One write task: an id and its state word. Shared by the queues and the table.
#[derive(Debug)]
pub struct Task {
    state: TaskStateCell,
}

impl Task {
    /// A task in PENDING.
    pub fn new(id: TaskId) -> Self {
        Self {
            state: TaskStateCell::new(id),
        }
    }

    /// The task's id.
    pub fn id(&self) -> TaskId {
        self.state.task()
    }

    /// The task's state word.
    pub fn state(&self) -> &TaskStateCell {
        &self.state
    }
}

/// Live tasks by id. Any thread.
#[derive(Debug, Default)]
pub struct TaskTable {
    next: AtomicU64,
    live: Mutex<HashMap<TaskId, Arc<Task>>>,
}

impl TaskTable {
    /// An empty table; the first id issued is `task#0`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Issues a new id and registers a PENDING task under it.
    pub fn create(&self) -> Arc<Task> {
        let id = TaskId(self.next.fetch_add(1, Ordering::Relaxed));
        let task = Arc::new(Task::new(id));
        self.live.lock().insert(id, task.clone());
        task
    }

    /// The live task with this id.
    pub fn get(&self, id: TaskId) -> Result<Arc<Task>> {
        self.live
            .lock()
            .get(&id)
            .cloned()
            .ok_or(Error::UnknownTask { task: id })
    }

    /// Removes a task that reached WRITTEN or FAILED; a live (non-terminal) task is refused.
    pub fn remove(&self, id: TaskId) -> Result<Arc<Task>> {
        let mut live = self.live.lock();
        let task = live.get(&id).ok_or(Error::UnknownTask { task: id })?;
        let state = task.state().load().state();
        if !state.is_terminal() {
            return Err(Error::InvalidInput {
                what: format!("{id} is still {} and cannot be removed", state.name()),
            });
        }
        Ok(live.remove(&id).expect("checked above"))
    }

    /// Number of tasks in the table.
    pub fn len(&self) -> usize {
        self.live.lock().len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every live task with its state, sorted by id: the diagnostic for "which task is stuck".
    pub fn states(&self) -> Vec<(TaskId, TaskState)> {
        let mut out: Vec<_> = self
            .live
            .lock()
            .values()
            .map(|t| (t.id(), t.state().load().state()))
            .collect();
        out.sort_unstable();
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn ids_increase_and_unknown_ids_are_refused() {
        let t = TaskTable::new();
        let a = t.create();
        let b = t.create();
        assert!(a.id() < b.id());
        assert_eq!(
            t.get(TaskId(99)).unwrap_err(),
            Error::UnknownTask { task: TaskId(99) }
        );
        assert_eq!(t.get(a.id()).unwrap().id(), a.id());
    }

    #[test]
    fn only_terminal_tasks_are_removed() {
        let t = TaskTable::new();
        let a = t.create();
        let err = t.remove(a.id()).unwrap_err();
        assert!(err.to_string().contains("still PENDING"), "{err}");
        assert_eq!(t.len(), 1);
        a.state().fail().unwrap();
        t.remove(a.id()).unwrap();
        assert!(t.is_empty());
        assert!(matches!(t.remove(a.id()), Err(Error::UnknownTask { .. })));
    }

    #[test]
    fn states_lists_every_live_task_by_id() {
        let t = TaskTable::new();
        assert_eq!(t.states(), vec![]);
        let (a, b, c) = (t.create(), t.create(), t.create());
        assert!(!t.is_empty());
        c.state().enqueue().unwrap();
        a.state().fail().unwrap();
        assert_eq!(
            t.states(),
            vec![
                (a.id(), TaskState::Failed),
                (b.id(), TaskState::Pending),
                (c.id(), TaskState::Queued)
            ]
        );
        t.remove(a.id()).unwrap();
        assert_eq!(t.states().len(), 2);
    }
}
