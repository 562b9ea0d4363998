//! The slot/version ledger: for every (slot, key), who holds the row and at which version.
//!
//! Occupancy of a (slot, key) is *absent*, *in transit* under a write task, or *committed*
//! (its row is in the pool). Every claim bumps the version. From that the ledger answers the
//! three questions the cache asks:
//!
//! - **claim** (a write is planned): which slots were stolen from an older in-transit task —
//!   that task must skip them when it writes, so the newest tenant wins — and which committed
//!   slots a pending read captured at the current version, so the caller copies those rows
//!   aside before the new rows overwrite them (copy-on-write);
//! - **commit** (a write landed): only the slots the task still owns become committed;
//! - **plan_read / validate / release** (a hit is read, possibly a step late): where each row
//!   is now and at which version, and later, which of them moved since.
//!
//! The ledger is a plain `&mut self` structure; the binding keeps it behind one mutex that is
//! never held across a wait or a copy. Pool writes for a key must be issued by one thread (the
//! committer), in the order `owned` → scatter → `commit`.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::{KeyId, ReadId, TaskId};

const OWNER_ABSENT: u64 = 0;
const OWNER_POOL: u64 = 1;
const OWNER_TASK_BASE: u64 = 2;

/// `source` code in a [`ReadPlan`] for a slot with no row.
pub const SOURCE_ABSENT: i64 = -2;
/// `source` code in a [`ReadPlan`] for a slot whose row is in the pool.
pub const SOURCE_POOL: i64 = -1;

/// Where a slot's row is, decoded from a [`ReadPlan`] source code.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Source {
    /// Never written, or its writer failed.
    Absent,
    /// Committed: the row is in the pool.
    Pool,
    /// In transit under this task.
    Task(TaskId),
}

impl Source {
    /// Decodes a source code (`-2` absent, `-1` pool, `t >= 0` task `t`).
    pub fn decode(code: i64) -> Source {
        match code {
            SOURCE_ABSENT => Source::Absent,
            SOURCE_POOL => Source::Pool,
            t => Source::Task(TaskId(t as u64)),
        }
    }

    /// The numeric code of this source.
    pub fn code(self) -> i64 {
        match self {
            Source::Absent => SOURCE_ABSENT,
            Source::Pool => SOURCE_POOL,
            Source::Task(t) => t.0 as i64,
        }
    }

    fn from_owner(owner: u64) -> Source {
        match owner {
            OWNER_ABSENT => Source::Absent,
            OWNER_POOL => Source::Pool,
            t => Source::Task(TaskId(t - OWNER_TASK_BASE)),
        }
    }
}

/// A raw slot id as the engine hands it over (int64 or int32 arrays); validated on entry.
pub trait RawSlot: Copy + Send + Sync {
    /// The id as a signed 64-bit integer (ids that do not fit are out of range anyway).
    fn to_i64(self) -> i64;
}

impl RawSlot for i64 {
    fn to_i64(self) -> i64 {
        self
    }
}
impl RawSlot for i32 {
    fn to_i64(self) -> i64 {
        self as i64
    }
}
impl RawSlot for u32 {
    fn to_i64(self) -> i64 {
        self as i64
    }
}

/// What a claim found. Slot arrays are int64, ready to index tensors.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ClaimOutcome {
    /// Slots taken from an older in-transit task; that task skips them when it writes.
    pub stolen_slots: Vec<i64>,
    /// The task each stolen slot was taken from (same length as `stolen_slots`).
    pub stolen_from: Vec<i64>,
    /// Slots a pending read captured at their current version, which this claim moves on:
    /// their current rows must be kept aside for that read (copy-on-write). Committed rows
    /// are in the pool now; rows of an in-transit task are in that task's staging rows.
    pub preserve_slots: Vec<i64>,
    /// The version each preserved row had (what the pending read captured).
    pub preserve_versions: Vec<u64>,
    /// Where each preserved row is now: [`SOURCE_POOL`] or the in-transit task's id.
    pub preserve_from: Vec<i64>,
}

/// A registered pending read: per slot, where the row was and its captured version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    /// The read's id; release it when the rows have been served.
    pub read: ReadId,
    /// Per slot: [`SOURCE_ABSENT`], [`SOURCE_POOL`] or the id of the in-transit task.
    pub sources: Vec<i64>,
    /// Per slot: the version captured.
    pub versions: Vec<u64>,
}

/// Per-key columns, one entry per slot.
#[derive(Debug, Clone)]
struct KeyColumns {
    owner: Vec<u64>,
    version: Vec<u64>,
    /// Pending reads that captured this slot at its *current* version.
    readers: Vec<u32>,
}

#[derive(Debug, Clone)]
struct PendingRead {
    key: KeyId,
    slots: Vec<u32>,
    versions: Vec<u64>,
    owners: Vec<u64>,
}

/// One task's claims on one key, in row order: (slot, version assigned by the claim).
#[derive(Debug, Clone, Default)]
struct TaskClaims {
    per_key: Vec<(KeyId, Vec<(u32, u64)>)>,
}

impl TaskClaims {
    fn key_mut(&mut self, key: KeyId) -> &mut Vec<(u32, u64)> {
        let i = match self.per_key.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                self.per_key.push((key, Vec::new()));
                self.per_key.len() - 1
            }
        };
        &mut self.per_key[i].1
    }
}

/// The slot/version ledger. Not thread-safe by itself: wrap it in one mutex.
#[derive(Debug, Clone)]
pub struct Ledger {
    num_slots: u32,
    keys: Vec<KeyColumns>,
    tasks: HashMap<TaskId, TaskClaims>,
    reads: HashMap<ReadId, PendingRead>,
    next_read: u64,
    /// Duplicate detection for claims: `seen[slot] == epoch` means seen in this claim.
    seen: Vec<u32>,
    epoch: u32,
}

impl Ledger {
    /// A ledger for `num_slots` slots (`num_blocks * block_size`) and no keys yet.
    pub fn new(num_slots: u32) -> Result<Self> {
        if num_slots == 0 {
            return Err(Error::InvalidConfig {
                what: "a ledger needs at least one slot".into(),
            });
        }
        Ok(Self {
            num_slots,
            keys: Vec::new(),
            tasks: HashMap::new(),
            reads: HashMap::new(),
            next_read: 0,
            seen: vec![0; num_slots as usize],
            epoch: 0,
        })
    }

    /// Number of slots per key.
    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// Number of registered keys.
    pub fn num_keys(&self) -> u32 {
        self.keys.len() as u32
    }

    /// Registers a key: every slot absent at version 0.
    pub fn add_key(&mut self) -> KeyId {
        let n = self.num_slots as usize;
        self.keys.push(KeyColumns {
            owner: vec![OWNER_ABSENT; n],
            version: vec![0; n],
            readers: vec![0; n],
        });
        KeyId(self.keys.len() as u32 - 1)
    }

    /// Tasks holding at least one claim (claimed, not yet committed or failed).
    pub fn num_tasks(&self) -> usize {
        self.tasks.len()
    }

    /// Pending reads (planned, not yet released).
    pub fn num_pending_reads(&self) -> usize {
        self.reads.len()
    }

    fn check_key(&self, key: KeyId) -> Result<()> {
        if key.0 < self.num_keys() {
            Ok(())
        } else {
            Err(Error::UnknownKey {
                key,
                num_keys: self.num_keys(),
            })
        }
    }

    fn check_slots<S: RawSlot>(&self, slots: &[S]) -> Result<()> {
        for (position, s) in slots.iter().enumerate() {
            let slot = s.to_i64();
            if slot < 0 || slot >= self.num_slots as i64 {
                return Err(Error::SlotOutOfRange {
                    slot,
                    position,
                    num_slots: self.num_slots,
                });
            }
        }
        Ok(())
    }

    fn check_unique<S: RawSlot>(&mut self, slots: &[S]) -> Result<()> {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.seen.fill(0);
            self.epoch = 1;
        }
        for (position, s) in slots.iter().enumerate() {
            let slot = s.to_i64() as usize;
            if self.seen[slot] == self.epoch {
                let first = slots
                    .iter()
                    .position(|x| x.to_i64() as usize == slot)
                    .unwrap_or(0);
                return Err(Error::DuplicateSlot {
                    slot: slot as u32,
                    first,
                    second: position,
                });
            }
            self.seen[slot] = self.epoch;
        }
        Ok(())
    }

    /// Claims `slots` of `key` for `task`, in the task's row order (appended to what the
    /// task already claimed on this key). Every slot's version is bumped and its owner becomes
    /// `task`. A slot the same task already holds is not reported as stolen or preserved. Refused as a whole (nothing changes) for an unknown key, an out-of-range or
    /// negative slot, or a slot listed twice.
    pub fn claim<S: RawSlot>(
        &mut self,
        slots: &[S],
        key: KeyId,
        task: TaskId,
    ) -> Result<ClaimOutcome> {
        self.check_key(key)?;
        self.check_slots(slots)?;
        self.check_unique(slots)?;
        let me = task.0 + OWNER_TASK_BASE;
        let cols = &mut self.keys[key.0 as usize];
        let rows = self.tasks.entry(task).or_default().key_mut(key);
        rows.reserve(slots.len());
        let mut out = ClaimOutcome::default();
        for s in slots {
            let slot = s.to_i64() as usize;
            let owner = cols.owner[slot];
            let other_task = owner >= OWNER_TASK_BASE && owner != me;
            if other_task {
                out.stolen_slots.push(slot as i64);
                out.stolen_from.push((owner - OWNER_TASK_BASE) as i64);
            }
            if cols.readers[slot] > 0 && (owner == OWNER_POOL || other_task) {
                out.preserve_slots.push(slot as i64);
                out.preserve_versions.push(cols.version[slot]);
                out.preserve_from.push(Source::from_owner(owner).code());
            }
            let version = cols.version[slot] + 1;
            cols.version[slot] = version;
            cols.readers[slot] = 0;
            cols.owner[slot] = me;
            rows.push((slot as u32, version));
        }
        Ok(out)
    }

    fn task_rows(&self, task: TaskId) -> Result<&TaskClaims> {
        self.tasks.get(&task).ok_or(Error::UnknownTask { task })
    }

    /// The rows `task` still owns on `key`: positions in its row order and their slots.
    /// The writer gathers rows at `positions` and scatters them to `slots`; stolen slots
    /// are left out. A task with no claim on `key` owns nothing.
    pub fn owned(&self, task: TaskId, key: KeyId) -> Result<(Vec<i64>, Vec<i64>)> {
        self.check_key(key)?;
        let claims = self.task_rows(task)?;
        let me = task.0 + OWNER_TASK_BASE;
        let cols = &self.keys[key.0 as usize];
        let (mut positions, mut slots) = (Vec::new(), Vec::new());
        if let Some((_, rows)) = claims.per_key.iter().find(|(k, _)| *k == key) {
            for (i, &(slot, version)) in rows.iter().enumerate() {
                let s = slot as usize;
                if cols.owner[s] == me && cols.version[s] == version {
                    positions.push(i as i64);
                    slots.push(slot as i64);
                }
            }
        }
        Ok((positions, slots))
    }

    /// Ends `task`'s claims, setting every slot it still owns to `to`. Returns how many.
    fn settle(&mut self, task: TaskId, to: u64) -> Result<usize> {
        let claims = self
            .tasks
            .remove(&task)
            .ok_or(Error::UnknownTask { task })?;
        let me = task.0 + OWNER_TASK_BASE;
        let mut n = 0;
        for (key, rows) in claims.per_key {
            let cols = &mut self.keys[key.0 as usize];
            for (slot, version) in rows {
                let s = slot as usize;
                if cols.owner[s] == me && cols.version[s] == version {
                    cols.owner[s] = to;
                    n += 1;
                }
            }
        }
        Ok(n)
    }

    /// The task's rows landed in the pool: the slots it still owns become committed.
    /// Returns how many slots were committed (stolen ones are not).
    pub fn commit(&mut self, task: TaskId) -> Result<usize> {
        self.settle(task, OWNER_POOL)
    }

    /// The task failed: the slots it still owns become absent (reads of them will see that
    /// they moved). Returns how many slots were dropped.
    pub fn abandon(&mut self, task: TaskId) -> Result<usize> {
        self.settle(task, OWNER_ABSENT)
    }

    /// Where each slot's row of `key` is now and at which version, without registering a read.
    pub fn peek<S: RawSlot>(&self, slots: &[S], key: KeyId) -> Result<(Vec<i64>, Vec<u64>)> {
        self.check_key(key)?;
        self.check_slots(slots)?;
        let cols = &self.keys[key.0 as usize];
        let sources = slots
            .iter()
            .map(|s| Source::from_owner(cols.owner[s.to_i64() as usize]).code())
            .collect();
        let versions = slots
            .iter()
            .map(|s| cols.version[s.to_i64() as usize])
            .collect();
        Ok((sources, versions))
    }

    /// Plans a read of `slots` of `key`: per slot its source and version, registered as a
    /// pending read until [`Ledger::release`]. A later claim of a committed slot still at the
    /// captured version reports it in `preserve_slots`. The same slot may appear twice.
    pub fn plan_read<S: RawSlot>(&mut self, slots: &[S], key: KeyId) -> Result<ReadPlan> {
        self.check_key(key)?;
        self.check_slots(slots)?;
        let cols = &mut self.keys[key.0 as usize];
        let n = slots.len();
        let (mut sources, mut versions, mut owners, mut raw) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        for s in slots {
            let slot = s.to_i64() as usize;
            let owner = cols.owner[slot];
            cols.readers[slot] += 1;
            sources.push(Source::from_owner(owner).code());
            versions.push(cols.version[slot]);
            owners.push(owner);
            raw.push(slot as u32);
        }
        let read = ReadId(self.next_read);
        self.next_read += 1;
        self.reads.insert(
            read,
            PendingRead {
                key,
                slots: raw,
                versions: versions.clone(),
                owners,
            },
        );
        Ok(ReadPlan {
            read,
            sources,
            versions,
        })
    }

    /// Positions (in the read's slot order) whose row moved since the read was planned: the
    /// version changed (a newer claim), or the row became absent (its writer failed).
    pub fn validate(&self, read: ReadId) -> Result<Vec<i64>> {
        let r = self.reads.get(&read).ok_or(Error::UnknownRead { read })?;
        let cols = &self.keys[r.key.0 as usize];
        let mut moved = Vec::new();
        for (i, (&slot, &version)) in r.slots.iter().zip(&r.versions).enumerate() {
            let s = slot as usize;
            let vanished = cols.owner[s] == OWNER_ABSENT && r.owners[i] != OWNER_ABSENT;
            if cols.version[s] != version || vanished {
                moved.push(i as i64);
            }
        }
        Ok(moved)
    }

    /// Releases a pending read: its slots no longer need preserving.
    pub fn release(&mut self, read: ReadId) -> Result<()> {
        let r = self
            .reads
            .remove(&read)
            .ok_or(Error::UnknownRead { read })?;
        let cols = &mut self.keys[r.key.0 as usize];
        for (&slot, &version) in r.slots.iter().zip(&r.versions) {
            let s = slot as usize;
            if cols.version[s] == version {
                cols.readers[s] = cols.readers[s].saturating_sub(1);
            }
        }
        Ok(())
    }

    /// Pending reads holding each slot of `key` at its current version (diagnostics, tests).
    pub fn readers<S: RawSlot>(&self, slots: &[S], key: KeyId) -> Result<Vec<u32>> {
        self.check_key(key)?;
        self.check_slots(slots)?;
        let cols = &self.keys[key.0 as usize];
        Ok(slots
            .iter()
            .map(|s| cols.readers[s.to_i64() as usize])
            .collect())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const T1: TaskId = TaskId(1);
    const T2: TaskId = TaskId(2);

    fn ledger_with_key() -> (Ledger, KeyId) {
        let mut l = Ledger::new(64).unwrap();
        let k = l.add_key();
        (l, k)
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
        assert_eq!(plan.sources, vec![SOURCE_POOL, SOURCE_POOL]);
        let out = l.claim(&[9i64, 10], k, T2).unwrap();
        assert_eq!(out.preserve_slots, vec![9]);
        assert_eq!((out.preserve_versions, out.preserve_from), (vec![1], vec![SOURCE_POOL]));
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
        assert_eq!(plan.sources, vec![1], "in transit under task#1");
        let out = l.claim(&[9i64], k, T2).unwrap();
        assert_eq!(out.stolen_slots, vec![9]);
        assert_eq!(out.preserve_slots, vec![9]);
        assert_eq!(out.preserve_versions, vec![1]);
        assert_eq!(out.preserve_from, vec![1], "task#1 holds the captured row");
        l.release(plan.read).unwrap();
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
        assert_eq!(plan.sources, vec![1]);
        assert_eq!(l.abandon(T1).unwrap(), 1);
        assert_eq!(l.validate(plan.read).unwrap(), vec![0]);
        assert_eq!(l.peek(&[5i64], k).unwrap().0, vec![SOURCE_ABSENT]);
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
            Error::SlotOutOfRange {
                slot: -3,
                position: 1,
                num_slots: 64
            }
        );
        assert_eq!(
            l.claim(&[1i64, 64], k, T1).unwrap_err(),
            Error::SlotOutOfRange {
                slot: 64,
                position: 1,
                num_slots: 64
            }
        );
        assert_eq!(
            l.claim(&[1i64, 2, 1], k, T1).unwrap_err(),
            Error::DuplicateSlot {
                slot: 1,
                first: 0,
                second: 2
            }
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
        assert!(matches!(Ledger::new(0), Err(Error::InvalidConfig { .. })));
    }

    #[test]
    fn int32_slots_work_like_int64() {
        let (mut l, k) = ledger_with_key();
        l.claim(&[3i32, 4], k, T1).unwrap();
        assert_eq!(l.owned(T1, k).unwrap().1, vec![3, 4]);
    }
}
