//! Unit tests of the ledger over slot lists as runs (`ledger.rs`): long runs and their
//! vectorised paths, runs across bitmap words, scattered lists, slot integer types and the
//! errors of bad lists.

use super::tests::{duplicate, ledger_with_key, out_of_range, T1, T2};
use super::*;

fn range(r: std::ops::Range<i64>) -> Vec<i64> {
    r.collect()
}

#[test]
fn runs_across_bitmap_words_are_checked_and_claimed_slot_by_slot() {
    let mut l = Ledger::new(200, 4).unwrap();
    let k = l.add_key();
    // Runs straddling the duplicate bitmap's word boundaries (64, 128).
    let first: Vec<i64> = (60..140).chain(10..20).collect();
    assert_eq!(l.claim(&first, k, T1).unwrap(), ClaimOutcome::default());
    let dup: Vec<i64> = (0..10).chain(150..170).chain(5..8).collect();
    assert_eq!(l.claim(&dup, k, T2).unwrap_err(), duplicate(5, 5, 30));
    // An out-of-range id anywhere wins over an earlier duplicate.
    assert_eq!(
        l.claim(&[3i64, 4, 3, 200], k, T2).unwrap_err(),
        out_of_range(200, 3, 200)
    );
    // The refused claims left nothing behind.
    let ok: Vec<i64> = (0..10).chain(150..170).collect();
    assert_eq!(l.claim(&ok, k, T2).unwrap(), ClaimOutcome::default());
    let out = l.claim(&range(100..116), k, T2).unwrap();
    assert_eq!(out.stolen_slots, range(100..116));
    assert_eq!(out.stolen_from, vec![1; 16]);
    let (positions, slots) = l.owned(T1, k).unwrap();
    let kept = |&s: &i64| !(100..116).contains(&s);
    assert_eq!(
        slots,
        first.iter().copied().filter(kept).collect::<Vec<_>>()
    );
    assert_eq!(
        positions,
        range(0..40).into_iter().chain(56..90).collect::<Vec<_>>()
    );
    assert_eq!(l.commit(T1).unwrap(), 74);
    assert_eq!(l.commit(T2).unwrap(), 46);
    let (sources, versions) = l.peek(&range(96..120), k).unwrap();
    assert_eq!(sources, vec![SOURCE_POOL; 24]);
    // (a version numbers the successful claim that wrote the row: 100..116 the third)
    let want: Vec<u64> = (96..120)
        .map(|s| if (100..116).contains(&s) { 3 } else { 1 })
        .collect();
    assert_eq!(versions, want);
}

#[test]
fn a_read_of_runs_at_mixed_versions_and_owners() {
    let (mut l, k) = ledger_with_key();
    l.claim(&range(0..16), k, T1).unwrap();
    l.commit(T1).unwrap();
    l.claim(&range(4..8), k, T2).unwrap();
    l.commit(T2).unwrap();
    l.claim(&range(12..14), k, TaskId(3)).unwrap();
    let slots: Vec<i64> = (0..16).chain(20..22).collect();
    let plan = l.plan_read(&slots, k).unwrap();
    let mut sources = vec![SOURCE_POOL; 16];
    sources[12..14].fill(3);
    sources.extend([SOURCE_ABSENT; 2]);
    assert_eq!(plan.sources, Some(sources));
    // (each claim's number: 0..16 the first, 4..8 the second, 12..14 the third)
    let mut versions = vec![1u64; 16];
    versions[4..8].fill(2);
    versions[12..14].fill(3);
    versions.extend([0; 2]);
    assert_eq!(l.captured_versions(plan.read).unwrap(), versions);
    assert_eq!(l.readers(&slots, k).unwrap(), vec![1; 18]);
    let out = l.claim(&range(6..14), k, TaskId(4)).unwrap();
    assert_eq!(out.stolen_slots, vec![12, 13]);
    assert_eq!(out.preserve_slots, range(6..14));
    assert_eq!(out.preserve_versions, vec![2, 2, 1, 1, 1, 1, 3, 3]);
    assert_eq!(out.preserve_from, vec![-1, -1, -1, -1, -1, -1, 3, 3]);
    assert_eq!(l.validate(plan.read).unwrap(), range(6..14));
    assert_eq!(l.abandon(TaskId(3)).unwrap(), 0);
    assert_eq!(l.abandon(TaskId(4)).unwrap(), 8);
    assert_eq!(l.validate(plan.read).unwrap(), range(6..14));
    l.release(plan.read).unwrap();
    assert_eq!(l.readers(&slots, k).unwrap(), vec![0; 18]);
}

#[test]
fn a_task_reclaiming_a_slot_stolen_from_it_owns_only_the_new_row() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[6i64, 7], k, T1).unwrap();
    assert_eq!(l.claim(&[6i64], k, T2).unwrap().stolen_from, vec![1]);
    assert_eq!(l.claim(&[6i64], k, T1).unwrap().stolen_from, vec![2]);
    assert_eq!(l.owned(T1, k).unwrap(), (vec![1, 2], vec![7, 6]));
    assert_eq!(l.owned(T2, k).unwrap(), (vec![], vec![]));
    assert_eq!(l.commit(T2).unwrap(), 0);
    assert_eq!(l.commit(T1).unwrap(), 2);
    assert_eq!(l.peek(&[6i64, 7], k).unwrap(), (vec![-1, -1], vec![3, 1]));
}

#[test]
fn scattered_lists_work_like_lists_of_blocks() {
    let mut l = Ledger::new(4096, 4).unwrap();
    let (k, scattered_key) = (l.add_key(), l.add_key());
    // The same slots as blocks, and as one scattered list (blocks in between).
    let blocks: Vec<i64> = (0..8).flat_map(|b| b * 400..b * 400 + 16).collect();
    let mut scattered: Vec<i64> = (0..128).map(|i| 3000 + (i * 37) % 128 * 7).collect();
    scattered.extend(&blocks);
    let big = TaskId(u64::MAX / 2);
    for (key, slots) in [(k, &blocks), (scattered_key, &scattered)] {
        assert_eq!(l.claim(slots, key, big).unwrap(), ClaimOutcome::default());
        let n = slots.len() as i64;
        assert_eq!(l.owned(big, key).unwrap(), (range(0..n), slots.clone()));
        let plan = l.plan_read(slots, key).unwrap();
        assert_eq!(plan.sources, Some(vec![big.0 as i64; slots.len()]));
        let out = l.claim(slots, key, T1).unwrap();
        assert_eq!(out.stolen_slots, *slots);
        assert_eq!(out.preserve_slots, *slots);
        assert_eq!(out.preserve_from, vec![big.0 as i64; slots.len()]);
        assert_eq!(l.validate(plan.read).unwrap(), range(0..n));
        assert_eq!(l.commit(big).unwrap(), 0);
        assert_eq!(l.commit(T1).unwrap(), slots.len());
        l.release(plan.read).unwrap();
        assert_eq!(l.readers(slots, key).unwrap(), vec![0; slots.len()]);
    }
}

#[test]
fn int32_slots_work_like_int64() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[3i32, 4], k, T1).unwrap();
    assert_eq!(l.owned(T1, k).unwrap().1, vec![3, 4]);
}

#[test]
fn unsigned_slots_work_like_int64() {
    let (mut l, k) = ledger_with_key();
    l.claim(&[3u32, 4], k, T1).unwrap();
    assert_eq!(l.owned(T1, k).unwrap().1, vec![3, 4]);
    assert_eq!(
        l.claim(&[5u32, 64], k, T2).unwrap_err(),
        out_of_range(64, 1, 64)
    );
}

#[test]
fn peek_and_readers_refuse_out_of_range_slots() {
    let (mut l, k) = ledger_with_key();
    assert_eq!(l.num_slots(), 64);
    assert_eq!(l.peek(&[1i64, 64], k).unwrap_err(), out_of_range(64, 1, 64));
    assert_eq!(l.readers(&[-1i64], k).unwrap_err(), out_of_range(-1, 0, 64));
    l.claim(&[63i64], k, T1).unwrap();
    assert_eq!(
        l.peek(&[0i64, 63], k).unwrap(),
        (vec![SOURCE_ABSENT, 1], vec![0, 1])
    );
}

/// Sources and versions of `slots` as `peek` gives them slot by slot: the reference for a
/// read planned over long runs.
fn peek_each(l: &Ledger, slots: &[i64], k: KeyId) -> (Vec<i64>, Vec<u64>) {
    let (mut sources, mut versions) = (Vec::new(), Vec::new());
    for &s in slots {
        let (src, ver) = l.peek(&[s], k).unwrap();
        sources.extend(src);
        versions.extend(ver);
    }
    (sources, versions)
}

#[test]
fn a_long_run_read_starting_at_an_absent_slot_reports_each_slots_owner_and_version() {
    let (mut l, k) = ledger_with_key();
    // One run 0..24: absent (never written, version 0), committed, in transit, absent.
    l.claim(&range(4..16), k, T1).unwrap();
    l.commit(T1).unwrap();
    l.claim(&range(16..20), k, T2).unwrap();
    let slots = range(0..24);
    let plan = l.plan_read(&slots, k).unwrap();
    let mut sources = vec![SOURCE_ABSENT; 24];
    sources[4..16].fill(SOURCE_POOL);
    sources[16..20].fill(2);
    let mut versions = vec![0u64; 24];
    versions[4..16].fill(1);
    versions[16..20].fill(2);
    let captured = l.captured_versions(plan.read).unwrap();
    assert_eq!((plan.source_codes(), captured.clone()), (sources, versions));
    assert_eq!(peek_each(&l, &slots, k), (plan.source_codes(), captured));
    assert_eq!((plan.num_absent(), plan.num_from_pool()), (8, 12));
    // Nothing moved yet; every slot has one reader at its version.
    assert_eq!(l.validate(plan.read).unwrap(), Vec::<i64>::new());
    assert_eq!(l.readers(&slots, k).unwrap(), vec![1; 24]);
    // The captured committed rows must be kept aside when claimed over.
    let out = l.claim(&range(8..12), k, TaskId(3)).unwrap();
    assert_eq!(out.preserve_slots, range(8..12));
    assert_eq!(out.preserve_versions, vec![1; 4]);
    // The in-transit rows vanish when their writer fails.
    assert_eq!(l.abandon(T2).unwrap(), 4);
    assert_eq!(
        l.validate(plan.read).unwrap(),
        range(8..12).into_iter().chain(16..20).collect::<Vec<_>>()
    );
    l.release(plan.read).unwrap();
    assert_eq!(l.readers(&slots, k).unwrap(), vec![0; 24]);
}

#[test]
fn long_runs_of_absent_slots_before_and_after_other_rows_are_captured_absent() {
    let (mut l, k) = ledger_with_key();
    l.claim(&range(4..16), k, T1).unwrap();
    l.commit(T1).unwrap();
    // Three long runs: 10 slots never written, 12 committed rows, 4 more never written.
    let slots: Vec<i64> = (30..40).chain(4..16).chain(40..44).collect();
    let plan = l.plan_read(&slots, k).unwrap();
    let mut sources = vec![SOURCE_ABSENT; 10];
    sources.extend([SOURCE_POOL; 12]);
    sources.extend([SOURCE_ABSENT; 4]);
    assert_eq!(plan.sources, Some(sources));
    assert_eq!(plan.num_absent(), 14);
    // A slot that had no row when planned has not "vanished": nothing moved.
    assert_eq!(l.validate(plan.read).unwrap(), Vec::<i64>::new());
    // Invalidating some committed rows moves exactly those positions.
    l.invalidate(&range(4..8), k).unwrap();
    assert_eq!(l.validate(plan.read).unwrap(), range(10..14));
    l.release(plan.read).unwrap();
}

#[test]
fn claiming_a_long_run_steals_every_slot_of_an_older_task_even_past_the_first() {
    let (mut l, k) = ledger_with_key();
    // Slots 0 and 1 absent, 2 and 3 in transit under T1, 4..8 committed; then one run 0..8.
    l.claim(&[2i64, 3], k, T1).unwrap();
    l.claim(&range(4..8), k, TaskId(3)).unwrap();
    l.commit(TaskId(3)).unwrap();
    let out = l.claim(&range(0..8), k, T2).unwrap();
    assert_eq!(
        (out.stolen_slots, out.stolen_from),
        (vec![2, 3], vec![1, 1])
    );
    assert_eq!(l.owned(T1, k).unwrap(), (vec![], vec![]));
    assert_eq!(l.commit(T1).unwrap(), 0);
    assert_eq!(l.commit(T2).unwrap(), 8);
    let (sources, versions) = l.peek(&range(0..8), k).unwrap();
    assert_eq!(sources, vec![SOURCE_POOL; 8]);
    // (all eight last written by the third claim)
    assert_eq!(versions, vec![3; 8]);
}

#[test]
fn a_chunk_of_slots_is_taken_whole_only_when_every_slot_is_consecutive_and_in_range() {
    let (mut l, k) = ledger_with_key();
    // Eight slots with the first and last eight apart but not in order: kept in list order.
    let swapped = [0i64, 1, 2, 3, 5, 4, 6, 7];
    l.claim(&swapped, k, T1).unwrap();
    assert_eq!(l.owned(T1, k).unwrap(), (range(0..8), swapped.to_vec()));
    let bad_inside = [8i64, 9, 10, 11, 100, 13, 14, 15];
    // (after a run, so the list is taken for blocks)
    let repeat_inside: Vec<i64> = (16..24).chain([8, 9, 9, 9, 9, 9, 9, 15]).collect();
    let past_the_end = range(60..68);
    let negative = range(-8..0);
    let mut small = Ledger::new(8, 4).unwrap();
    let small_key = small.add_key();
    // The same for the 16-slot chunks: one slot sixteen times (after a run, so the list is
    // taken for blocks), a bad id inside, two swapped.
    let same_sixteen: Vec<i64> = (0..32).chain([40; 16]).collect();
    let mut bad_in_sixteen = range(32..48);
    bad_in_sixteen[9] = 64;
    let mut swapped_sixteen = range(48..64);
    swapped_sixteen.swap(3, 4);
    for (result, want) in [
        (l.claim(&same_sixteen, k, T2), duplicate(40, 32, 33)),
        (l.claim(&bad_in_sixteen, k, T2), out_of_range(64, 9, 64)),
        (l.claim(&bad_inside, k, T2), out_of_range(100, 4, 64)),
        (l.claim(&repeat_inside, k, T2), duplicate(9, 9, 10)),
        (l.claim(&past_the_end, k, T2), out_of_range(64, 4, 64)),
        (l.claim(&negative, k, T2), out_of_range(-8, 0, 64)),
        (
            small.claim(&range(1..9), small_key, T2),
            out_of_range(8, 7, 8),
        ),
    ] {
        assert_eq!(result.unwrap_err(), want);
    }
    assert_eq!(l.num_tasks(), 1, "the refused claims took nothing");
    l.claim(&swapped_sixteen, k, T2).unwrap();
    assert_eq!(l.owned(T2, k).unwrap(), (range(0..16), swapped_sixteen));
}

#[test]
fn scattered_lists_with_several_bad_ids_report_the_first() {
    let (mut l, k) = ledger_with_key();
    for (slots, slot, position) in [
        (vec![-1i64, -2], -1, 0),
        (vec![7i64, 100, 3, -1], 100, 1),
        (vec![5i64, i64::MIN], i64::MIN, 1),
    ] {
        assert_eq!(
            l.claim(&slots, k, T1).unwrap_err(),
            Error::SlotOutOfRange {
                slot,
                position,
                num_slots: 64
            }
        );
    }
    assert_eq!(l.num_tasks(), 0);
}

#[test]
fn a_slot_repeated_inside_a_later_run_is_reported_where_it_repeats() {
    let (mut l, k) = ledger_with_key();
    // Runs [5] and [0..8]: slot 5 comes back at position 6, not at the run's start.
    let slots: Vec<i64> = std::iter::once(5).chain(0..8).collect();
    assert_eq!(l.claim(&slots, k, T1).unwrap_err(), duplicate(5, 0, 6));
    assert_eq!(l.num_tasks(), 0);
    assert_eq!(
        l.claim(&range(0..8), k, T1).unwrap(),
        ClaimOutcome::default()
    );
}
