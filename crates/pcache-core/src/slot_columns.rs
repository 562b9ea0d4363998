//! The ledger's per-key columns (owner, version, pending readers per slot, summarised per
//! block) and the table of task handles its owner codes name, with the claim, commit, read
//! and release of runs of slots on them. Private to the crate: [`crate::ledger::Ledger`] is
//! their only user.

use std::ops::Range;

use crate::ids::TaskId;
use crate::ledger_outcomes::{ClaimOutcome, Source};
use crate::slot_runs::Run;

/// Owner codes in the per-key owner column: nobody, the pool, or an in-transit task, named
/// by its *handle*: `OWNER_TASK_BASE + i`, where `i` indexes the handle table of
/// [`Ledger`](crate::ledger::Ledger). A task gets a handle at its first claim and gives it
/// back when it settles, when no slot names it any more. Four bytes per slot instead of a
/// task id's eight.
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

    /// Handles ever made (in use or free): the table's size (tests).
    #[cfg(test)]
    pub(crate) fn allocated(&self) -> usize {
        self.tasks.len()
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

/// One slot's entry: owner code, version and pending readers at that version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) owner: u32,
    pub(crate) version: u64,
    pub(crate) readers: u32,
}

/// The part of a run inside one block: `slots`, and whether they are the whole block.
#[derive(Debug, Clone)]
pub(crate) struct Piece {
    pub(crate) block: usize,
    pub(crate) slots: Range<usize>,
    pub(crate) whole: bool,
}

/// Per-key columns: one entry per slot (struct of arrays: the per-run loops read and write
/// each column as one contiguous range), and a summary per block of the engine's KV block
/// size. While a block is *whole*, every slot of it has the block's entry and its per-slot
/// entries are stale: a claim, commit, read or release of the whole block is one update
/// there instead of one per slot. A block becomes whole when one claim takes all of it, and
/// stops being whole (its entry is written to its slots) when a call touches only part of
/// it. A block that ends past the last slot is never whole.
#[derive(Debug, Clone)]
pub(crate) struct KeyColumns {
    /// Owner codes (`OWNER_*`).
    owner: Vec<u32>,
    version: Vec<u64>,
    /// Pending reads that captured this slot at its *current* version.
    readers: Vec<u32>,
    /// One bit per block: whether it is whole (small enough to stay in the L1 cache).
    whole: Vec<u64>,
    /// Per block: its entry, meaningful while it is whole.
    blocks: Vec<Entry>,
    block_size: usize,
    /// `log2(block_size)` when it is a power of two (a shift instead of a division).
    block_shift: Option<u32>,
}

/// `len` copies of `value`, or `None` when they cannot be allocated. The allocation is probed
/// first (`try_reserve_exact`, released at once), then made by `vec!`: for a zero `value`
/// that is fresh zero pages the system maps only when touched (16M slots: ~16 µs, not the
/// ~150 ms and 256 MiB of writing them out), for any other a fill.
pub(crate) fn filled<T: Clone>(len: usize, value: T) -> Option<Vec<T>> {
    let mut probe: Vec<T> = Vec::new();
    probe.try_reserve_exact(len).ok()?;
    drop(probe);
    Some(vec![value; len])
}

impl KeyColumns {
    /// `try_new`, for tests.
    #[cfg(test)]
    pub(crate) fn new(num_slots: usize, block_size: usize) -> Self {
        Self::try_new(num_slots, block_size).expect("allocating a key's ledger columns")
    }

    /// Host bytes of one key's columns for `num_slots` slots in blocks of `block_size` (`>= 1`):
    /// what [`KeyColumns::try_new`] allocates.
    pub(crate) fn bytes_for(num_slots: usize, block_size: usize) -> usize {
        let num_blocks = num_slots.div_ceil(block_size);
        num_slots * (size_of::<u32>() + size_of::<u64>() + size_of::<u32>())
            + num_blocks.div_ceil(64) * size_of::<u64>()
            + num_blocks * size_of::<Entry>()
    }

    /// Columns for `num_slots` slots in blocks of `block_size` (`>= 1`), every slot absent at
    /// version 0; `None` when the allocator cannot provide them (16 bytes per slot, and an
    /// entry per block), instead of aborting the process.
    pub(crate) fn try_new(num_slots: usize, block_size: usize) -> Option<Self> {
        let absent = Entry {
            owner: OWNER_ABSENT,
            version: 0,
            readers: 0,
        };
        let num_blocks = num_slots.div_ceil(block_size);
        let mut whole = filled(num_blocks.div_ceil(64), 0u64)?;
        for b in 0..num_slots / block_size {
            whole[b / 64] |= 1 << (b % 64);
        }
        Some(Self {
            owner: filled(num_slots, OWNER_ABSENT)?,
            version: filled(num_slots, 0)?,
            readers: filled(num_slots, 0)?,
            whole,
            blocks: filled(num_blocks, absent)?,
            block_size,
            block_shift: block_size
                .is_power_of_two()
                .then(|| block_size.trailing_zeros()),
        })
    }

    fn block_of(&self, slot: usize) -> usize {
        match self.block_shift {
            Some(shift) => slot >> shift,
            None => slot / self.block_size,
        }
    }

    /// The pieces of `run`, block by block, in slot order (one division per run).
    pub(crate) fn pieces(&self, run: Run) -> impl Iterator<Item = Piece> {
        let (mut lo, hi) = (run.start as usize, run.start as usize + run.len as usize);
        let (size, num_slots) = (self.block_size, self.owner.len());
        let mut block = self.block_of(lo);
        std::iter::from_fn(move || {
            (lo < hi).then(|| {
                let (block_start, block_end) = (block * size, (block + 1) * size);
                let end = hi.min(block_end);
                let piece = Piece {
                    block,
                    slots: lo..end,
                    whole: lo == block_start && end == block_end && block_end <= num_slots,
                };
                (lo, block) = (end, block + 1);
                piece
            })
        })
    }

    #[inline(always)]
    fn is_whole(&self, block: usize) -> bool {
        self.whole[block / 64] & (1 << (block % 64)) != 0
    }

    /// Makes `block` whole with every slot at `entry`.
    fn make_whole(&mut self, block: usize, entry: Entry) {
        self.whole[block / 64] |= 1 << (block % 64);
        self.blocks[block] = entry;
    }

    /// The entry of `block` if it is whole.
    #[inline(always)]
    pub(crate) fn whole_entry(&self, block: usize) -> Option<Entry> {
        self.is_whole(block).then(|| self.blocks[block])
    }

    /// The entry of one slot.
    pub(crate) fn entry(&self, slot: usize) -> Entry {
        self.whole_entry(self.block_of(slot)).unwrap_or(Entry {
            owner: self.owner[slot],
            version: self.version[slot],
            readers: self.readers[slot],
        })
    }

    /// Makes `block` per-slot: its summary is written to its slots.
    fn split(&mut self, block: usize) {
        if self.is_whole(block) {
            self.whole[block / 64] &= !(1 << (block % 64));
            let (e, start) = (self.blocks[block], block * self.block_size);
            let range = start..start + self.block_size;
            self.owner[range.clone()].fill(e.owner);
            self.version[range.clone()].fill(e.version);
            self.readers[range].fill(e.readers);
        }
    }

    /// Per-slot columns of a piece, its block made per-slot first.
    pub(crate) fn slots_of(&mut self, piece: &Piece) -> (&mut [u32], &mut [u64], &mut [u32]) {
        self.split(piece.block);
        let r = piece.slots.clone();
        (
            &mut self.owner[r.clone()],
            &mut self.version[r.clone()],
            &mut self.readers[r],
        )
    }

    /// The per-slot owners of `slots` (stale where their block is whole).
    pub(crate) fn slot_owners(&self, slots: Range<usize>) -> &[u32] {
        &self.owner[slots]
    }

    /// Per-slot columns of a piece of a block that is not whole, read-only.
    fn slot_columns(&self, slots: Range<usize>) -> (&[u32], &[u64], &[u32]) {
        (
            &self.owner[slots.clone()],
            &self.version[slots.clone()],
            &self.readers[slots],
        )
    }

    /// Claims `runs` for owner `me` at `version` (a version no claim gave these slots
    /// before): reports every slot that is stolen (held by another in-transit task) or must
    /// be preserved (a pending read captured it, and its row is committed or another task's)
    /// in `out`, in slot order, then takes them over.
    pub(crate) fn claim(
        &mut self,
        runs: &[Run],
        me: u32,
        version: u64,
        handles: &Handles,
        out: &mut ClaimOutcome,
    ) {
        let mine = Entry {
            owner: me,
            version,
            readers: 0,
        };
        for &run in runs {
            for piece in self.pieces(run) {
                if piece.whole {
                    if self.is_whole(piece.block) {
                        // (by reference: copying the entry out cost a store and a reload)
                        let before = &self.blocks[piece.block];
                        report_block(piece.slots.clone(), before, me, handles, out);
                    } else {
                        let (owner, version, readers) = self.slot_columns(piece.slots.clone());
                        let first = piece.slots.start;
                        report_slots(first, owner, version, readers, me, handles, out);
                    }
                    self.make_whole(piece.block, mine);
                } else {
                    let first = piece.slots.start;
                    let (owner, versions, readers) = self.slots_of(&piece);
                    report_slots(first, owner, versions, readers, me, handles, out);
                    owner.fill(me);
                    versions.fill(version);
                    readers.fill(0);
                }
            }
        }
    }

    /// Sets every slot of `runs` that `me` owns to owner `to`; returns how many.
    pub(crate) fn settle(&mut self, runs: &[Run], me: u32, to: u32) -> usize {
        let mut n = 0;
        for &run in runs {
            for piece in self.pieces(run) {
                if self.is_whole(piece.block) {
                    let owner = &mut self.blocks[piece.block].owner;
                    if *owner != me {
                        continue;
                    }
                    if piece.whole {
                        *owner = to;
                        n += piece.slots.len();
                        continue;
                    }
                }
                for o in self.slots_of(&piece).0 {
                    let mine = *o == me;
                    n += usize::from(mine);
                    *o = if mine { to } else { *o };
                }
            }
        }
        n
    }

    /// Registers one more pending read of `piece`'s slots at their current versions and
    /// returns their entries (before the registration): one for a whole block, else one per
    /// slot (`None`: read them from the returned per-slot columns).
    #[inline(always)]
    pub(crate) fn read_piece(&mut self, piece: &Piece) -> ReadOf<'_> {
        match self.whole_entry(piece.block) {
            Some(e) if piece.whole => {
                self.blocks[piece.block].readers += 1;
                ReadOf::Block(e)
            }
            _ => {
                let (owner, version, readers) = self.slots_of(piece);
                readers.iter_mut().for_each(|n| *n += 1);
                ReadOf::Slots(owner, version)
            }
        }
    }

    /// A pending read of `runs` is released: each slot still at the version its run
    /// captured has one reader fewer.
    pub(crate) fn release(&mut self, runs: &[ReadRun]) {
        for &ReadRun { run, version } in runs {
            for piece in self.pieces(run) {
                if self.is_whole(piece.block) {
                    let entry = &mut self.blocks[piece.block];
                    if entry.version != version {
                        // (A claim since gave the block a new version: no reader of this read.)
                        continue;
                    }
                    if piece.whole {
                        entry.readers = entry.readers.saturating_sub(1);
                        continue;
                    }
                }
                let (_, versions, readers) = self.slots_of(&piece);
                for (n, &v) in readers.iter_mut().zip(versions.iter()) {
                    // Branch-free, which the compiler vectorises.
                    *n = if v == version {
                        n.saturating_sub(1)
                    } else {
                        *n
                    };
                }
            }
        }
    }
}

/// Consecutive slots of a pending read, all captured at one version.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReadRun {
    pub(crate) run: Run,
    pub(crate) version: u64,
}

/// What [`KeyColumns::read_piece`] found: one entry for a whole block, or the piece's owner
/// and version columns.
pub(crate) enum ReadOf<'a> {
    Block(Entry),
    Slots(&'a [u32], &'a [u64]),
}

/// Reports the claim of a whole block whose slots all have entry `before` by owner `me`.
#[inline(always)]
fn report_block(
    slots: Range<usize>,
    before: &Entry,
    me: u32,
    handles: &Handles,
    out: &mut ClaimOutcome,
) {
    let other_task = before.owner >= OWNER_TASK_BASE && before.owner != me;
    // (Typically neither: nothing to report.)
    if other_task || (before.readers > 0 && before.owner == OWNER_POOL) {
        report_taken(slots, *before, other_task, handles, out);
    }
}

/// [`report_block`]'s reporting, out of line.
#[cold]
fn report_taken(
    slots: Range<usize>,
    before: Entry,
    other_task: bool,
    handles: &Handles,
    out: &mut ClaimOutcome,
) {
    if other_task {
        let from = handles.task(before.owner).0 as i64;
        out.stolen_slots.extend(slots.clone().map(|s| s as i64));
        out.stolen_from
            .extend(std::iter::repeat_n(from, slots.len()));
    }
    if before.readers > 0 && (before.owner == OWNER_POOL || other_task) {
        let from = handles.source(before.owner).code();
        out.preserve_versions
            .extend(std::iter::repeat_n(before.version, slots.len()));
        out.preserve_from
            .extend(std::iter::repeat_n(from, slots.len()));
        out.preserve_slots.extend(slots.map(|s| s as i64));
    }
}

/// Reports the claim by owner `me` of the slots `first..` with these per-slot columns.
fn report_slots(
    first: usize,
    owner: &[u32],
    version: &[u64],
    readers: &[u32],
    me: u32,
    handles: &Handles,
    out: &mut ClaimOutcome,
) {
    // Typically nothing is reported: one owner throughout (nobody, the pool or this task)
    // and no pending reader. Both folds are plain bit operations, which the compiler
    // vectorises.
    let Some(&o0) = owner.first() else { return };
    let uniform = owner.iter().fold(0, |diff, &o| diff | (o ^ o0)) == 0;
    let read = readers.iter().fold(0, |any, &n| any | n) != 0;
    if uniform && !read && !(o0 >= OWNER_TASK_BASE && o0 != me) {
        return;
    }
    for (i, (&o, &n)) in owner.iter().zip(readers).enumerate() {
        let before = Entry {
            owner: o,
            version: version[i],
            readers: n,
        };
        report_block(first + i..first + i + 1, &before, me, handles, out);
    }
}

#[cfg(all(test, not(loom)))]
#[path = "slot_columns_tests.rs"]
mod tests;
