//! The ledger's per-key columns (owner, version, pending readers per slot) and the table of
//! task handles its owner codes name, with the claim of one slot or one run on them.
//! Private to the crate: [`crate::ledger::Ledger`] is their only user.

use crate::ids::TaskId;
use crate::ledger_outcomes::{ClaimOutcome, Source};
use crate::slot_runs::Run;

/// Owner codes in the per-key owner column: nobody, the pool, or an in-transit task, named
/// by its *handle*: `OWNER_TASK_BASE + i`, where `i` indexes [`Ledger`]'s handle table. A
/// task gets a handle at its first claim and gives it back when it settles, when no slot
/// names it any more. Four bytes per slot instead of a task id's eight.
pub(crate) const OWNER_ABSENT: u32 = 0;
pub(crate) const OWNER_POOL: u32 = 1;
pub(crate) const OWNER_TASK_BASE: u32 = 2;

/// The task of each handle (see [`OWNER_TASK_BASE`]); entries of free handles are stale.
#[derive(Debug, Clone, Default)]
pub(crate) struct Handles {
    tasks: Vec<TaskId>,
    free: Vec<u32>,
}

impl Handles {
    /// A handle for `task`, as its owner code.
    pub(crate) fn take(&mut self, task: TaskId) -> u32 {
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

    /// Frees a handle (owner code) once no slot names its task any more.
    pub(crate) fn give_back(&mut self, owner: u32) {
        self.free.push(owner);
    }

    /// The task an owner code (`>= OWNER_TASK_BASE`) names.
    pub(crate) fn task(&self, owner: u32) -> TaskId {
        self.tasks[(owner - OWNER_TASK_BASE) as usize]
    }

    /// The [`Source`] of an owner code.
    pub(crate) fn source(&self, owner: u32) -> Source {
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
pub(crate) struct KeyColumns {
    /// Owner codes (`OWNER_*`).
    pub(crate) owner: Vec<u32>,
    pub(crate) version: Vec<u64>,
    /// Pending reads that captured this slot at its *current* version.
    pub(crate) readers: Vec<u32>,
}

impl KeyColumns {
    /// Claims one slot for owner `me`: reports it in `out` if it is stolen or must be
    /// preserved, bumps its version and takes it over.
    #[inline]
    pub(crate) fn claim_slot(
        &mut self,
        slot: usize,
        me: u32,
        handles: &Handles,
        out: &mut ClaimOutcome,
    ) {
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
    pub(crate) fn claim_run(
        &mut self,
        run: Run,
        me: u32,
        handles: &Handles,
        out: &mut ClaimOutcome,
    ) {
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
