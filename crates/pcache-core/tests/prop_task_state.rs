//! Property tests of the write-task state word ([`TaskStateCell`]) and of the copy queues
//! ([`CopyQueues`]) against small reference models.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use pcache_core::{
    CopyQueues, Error, Escalation, Priority, Task, TaskId, TaskState, TaskStateCell,
};
use proptest::prelude::*;

const ID: TaskId = TaskId(42);

// ---------------------------------------------------------------------------------------------
// TaskStateCell
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum CellOp {
    Enqueue,
    StartCopy,
    CopyDone,
    Written,
    Fail,
    Transition(TaskState),
    MarkEscalated,
}

/// The edges of the diagram, written out independently of `TaskState::can_move_to`.
fn is_edge(from: TaskState, to: TaskState) -> bool {
    use TaskState::*;
    const EDGES: [(TaskState, TaskState); 8] = [
        (Pending, Queued),
        (Queued, Copying),
        (Copying, HostReady),
        (HostReady, Written),
        (Pending, Failed),
        (Queued, Failed),
        (Copying, Failed),
        (HostReady, Failed),
    ];
    EDGES.contains(&(from, to))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CellModel {
    state: TaskState,
    escalated: bool,
}

/// What a transition returns, decoded: the new (state, escalated) or the error.
type Outcome = Result<(TaskState, bool), Error>;

impl CellModel {
    fn step(&mut self, from: TaskState, to: TaskState) -> Outcome {
        if self.state == from {
            self.state = to;
            Ok((self.state, self.escalated))
        } else {
            Err(Error::IllegalTransition {
                task: ID,
                from: self.state,
                to,
            })
        }
    }

    fn transition(&mut self, to: TaskState) -> Outcome {
        if is_edge(self.state, to) {
            self.state = to;
            Ok((self.state, self.escalated))
        } else {
            Err(Error::IllegalTransition {
                task: ID,
                from: self.state,
                to,
            })
        }
    }

    fn fail(&mut self) -> Outcome {
        match self.state {
            TaskState::Written | TaskState::Failed => Err(Error::IllegalTransition {
                task: ID,
                from: self.state,
                to: TaskState::Failed,
            }),
            _ => {
                self.state = TaskState::Failed;
                Ok((self.state, self.escalated))
            }
        }
    }

    /// `Some(before)` when the flag was set now.
    fn mark_escalated(&mut self) -> Option<(TaskState, bool)> {
        let before = (self.state, self.escalated);
        if !self.escalated && matches!(self.state, TaskState::Pending | TaskState::Queued) {
            self.escalated = true;
            Some(before)
        } else {
            None
        }
    }
}

fn any_state() -> impl Strategy<Value = TaskState> {
    proptest::sample::select(TaskState::ALL.to_vec())
}

fn cell_op() -> impl Strategy<Value = CellOp> {
    prop_oneof![
        3 => Just(CellOp::Enqueue),
        3 => Just(CellOp::StartCopy),
        3 => Just(CellOp::CopyDone),
        3 => Just(CellOp::Written),
        1 => Just(CellOp::Fail),
        3 => any_state().prop_map(CellOp::Transition),
        2 => Just(CellOp::MarkEscalated),
    ]
}

/// 512 cases, or PROPTEST_CASES when set (`just test-slow`).
fn config() -> ProptestConfig {
    let mut config = ProptestConfig::default(); // (reads PROPTEST_CASES)
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = 512;
    }
    config
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn task_state_cell_agrees_with_the_model(ops in prop::collection::vec(cell_op(), 1..40)) {
        let cell = TaskStateCell::new(ID);
        let mut model = CellModel { state: TaskState::Pending, escalated: false };
        prop_assert_eq!(cell.task(), ID);
        for op in ops {
            let decode = |r: pcache_core::Result<pcache_core::Snapshot>| r.map(|s| (s.state(), s.is_escalated()));
            match op {
                CellOp::MarkEscalated => {
                    let got = cell.mark_escalated().map(|s| (s.state(), s.is_escalated()));
                    prop_assert_eq!(got, model.mark_escalated(), "mark_escalated");
                }
                CellOp::Enqueue => {
                    prop_assert_eq!(decode(cell.enqueue()), model.step(TaskState::Pending, TaskState::Queued));
                }
                CellOp::StartCopy => {
                    prop_assert_eq!(decode(cell.start_copy()), model.step(TaskState::Queued, TaskState::Copying));
                }
                CellOp::CopyDone => {
                    prop_assert_eq!(decode(cell.copy_done()), model.step(TaskState::Copying, TaskState::HostReady));
                }
                CellOp::Written => {
                    prop_assert_eq!(decode(cell.written()), model.step(TaskState::HostReady, TaskState::Written));
                }
                CellOp::Fail => prop_assert_eq!(decode(cell.fail()), model.fail()),
                CellOp::Transition(to) => {
                    prop_assert_eq!(decode(cell.transition(to)), model.transition(to), "transition({:?})", to);
                }
            }
            let now = cell.load();
            prop_assert_eq!((now.state(), now.is_escalated()), (model.state, model.escalated), "after {:?}", op);
            prop_assert_eq!(now.state().can_move_to(TaskState::Failed), !now.state().is_terminal());
        }
    }
}

/// Every (from, to) pair reached through `transition` from a fresh cell: the edge table.
#[test]
fn transition_from_every_state_to_every_state() {
    let path = [
        TaskState::Queued,
        TaskState::Copying,
        TaskState::HostReady,
        TaskState::Written,
    ];
    for from in TaskState::ALL {
        for to in TaskState::ALL {
            let cell = TaskStateCell::new(ID);
            if from == TaskState::Failed {
                cell.fail().unwrap();
            } else {
                for s in path.iter().take_while(|s| **s <= from) {
                    cell.transition(*s).unwrap();
                }
            }
            assert_eq!(cell.load().state(), from);
            let got = cell.transition(to);
            if is_edge(from, to) {
                assert_eq!(got.unwrap().state(), to);
            } else {
                assert_eq!(
                    got.unwrap_err(),
                    Error::IllegalTransition { task: ID, from, to }
                );
                assert_eq!(cell.load().state(), from, "a refused move changes nothing");
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// CopyQueues
// ---------------------------------------------------------------------------------------------

const NUM_QTASKS: usize = 8;

#[derive(Clone, Copy, Debug)]
enum QueueOp {
    Push(usize, Priority),
    Escalate(usize),
    Pop,
    Fail(usize),
    /// COPYING → HOST_READY → WRITTEN, as a copier would after a pop.
    Finish(usize),
}

/// The queues as seen from outside: every QUEUED task holds one ticket (lane rank, arrival
/// sequence); `pop` returns the QUEUED task with the smallest ticket. No stale entries exist
/// in the model — those are an implementation detail that must be invisible.
#[derive(Default, Debug)]
struct QueueModel {
    cells: Vec<CellModel>,
    tickets: HashMap<usize, (u8, u64)>,
    seq: u64,
}

impl QueueModel {
    fn new() -> Self {
        Self {
            cells: vec![
                CellModel {
                    state: TaskState::Pending,
                    escalated: false
                };
                NUM_QTASKS
            ],
            ..Self::default()
        }
    }

    fn ticket(&mut self, lane: u8) -> (u8, u64) {
        self.seq += 1;
        (lane, self.seq)
    }

    fn push(&mut self, t: usize, priority: Priority) -> Result<(), Error> {
        let c = &mut self.cells[t];
        if c.state != TaskState::Pending {
            return Err(Error::IllegalTransition {
                task: TaskId(t as u64),
                from: c.state,
                to: TaskState::Queued,
            });
        }
        c.state = TaskState::Queued;
        let lane = if c.escalated {
            0
        } else {
            match priority {
                Priority::High => 1,
                Priority::Low => 2,
            }
        };
        let ticket = self.ticket(lane);
        self.tickets.insert(t, ticket);
        Ok(())
    }

    fn escalate(&mut self, t: usize) -> Escalation {
        let c = &mut self.cells[t];
        match (c.state, c.escalated) {
            (TaskState::Pending, false) => {
                c.escalated = true;
                Escalation::Flagged
            }
            (TaskState::Queued, false) => {
                c.escalated = true;
                let ticket = self.ticket(0);
                self.tickets.insert(t, ticket);
                Escalation::MovedToFront
            }
            _ => Escalation::Unchanged,
        }
    }

    fn pop(&mut self) -> Option<usize> {
        let (&t, _) = self.tickets.iter().min_by_key(|(_, ticket)| **ticket)?;
        self.tickets.remove(&t);
        self.cells[t].state = TaskState::Copying;
        Some(t)
    }

    fn fail(&mut self, t: usize) -> bool {
        let ok = self.cells[t].fail().is_ok();
        if ok {
            self.tickets.remove(&t);
        }
        ok
    }

    fn finish(&mut self, t: usize) -> bool {
        let c = &mut self.cells[t];
        c.state == TaskState::Copying
            && c.transition(TaskState::HostReady)
                .and_then(|_| c.transition(TaskState::Written))
                .is_ok()
    }
}

fn queue_op() -> impl Strategy<Value = QueueOp> {
    let t = || 0..NUM_QTASKS;
    let prio = || prop_oneof![Just(Priority::High), Just(Priority::Low)];
    prop_oneof![
        4 => (t(), prio()).prop_map(|(t, p)| QueueOp::Push(t, p)),
        3 => t().prop_map(QueueOp::Escalate),
        4 => Just(QueueOp::Pop),
        1 => t().prop_map(QueueOp::Fail),
        1 => t().prop_map(QueueOp::Finish),
    ]
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn copy_queues_pop_in_lane_order_each_task_once(ops in prop::collection::vec(queue_op(), 1..50)) {
        let q = CopyQueues::new();
        let tasks: Vec<Arc<Task>> = (0..NUM_QTASKS).map(|i| Arc::new(Task::new(TaskId(i as u64)))).collect();
        let mut model = QueueModel::new();
        let mut popped = HashSet::new();
        let mut check_pop = |got: Option<Arc<Task>>, model: &mut QueueModel| -> Result<bool, TestCaseError> {
            let got = got.map(|t| {
                prop_assert_eq!(t.state().load().state(), TaskState::Copying, "popped tasks are COPYING");
                Ok(t.id().0 as usize)
            }).transpose()?;
            prop_assert_eq!(got, model.pop(), "pop");
            if let Some(t) = got {
                prop_assert!(popped.insert(t), "task {} popped twice", t);
            }
            Ok(got.is_some())
        };
        for op in ops {
            match op {
                QueueOp::Push(t, p) => {
                    prop_assert_eq!(q.push(tasks[t].clone(), p), model.push(t, p), "push({}, {:?})", t, p);
                }
                QueueOp::Escalate(t) => prop_assert_eq!(q.escalate(&tasks[t]), model.escalate(t), "escalate({})", t),
                QueueOp::Pop => {
                    let more = check_pop(q.pop(), &mut model)?;
                    if !more {
                        prop_assert_eq!(q.num_entries(), 0, "an empty pop drains every stale entry");
                    }
                }
                QueueOp::Fail(t) => prop_assert_eq!(tasks[t].state().fail().is_ok(), model.fail(t), "fail({})", t),
                QueueOp::Finish(t) => {
                    let s = tasks[t].state();
                    let ok = s.load().state() == TaskState::Copying && s.copy_done().is_ok() && s.written().is_ok();
                    prop_assert_eq!(ok, model.finish(t), "finish({})", t);
                }
            }
            prop_assert!(q.num_entries() >= model.tickets.len(), "every queued task has an entry");
            for (t, task) in tasks.iter().enumerate() {
                let now = task.state().load();
                prop_assert_eq!((now.state(), now.is_escalated()), (model.cells[t].state, model.cells[t].escalated), "task {}", t);
            }
        }
        // Drain: everything still queued comes out in ticket order, then nothing.
        while check_pop(q.pop(), &mut model)? {}
        prop_assert!(model.tickets.is_empty());
        prop_assert_eq!(q.num_entries(), 0);
        // Never re-queued: escalating or pushing a task that left PENDING changes nothing.
        for task in &tasks {
            if task.state().load().state() != TaskState::Pending {
                prop_assert!(q.push(task.clone(), Priority::High).is_err());
                prop_assert_eq!(q.escalate(task), Escalation::Unchanged);
            }
        }
        prop_assert!(q.pop().is_none());
    }
}
