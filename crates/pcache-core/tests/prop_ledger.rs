//! State-machine property test of [`Ledger`] against a small reference model.
//!
//! The model keeps, per (key, slot), the owner (absent, pool, or an in-transit task) and the
//! version; per task its claimed rows in order with the version each claim assigned; per
//! pending read the slots, captured versions and captured owners. The number of readers of a
//! slot is *derived* (pending read positions that captured the slot at its current version)
//! rather than counted, so the ledger's incremental counters are checked against an
//! independent definition.
//!
//! Every generated operation is applied to both; results must agree, and after every
//! operation the whole observable state (`peek`, `readers`, `owned`, `validate` of every
//! pending read, task and read counts) must agree too.

use std::collections::HashMap;

use pcache_core::ledger::{SOURCE_ABSENT, SOURCE_POOL};
use pcache_core::{ClaimOutcome, Error, KeyId, Ledger, ReadId, ReadPlan, Result, Source, TaskId};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

const NUM_SLOTS: u32 = 16;
const NUM_KEYS: u32 = 2;
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
// Reference model
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
enum Owner {
    #[default]
    Absent,
    Pool,
    Task(u64),
}

impl Owner {
    fn code(self) -> i64 {
        match self {
            Owner::Absent => SOURCE_ABSENT,
            Owner::Pool => SOURCE_POOL,
            Owner::Task(t) => t as i64,
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Cell {
    owner: Owner,
    version: u64,
}

#[derive(Clone, Copy, Debug)]
struct ClaimedRow {
    key: u32,
    slot: usize,
    version: u64,
}

#[derive(Clone, Debug)]
struct PendingRead {
    key: u32,
    slots: Vec<usize>,
    versions: Vec<u64>,
    owners: Vec<Owner>,
}

#[derive(Default, Debug)]
struct Model {
    cells: HashMap<(u32, usize), Cell>,
    /// Present from the first successful claim (even an empty one) until commit/abandon.
    tasks: HashMap<u64, Vec<ClaimedRow>>,
    reads: HashMap<u64, PendingRead>,
    next_read: u64,
}

impl Model {
    fn cell(&self, key: u32, slot: usize) -> Cell {
        self.cells.get(&(key, slot)).copied().unwrap_or_default()
    }

    fn cell_mut(&mut self, key: u32, slot: usize) -> &mut Cell {
        self.cells.entry((key, slot)).or_default()
    }

    /// Pending read positions that captured (key, slot) at its current version.
    fn readers(&self, key: u32, slot: usize) -> u32 {
        let now = self.cell(key, slot).version;
        self.reads
            .values()
            .filter(|r| r.key == key)
            .flat_map(|r| r.slots.iter().zip(&r.versions))
            .filter(|&(&s, &v)| s == slot && v == now)
            .count() as u32
    }

    fn check_key(&self, key: u32) -> Result<()> {
        if key < NUM_KEYS {
            Ok(())
        } else {
            Err(Error::UnknownKey {
                key: KeyId(key),
                num_keys: NUM_KEYS,
            })
        }
    }

    fn check_range(slots: &[i64]) -> Result<Vec<usize>> {
        for (position, &slot) in slots.iter().enumerate() {
            if !(0..NUM_SLOTS as i64).contains(&slot) {
                return Err(Error::SlotOutOfRange {
                    slot,
                    position,
                    num_slots: NUM_SLOTS,
                });
            }
        }
        Ok(slots.iter().map(|&s| s as usize).collect())
    }

    fn claim(&mut self, slots: &[i64], key: u32, task: u64) -> Result<ClaimOutcome> {
        self.claim_for(slots, key, Owner::Task(task))
    }

    /// A claim by nobody: the slots become absent (`Ledger::invalidate`).
    fn invalidate(&mut self, slots: &[i64], key: u32) -> Result<ClaimOutcome> {
        self.claim_for(slots, key, Owner::Absent)
    }

    fn claim_for(&mut self, slots: &[i64], key: u32, owner: Owner) -> Result<ClaimOutcome> {
        self.check_key(key)?;
        let slots = Self::check_range(slots)?;
        let mut first_seen: HashMap<usize, usize> = HashMap::new();
        for (position, &slot) in slots.iter().enumerate() {
            if let Some(&first) = first_seen.get(&slot) {
                return Err(Error::DuplicateSlot {
                    slot: slot as u32,
                    first,
                    second: position,
                });
            }
            first_seen.insert(slot, position);
        }
        let mut out = ClaimOutcome::default();
        let mut rows = Vec::new();
        for &slot in &slots {
            let before = self.cell(key, slot);
            let from = match before.owner {
                Owner::Task(t) if before.owner != owner => {
                    out.stolen_slots.push(slot as i64);
                    out.stolen_from.push(t as i64);
                    Some(t as i64)
                }
                Owner::Pool => Some(SOURCE_POOL),
                _ => None,
            };
            if let Some(from) = from.filter(|_| self.readers(key, slot) > 0) {
                out.preserve_slots.push(slot as i64);
                out.preserve_versions.push(before.version);
                out.preserve_from.push(from);
            }
            let version = before.version + 1;
            *self.cell_mut(key, slot) = Cell { owner, version };
            rows.push(ClaimedRow { key, slot, version });
        }
        if let Owner::Task(task) = owner {
            self.tasks.entry(task).or_default().extend(rows);
        }
        Ok(out)
    }

    fn still_owns(&self, task: u64, row: &ClaimedRow) -> bool {
        let c = self.cell(row.key, row.slot);
        c.owner == Owner::Task(task) && c.version == row.version
    }

    fn owned(&self, task: u64, key: u32) -> Result<(Vec<i64>, Vec<i64>)> {
        self.check_key(key)?;
        let rows = self
            .tasks
            .get(&task)
            .ok_or(Error::UnknownTask { task: TaskId(task) })?;
        let (mut positions, mut slots) = (Vec::new(), Vec::new());
        for (i, row) in rows.iter().filter(|r| r.key == key).enumerate() {
            if self.still_owns(task, row) {
                positions.push(i as i64);
                slots.push(row.slot as i64);
            }
        }
        Ok((positions, slots))
    }

    fn settle(&mut self, task: u64, to: Owner) -> Result<usize> {
        let rows = self
            .tasks
            .remove(&task)
            .ok_or(Error::UnknownTask { task: TaskId(task) })?;
        let mut n = 0;
        for row in &rows {
            if self.still_owns(task, row) {
                self.cell_mut(row.key, row.slot).owner = to;
                n += 1;
            }
        }
        Ok(n)
    }

    fn peek(&self, key: u32) -> (Vec<i64>, Vec<u64>) {
        (0..NUM_SLOTS as usize)
            .map(|s| {
                let c = self.cell(key, s);
                (c.owner.code(), c.version)
            })
            .unzip()
    }

    fn plan_read(&mut self, slots: &[i64], key: u32) -> Result<ReadPlan> {
        self.check_key(key)?;
        let slots = Self::check_range(slots)?;
        let cells: Vec<Cell> = slots.iter().map(|&s| self.cell(key, s)).collect();
        let read = self.next_read;
        self.next_read += 1;
        let plan = ReadPlan {
            read: ReadId(read),
            sources: cells.iter().map(|c| c.owner.code()).collect(),
            versions: cells.iter().map(|c| c.version).collect(),
        };
        self.reads.insert(
            read,
            PendingRead {
                key,
                slots,
                versions: plan.versions.clone(),
                owners: cells.iter().map(|c| c.owner).collect(),
            },
        );
        Ok(plan)
    }

    /// Mostly an issued read (pending or released), sometimes one never issued.
    fn pick_read(&self, pick: usize) -> ReadId {
        ReadId(pick as u64 % (self.next_read + 1))
    }

    fn validate(&self, read: ReadId) -> Result<Vec<i64>> {
        let r = self.reads.get(&read.0).ok_or(Error::UnknownRead { read })?;
        let mut moved = Vec::new();
        for (i, (&slot, &version)) in r.slots.iter().zip(&r.versions).enumerate() {
            let now = self.cell(r.key, slot);
            let vanished = now.owner == Owner::Absent && r.owners[i] != Owner::Absent;
            if now.version != version || vanished {
                moved.push(i as i64);
            }
        }
        Ok(moved)
    }

    fn release(&mut self, read: ReadId) -> Result<()> {
        self.reads
            .remove(&read.0)
            .map(drop)
            .ok_or(Error::UnknownRead { read })
    }
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
    for &read in model.reads.keys() {
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

fn run(ops: &[Op]) -> Stats {
    let mut stats = Stats::default();
    let mut ledger = Ledger::new(NUM_SLOTS).unwrap();
    for k in 0..NUM_KEYS {
        assert_eq!(ledger.add_key(), KeyId(k));
    }
    let mut model = Model::default();
    check_state(&ledger, &model, &mut stats);
    for op in ops {
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
        16 => unique(),
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

/// Reads may repeat a slot; sometimes out of range.
fn read_slots() -> impl Strategy<Value = Vec<i64>> {
    prop_oneof![
        9 => prop::collection::vec(0..NUM_SLOTS as i64, 0..6),
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
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn ledger_agrees_with_the_model(ops in ops()) {
        run(&ops);
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
        .run(&ops(), |ops| {
            let s = run(&ops);
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
            Ok(())
        })
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
    ] {
        assert!(n >= 10, "{name} happened only {n} times: {t:?}");
    }
}

/// A fixed scenario through the same harness, so a broken harness cannot pass silently.
#[test]
fn scripted_scenario_matches_hand_computed_results() {
    let mut ledger = Ledger::new(NUM_SLOTS).unwrap();
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
        (vec![SOURCE_POOL, SOURCE_ABSENT], vec![2, 2])
    );
}
