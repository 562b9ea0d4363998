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
//!
//! # Representation
//!
//! Per key, three columns hold one entry per slot: the owner (a 4-byte code: nobody, the
//! pool, or an in-transit task's handle), the version and the number of pending readers.
//! Slot lists are handled as *runs* of consecutive ids: the engine hands out slots in blocks
//! of consecutive ids, so 16,384 slots are typically 1,024 runs of 16, each one contiguous
//! range of every column, walked by branch-free loops the compiler vectorises; a scattered
//! list is handled slot by slot. A task's claimed rows and a pending read's slots are kept
//! as runs too, and a pending read keeps one captured version per run of equal versions.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::{KeyId, ReadId, TaskId};
pub use crate::slot_runs::RawSlot;
use crate::slot_runs::{check_unique, split_runs, Run, SHORT_RUN};

/// Owner codes in the per-key owner column: nobody, the pool, or an in-transit task, named
/// by its *handle*: `OWNER_TASK_BASE + i`, where `i` indexes [`Ledger`]'s handle table. A
/// task gets a handle at its first claim and gives it back when it settles, when no slot
/// names it any more. Four bytes per slot instead of a task id's eight.
const OWNER_ABSENT: u32 = 0;
const OWNER_POOL: u32 = 1;
const OWNER_TASK_BASE: u32 = 2;

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

/// `Some(first)` when `positions` are exactly `first, first + 1, ..` (a gather of them is a
/// slice), else `None`.
pub fn contiguous_from(positions: &[i64]) -> Option<i64> {
    let first = *positions.first()?;
    positions
        .windows(2)
        .all(|w| w[1] == w[0] + 1)
        .then_some(first)
}

impl ReadPlan {
    /// Slots never written (a read of them cannot be served).
    pub fn num_absent(&self) -> usize {
        self.sources.iter().filter(|&&s| s == SOURCE_ABSENT).count()
    }

    /// Slots whose rows are committed in the pool.
    pub fn num_from_pool(&self) -> usize {
        self.sources.iter().filter(|&&s| s == SOURCE_POOL).count()
    }

    /// The in-transit tasks the read waits for, ascending, each once.
    pub fn tasks(&self) -> Vec<TaskId> {
        let mut tasks: Vec<u64> = self
            .sources
            .iter()
            .filter(|&&s| s >= 0)
            .map(|&s| s as u64)
            .collect();
        tasks.sort_unstable();
        tasks.dedup();
        tasks.into_iter().map(TaskId).collect()
    }
}

/// The task of each handle (see [`OWNER_TASK_BASE`]); entries of free handles are stale.
#[derive(Debug, Clone, Default)]
struct Handles {
    tasks: Vec<TaskId>,
    free: Vec<u32>,
}

impl Handles {
    /// A handle for `task`, as its owner code.
    fn take(&mut self, task: TaskId) -> u32 {
        match self.free.pop() {
            Some(owner) => {
                self.tasks[(owner - OWNER_TASK_BASE) as usize] = task;
                owner
            }
            None => {
                self.tasks.push(task);
                // Beyond `u32::MAX - 2` tasks holding claims at once, memory runs out first.
                u32::try_from(self.tasks.len() - 1)
                    .ok()
                    .and_then(|i| i.checked_add(OWNER_TASK_BASE))
                    .expect("fewer than 2^32 - 2 tasks hold claims at once")
            }
        }
    }

    /// The task an owner code (`>= OWNER_TASK_BASE`) names.
    fn task(&self, owner: u32) -> TaskId {
        self.tasks[(owner - OWNER_TASK_BASE) as usize]
    }

    /// The [`Source`] of an owner code.
    fn source(&self, owner: u32) -> Source {
        match owner {
            OWNER_ABSENT => Source::Absent,
            OWNER_POOL => Source::Pool,
            t => Source::Task(self.task(t)),
        }
    }
}

/// Per-key columns, one entry per slot (struct of arrays: the per-run loops read and write
/// each column as one contiguous range).
#[derive(Debug, Clone)]
struct KeyColumns {
    /// Owner codes (`OWNER_*`).
    owner: Vec<u32>,
    version: Vec<u64>,
    /// Pending reads that captured this slot at its *current* version.
    readers: Vec<u32>,
}

impl KeyColumns {
    /// Claims one slot for owner `me`: reports it in `out` if it is stolen or must be
    /// preserved, bumps its version and takes it over.
    #[inline]
    fn claim_slot(&mut self, slot: usize, me: u32, handles: &Handles, out: &mut ClaimOutcome) {
        let owner = self.owner[slot];
        let other_task = owner >= OWNER_TASK_BASE && owner != me;
        if other_task {
            out.stolen_slots.push(slot as i64);
            out.stolen_from.push(handles.task(owner).0 as i64);
        }
        if self.readers[slot] > 0 && (owner == OWNER_POOL || other_task) {
            out.preserve_slots.push(slot as i64);
            out.preserve_versions.push(self.version[slot]);
            out.preserve_from.push(handles.source(owner).code());
        }
        self.version[slot] += 1;
        self.readers[slot] = 0;
        self.owner[slot] = me;
    }

    /// Claims a run for owner `me`, as [`KeyColumns::claim_slot`] on each of its slots.
    fn claim_run(&mut self, run: Run, me: u32, handles: &Handles, out: &mut ClaimOutcome) {
        let range = run.range();
        let owner = &mut self.owner[range.clone()];
        let version = &mut self.version[range.clone()];
        let readers = &mut self.readers[range.clone()];
        // Typically nothing is reported: one owner throughout (nobody, the pool or this
        // task) and no pending reader. Both folds are plain bit operations, which the
        // compiler vectorises.
        let first = owner[0];
        let uniform = owner.iter().fold(0, |diff, &o| diff | (o ^ first)) == 0;
        let other_task = first >= OWNER_TASK_BASE && first != me;
        let read = readers.iter().fold(0, |any, &n| any | n) != 0;
        if uniform && !other_task && !read {
            version.iter_mut().for_each(|v| *v += 1);
            readers.fill(0);
            owner.fill(me);
        } else {
            range.for_each(|slot| self.claim_slot(slot, me, handles, out));
        }
    }
}

#[derive(Debug, Clone)]
struct PendingRead {
    key: KeyId,
    /// The read's slots, in order, in runs of slots captured at one version.
    runs: Vec<ReadRun>,
    /// Positions (ascending) whose slot had no row when the read was planned; every other
    /// position captured a row, and the read sees it vanish if the slot becomes absent.
    captured_absent: Vec<usize>,
}

/// Consecutive slots of a pending read, all captured at one version.
#[derive(Debug, Clone, Copy)]
struct ReadRun {
    run: Run,
    version: u64,
}

/// Appends the slots of `run` at `version` (their versions, in order) to `out` as runs of
/// equal versions. A block is claimed as a whole, so that is usually one run.
fn push_read_runs(out: &mut Vec<ReadRun>, run: Run, version: &[u64]) {
    let mut start = run.start;
    for same in version.chunk_by(|a, b| a == b) {
        let len = same.len() as u32;
        out.push(ReadRun {
            run: Run { start, len },
            version: same[0],
        });
        start += len;
    }
}

/// One task's claims on one key: the claimed slots in row order.
///
/// A row still belongs to the task iff the slot's owner is the task and the row is the
/// task's *last* row of that slot: only this task's claims make it the owner, and each
/// appends a row, so while the task owns the slot its newest claim is the task's last row
/// of it. (That is what comparing the version a claim assigned with the current version
/// decides, without storing versions.)
#[derive(Debug, Clone)]
struct KeyRows {
    key: KeyId,
    runs: Vec<Run>,
    /// Whether a slot may appear twice: set when a second non-empty claim is appended (the
    /// slots of one claim are distinct). When not, every row is the last of its slot.
    may_repeat: bool,
}

/// One task's claims, per key.
#[derive(Debug, Clone)]
struct TaskClaims {
    /// The task's handle, as its owner code.
    owner: u32,
    per_key: Vec<KeyRows>,
}

impl TaskClaims {
    fn key(&self, key: KeyId) -> Option<&KeyRows> {
        self.per_key.iter().find(|r| r.key == key)
    }

    /// Appends `runs` (one claim's slots) to the task's rows on `key`.
    fn append(&mut self, key: KeyId, runs: Vec<Run>) {
        match self.per_key.iter_mut().find(|r| r.key == key) {
            Some(rows) if rows.runs.is_empty() => rows.runs = runs,
            Some(rows) => {
                rows.may_repeat |= !runs.is_empty();
                rows.runs.extend_from_slice(&runs);
            }
            None => self.per_key.push(KeyRows {
                key,
                runs,
                may_repeat: false,
            }),
        }
    }
}

/// The slot/version ledger. Not thread-safe by itself: wrap it in one mutex.
#[derive(Debug, Clone)]
pub struct Ledger {
    num_slots: u32,
    keys: Vec<KeyColumns>,
    tasks: HashMap<TaskId, TaskClaims>,
    handles: Handles,
    reads: HashMap<ReadId, PendingRead>,
    next_read: u64,
    /// Duplicate detection for claims: one bit per slot, all clear between calls.
    seen: Vec<u64>,
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
            handles: Handles::default(),
            reads: HashMap::new(),
            next_read: 0,
            seen: vec![0; num_slots.div_ceil(64) as usize],
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
        let runs = split_runs(slots, self.num_slots)?;
        check_unique(&mut self.seen, &runs, slots)?;
        let mut out = ClaimOutcome::default();
        self.claim_runs(runs, key, task, &mut out);
        Ok(out)
    }

    /// Claims several tasks' slots in one call: the first `counts[0]` slots for `tasks[0]`,
    /// the next `counts[1]` for `tasks[1]`, and so on (one step's requests, in batch order).
    /// Validated as a whole first — lengths, ranges, and no slot twice in the whole batch —
    /// and refused as a whole. Reports what every claim found, in slot order.
    pub fn claim_many<S: RawSlot>(
        &mut self,
        slots: &[S],
        counts: &[usize],
        key: KeyId,
        tasks: &[TaskId],
    ) -> Result<ClaimOutcome> {
        self.check_key(key)?;
        if counts.len() != tasks.len() || counts.iter().sum::<usize>() != slots.len() {
            return Err(Error::InvalidInput {
                what: format!(
                    "{} counts for {} tasks, summing to {} for {} slots",
                    counts.len(),
                    tasks.len(),
                    counts.iter().sum::<usize>(),
                    slots.len()
                ),
            });
        }
        let all = split_runs(slots, self.num_slots)?;
        check_unique(&mut self.seen, &all, slots)?;
        let mut out = ClaimOutcome::default();
        let mut start = 0;
        for (&count, &task) in counts.iter().zip(tasks) {
            let segment = &slots[start..start + count];
            start += count;
            if !segment.is_empty() {
                let runs = split_runs(segment, self.num_slots)?;
                self.claim_runs(runs, key, task, &mut out);
            }
        }
        Ok(out)
    }

    /// The claim itself, on validated runs.
    fn claim_runs(&mut self, runs: Vec<Run>, key: KeyId, task: TaskId, out: &mut ClaimOutcome) {
        let handles = &mut self.handles;
        let claims = self.tasks.entry(task).or_insert_with(|| TaskClaims {
            owner: handles.take(task),
            per_key: Vec::new(),
        });
        let (me, handles) = (claims.owner, &self.handles);
        let cols = &mut self.keys[key.0 as usize];
        for &run in &runs {
            if run.len < SHORT_RUN {
                (run.range()).for_each(|slot| cols.claim_slot(slot, me, handles, out));
            } else {
                cols.claim_run(run, me, handles, out);
            }
        }
        claims.append(key, runs);
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
        let me = claims.owner;
        let owner = &self.keys[key.0 as usize].owner;
        let (mut positions, mut slots) = (Vec::new(), Vec::new());
        let Some(rows) = claims.key(key) else {
            return Ok((positions, slots));
        };
        if rows.may_repeat {
            // Only a slot's last row counts: walk backwards, skipping slots already seen.
            let mut later = vec![0u64; self.seen.len()];
            let mut position: usize = rows.runs.iter().map(|r| r.len as usize).sum();
            for &run in rows.runs.iter().rev() {
                for s in run.range().rev() {
                    position -= 1;
                    let (word, bit) = (s / 64, 1u64 << (s % 64));
                    if owner[s] == me && later[word] & bit == 0 {
                        positions.push(position as i64);
                        slots.push(s as i64);
                    }
                    later[word] |= bit;
                }
            }
            positions.reverse();
            slots.reverse();
        } else {
            let mut position = 0;
            for &run in &rows.runs {
                let range = run.range();
                let len = range.len();
                let run_owner = &owner[range.clone()];
                if run_owner.iter().all(|&o| o == me) {
                    positions.extend((position..position + len).map(|p| p as i64));
                    slots.extend(range.map(|s| s as i64));
                } else {
                    for ((p, s), &o) in (position..).zip(range).zip(run_owner) {
                        if o == me {
                            positions.push(p as i64);
                            slots.push(s as i64);
                        }
                    }
                }
                position += len;
            }
        }
        Ok((positions, slots))
    }

    /// Ends `task`'s claims, setting every slot it still owns to `to` (`OWNER_POOL` or
    /// `OWNER_ABSENT`). Returns how many.
    ///
    /// A slot the task claimed twice is settled at its first row and no longer owned by the
    /// task at the second, so each owned slot counts once, as its last row would.
    fn settle(&mut self, task: TaskId, to: u32) -> Result<usize> {
        let claims = self
            .tasks
            .remove(&task)
            .ok_or(Error::UnknownTask { task })?;
        let me = claims.owner;
        let mut n = 0;
        for rows in &claims.per_key {
            let owner = &mut self.keys[rows.key.0 as usize].owner;
            for &run in &rows.runs {
                for o in &mut owner[run.range()] {
                    let mine = *o == me;
                    n += usize::from(mine);
                    *o = if mine { to } else { *o };
                }
            }
        }
        // No slot names the task any more: its handle is free.
        self.handles.free.push(me);
        Ok(n)
    }

    /// The task's rows landed in the pool: the slots it still owns become committed.
    /// Returns how many slots were committed (stolen ones are not).
    pub fn commit(&mut self, task: TaskId) -> Result<usize> {
        self.settle(task, OWNER_POOL)
    }

    /// Commits several tasks in order (one writer batch), stopping at the first error.
    /// Returns how many slots were committed in all.
    pub fn commit_many(&mut self, tasks: &[TaskId]) -> Result<usize> {
        tasks.iter().try_fold(0, |n, &t| Ok(n + self.commit(t)?))
    }

    /// The rows several tasks still own on `key`, for one gather and one scatter: each task's
    /// positions shifted by its `offsets[i]` (where its rows start in a shared page) and its
    /// slots, concatenated in task order.
    pub fn owned_many(
        &self,
        tasks: &[TaskId],
        key: KeyId,
        offsets: &[i64],
    ) -> Result<(Vec<i64>, Vec<i64>)> {
        if tasks.len() != offsets.len() {
            return Err(Error::InvalidInput {
                what: format!("{} tasks but {} offsets", tasks.len(), offsets.len()),
            });
        }
        let (mut positions, mut slots) = (Vec::new(), Vec::new());
        for (&task, &offset) in tasks.iter().zip(offsets) {
            let (p, s) = self.owned(task, key)?;
            positions.extend(p.into_iter().map(|p| p + offset));
            slots.extend(s);
        }
        Ok((positions, slots))
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
            .map(|s| self.handles.source(cols.owner[s.to_i64() as usize]).code())
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
        let runs = split_runs(slots, self.num_slots)?;
        let cols = &mut self.keys[key.0 as usize];
        let code = |owner| self.handles.source(owner).code();
        let mut sources = Vec::with_capacity(slots.len());
        let mut versions = Vec::with_capacity(slots.len());
        let mut read_runs = Vec::with_capacity(runs.len());
        let mut captured_absent = Vec::new();
        for run in runs {
            let range = run.range();
            if run.len < SHORT_RUN {
                for slot in range {
                    let (owner, version) = (cols.owner[slot], cols.version[slot]);
                    if owner == OWNER_ABSENT {
                        captured_absent.push(sources.len());
                    }
                    sources.push(code(owner));
                    versions.push(version);
                    cols.readers[slot] += 1;
                    let run = Run {
                        start: slot as u32,
                        len: 1,
                    };
                    read_runs.push(ReadRun { run, version });
                }
                continue;
            }
            let owner = &cols.owner[range.clone()];
            let version = &cols.version[range.clone()];
            // Typically one owner and one version throughout; both checks are branch-free
            // folds, which the compiler vectorises.
            let (first, v0) = (owner[0], version[0]);
            let same_owner = owner.iter().fold(0, |diff, &o| diff | (o ^ first)) == 0;
            let same_version = version.iter().fold(0, |diff, &v| diff | (v ^ v0)) == 0;
            if same_owner {
                if first == OWNER_ABSENT {
                    captured_absent.extend(sources.len()..sources.len() + owner.len());
                }
                sources.extend(std::iter::repeat_n(code(first), owner.len()));
            } else {
                let absent = (sources.len()..)
                    .zip(owner)
                    .filter(|&(_, &o)| o == OWNER_ABSENT);
                captured_absent.extend(absent.map(|(p, _)| p));
                sources.extend(owner.iter().map(|&o| code(o)));
            }
            versions.extend(version.iter().copied());
            if same_version {
                read_runs.push(ReadRun { run, version: v0 });
            } else {
                push_read_runs(&mut read_runs, run, version);
            }
            cols.readers[range].iter_mut().for_each(|n| *n += 1);
        }
        let read = ReadId(self.next_read);
        self.next_read += 1;
        self.reads.insert(
            read,
            PendingRead {
                key,
                runs: read_runs,
                captured_absent,
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
        let mut captured_absent = r.captured_absent.iter().copied().peekable();
        let mut moved = Vec::new();
        let mut position = 0;
        for rr in &r.runs {
            for slot in rr.run.range() {
                let was_absent = captured_absent.next_if_eq(&position).is_some();
                let vanished = cols.owner[slot] == OWNER_ABSENT && !was_absent;
                if cols.version[slot] != rr.version || vanished {
                    moved.push(position as i64);
                }
                position += 1;
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
        for rr in &r.runs {
            let range = rr.run.range();
            let readers = &mut cols.readers[range.clone()];
            for (n, &version) in readers.iter_mut().zip(&cols.version[range]) {
                // Still captured at the current version: one reader fewer. (Branch-free,
                // which the compiler vectorises.)
                *n = if version == rr.version {
                    n.saturating_sub(1)
                } else {
                    *n
                };
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
        assert_eq!(plan.sources, vec![SOURCE_POOL, SOURCE_POOL]);
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
        assert_eq!(plan.sources, vec![1], "in transit under task#1");
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

    fn range(r: std::ops::Range<i64>) -> Vec<i64> {
        r.collect()
    }

    #[test]
    fn runs_across_bitmap_words_are_checked_and_claimed_slot_by_slot() {
        let mut l = Ledger::new(200).unwrap();
        let k = l.add_key();
        // Runs straddling the duplicate bitmap's word boundaries (64, 128).
        let first: Vec<i64> = (60..140).chain(10..20).collect();
        assert_eq!(l.claim(&first, k, T1).unwrap(), ClaimOutcome::default());
        let dup: Vec<i64> = (0..10).chain(150..170).chain(5..8).collect();
        assert_eq!(
            l.claim(&dup, k, T2).unwrap_err(),
            Error::DuplicateSlot {
                slot: 5,
                first: 5,
                second: 30
            }
        );
        // An out-of-range id anywhere wins over an earlier duplicate.
        assert_eq!(
            l.claim(&[3i64, 4, 3, 200], k, T2).unwrap_err(),
            Error::SlotOutOfRange {
                slot: 200,
                position: 3,
                num_slots: 200
            }
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
        let want: Vec<u64> = (96..120)
            .map(|s| 1 + u64::from((100..116).contains(&s)))
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
        assert_eq!(plan.sources, sources);
        let mut versions = vec![1u64; 16];
        versions[4..8].fill(2);
        versions[12..14].fill(2);
        versions.extend([0; 2]);
        assert_eq!(plan.versions, versions);
        assert_eq!(l.readers(&slots, k).unwrap(), vec![1; 18]);
        let out = l.claim(&range(6..14), k, TaskId(4)).unwrap();
        assert_eq!(out.stolen_slots, vec![12, 13]);
        assert_eq!(out.preserve_slots, range(6..14));
        assert_eq!(out.preserve_versions, vec![2, 2, 1, 1, 1, 1, 2, 2]);
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
        let mut l = Ledger::new(4096).unwrap();
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
            assert_eq!(plan.sources, vec![big.0 as i64; slots.len()]);
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
}
