//! What ledger calls hand back: where a row is ([`Source`] and its numeric codes), what a
//! claim found ([`ClaimOutcome`]) and a registered read ([`ReadPlan`], its per-slot sources
//! built by `Sources`); plain data.

use crate::ids::{ReadId, TaskId};

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

/// A registered pending read: per slot, where the row was. (The versions it captured stay in
/// the ledger: `Ledger::captured_versions`.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    /// The read's id; release it when the rows have been served.
    pub read: ReadId,
    /// Slots read.
    pub len: usize,
    /// Per slot: [`SOURCE_ABSENT`], [`SOURCE_POOL`] or the id of the in-transit task; `None`
    /// when every row is in the pool (the usual hit), which needs nothing per slot.
    pub sources: Option<Vec<i64>>,
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
    /// Per slot: [`SOURCE_ABSENT`], [`SOURCE_POOL`] or the id of the in-transit task.
    pub fn source_codes(&self) -> Vec<i64> {
        match &self.sources {
            Some(sources) => sources.clone(),
            None => vec![SOURCE_POOL; self.len],
        }
    }

    fn count(&self, code: i64) -> usize {
        let sources = self.sources.iter().flatten();
        sources.filter(|&&s| s == code).count()
    }

    /// Slots never written (a read of them cannot be served).
    pub fn num_absent(&self) -> usize {
        self.count(SOURCE_ABSENT)
    }

    /// Slots whose rows are committed in the pool.
    pub fn num_from_pool(&self) -> usize {
        match self.sources {
            Some(_) => self.count(SOURCE_POOL),
            None => self.len,
        }
    }

    /// The in-transit tasks the read waits for, ascending, each once.
    pub fn tasks(&self) -> Vec<TaskId> {
        let mut tasks: Vec<u64> = (self.sources.iter().flatten())
            .filter(|&&s| s >= 0)
            .map(|&s| s as u64)
            .collect();
        tasks.sort_unstable();
        tasks.dedup();
        tasks.into_iter().map(TaskId).collect()
    }
}

/// The per-slot sources of a read being planned: none kept while every row so far is in the
/// pool (the usual hit), so such a read writes nothing per slot.
pub(crate) struct Sources {
    codes: Vec<i64>,
    /// Slots added so far.
    pub(crate) len: usize,
    all_pool: bool,
    capacity: usize,
}

impl Sources {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            codes: Vec::new(),
            len: 0,
            all_pool: true,
            capacity,
        }
    }

    /// From the first row not in the pool on, every slot's code is kept.
    fn keep_codes(&mut self) {
        if self.all_pool {
            self.all_pool = false;
            self.codes.reserve(self.capacity);
            self.codes.resize(self.len, SOURCE_POOL);
        }
    }

    /// `n` slots with source `code`.
    #[inline]
    pub(crate) fn push_same(&mut self, code: i64, n: usize) {
        if !(self.all_pool && code == SOURCE_POOL) {
            self.keep_codes();
            self.codes.extend(std::iter::repeat_n(code, n));
        }
        self.len += n;
    }

    /// Slots with these sources, not all in the pool.
    pub(crate) fn push_each(&mut self, codes: impl ExactSizeIterator<Item = i64>) {
        self.keep_codes();
        self.len += codes.len();
        self.codes.extend(codes);
    }

    pub(crate) fn finish(self) -> Option<Vec<i64>> {
        (!self.all_pool).then_some(self.codes)
    }
}
