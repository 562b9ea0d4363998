//! Unit tests of the task state cell (`task_state.rs`), kept beside it so that file holds the
//! state machine only.

use super::*;

fn cell() -> TaskStateCell {
    TaskStateCell::new(TaskId(7))
}

#[test]
fn a_completion_is_published_once_and_only_from_a_terminal_state() {
    let c = cell();
    assert!(c.mark_published().is_err(), "PENDING cannot complete");
    c.fail().unwrap();
    assert!(c.mark_published().unwrap().is_published());
    let twice = c.mark_published().unwrap_err();
    assert_eq!(
        twice.to_string(),
        "invalid input: task#7 was already published as complete"
    );
    assert_eq!(c.load().state(), TaskState::Failed);
}

#[test]
fn happy_path_reaches_written() {
    let c = cell();
    assert_eq!(c.enqueue().unwrap().state(), TaskState::Queued);
    assert_eq!(c.start_copy().unwrap().state(), TaskState::Copying);
    assert_eq!(c.copy_done().unwrap().state(), TaskState::HostReady);
    assert_eq!(c.written().unwrap().state(), TaskState::Written);
}

#[test]
fn start_copy_now_passes_through_queued_and_only_from_pending() {
    let c = cell();
    c.mark_escalated().unwrap();
    let now = c.start_copy_now().unwrap();
    assert_eq!(now.state(), TaskState::Copying);
    assert!(now.is_escalated(), "the flag survives both edges");
    let err = c.start_copy_now().unwrap_err();
    assert_eq!(
        err.to_string(),
        "task#7: illegal transition COPYING -> QUEUED"
    );
    assert_eq!(
        c.load().state(),
        TaskState::Copying,
        "a refusal changes nothing"
    );
    let queued = cell();
    queued.enqueue().unwrap();
    assert!(
        queued.start_copy_now().is_err(),
        "a queued task is the queue's"
    );
    assert_eq!(queued.load().state(), TaskState::Queued);
}

#[test]
fn skipping_a_state_is_refused_with_both_states_named() {
    let c = cell();
    let err = c.start_copy().unwrap_err();
    assert_eq!(
        err,
        Error::IllegalTransition {
            task: TaskId(7),
            from: TaskState::Pending,
            to: TaskState::Copying
        }
    );
    assert_eq!(
        err.to_string(),
        "task#7: illegal transition PENDING -> COPYING"
    );
    assert_eq!(
        c.load().state(),
        TaskState::Pending,
        "a refused move changes nothing"
    );
}

#[test]
fn terminal_states_are_final() {
    let c = cell();
    c.fail().unwrap();
    for to in TaskState::ALL {
        assert!(
            c.transition(to).is_err(),
            "FAILED -> {to:?} must be refused"
        );
    }
    let w = cell();
    for to in [
        TaskState::Queued,
        TaskState::Copying,
        TaskState::HostReady,
        TaskState::Written,
    ] {
        w.transition(to).unwrap();
    }
    assert!(w.fail().is_err());
    assert!(w.transition(TaskState::Pending).is_err());
}

#[test]
fn fail_from_every_live_state() {
    for stop in 0..4 {
        let c = cell();
        for to in &[TaskState::Queued, TaskState::Copying, TaskState::HostReady][..stop.min(3)] {
            c.transition(*to).unwrap();
        }
        assert_eq!(c.fail().unwrap().state(), TaskState::Failed);
    }
}

#[test]
fn edge_table_matches_the_diagram() {
    let mut edges = vec![];
    for a in TaskState::ALL {
        for b in TaskState::ALL {
            if a.can_move_to(b) {
                edges.push((a.name(), b.name()));
            }
        }
    }
    assert_eq!(
        edges,
        vec![
            ("PENDING", "QUEUED"),
            ("PENDING", "FAILED"),
            ("QUEUED", "COPYING"),
            ("QUEUED", "FAILED"),
            ("COPYING", "HOST_READY"),
            ("COPYING", "FAILED"),
            ("HOST_READY", "WRITTEN"),
            ("HOST_READY", "FAILED"),
        ]
    );
}

#[test]
fn escalation_only_before_copying_and_only_once() {
    let c = cell();
    assert!(c.mark_escalated().is_some());
    assert!(c.mark_escalated().is_none(), "second escalation is a no-op");
    assert!(c.load().is_escalated());
    assert!(
        c.enqueue().unwrap().is_escalated(),
        "flag survives transitions"
    );
    let d = cell();
    d.enqueue().unwrap();
    d.start_copy().unwrap();
    assert!(d.mark_escalated().is_none());
    assert!(!d.load().is_escalated());
}

#[test]
fn racing_copiers_exactly_one_wins() {
    for _ in 0..200 {
        let c = std::sync::Arc::new(cell());
        c.enqueue().unwrap();
        let wins: usize = std::thread::scope(|s| {
            let hs: Vec<_> = (0..4)
                .map(|_| {
                    let c = c.clone();
                    s.spawn(move || c.start_copy().is_ok() as usize)
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).sum()
        });
        assert_eq!(wins, 1);
    }
}

#[test]
fn names_parse_back_to_their_states() {
    for s in TaskState::ALL {
        assert_eq!(TaskState::from_name(s.name()), Some(s));
    }
    assert_eq!(TaskState::from_name("pending"), None);
    assert_eq!(TaskState::from_name(""), None);
}
