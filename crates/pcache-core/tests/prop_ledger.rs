//! State-machine property test of [`Ledger`] against a small reference model
//! (`ledger_model`: per (key, slot) the owner and version, per task its claimed rows, per
//! pending read what it captured; a slot's readers derived, not counted).
//!
//! Every generated operation is applied to both; results must agree, and after every
//! operation the whole observable state (`peek`, `readers`, `owned`, `validate` of every
//! pending read, task and read counts) must agree too.

use pcache_core::ledger::{SOURCE_ABSENT, SOURCE_POOL};
use pcache_core::{Error, KeyId, Ledger, ReadId, Source, TaskId};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

mod ledger_model;

use ledger_model::{Model, Owner, NUM_KEYS, NUM_SLOTS};

/// Tasks 0..NUM_TASKS are used by the operations; NUM_TASKS itself is never claimed.
const NUM_TASKS: u64 = 4;

#[derive(Clone, Debug)]
enum Op {
    Claim {
        slots: Vec<i64>,
        key: u32,
        task: u64,
    },
    Commit {
        task: u64,
    },
    Abandon {
        task: u64,
    },
    Invalidate {
        slots: Vec<i64>,
        key: u32,
    },
    PlanRead {
        slots: Vec<i64>,
        key: u32,
    },
    /// `pick` is resolved against the reads issued so far (see [`Model::pick_read`]).
    Validate {
        pick: usize,
    },
    Release {
        pick: usize,
    },
}

// ---------------------------------------------------------------------------------------------
// Running operations against both
// ---------------------------------------------------------------------------------------------

/// How often the interesting outcomes happened (checked by `generator_reaches_every_outcome`).
#[derive(Default, Debug, Clone, Copy)]
struct Stats {
    claims_ok: usize,
    invalidations_ok: usize,
    stolen: usize,
    preserved: usize,
    partial_commits: usize,
    moved_reads: usize,
    vanished_only: usize,
    out_of_range: usize,
    duplicates: usize,
    unknown_key: usize,
    unknown_task: usize,
    unknown_read: usize,
    release_ok: usize,
    /// Claims, invalidations and reads listing a whole block of the ledger's size (> 1) in
    /// order, and ones listing part of a block: the ledger's two paths.
    whole_block_lists: usize,
    part_block_lists: usize,
}

/// Whether `slots` list some whole block of `size` in order, and some part of a block.
fn block_shapes(slots: &[i64], size: u32) -> (bool, bool) {
    let size = size as usize;
    let whole = (size > 1)
        && slots.windows(size).any(|w| {
            w[0] >= 0
                && (w[0] as usize).is_multiple_of(size)
                && (0..).zip(w).all(|(k, &s)| s == w[0] + k)
        });
    let part = (size > 1) && !slots.len().is_multiple_of(size);
    (whole, part)
}

fn count_error(stats: &mut Stats, err: &Error) {
    match err {
        Error::SlotOutOfRange { .. } => stats.out_of_range += 1,
        Error::DuplicateSlot { .. } => stats.duplicates += 1,
        Error::UnknownKey { .. } => stats.unknown_key += 1,
        Error::UnknownTask { .. } => stats.unknown_task += 1,
        Error::UnknownRead { .. } => stats.unknown_read += 1,
        _ => {}
    }
}

fn apply(ledger: &mut Ledger, model: &mut Model, op: &Op, stats: &mut Stats) {
    match op {
        Op::Claim { .. } | Op::Invalidate { .. } => {
            let (got, want) = match op {
                Op::Claim { slots, key, task } => (
                    ledger.claim(slots, KeyId(*key), TaskId(*task)),
                    model.claim(slots, *key, *task),
                ),
                Op::Invalidate { slots, key } => (
                    ledger.invalidate(slots, KeyId(*key)),
                    model.invalidate(slots, *key),
                ),
                _ => unreachable!(),
            };
            assert_eq!(got, want, "{op:?}");
            match &got {
                Ok(out) => {
                    match op {
                        Op::Claim { .. } => stats.claims_ok += 1,
                        _ => stats.invalidations_ok += 1,
                    }
                    stats.stolen += out.stolen_slots.len();
                    stats.preserved += out.preserve_slots.len();
                }
                Err(e) => count_error(stats, e),
            }
        }
        Op::Commit { task } | Op::Abandon { task } => {
            let commit = matches!(op, Op::Commit { .. });
            let claimed = model.tasks.get(task).map(Vec::len);
            let (got, want) = if commit {
                (
                    ledger.commit(TaskId(*task)),
                    model.settle(*task, Owner::Pool),
                )
            } else {
                (
                    ledger.abandon(TaskId(*task)),
                    model.settle(*task, Owner::Absent),
                )
            };
            assert_eq!(got, want, "{op:?}");
            match (&got, claimed) {
                (Ok(n), Some(c)) if *n < c => stats.partial_commits += 1,
                (Err(e), _) => count_error(stats, e),
                _ => {}
            }
        }
        Op::PlanRead { slots, key } => {
            let got = ledger.plan_read(slots, KeyId(*key));
            let want = model.plan_read(slots, *key);
            assert_eq!(got, want, "plan_read({slots:?}, key#{key})");
            if let Err(e) = &got {
                count_error(stats, e);
            }
        }
        Op::Validate { pick } => {
            let read = model.pick_read(*pick);
            let got = ledger.validate(read);
            assert_eq!(got, model.validate(read), "validate({read})");
            if let Err(e) = &got {
                count_error(stats, e);
            }
        }
        Op::Release { pick } => {
            let read = model.pick_read(*pick);
            let got = ledger.release(read);
            assert_eq!(got, model.release(read), "release({read})");
            match &got {
                Ok(()) => stats.release_ok += 1,
                Err(e) => count_error(stats, e),
            }
        }
    }
}

/// Everything observable must agree with the model.
fn check_state(ledger: &Ledger, model: &Model, stats: &mut Stats) {
    let all: Vec<i64> = (0..NUM_SLOTS as i64).collect();
    for key in 0..NUM_KEYS {
        let (sources, versions) = ledger.peek(&all, KeyId(key)).unwrap();
        assert_eq!(
            (sources.clone(), versions),
            model.peek(key),
            "peek key#{key}"
        );
        for (&code, s) in sources.iter().zip(0..) {
            // The documented decoding agrees with the encoding.
            let want = match model.cell(key, s).owner {
                Owner::Absent => Source::Absent,
                Owner::Pool => Source::Pool,
                Owner::Task(t) => Source::Task(TaskId(t)),
            };
            assert_eq!(Source::decode(code), want);
        }
        let readers: Vec<u32> = (0..NUM_SLOTS as usize)
            .map(|s| model.readers(key, s))
            .collect();
        assert_eq!(
            ledger.readers(&all, KeyId(key)).unwrap(),
            readers,
            "readers key#{key}"
        );
    }
    let unknown = Error::UnknownKey {
        key: KeyId(NUM_KEYS),
        num_keys: NUM_KEYS,
    };
    assert_eq!(ledger.peek(&all, KeyId(NUM_KEYS)).unwrap_err(), unknown);
    assert_eq!(ledger.readers(&all, KeyId(NUM_KEYS)).unwrap_err(), unknown);
    for task in 0..=NUM_TASKS {
        for key in 0..=NUM_KEYS {
            assert_eq!(
                ledger.owned(TaskId(task), KeyId(key)),
                model.owned(task, key),
                "owned(task#{task}, key#{key})"
            );
        }
    }
    for (&read, r) in &model.reads {
        assert_eq!(
            ledger.captured_versions(ReadId(read)).unwrap(),
            r.versions,
            "captured_versions(read#{read})"
        );
        let moved = ledger.validate(ReadId(read)).unwrap();
        assert_eq!(
            moved,
            model.validate(ReadId(read)).unwrap(),
            "validate(read#{read})"
        );
        if !moved.is_empty() {
            stats.moved_reads += 1;
            let r = &model.reads[&read];
            if moved
                .iter()
                .any(|&i| model.cell(r.key, r.slots[i as usize]).version == r.versions[i as usize])
            {
                stats.vanished_only += 1;
            }
        }
    }
    assert_eq!(ledger.num_tasks(), model.tasks.len(), "num_tasks");
    assert_eq!(
        ledger.num_pending_reads(),
        model.reads.len(),
        "num_pending_reads"
    );
}

/// Block sizes the ledger is run with: slot by slot, blocks that end past the last slot
/// (never whole), blocks of the aligned runs below, one block for every slot.
const BLOCK_SIZES: [u32; 4] = [1, 3, 4, 16];

fn run(ops: &[Op], block_size: u32) -> Stats {
    let mut stats = Stats::default();
    let mut ledger = Ledger::new(NUM_SLOTS, block_size).unwrap();
    for k in 0..NUM_KEYS {
        assert_eq!(ledger.add_key(), KeyId(k));
    }
    let mut model = Model::default();
    check_state(&ledger, &model, &mut stats);
    for op in ops {
        if let Op::Claim { slots, .. } | Op::Invalidate { slots, .. } | Op::PlanRead { slots, .. } =
            op
        {
            let (whole, part) = block_shapes(slots, block_size);
            stats.whole_block_lists += usize::from(whole);
            stats.part_block_lists += usize::from(part);
        }
        apply(&mut ledger, &mut model, op, &mut stats);
        check_state(&ledger, &model, &mut stats);
    }
    stats
}

// ---------------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------------

fn key() -> impl Strategy<Value = u32> {
    prop_oneof![9 => 0..NUM_KEYS, 1 => Just(NUM_KEYS)]
}

/// Mostly unique in-range slots in random order; sometimes a duplicate, sometimes anything
/// (out of range, negative, duplicates mixed).
fn claim_slots() -> impl Strategy<Value = Vec<i64>> {
    let unique = || {
        proptest::sample::subsequence((0..NUM_SLOTS as i64).collect::<Vec<_>>(), 0..=6)
            .prop_shuffle()
    };
    prop_oneof![
        10 => unique(),
        6 => aligned_runs(),
        2 => (unique(), any::<prop::sample::Index>(), any::<prop::sample::Index>()).prop_filter_map(
            "needs a slot to repeat",
            |(mut v, from, at)| {
                if v.is_empty() {
                    return None;
                }
                let dup = v[from.index(v.len())];
                v.insert(at.index(v.len() + 1), dup);
                Some(v)
            }
        ),
        2 => prop::collection::vec(-3i64..NUM_SLOTS as i64 + 3, 1..6),
    ]
}

/// Runs of 4 consecutive slots starting at multiples of 4 (whole blocks of 4, as an engine
/// hands them out), in any order, the last one sometimes cut short: whole and partial
/// blocks for every size in [`BLOCK_SIZES`].
fn aligned_runs() -> impl Strategy<Value = Vec<i64>> {
    let groups = (0..NUM_SLOTS as i64 / 4).collect::<Vec<_>>();
    (
        proptest::sample::subsequence(groups, 1..=3).prop_shuffle(),
        0..4usize,
    )
        .prop_map(|(groups, cut)| {
            let mut slots: Vec<i64> = groups.iter().flat_map(|g| 4 * g..4 * g + 4).collect();
            slots.truncate(slots.len() - cut);
            slots
        })
}

/// Reads may repeat a slot; sometimes out of range.
fn read_slots() -> impl Strategy<Value = Vec<i64>> {
    prop_oneof![
        6 => prop::collection::vec(0..NUM_SLOTS as i64, 0..6),
        3 => aligned_runs(),
        1 => prop::collection::vec(-3i64..NUM_SLOTS as i64 + 3, 1..6),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let task = || 0..NUM_TASKS;
    prop_oneof![
        5 => (claim_slots(), key(), task()).prop_map(|(slots, key, task)| Op::Claim { slots, key, task }),
        2 => task().prop_map(|task| Op::Commit { task }),
        1 => task().prop_map(|task| Op::Abandon { task }),
        1 => (claim_slots(), key()).prop_map(|(slots, key)| Op::Invalidate { slots, key }),
        3 => (read_slots(), key()).prop_map(|(slots, key)| Op::PlanRead { slots, key }),
        2 => any::<usize>().prop_map(|pick| Op::Validate { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Release { pick }),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(), 1..=60)
}

proptest! {
    // 256 cases, or PROPTEST_CASES when set (`just test-slow`).
    #![proptest_config(ProptestConfig::default())]

    #[test]
    fn ledger_agrees_with_the_model(ops in ops(), size in proptest::sample::select(&BLOCK_SIZES[..])) {
        run(&ops, size);
    }
}

/// The generator is only meaningful if it reaches the interesting outcomes: steals,
/// preservation, partial commits, moved and vanished reads, and every error.
#[test]
fn generator_reaches_every_outcome() {
    let mut runner = TestRunner::new_with_rng(
        Config {
            cases: 256,
            failure_persistence: None,
            ..Config::default()
        },
        proptest::test_runner::TestRng::deterministic_rng(
            proptest::test_runner::RngAlgorithm::ChaCha,
        ),
    );
    let total = std::cell::RefCell::new(Stats::default());
    runner
        .run(
            &(ops(), proptest::sample::select(&BLOCK_SIZES[..])),
            |(ops, size)| {
                let s = run(&ops, size);
                let mut t = total.borrow_mut();
                t.claims_ok += s.claims_ok;
                t.invalidations_ok += s.invalidations_ok;
                t.stolen += s.stolen;
                t.preserved += s.preserved;
                t.partial_commits += s.partial_commits;
                t.moved_reads += s.moved_reads;
                t.vanished_only += s.vanished_only;
                t.out_of_range += s.out_of_range;
                t.duplicates += s.duplicates;
                t.unknown_key += s.unknown_key;
                t.unknown_task += s.unknown_task;
                t.unknown_read += s.unknown_read;
                t.release_ok += s.release_ok;
                t.whole_block_lists += s.whole_block_lists;
                t.part_block_lists += s.part_block_lists;
                Ok(())
            },
        )
        .unwrap();
    let t = total.into_inner();
    for (name, n) in [
        ("claims_ok", t.claims_ok),
        ("invalidations_ok", t.invalidations_ok),
        ("stolen", t.stolen),
        ("preserved", t.preserved),
        ("partial_commits", t.partial_commits),
        ("moved_reads", t.moved_reads),
        ("vanished_only", t.vanished_only),
        ("out_of_range", t.out_of_range),
        ("duplicates", t.duplicates),
        ("unknown_key", t.unknown_key),
        ("unknown_task", t.unknown_task),
        ("unknown_read", t.unknown_read),
        ("release_ok", t.release_ok),
        ("whole_block_lists", t.whole_block_lists),
        ("part_block_lists", t.part_block_lists),
    ] {
        assert!(n >= 10, "{name} happened only {n} times: {t:?}");
    }
}

/// A fixed scenario through the same harness, so a broken harness cannot pass silently.
#[test]
fn scripted_scenario_matches_hand_computed_results() {
    let mut ledger = Ledger::new(NUM_SLOTS, 4).unwrap();
    let k = ledger.add_key();
    let mut model = Model::default();
    let mut stats = Stats::default();
    let ops = [
        Op::Claim {
            slots: vec![1, 2, 3],
            key: 0,
            task: 0,
        },
        Op::Commit { task: 0 },
        Op::PlanRead {
            slots: vec![2, 2, 3],
            key: 0,
        },
        Op::Claim {
            slots: vec![3, 2, 9],
            key: 0,
            task: 1,
        },
        Op::Claim {
            slots: vec![9],
            key: 0,
            task: 2,
        },
    ];
    for op in &ops {
        apply(&mut ledger, &mut model, op, &mut stats);
    }
    assert_eq!(
        stats.preserved, 2,
        "slots 3 and 2 were captured by the read"
    );
    assert_eq!(stats.stolen, 1, "slot 9 was taken from task 1");
    assert_eq!(ledger.validate(ReadId(0)).unwrap(), vec![0, 1, 2]);
    assert_eq!(
        ledger.owned(TaskId(1), k).unwrap(),
        (vec![0, 1], vec![3, 2])
    );
    assert_eq!(ledger.commit(TaskId(1)).unwrap(), 2);
    assert_eq!(ledger.abandon(TaskId(2)).unwrap(), 1);
    assert_eq!(
        ledger.peek(&[2i64, 9], k).unwrap(),
        // (versions number the claims: slot 2 last taken by the second, slot 9 by the third)
        (vec![SOURCE_POOL, SOURCE_ABSENT], vec![2, 3])
    );
}
