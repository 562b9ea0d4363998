//! The slot/version ledger: for every (slot, key), who holds the row and at which version.
//!
//! Occupancy of a (slot, key) is *absent*, *in transit* under a write task, or *committed*
//! (its row is in the pool). Every claim gives its slots a new version: the ledger-wide number
//! of that claim (1, 2, ...), so a version never repeats on a slot. From that the ledger
//! answers the three questions the cache asks:
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
//! of consecutive ids, so 16,384 slots are typically 1,024 runs of 16. Each block of the
//! engine's block size also has a summary entry: a claim that takes a whole block sets the
//! summary alone, and while the block is *whole* its slots share that entry, so a commit, a
//! read and a release of the block are one update each, not one per slot. A call that
//! touches part of a whole block first writes the summary to the block's slots; per-slot
//! ranges are walked by branch-free loops the compiler vectorises, and a scattered list slot
//! by slot. A task's claimed rows and a pending read's slots are kept as runs too, and a
//! pending read keeps one captured version per run of equal versions. The columns and their
//! per-block/per-slot operations live in `slot_columns`; the values calls hand back in
//! `ledger_outcomes`; the read side (`peek`, `plan_read`, `validate`, `release`) in
//! `ledger_reads`, over the same fields.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::ids::{first_repeat, KeyId, ReadId, TaskId};
pub use crate::ledger_outcomes::{
    contiguous_from, ClaimOutcome, ReadPlan, Source, SOURCE_ABSENT, SOURCE_POOL,
};
use crate::slot_columns::{Handles, KeyColumns, OWNER_ABSENT, OWNER_POOL};
pub use crate::slot_runs::RawSlot;
use crate::slot_runs::{check_unique, split_runs, Run};

#[path = "ledger_reads.rs"]
mod reads;
use reads::PendingRead;

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
    block_size: u32,
    keys: Vec<KeyColumns>,
    tasks: HashMap<TaskId, TaskClaims>,
    handles: Handles,
    reads: HashMap<ReadId, PendingRead>,
    next_read: u64,
    /// The version the next claim gives its slots.
    next_version: u64,
    /// Duplicate detection for claims: one bit per slot, all clear between calls.
    seen: Vec<u64>,
}

impl Ledger {
    /// A ledger for `num_slots` slots (`num_blocks * block_size`) and no keys yet. The
    /// block size is the engine's KV block size: slots `b * block_size ..` form block `b`,
    /// which the ledger summarises (see the module docs). It changes no result, only how
    /// fast whole blocks go.
    pub fn new(num_slots: u32, block_size: u32) -> Result<Self> {
        if num_slots == 0 || block_size == 0 {
            return Err(Error::InvalidConfig {
                what: format!(
                    "a ledger needs at least one slot and a block size of at least one \
                     (got {num_slots} slots in blocks of {block_size})"
                ),
            });
        }
        Ok(Self {
            num_slots,
            block_size,
            keys: Vec::new(),
            tasks: HashMap::new(),
            handles: Handles::default(),
            reads: HashMap::new(),
            next_read: 0,
            next_version: 1,
            seen: vec![0; num_slots.div_ceil(64) as usize],
        })
    }

    /// Number of slots per key.
    pub fn num_slots(&self) -> u32 {
        self.num_slots
    }

    /// The block size the ledger summarises.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Number of registered keys.
    pub fn num_keys(&self) -> u32 {
        self.keys.len() as u32
    }

    /// Host bytes one key's columns take (each registered key holds this much).
    pub fn key_column_bytes(&self) -> usize {
        KeyColumns::bytes_for(self.num_slots as usize, self.block_size as usize)
    }

    /// Registers a key: every slot absent at version 0. Panics when its columns cannot be
    /// allocated ([`Ledger::try_add_key`] refuses instead).
    pub fn add_key(&mut self) -> KeyId {
        self.try_add_key()
            .expect("allocating a key's ledger columns")
    }

    /// Registers a key, or refuses with `InvalidInput` (nothing registered) when the
    /// allocator cannot provide its columns: 16 bytes per slot, allocated at once.
    pub fn try_add_key(&mut self) -> Result<KeyId> {
        let (num_slots, block_size) = (self.num_slots as usize, self.block_size as usize);
        let columns = KeyColumns::try_new(num_slots, block_size).ok_or_else(|| Error::InvalidInput {
            what: format!(
                "the ledger's columns for a new key ({num_slots} slots, 16 bytes each) cannot be allocated"
            ),
        })?;
        self.keys.push(columns);
        Ok(KeyId(self.keys.len() as u32 - 1))
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
    /// task already claimed on this key). Every slot gets this claim's version and its owner
    /// becomes `task`. A slot the same task already holds is not reported as stolen or
    /// preserved. Refused as a whole (nothing changes) for an unknown key, an out-of-range or
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
        let version = self.take_version();
        self.claim_runs(runs, key, task, version, &mut out);
        Ok(out)
    }

    /// The version of the next claim (one per successful call).
    fn take_version(&mut self) -> u64 {
        let version = self.next_version;
        self.next_version += 1;
        version
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
        let total = counts.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
        if counts.len() != tasks.len() || total != Some(slots.len()) {
            return Err(Error::InvalidInput {
                what: format!(
                    "{} counts for {} tasks, summing to {} for {} slots",
                    counts.len(),
                    tasks.len(),
                    total.map_or("more than usize::MAX".to_string(), |t| t.to_string()),
                    slots.len()
                ),
            });
        }
        let all = split_runs(slots, self.num_slots)?;
        check_unique(&mut self.seen, &all, slots)?;
        let mut out = ClaimOutcome::default();
        let version = self.take_version();
        let mut start = 0;
        for (&count, &task) in counts.iter().zip(tasks) {
            let segment = &slots[start..start + count];
            start += count;
            // (a task of no slots is registered too, as `claim` registers one: it commits nothing)
            let runs = split_runs(segment, self.num_slots)?;
            self.claim_runs(runs, key, task, version, &mut out);
        }
        Ok(out)
    }

    /// The rows of `slots` on `key` are gone and nothing replaces them (a step that computed
    /// these positions did not give this key): every slot gets a new version and becomes
    /// absent, so a read planned later finds no row to serve and a pending read sees its row
    /// move. Reports what a claim reports: slots taken from an older in-transit task (which
    /// skips them when it writes) and rows a pending read captured (to keep aside). Refused as
    /// a whole (nothing changes) for an unknown key, an out-of-range or negative slot, or a
    /// slot listed twice.
    pub fn invalidate<S: RawSlot>(&mut self, slots: &[S], key: KeyId) -> Result<ClaimOutcome> {
        self.check_key(key)?;
        let runs = split_runs(slots, self.num_slots)?;
        check_unique(&mut self.seen, &runs, slots)?;
        let mut out = ClaimOutcome::default();
        let version = self.take_version();
        let (cols, handles) = (&mut self.keys[key.0 as usize], &self.handles);
        // (a claim by nobody: the owner becomes absent, and an absent slot is nobody's to steal)
        cols.claim(&runs, OWNER_ABSENT, version, handles, &mut out);
        Ok(out)
    }

    /// The claim itself, on validated runs.
    fn claim_runs(
        &mut self,
        runs: Vec<Run>,
        key: KeyId,
        task: TaskId,
        version: u64,
        out: &mut ClaimOutcome,
    ) {
        let handles = &mut self.handles;
        let claims = self.tasks.entry(task).or_insert_with(|| TaskClaims {
            owner: handles.take(task),
            per_key: Vec::new(),
        });
        let (me, handles) = (claims.owner, &self.handles);
        let cols = &mut self.keys[key.0 as usize];
        cols.claim(&runs, me, version, handles, out);
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
        let cols = &self.keys[key.0 as usize];
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
                    if cols.entry(s).owner == me && later[word] & bit == 0 {
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
            for piece in rows.runs.iter().flat_map(|&run| cols.pieces(run)) {
                let range = piece.slots;
                let len = range.len();
                match cols.whole_entry(piece.block) {
                    // (a whole block is the task's throughout, or not at all)
                    Some(e) if e.owner != me => {}
                    Some(_) => {
                        positions.extend((position..position + len).map(|p| p as i64));
                        slots.extend(range.map(|s| s as i64));
                    }
                    None => {
                        let owners = cols.slot_owners(range.clone());
                        for ((p, s), &o) in (position..).zip(range).zip(owners) {
                            if o == me {
                                positions.push(p as i64);
                                slots.push(s as i64);
                            }
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
            n += self.keys[rows.key.0 as usize].settle(&rows.runs, me, to);
        }
        // No slot names the task any more: its handle is free.
        self.handles.give_back(me);
        Ok(n)
    }

    /// The task's rows landed in the pool: the slots it still owns become committed.
    /// Returns how many slots were committed (stolen ones are not).
    pub fn commit(&mut self, task: TaskId) -> Result<usize> {
        self.settle(task, OWNER_POOL)
    }

    /// Commits several tasks in order (one writer batch). Returns how many slots were
    /// committed in all. Refused as a whole (nothing committed) when a task is unknown or
    /// listed twice.
    pub fn commit_many(&mut self, tasks: &[TaskId]) -> Result<usize> {
        if let Some(&task) = tasks.iter().find(|t| !self.tasks.contains_key(t)) {
            return Err(Error::UnknownTask { task });
        }
        if let Some(twice) = first_repeat(tasks) {
            return Err(Error::InvalidInput {
                what: format!("{twice} is listed twice in one commit"),
            });
        }
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
        // A task's positions are below `num_slots`: these offsets cannot overflow them.
        let most = i64::MAX - i64::from(self.num_slots);
        if let Some(i) = offsets.iter().position(|&o| !(0..=most).contains(&o)) {
            return Err(Error::InvalidInput {
                what: format!(
                    "offset {} of {} is out of range [0, {most}]",
                    offsets[i], tasks[i]
                ),
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
}

#[cfg(all(test, not(loom)))]
#[path = "ledger_tests.rs"]
mod tests;

#[cfg(all(test, not(loom)))]
#[path = "ledger_run_tests.rs"]
mod run_tests;
