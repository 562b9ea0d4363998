//! Unit tests of the ledger (`ledger.rs`), kept beside it so that file holds the ledger only.

use super::*;

pub(super) const T1: TaskId = TaskId(1);
pub(super) const T2: TaskId = TaskId(2);

pub(super) fn ledger_with_key() -> (Ledger, KeyId) {
    let mut l = Ledger::new(64, 4).unwrap();
    let k = l.add_key();
    (l, k)
}

#[test]
fn owned_many_concatenates_shifted_positions_and_skips_stolen_rows() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[4i64, 5], k, T1).unwrap();
    l.claim(&[6i64, 7], k, T2).unwrap();
    assert_eq!(
        l.owned_many(&[T1, T2], k, &[10, 12]).unwrap(),
        (vec![10, 11, 12, 13], vec![4, 5, 6, 7])
    );
    l.claim(&[5i64], k, TaskId(3)).unwrap(); // newest tenant wins
    let (positions, slots) = l.owned_many(&[T1, T2], k, &[10, 12]).unwrap();
    assert_eq!(
        (positions.clone(), slots),
        (vec![10, 12, 13], vec![4, 6, 7])
    );
    assert_eq!(contiguous_from(&positions), None);
    assert_eq!(contiguous_from(&[3, 4, 5]), Some(3));
    assert_eq!(contiguous_from(&[]), None);
    assert!(l.owned_many(&[T1], k, &[]).is_err());
    assert_eq!(l.commit_many(&[T1, T2]).unwrap(), 3);
    assert_eq!(l.num_tasks(), 1);
}

#[test]
fn commit_many_is_refused_as_a_whole_for_an_unknown_or_repeated_task() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[4i64, 5], k, T1).unwrap();
    l.claim(&[6i64], k, T2).unwrap();
    let before = l.peek(&[4i64, 5, 6], k).unwrap();
    assert_eq!(
        l.commit_many(&[T1, TaskId(9), T2]),
        Err(Error::UnknownTask { task: TaskId(9) })
    );
    let err = l.commit_many(&[T2, T1, T2]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid input: task#2 is listed twice in one commit"
    );
    assert_eq!(
        l.peek(&[4i64, 5, 6], k).unwrap(),
        before,
        "nothing committed"
    );
    assert_eq!(l.num_tasks(), 2);
    assert_eq!(l.commit_many(&[T2, T1]).unwrap(), 3);
    assert_eq!(l.num_tasks(), 0);
}

#[test]
fn owned_many_refuses_offsets_that_are_negative_or_could_overflow_a_position() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[4i64, 5], k, T1).unwrap();
    let most = i64::MAX - 64;
    for offset in [-1, most + 1, i64::MAX, i64::MIN] {
        let err = l.owned_many(&[T1], k, &[offset]).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("invalid input: offset {offset} of task#1 is out of range [0, {most}]")
        );
    }
    assert_eq!(
        l.owned_many(&[T1], k, &[most]).unwrap(),
        (vec![most, most + 1], vec![4, 5])
    );
}

#[test]
fn a_read_plan_summarises_its_sources() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[1i64, 2], k, T1).unwrap();
    l.commit(T1).unwrap();
    l.claim(&[3i64, 5], k, T2).unwrap();
    l.claim(&[4i64], k, T1).unwrap();
    let plan = l.plan_read(&[1i64, 2, 3, 4, 5, 9], k).unwrap();
    assert_eq!(plan.num_absent(), 1);
    assert_eq!(plan.num_from_pool(), 2);
    assert_eq!(plan.tasks(), vec![T1, T2]);
}

#[test]
fn claim_then_commit_makes_rows_committed() {
    let (mut l, k) = ledger_with_key();
    let out = l.claim(&[4i64, 5, 6], k, T1).unwrap();
    assert_eq!(out, ClaimOutcome::default());
    assert_eq!(
        l.peek(&[4i64, 5, 6, 7], k).unwrap(),
        (vec![1, 1, 1, SOURCE_ABSENT], vec![1, 1, 1, 0])
    );
    assert_eq!(l.commit(T1).unwrap(), 3);
    assert_eq!(l.peek(&[4i64], k).unwrap(), (vec![SOURCE_POOL], vec![1]));
    assert_eq!(l.num_tasks(), 0);
}

#[test]
fn newest_tenant_wins_over_an_older_in_transit_task() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[1i64, 2, 3], k, T1).unwrap();
    let out = l.claim(&[3i64, 4], k, T2).unwrap();
    assert_eq!(out.stolen_slots, vec![3]);
    assert_eq!(out.stolen_from, vec![1]);
    assert_eq!(l.owned(T1, k).unwrap(), (vec![0, 1], vec![1, 2]));
    assert_eq!(l.owned(T2, k).unwrap(), (vec![0, 1], vec![3, 4]));
    // The older task finishing last must not take slot 3 back.
    assert_eq!(l.commit(T2).unwrap(), 2);
    assert_eq!(l.commit(T1).unwrap(), 2);
    assert_eq!(l.peek(&[3i64], k).unwrap(), (vec![SOURCE_POOL], vec![2]));
}

#[test]
fn claim_over_a_read_committed_slot_asks_for_preservation() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[8i64, 9], k, T1).unwrap();
    l.commit(T1).unwrap();
    let plan = l.plan_read(&[8i64, 9], k).unwrap();
    assert_eq!(
        plan.sources, None,
        "every row in the pool: nothing per slot"
    );
    assert_eq!(plan.source_codes(), vec![SOURCE_POOL, SOURCE_POOL]);
    let out = l.claim(&[9i64, 10], k, T2).unwrap();
    assert_eq!(out.preserve_slots, vec![9]);
    assert_eq!(
        (out.preserve_versions, out.preserve_from),
        (vec![1], vec![SOURCE_POOL])
    );
    assert!(out.stolen_slots.is_empty());
    assert_eq!(l.validate(plan.read).unwrap(), vec![1]);
    // Only once: the read captured the old version, a second claim needs no copy.
    assert!(l
        .claim(&[9i64], k, TaskId(3))
        .unwrap()
        .preserve_slots
        .is_empty());
    l.release(plan.read).unwrap();
    assert_eq!(l.readers(&[8i64, 9], k).unwrap(), vec![0, 0]);
}

#[test]
fn claim_over_a_read_in_transit_slot_asks_the_old_task_to_preserve() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[8i64, 9], k, T1).unwrap();
    let plan = l.plan_read(&[9i64], k).unwrap();
    assert_eq!(plan.sources, Some(vec![1]), "in transit under task#1");
    let out = l.claim(&[9i64], k, T2).unwrap();
    assert_eq!(out.stolen_slots, vec![9]);
    assert_eq!(out.preserve_slots, vec![9]);
    assert_eq!(out.preserve_versions, vec![1]);
    assert_eq!(out.preserve_from, vec![1], "task#1 holds the captured row");
    l.release(plan.read).unwrap();
}

#[test]
fn claim_many_equals_one_claim_per_task_and_is_refused_as_a_whole() {
    let (mut many, k) = ledger_with_key();
    let (mut one, _) = ledger_with_key();
    one.claim(&[5i64], k, TaskId(9)).unwrap();
    many.claim(&[5i64], k, TaskId(9)).unwrap();
    let plan = one.plan_read(&[5i64], k).unwrap();
    many.plan_read(&[5i64], k).unwrap();
    let slots = [0i64, 1, 2, 3, 5, 6];
    let out = many
        .claim_many(&slots, &[4, 0, 2], k, &[T1, TaskId(7), T2])
        .unwrap();
    let mut want = one.claim(&slots[..4], k, T1).unwrap();
    let tail = one.claim(&slots[4..], k, T2).unwrap();
    want.stolen_slots.extend(tail.stolen_slots);
    want.stolen_from.extend(tail.stolen_from);
    want.preserve_slots.extend(tail.preserve_slots);
    want.preserve_versions.extend(tail.preserve_versions);
    want.preserve_from.extend(tail.preserve_from);
    assert_eq!(out, want);
    assert_eq!(out.stolen_slots, vec![5]);
    assert_eq!(many.owned(T2, k).unwrap(), one.owned(T2, k).unwrap());
    assert_eq!(many.validate(plan.read).unwrap(), vec![0]);
    let before = many.peek(&slots, k).unwrap();
    let err = many
        .claim_many(&[10i64, 11, 10], &[2, 1], k, &[TaskId(3), TaskId(4)])
        .unwrap_err();
    assert!(
        matches!(err, Error::DuplicateSlot { slot: 10, .. }),
        "{err}"
    );
    assert!(matches!(
        many.claim_many(&[10i64], &[2], k, &[TaskId(3)]),
        Err(Error::InvalidInput { .. })
    ));
    assert_eq!(many.peek(&slots, k).unwrap(), before);
    assert!(many.owned(TaskId(3), k).is_err(), "nothing was claimed");
}

#[test]
fn released_reads_need_no_preservation() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[0i64], k, T1).unwrap();
    l.commit(T1).unwrap();
    let plan = l.plan_read(&[0i64, 0], k).unwrap();
    assert_eq!(l.readers(&[0i64], k).unwrap(), vec![2]);
    l.release(plan.read).unwrap();
    assert!(l.claim(&[0i64], k, T2).unwrap().preserve_slots.is_empty());
    assert_eq!(
        l.release(plan.read).unwrap_err(),
        Error::UnknownRead { read: plan.read }
    );
}

#[test]
fn abandoned_rows_are_absent_and_reads_see_it() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[5i64], k, T1).unwrap();
    let plan = l.plan_read(&[5i64], k).unwrap();
    assert_eq!(plan.sources, Some(vec![1]));
    assert_eq!(l.abandon(T1).unwrap(), 1);
    assert_eq!(l.validate(plan.read).unwrap(), vec![0]);
    assert_eq!(l.peek(&[5i64], k).unwrap().0, vec![SOURCE_ABSENT]);
}

#[test]
fn invalidated_rows_are_absent_captured_ones_are_preserved_and_in_transit_ones_stolen() {
    let (mut l, k) = ledger_with_key();
    // Slots 0..20 committed (a run of 16 and a short tail), 30 and 31 in transit under T2.
    let committed: Vec<i64> = (0..20).collect();
    l.claim(&committed, k, T1).unwrap();
    l.commit(T1).unwrap();
    l.claim(&[30i64, 31], k, T2).unwrap();
    let plan = l.plan_read(&[3i64, 18, 31], k).unwrap();

    let gone: Vec<i64> = (0..20).chain([30, 31]).collect();
    let out = l.invalidate(&gone, k).unwrap();
    // The captured rows are reported for preserving, from where they are now.
    assert_eq!(out.preserve_slots, vec![3, 18, 31]);
    assert_eq!(out.preserve_versions, vec![1, 1, 2]);
    assert_eq!(out.preserve_from, vec![SOURCE_POOL, SOURCE_POOL, 2]);
    // The in-transit task loses its slots: it writes nothing and commits nothing.
    assert_eq!(
        (out.stolen_slots, out.stolen_from),
        (vec![30, 31], vec![2, 2])
    );
    assert_eq!(l.owned(T2, k).unwrap(), (vec![], vec![]));
    assert_eq!(l.commit(T2).unwrap(), 0);
    // Every slot is absent at a new version; the pending read sees all three move.
    let (sources, versions) = l.peek(&gone, k).unwrap();
    assert!(sources.iter().all(|&s| s == SOURCE_ABSENT));
    assert!(versions.iter().all(|&v| v == 3)); // (the third successful claim)
    assert_eq!(l.validate(plan.read).unwrap(), vec![0, 1, 2]);
    l.release(plan.read).unwrap();
    // A read planned now finds nothing to serve.
    assert_eq!(l.plan_read(&[3i64], k).unwrap().num_absent(), 1);
    // Refused as a whole: a slot twice, or out of range, changes nothing.
    assert!(l.invalidate(&[40i64, 40], k).is_err());
    assert!(l.invalidate(&[41i64, 64], k).is_err());
    assert_eq!(l.peek(&[40i64, 41], k).unwrap().1, vec![0, 0]);
    assert!(l.invalidate(&[1i64], KeyId(7)).is_err());
}

#[test]
fn a_task_reclaiming_its_own_slot_owns_only_the_newest_position() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[1i64, 2], k, T1).unwrap();
    let out = l.claim(&[2i64], k, T1).unwrap();
    assert!(out.stolen_slots.is_empty());
    assert_eq!(l.owned(T1, k).unwrap(), (vec![0, 2], vec![1, 2]));
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let (mut l, k) = ledger_with_key();
    let before = l.peek(&[1i64, 2, 63], k).unwrap();
    assert_eq!(
        l.claim(&[1i64, -3], k, T1).unwrap_err(),
        out_of_range(-3, 1, 64)
    );
    assert_eq!(
        l.claim(&[1i64, 64], k, T1).unwrap_err(),
        out_of_range(64, 1, 64)
    );
    assert_eq!(
        l.claim(&[1i64, 2, 1], k, T1).unwrap_err(),
        duplicate(1, 0, 2)
    );
    assert_eq!(
        l.claim(&[1i64], KeyId(5), T1).unwrap_err(),
        Error::UnknownKey {
            key: KeyId(5),
            num_keys: 1
        }
    );
    assert_eq!(l.commit(T1).unwrap_err(), Error::UnknownTask { task: T1 });
    assert_eq!(l.peek(&[1i64, 2, 63], k).unwrap(), before);
    assert_eq!(l.num_tasks(), 0);
    assert!(matches!(
        Ledger::new(0, 4),
        Err(Error::InvalidConfig { .. })
    ));
    assert!(matches!(
        Ledger::new(64, 0),
        Err(Error::InvalidConfig { .. })
    ));
    assert_eq!(Ledger::new(64, 16).unwrap().block_size(), 16);
}

/// The error for `slot` at `position` of a list, in a ledger of `num_slots` slots.
pub(super) fn out_of_range(slot: i64, position: usize, num_slots: u32) -> Error {
    Error::SlotOutOfRange {
        slot,
        position,
        num_slots,
    }
}

pub(super) fn duplicate(slot: u32, first: usize, second: usize) -> Error {
    Error::DuplicateSlot {
        slot,
        first,
        second,
    }
}

#[test]
fn a_settled_task_gives_its_handle_back_for_the_next() {
    // A server runs millions of tasks: the owner-code table must not grow with them.
    let (mut l, k) = ledger_with_key();
    for t in 0..100u64 {
        l.claim(&[t as i64 % 64], k, TaskId(t)).unwrap();
        if t % 2 == 0 {
            l.commit(TaskId(t)).unwrap();
        } else {
            l.abandon(TaskId(t)).unwrap();
        }
    }
    assert_eq!(l.handles.allocated(), 1);
    // Two tasks in flight at once hold two.
    l.claim(&[1i64], k, T1).unwrap();
    l.claim(&[2i64], k, T2).unwrap();
    assert_eq!(l.handles.allocated(), 2);
}

#[test]
fn key_column_bytes_is_what_one_more_key_holds() {
    // 1,024 slots in 64 blocks of 16: 16 bytes per slot (owner, version, readers), one 64-bit
    // word of whole-block bits, and a 16-byte summary per block.
    let l = Ledger::new(1024, 16).unwrap();
    assert_eq!(l.key_column_bytes(), 1024 * 16 + 8 + 64 * 16);
    // (a partial last block has a summary too: 1,000 slots in 63 blocks)
    assert_eq!(
        Ledger::new(1000, 16).unwrap().key_column_bytes(),
        1000 * 16 + 8 + 63 * 16
    );
}
