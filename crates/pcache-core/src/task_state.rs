//! The write-task state machine, kept in one atomic word per task.
//!
//! ```text
//! PENDING -> QUEUED -> COPYING -> HOST_READY -> WRITTEN
//!    \          \          \           \
//!     +----------+----------+-----------+--> FAILED
//! ```
//!
//! Each edge has a named method that documents its pre- and postconditions and returns the
//! new [`Snapshot`] or an [`Error::IllegalTransition`] naming the task and both states.
//! All transitions go through one private compare-and-swap loop, so when two threads race
//! for the same edge (two copiers claiming COPYING) exactly one wins and the other gets the
//! error. Besides the state the word carries the *escalated* flag: a task whose request
//! finished or aborted is moved to the front of the copy queue (see [`crate::queues`]).

use std::fmt;

use crate::error::{Error, Result};
use crate::ids::TaskId;
use crate::sync::{AtomicU64, Ordering};

/// The states of a write task.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
#[repr(u8)]
pub enum TaskState {
    /// Created: its rows are claimed in the ledger; not yet in a copy queue.
    Pending = 0,
    /// In a copy queue, waiting for a copier.
    Queued = 1,
    /// A copier owns it: the device→host copy is in flight.
    Copying = 2,
    /// Its rows are in host staging memory; waiting for the pool write.
    HostReady = 3,
    /// Its rows are in the pool (terminal).
    Written = 4,
    /// The copy or the pool write failed (terminal).
    Failed = 5,
}

impl TaskState {
    /// All states, in order.
    pub const ALL: [TaskState; 6] = [
        TaskState::Pending,
        TaskState::Queued,
        TaskState::Copying,
        TaskState::HostReady,
        TaskState::Written,
        TaskState::Failed,
    ];

    /// Written and Failed: no edge leaves them.
    pub fn is_terminal(self) -> bool {
        matches!(self, TaskState::Written | TaskState::Failed)
    }

    /// Whether `self -> to` is an edge of the state machine.
    pub fn can_move_to(self, to: TaskState) -> bool {
        use TaskState::*;
        matches!(
            (self, to),
            (Pending, Queued)
                | (Queued, Copying)
                | (Copying, HostReady)
                | (HostReady, Written)
                | (Pending | Queued | Copying | HostReady, Failed)
        )
    }

    /// The upper-case name used in messages and in the Python binding.
    pub fn name(self) -> &'static str {
        match self {
            TaskState::Pending => "PENDING",
            TaskState::Queued => "QUEUED",
            TaskState::Copying => "COPYING",
            TaskState::HostReady => "HOST_READY",
            TaskState::Written => "WRITTEN",
            TaskState::Failed => "FAILED",
        }
    }

    /// Parses [`TaskState::name`] back.
    pub fn from_name(name: &str) -> Option<TaskState> {
        TaskState::ALL.into_iter().find(|s| s.name() == name)
    }

    fn from_bits(bits: u64) -> TaskState {
        TaskState::ALL[(bits & STATE_MASK) as usize]
    }
}

const STATE_MASK: u64 = 0b111;
const ESCALATED: u64 = 0b1000;
const PUBLISHED: u64 = 0b1_0000;

/// A decoded copy of the state word.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Snapshot(u64);

impl Snapshot {
    /// The task's state.
    pub fn state(self) -> TaskState {
        TaskState::from_bits(self.0)
    }

    /// Whether the task was escalated (its request finished or aborted).
    pub fn is_escalated(self) -> bool {
        self.0 & ESCALATED != 0
    }

    /// Whether the task's completion was published (`TaskStateCell::mark_published`).
    pub fn is_published(self) -> bool {
        self.0 & PUBLISHED != 0
    }

    fn with_state(self, state: TaskState) -> Snapshot {
        Snapshot((self.0 & !STATE_MASK) | state as u64)
    }
}

impl fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Snapshot")
            .field("state", &self.state())
            .field("escalated", &self.is_escalated())
            .field("published", &self.is_published())
            .finish()
    }
}

/// The atomic state word of one task.
pub struct TaskStateCell {
    task: TaskId,
    word: AtomicU64,
}

impl fmt::Debug for TaskStateCell {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TaskStateCell")
            .field("task", &self.task)
            .field("now", &self.load())
            .finish()
    }
}

impl TaskStateCell {
    /// A new task in PENDING, not escalated.
    pub fn new(task: TaskId) -> Self {
        Self {
            task,
            word: AtomicU64::new(TaskState::Pending as u64),
        }
    }

    /// The task this word belongs to.
    pub fn task(&self) -> TaskId {
        self.task
    }

    /// The current state (acquire).
    pub fn load(&self) -> Snapshot {
        Snapshot(self.word.load(Ordering::Acquire))
    }

    /// The one compare-and-swap loop: applies `f` to the current snapshot until the swap
    /// lands or `f` refuses. Returns the snapshot that was stored.
    fn update(&self, mut f: impl FnMut(Snapshot) -> Result<Snapshot>) -> Result<Snapshot> {
        let mut current = self.load();
        loop {
            let next = f(current)?;
            match self.word.compare_exchange_weak(
                current.0,
                next.0,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(next),
                Err(actual) => current = Snapshot(actual),
            }
        }
    }

    /// Moves along one edge `from -> to`; refused unless the task is in `from` right now.
    fn step(&self, from: TaskState, to: TaskState) -> Result<Snapshot> {
        debug_assert!(from.can_move_to(to));
        self.update(|now| {
            if now.state() == from {
                Ok(now.with_state(to))
            } else {
                Err(self.illegal(now.state(), to))
            }
        })
    }

    fn illegal(&self, from: TaskState, to: TaskState) -> Error {
        Error::IllegalTransition {
            task: self.task,
            from,
            to,
        }
    }

    /// PENDING → QUEUED: the task was pushed to a copy queue.
    pub fn enqueue(&self) -> Result<Snapshot> {
        self.step(TaskState::Pending, TaskState::Queued)
    }

    /// QUEUED → COPYING: a copier claimed the task. Exactly one of several racing copiers wins.
    pub fn start_copy(&self) -> Result<Snapshot> {
        self.step(TaskState::Queued, TaskState::Copying)
    }

    /// PENDING → QUEUED → COPYING with no queue entry: the pool's writer takes a task the
    /// moment it would be queued (a small step written by the thread that saved it, which
    /// holds the writer's lock, so nothing could pop it in between). Refused unless PENDING; a
    /// refusal of the second edge (the task failed in between) leaves it QUEUED or FAILED.
    pub fn start_copy_now(&self) -> Result<Snapshot> {
        self.enqueue()?;
        self.start_copy()
    }

    /// COPYING → HOST_READY: the task's rows are in host staging memory.
    pub fn copy_done(&self) -> Result<Snapshot> {
        self.step(TaskState::Copying, TaskState::HostReady)
    }

    /// HOST_READY → WRITTEN: the rows are in the pool (terminal).
    pub fn written(&self) -> Result<Snapshot> {
        self.step(TaskState::HostReady, TaskState::Written)
    }

    /// Any non-terminal state → FAILED (terminal). Refused from WRITTEN or FAILED.
    pub fn fail(&self) -> Result<Snapshot> {
        self.update(|now| {
            if now.state().is_terminal() {
                Err(self.illegal(now.state(), TaskState::Failed))
            } else {
                Ok(now.with_state(TaskState::Failed))
            }
        })
    }

    /// The edge `current -> to`, whichever it is; refused if it is not an edge.
    pub fn transition(&self, to: TaskState) -> Result<Snapshot> {
        self.update(|now| {
            if now.state().can_move_to(to) {
                Ok(now.with_state(to))
            } else {
                Err(self.illegal(now.state(), to))
            }
        })
    }

    /// Sets the escalated flag if the task is still PENDING or QUEUED.
    ///
    /// Returns the snapshot *before* the change, or `None` when the task is already
    /// COPYING or later (it must never be re-queued) or was already escalated.
    pub fn mark_escalated(&self) -> Option<Snapshot> {
        let mut before = None;
        let result = self.update(|now| {
            before = Some(now);
            let state = now.state();
            if now.is_escalated() || !matches!(state, TaskState::Pending | TaskState::Queued) {
                Err(self.illegal(state, state))
            } else {
                Ok(Snapshot(now.0 | ESCALATED))
            }
        });
        result.ok().and(before)
    }

    /// Marks a WRITTEN or FAILED task's completion as published, once: the caller then puts
    /// it on the completion queue, whose reader forgets each task it drains. Refused (nothing
    /// changes) for a task not in a terminal state, or already published, which would hand
    /// the reader one task twice.
    pub fn mark_published(&self) -> Result<Snapshot> {
        self.update(|now| match self.publish_refusal(now) {
            Some(err) => Err(err),
            None => Ok(Snapshot(now.0 | PUBLISHED)),
        })
    }

    /// Why [`TaskStateCell::mark_published`] would refuse the task in state `now`, if it
    /// would: a batch checks every task with it before publishing any.
    pub fn publish_refusal(&self, now: Snapshot) -> Option<Error> {
        let state = now.state();
        if !state.is_terminal() {
            Some(Error::InvalidInput {
                what: format!(
                    "{} is {} and cannot complete (only WRITTEN or FAILED tasks do)",
                    self.task,
                    state.name()
                ),
            })
        } else if now.is_published() {
            Some(Error::InvalidInput {
                what: format!("{} was already published as complete", self.task),
            })
        } else {
            None
        }
    }
}

#[cfg(all(test, not(loom)))]
#[path = "task_state_tests.rs"]
mod tests;
