//! The lock-free copy queues and the completion queue.
//!
//! Three FIFO lanes feed the copier: *escalated* (tasks of finished or aborted requests),
//! *high* and *low*. [`CopyQueues::pop`] drains them in that order, so escalating a task puts
//! it at the front of the high-priority queue. crossbeam's `SegQueue` cannot remove from the
//! middle, so a task moved out of the low lane leaves a stale entry behind; entries are
//! claimed with the task's QUEUED → COPYING compare-and-swap, so a stale or duplicate entry
//! loses that race and is dropped. A task already COPYING or later is never re-queued.
//!
//! Threads: any thread pushes and escalates; any number of copiers pop; the completion
//! queue is multi-producer, drained by whoever releases resources (the facade).

use std::sync::Arc;

use crate::error::Result;
use crate::ids::TaskId;
use crate::task_state::TaskState;
use crate::tasks::Task;

/// Which lane a task enters when it is queued (unless it was escalated before).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Priority {
    /// Ahead of every low-priority task.
    High,
    /// Behind every high-priority task.
    Low,
}

/// What [`CopyQueues::escalate`] did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Escalation {
    /// The task was QUEUED and is now at the front (its old entry goes stale).
    MovedToFront,
    /// The task was PENDING; it will enter the escalated lane when it is pushed.
    Flagged,
    /// Already escalated, or already COPYING or later: nothing changed.
    Unchanged,
}

#[cfg(not(loom))]
type Lane<T> = crossbeam_queue::SegQueue<T>;

/// Under loom the lanes are a mutex-guarded deque: loom cannot see inside crossbeam, and the
/// protocol under test is ours (the state-word claim), not crossbeam's.
#[cfg(loom)]
struct Lane<T>(crate::sync::Mutex<std::collections::VecDeque<T>>);

#[cfg(loom)]
impl<T> Lane<T> {
    fn new() -> Self {
        Self(crate::sync::Mutex::new(Default::default()))
    }
    fn push(&self, v: T) {
        self.0.lock().unwrap().push_back(v)
    }
    fn pop(&self) -> Option<T> {
        self.0.lock().unwrap().pop_front()
    }
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// The copy queues (escalated, high, low) and the completion queue.
pub struct CopyQueues {
    escalated: Lane<Arc<Task>>,
    high: Lane<Arc<Task>>,
    low: Lane<Arc<Task>>,
    completions: Lane<TaskId>,
}

impl Default for CopyQueues {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for CopyQueues {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyQueues")
            .field("entries", &self.num_entries())
            .field("completions", &self.completions.len())
            .finish()
    }
}

impl CopyQueues {
    /// Empty queues.
    pub fn new() -> Self {
        Self {
            escalated: Lane::new(),
            high: Lane::new(),
            low: Lane::new(),
            completions: Lane::new(),
        }
    }

    /// Queues a PENDING task (PENDING → QUEUED). A task escalated while PENDING enters the
    /// escalated lane whatever `priority` says. Refused (nothing queued) unless PENDING.
    pub fn push(&self, task: Arc<Task>, priority: Priority) -> Result<()> {
        let now = task.state().enqueue()?;
        let lane = if now.is_escalated() {
            &self.escalated
        } else {
            match priority {
                Priority::High => &self.high,
                Priority::Low => &self.low,
            }
        };
        lane.push(task);
        Ok(())
    }

    /// Moves a task to the front of the high-priority queue.
    ///
    /// QUEUED: a new entry goes to the escalated lane (the old one goes stale). PENDING: the
    /// task is flagged and enters the escalated lane when pushed. COPYING or later, or
    /// already escalated: unchanged — a task is never re-queued.
    pub fn escalate(&self, task: &Arc<Task>) -> Escalation {
        match task.state().mark_escalated() {
            Some(before) if before.state() == TaskState::Queued => {
                self.escalated.push(task.clone());
                Escalation::MovedToFront
            }
            Some(_) => Escalation::Flagged,
            None => Escalation::Unchanged,
        }
    }

    /// Claims the next task for copying (QUEUED → COPYING), escalated lane first, then high,
    /// then low. Stale entries (tasks claimed through another entry, or failed while
    /// queued) are dropped. Returns the task in COPYING, or `None` when every lane is empty.
    pub fn pop(&self) -> Option<Arc<Task>> {
        for lane in [&self.escalated, &self.high, &self.low] {
            while let Some(task) = lane.pop() {
                if task.state().start_copy().is_ok() {
                    return Some(task);
                }
            }
        }
        None
    }

    /// Entries in the copy lanes, stale ones included (an upper bound on queued tasks).
    pub fn num_entries(&self) -> usize {
        self.escalated.len() + self.high.len() + self.low.len()
    }

    /// Publishes a finished task (WRITTEN or FAILED) to whoever releases its resources.
    pub fn complete(&self, task: TaskId) {
        self.completions.push(task);
    }

    /// Takes every published completion, oldest first.
    pub fn drain_completions(&self) -> Vec<TaskId> {
        let mut out = Vec::new();
        while let Some(t) = self.completions.pop() {
            out.push(t);
        }
        out
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn task(id: u64) -> Arc<Task> {
        Arc::new(Task::new(TaskId(id)))
    }

    fn drain(q: &CopyQueues) -> Vec<u64> {
        std::iter::from_fn(|| q.pop()).map(|t| t.id().0).collect()
    }

    #[test]
    fn high_before_low_fifo_within_a_lane() {
        let q = CopyQueues::new();
        for (id, p) in [
            (1, Priority::Low),
            (2, Priority::High),
            (3, Priority::Low),
            (4, Priority::High),
        ] {
            q.push(task(id), p).unwrap();
        }
        assert_eq!(drain(&q), vec![2, 4, 1, 3]);
    }

    #[test]
    fn escalation_moves_a_low_task_to_the_front_once() {
        let q = CopyQueues::new();
        let tasks: Vec<_> = (0..4).map(task).collect();
        q.push(tasks[0].clone(), Priority::High).unwrap();
        q.push(tasks[1].clone(), Priority::Low).unwrap();
        q.push(tasks[2].clone(), Priority::Low).unwrap();
        assert_eq!(q.escalate(&tasks[2]), Escalation::MovedToFront);
        assert_eq!(q.escalate(&tasks[2]), Escalation::Unchanged);
        assert_eq!(q.escalate(&tasks[3]), Escalation::Flagged);
        q.push(tasks[3].clone(), Priority::Low).unwrap();
        assert_eq!(
            drain(&q),
            vec![2, 3, 0, 1],
            "each task exactly once, escalated first"
        );
        assert!(q.pop().is_none());
        assert_eq!(q.num_entries(), 0, "the stale entry of task 2 was dropped");
    }

    #[test]
    fn copying_tasks_are_never_requeued() {
        let q = CopyQueues::new();
        let t = task(1);
        q.push(t.clone(), Priority::Low).unwrap();
        let got = q.pop().unwrap();
        assert_eq!(got.state().load().state(), TaskState::Copying);
        assert_eq!(q.escalate(&t), Escalation::Unchanged);
        assert!(q.pop().is_none());
        assert!(q.push(t, Priority::High).is_err(), "push requires PENDING");
    }

    #[test]
    fn failed_while_queued_is_skipped() {
        let q = CopyQueues::new();
        let t = task(1);
        q.push(t.clone(), Priority::High).unwrap();
        t.state().fail().unwrap();
        assert!(q.pop().is_none());
    }

    #[test]
    fn completions_in_order() {
        let q = CopyQueues::new();
        q.complete(TaskId(3));
        q.complete(TaskId(1));
        assert_eq!(q.drain_completions(), vec![TaskId(3), TaskId(1)]);
        assert!(q.drain_completions().is_empty());
    }

    #[test]
    fn two_threads_push_and_pop_every_task_once() {
        let q = Arc::new(CopyQueues::new());
        let n = 10_000u64;
        let popped = std::thread::scope(|s| {
            let qp = q.clone();
            s.spawn(move || {
                for i in 0..n {
                    let t = task(i);
                    let p = if i % 3 == 0 {
                        Priority::High
                    } else {
                        Priority::Low
                    };
                    qp.push(t.clone(), p).unwrap();
                    if i % 7 == 0 {
                        qp.escalate(&t);
                    }
                }
            });
            let qc = q.clone();
            s.spawn(move || {
                let mut seen = vec![false; n as usize];
                let mut count = 0;
                while count < n {
                    if let Some(t) = qc.pop() {
                        assert!(!seen[t.id().0 as usize], "{} popped twice", t.id());
                        seen[t.id().0 as usize] = true;
                        count += 1;
                    } else {
                        std::hint::spin_loop();
                    }
                }
                count
            })
            .join()
            .unwrap()
        });
        assert_eq!(popped, n);
        assert!(q.pop().is_none());
    }
}
