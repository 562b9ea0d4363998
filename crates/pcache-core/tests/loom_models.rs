//! Loom models of the lock-free parts: the task state word and the copy queues.
//!
//! Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=3 cargo test -p pcache-core --release --test loom_models`.
//!
//! Under `--cfg loom` the crate's atomics (and the queue lanes) are loom's, so tasks and queues
//! must be created inside the model closure. `Task`s are shared through `std::sync::Arc`, as the
//! queues take; loom only needs to see the state words and the lane mutexes.
#![cfg(loom)]

use std::sync::Arc;

use loom::thread;
use pcache_core::{
    CopyQueues, Error, Escalation, Priority, Snapshot, Task, TaskId, TaskState, TaskStateCell,
};

/// `loom::model` with a preemption bound (LOOM_MAX_PREEMPTIONS overrides it).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// One edge of the copier's pipeline.
type Step = fn(&TaskStateCell) -> pcache_core::Result<Snapshot>;

fn queued_task(id: u64) -> Arc<Task> {
    let t = Arc::new(Task::new(TaskId(id)));
    t.state().enqueue().unwrap();
    t
}

/// (a) Two copiers race QUEUED → COPYING: exactly one wins; the loser is told the task is
/// already COPYING; the word ends in COPYING.
#[test]
fn racing_start_copy_exactly_one_wins() {
    model(|| {
        let t = queued_task(1);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let t = t.clone();
                thread::spawn(move || t.state().start_copy().map(|s| s.state()))
            })
            .collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let wins = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(wins, 1, "{results:?}");
        for r in &results {
            match r {
                Ok(s) => assert_eq!(*s, TaskState::Copying),
                Err(e) => assert_eq!(
                    *e,
                    Error::IllegalTransition {
                        task: TaskId(1),
                        from: TaskState::Copying,
                        to: TaskState::Copying
                    }
                ),
            }
        }
        assert_eq!(t.state().load().state(), TaskState::Copying);
        assert!(!t.state().load().is_escalated());
    });
}

/// (b) `fail` races `start_copy` on a QUEUED task. Either the copier wins (then `fail`
/// moves COPYING → FAILED, both succeed) or `fail` wins (the copier is refused with
/// FAILED → COPYING). `fail` always succeeds; the word ends FAILED.
#[test]
fn fail_races_start_copy() {
    model(|| {
        let t = queued_task(2);
        let failer = {
            let t = t.clone();
            thread::spawn(move || t.state().fail().map(|s| s.state()))
        };
        let copier = {
            let t = t.clone();
            thread::spawn(move || t.state().start_copy().map(|s| s.state()))
        };
        let failed = failer.join().unwrap();
        let copied = copier.join().unwrap();
        assert_eq!(failed, Ok(TaskState::Failed));
        match copied {
            Ok(s) => assert_eq!(s, TaskState::Copying),
            Err(e) => assert_eq!(
                e,
                Error::IllegalTransition {
                    task: TaskId(2),
                    from: TaskState::Failed,
                    to: TaskState::Copying
                }
            ),
        }
        assert_eq!(t.state().load().state(), TaskState::Failed);
    });
}

/// (b') `fail` races a copier running the whole pipeline QUEUED → … → WRITTEN. The copier
/// stops at the first refused step, which names FAILED as its source; if the copier reached
/// WRITTEN first, `fail` is refused from WRITTEN. The final state says who won.
#[test]
fn fail_races_the_whole_pipeline() {
    model(|| {
        let t = queued_task(3);
        let failer = {
            let t = t.clone();
            thread::spawn(move || t.state().fail())
        };
        let copier = {
            let t = t.clone();
            thread::spawn(move || {
                let s = t.state();
                let steps: [(TaskState, Step); 3] = [
                    (TaskState::Copying, |c| c.start_copy()),
                    (TaskState::HostReady, |c| c.copy_done()),
                    (TaskState::Written, |c| c.written()),
                ];
                for (i, (to, step)) in steps.into_iter().enumerate() {
                    match step(s) {
                        Ok(snap) => assert_eq!(snap.state(), to),
                        Err(e) => {
                            assert_eq!(
                                e,
                                Error::IllegalTransition {
                                    task: TaskId(3),
                                    from: TaskState::Failed,
                                    to
                                }
                            );
                            return i;
                        }
                    }
                }
                3
            })
        };
        let failed = failer.join().unwrap();
        let done = copier.join().unwrap();
        let end = t.state().load().state();
        if done == 3 {
            assert_eq!(
                failed.unwrap_err(),
                Error::IllegalTransition {
                    task: TaskId(3),
                    from: TaskState::Written,
                    to: TaskState::Failed
                }
            );
            assert_eq!(end, TaskState::Written);
        } else {
            assert_eq!(failed.unwrap().state(), TaskState::Failed);
            assert_eq!(end, TaskState::Failed);
        }
    });
}

/// `mark_escalated` races `start_copy`: the flag is set only if it landed while QUEUED,
/// and neither CAS loses the other's bit.
#[test]
fn escalation_flag_races_start_copy() {
    model(|| {
        let t = queued_task(4);
        let marker = {
            let t = t.clone();
            thread::spawn(move || {
                t.state()
                    .mark_escalated()
                    .map(|s| (s.state(), s.is_escalated()))
            })
        };
        let copier = {
            let t = t.clone();
            thread::spawn(move || t.state().start_copy().is_ok())
        };
        let marked = marker.join().unwrap();
        assert!(copier.join().unwrap(), "nothing else claims the task");
        let now = t.state().load();
        assert_eq!(now.state(), TaskState::Copying);
        match marked {
            Some(before) => {
                assert_eq!(before, (TaskState::Queued, false));
                assert!(now.is_escalated(), "the copier's CAS kept the flag");
            }
            None => assert!(!now.is_escalated(), "a COPYING task is never flagged"),
        }
    });
}

/// (c) One thread escalates a task QUEUED in the low lane while another pops twice. The task
/// is popped exactly once in total (the thread's pops plus a final drain), its stale entry is
/// dropped, and it is never re-queued once COPYING.
#[test]
fn escalate_races_pop_each_task_once() {
    model(|| {
        let q = Arc::new(CopyQueues::new());
        let low = Arc::new(Task::new(TaskId(10)));
        let high = Arc::new(Task::new(TaskId(11)));
        q.push(low.clone(), Priority::Low).unwrap();
        q.push(high.clone(), Priority::High).unwrap();

        let escalator = {
            let (q, low) = (q.clone(), low.clone());
            thread::spawn(move || q.escalate(&low))
        };
        let popper = {
            let q = q.clone();
            thread::spawn(move || {
                (0..2)
                    .filter_map(|_| q.pop())
                    .map(|t| t.id())
                    .collect::<Vec<_>>()
            })
        };
        let escalation = escalator.join().unwrap();
        let mut popped = popper.join().unwrap();
        let by_thread = popped.clone();
        // The first pop always finds one of the two, and so does the second.
        assert_eq!(by_thread.len(), 2, "{by_thread:?}");
        while let Some(t) = q.pop() {
            popped.push(t.id());
        }

        let mut sorted = popped.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            vec![TaskId(10), TaskId(11)],
            "each task exactly once: {popped:?}"
        );
        assert_eq!(q.num_entries(), 0, "stale entries are dropped");
        assert!(q.pop().is_none());
        for t in [&low, &high] {
            assert_eq!(t.state().load().state(), TaskState::Copying);
        }
        // `low` can only overtake `high` through the escalated lane.
        if by_thread[0] == TaskId(10) {
            assert_eq!(escalation, Escalation::MovedToFront);
        }
        match escalation {
            Escalation::MovedToFront => assert!(low.state().load().is_escalated()),
            // Refused only because the task was already COPYING: the popper took it, after `high`.
            Escalation::Unchanged => {
                assert!(!low.state().load().is_escalated());
                assert_eq!(by_thread, vec![TaskId(11), TaskId(10)]);
            }
            Escalation::Flagged => panic!("the task was never PENDING during the race"),
        }
        // Once COPYING, escalation must not queue it again.
        assert_eq!(q.escalate(&low), Escalation::Unchanged);
        assert_eq!(q.num_entries(), 0);
    });
}

/// Two copiers pop concurrently while a third thread escalates: no task is handed to two
/// copiers, and nothing is lost.
#[test]
fn two_poppers_and_an_escalator_never_share_a_task() {
    model(|| {
        let q = Arc::new(CopyQueues::new());
        let t = Arc::new(Task::new(TaskId(20)));
        q.push(t.clone(), Priority::Low).unwrap();
        let escalator = {
            let (q, t) = (q.clone(), t.clone());
            thread::spawn(move || q.escalate(&t))
        };
        let poppers: Vec<_> = (0..2)
            .map(|_| {
                let q = q.clone();
                thread::spawn(move || q.pop().map(|t| t.id()))
            })
            .collect();
        escalator.join().unwrap();
        let mut got: Vec<_> = poppers
            .into_iter()
            .filter_map(|h| h.join().unwrap())
            .collect();
        got.extend(std::iter::from_fn(|| q.pop()).map(|t| t.id()));
        assert_eq!(got, vec![TaskId(20)]);
        assert_eq!(q.num_entries(), 0);
    });
}
