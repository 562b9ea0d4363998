//! The reference model `prop_ledger` checks [`pcache_core::Ledger`] against, slot by slot
//! (no blocks): per (key, slot) the owner and version (the number of the successful claim or
//! invalidation that last took it: 1, 2, ...), per task its claimed rows in order with the version each claim
//! assigned, per pending read the slots, captured versions and captured owners. A slot's
//! readers are *derived* (pending read positions that captured it at its current version), so
//! the ledger's incremental counters are checked against an independent definition.

use std::collections::HashMap;

use pcache_core::ledger::{SOURCE_ABSENT, SOURCE_POOL};
use pcache_core::{ClaimOutcome, Error, KeyId, ReadId, ReadPlan, Result, TaskId};

/// Slots and keys of the modelled ledger.
pub const NUM_SLOTS: u32 = 16;
pub const NUM_KEYS: u32 = 2;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Owner {
    #[default]
    Absent,
    Pool,
    Task(u64),
}

impl Owner {
    pub fn code(self) -> i64 {
        match self {
            Owner::Absent => SOURCE_ABSENT,
            Owner::Pool => SOURCE_POOL,
            Owner::Task(t) => t as i64,
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Cell {
    pub owner: Owner,
    pub version: u64,
}

#[derive(Clone, Copy, Debug)]
pub struct ClaimedRow {
    pub key: u32,
    pub slot: usize,
    pub version: u64,
}

#[derive(Clone, Debug)]
pub struct PendingRead {
    pub key: u32,
    pub slots: Vec<usize>,
    pub versions: Vec<u64>,
    pub owners: Vec<Owner>,
}

#[derive(Default, Debug)]
pub struct Model {
    pub cells: HashMap<(u32, usize), Cell>,
    /// Present from the first successful claim (even an empty one) until commit/abandon.
    pub tasks: HashMap<u64, Vec<ClaimedRow>>,
    pub reads: HashMap<u64, PendingRead>,
    pub next_read: u64,
    /// Successful claims and invalidations so far.
    pub claims: u64,
}

impl Model {
    pub fn cell(&self, key: u32, slot: usize) -> Cell {
        self.cells.get(&(key, slot)).copied().unwrap_or_default()
    }

    pub fn cell_mut(&mut self, key: u32, slot: usize) -> &mut Cell {
        self.cells.entry((key, slot)).or_default()
    }

    /// Pending read positions that captured (key, slot) at its current version.
    pub fn readers(&self, key: u32, slot: usize) -> u32 {
        let now = self.cell(key, slot).version;
        self.reads
            .values()
            .filter(|r| r.key == key)
            .flat_map(|r| r.slots.iter().zip(&r.versions))
            .filter(|&(&s, &v)| s == slot && v == now)
            .count() as u32
    }

    pub fn check_key(&self, key: u32) -> Result<()> {
        if key < NUM_KEYS {
            Ok(())
        } else {
            Err(Error::UnknownKey {
                key: KeyId(key),
                num_keys: NUM_KEYS,
            })
        }
    }

    pub fn check_range(slots: &[i64]) -> Result<Vec<usize>> {
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

    pub fn claim(&mut self, slots: &[i64], key: u32, task: u64) -> Result<ClaimOutcome> {
        self.claim_for(slots, key, Owner::Task(task))
    }

    /// A claim by nobody: the slots become absent (`Ledger::invalidate`).
    pub fn invalidate(&mut self, slots: &[i64], key: u32) -> Result<ClaimOutcome> {
        self.claim_for(slots, key, Owner::Absent)
    }

    pub fn claim_for(&mut self, slots: &[i64], key: u32, owner: Owner) -> Result<ClaimOutcome> {
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
        self.claims += 1;
        let version = self.claims;
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
            *self.cell_mut(key, slot) = Cell { owner, version };
            rows.push(ClaimedRow { key, slot, version });
        }
        if let Owner::Task(task) = owner {
            self.tasks.entry(task).or_default().extend(rows);
        }
        Ok(out)
    }

    pub fn still_owns(&self, task: u64, row: &ClaimedRow) -> bool {
        let c = self.cell(row.key, row.slot);
        c.owner == Owner::Task(task) && c.version == row.version
    }

    pub fn owned(&self, task: u64, key: u32) -> Result<(Vec<i64>, Vec<i64>)> {
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

    pub fn settle(&mut self, task: u64, to: Owner) -> Result<usize> {
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

    pub fn peek(&self, key: u32) -> (Vec<i64>, Vec<u64>) {
        (0..NUM_SLOTS as usize)
            .map(|s| {
                let c = self.cell(key, s);
                (c.owner.code(), c.version)
            })
            .unzip()
    }

    pub fn plan_read(&mut self, slots: &[i64], key: u32) -> Result<ReadPlan> {
        self.check_key(key)?;
        let slots = Self::check_range(slots)?;
        let cells: Vec<Cell> = slots.iter().map(|&s| self.cell(key, s)).collect();
        let read = self.next_read;
        self.next_read += 1;
        // (no per-slot sources when every row is in the pool)
        let all_pool = cells.iter().all(|c| c.owner == Owner::Pool);
        let plan = ReadPlan {
            read: ReadId(read),
            len: slots.len(),
            sources: (!all_pool).then(|| cells.iter().map(|c| c.owner.code()).collect()),
        };
        self.reads.insert(
            read,
            PendingRead {
                key,
                slots,
                versions: cells.iter().map(|c| c.version).collect(),
                owners: cells.iter().map(|c| c.owner).collect(),
            },
        );
        Ok(plan)
    }

    /// Mostly an issued read (pending or released), sometimes one never issued.
    pub fn pick_read(&self, pick: usize) -> ReadId {
        ReadId(pick as u64 % (self.next_read + 1))
    }

    pub fn validate(&self, read: ReadId) -> Result<Vec<i64>> {
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

    pub fn release(&mut self, read: ReadId) -> Result<()> {
        self.reads
            .remove(&read.0)
            .map(drop)
            .ok_or(Error::UnknownRead { read })
    }
}
