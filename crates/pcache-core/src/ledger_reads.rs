//! The ledger's read side: planning a hit's read of slots, checking later which of its rows
//! moved, and releasing it. A pending read holds its slots' captured versions, so a claim of
//! one of those committed slots reports it for copy-on-write (see the parent module).

use super::Ledger;
use crate::error::{Error, Result};
use crate::ids::{KeyId, ReadId};
use crate::ledger_outcomes::{ReadPlan, Sources};
use crate::slot_columns::{ReadOf, ReadRun, OWNER_ABSENT};
use crate::slot_runs::{split_runs, RawSlot, Run};

#[derive(Debug, Clone)]
pub(super) struct PendingRead {
    key: KeyId,
    /// The read's slots, in order, in runs of slots captured at one version.
    runs: Vec<ReadRun>,
    /// Positions (ascending) whose slot had no row when the read was planned; every other
    /// position captured a row, and the read sees it vanish if the slot becomes absent.
    captured_absent: Vec<usize>,
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

impl Ledger {
    /// Where each slot's row of `key` is now and at which version, without registering a read.
    pub fn peek<S: RawSlot>(&self, slots: &[S], key: KeyId) -> Result<(Vec<i64>, Vec<u64>)> {
        self.check_key(key)?;
        self.check_slots(slots)?;
        let cols = &self.keys[key.0 as usize];
        let entries: Vec<_> = slots
            .iter()
            .map(|s| cols.entry(s.to_i64() as usize))
            .collect();
        let sources = (entries.iter())
            .map(|e| self.handles.source(e.owner).code())
            .collect();
        Ok((sources, entries.iter().map(|e| e.version).collect()))
    }

    /// Plans a read of `slots` of `key`: per slot its source (see [`ReadPlan`]), registered
    /// with the versions it captured as a pending read until [`Ledger::release`]. A later
    /// claim of a committed slot still at the captured version reports it in
    /// `preserve_slots`. The same slot may appear twice.
    pub fn plan_read<S: RawSlot>(&mut self, slots: &[S], key: KeyId) -> Result<ReadPlan> {
        self.check_key(key)?;
        let runs = split_runs(slots, self.num_slots)?;
        let cols = &mut self.keys[key.0 as usize];
        let handles = &self.handles;
        let code = |owner| handles.source(owner).code();
        let mut sources = Sources::new(slots.len());
        let mut read_runs = Vec::with_capacity(runs.len());
        let mut captured_absent = Vec::new();
        for run in runs {
            for piece in cols.pieces(run) {
                let (len, position) = (piece.slots.len(), sources.len);
                let run = Run {
                    start: piece.slots.start as u32,
                    len: len as u32,
                };
                match cols.read_piece(&piece) {
                    ReadOf::Block(e) => {
                        if e.owner == OWNER_ABSENT {
                            captured_absent.extend(position..position + len);
                        }
                        sources.push_same(code(e.owner), len);
                        read_runs.push(ReadRun {
                            run,
                            version: e.version,
                        });
                    }
                    ReadOf::Slots(owner, version) => {
                        // Typically one owner and one version throughout; both checks are
                        // branch-free folds, which the compiler vectorises.
                        let (first, v0) = (owner[0], version[0]);
                        let same_owner = owner.iter().fold(0, |diff, &o| diff | (o ^ first)) == 0;
                        let same_version = version.iter().fold(0, |diff, &v| diff | (v ^ v0)) == 0;
                        if same_owner {
                            if first == OWNER_ABSENT {
                                captured_absent.extend(position..position + len);
                            }
                            sources.push_same(code(first), len);
                        } else {
                            let absent =
                                (position..).zip(owner).filter(|&(_, &o)| o == OWNER_ABSENT);
                            captured_absent.extend(absent.map(|(p, _)| p));
                            sources.push_each(owner.iter().map(|&o| code(o)));
                        }
                        if same_version {
                            read_runs.push(ReadRun { run, version: v0 });
                        } else {
                            push_read_runs(&mut read_runs, run, version);
                        }
                    }
                }
            }
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
            len: sources.len,
            sources: sources.finish(),
        })
    }

    /// The version each position of a pending read captured, in the read's slot order (what a
    /// row kept aside for it is keyed by).
    pub fn captured_versions(&self, read: ReadId) -> Result<Vec<u64>> {
        let r = self.reads.get(&read).ok_or(Error::UnknownRead { read })?;
        let runs = r.runs.iter();
        Ok(runs
            .flat_map(|rr| std::iter::repeat_n(rr.version, rr.run.len as usize))
            .collect())
    }

    /// Positions (in the read's slot order) whose captured version is not `versions`' entry
    /// there, or whose entry is 0: the rows a prefetch did not vouch for at the version this
    /// read captured (see [`crate::prefetch`]). Refuses `versions` of another length than the
    /// read's.
    pub fn unvouched(&self, read: ReadId, versions: &[u64]) -> Result<Vec<i64>> {
        let r = self.reads.get(&read).ok_or(Error::UnknownRead { read })?;
        let len: usize = r.runs.iter().map(|rr| rr.run.len as usize).sum();
        if versions.len() != len {
            return Err(Error::InvalidInput {
                what: format!("{} versions for a read of {len} slots", versions.len()),
            });
        }
        let mut out = Vec::new();
        let mut position = 0;
        for rr in &r.runs {
            let end = position + rr.run.len as usize;
            let run = &versions[position..end];
            // (0 marks a row not vouched for, even where the read captured no row: version 0)
            if run.iter().any(|&v| v != rr.version || v == 0) {
                let stale =
                    (position..end).filter(|&p| versions[p] != rr.version || versions[p] == 0);
                out.extend(stale.map(|p| p as i64));
            }
            position = end;
        }
        Ok(out)
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
            for piece in cols.pieces(rr.run) {
                let end = position + piece.slots.len();
                if let Some(e) = cols.whole_entry(piece.block) {
                    if e.version == rr.version && e.owner != OWNER_ABSENT {
                        // Nothing moved. (No position here was captured absent: a slot gets a
                        // row only from a claim, which gives it a new version.)
                        while captured_absent.next_if(|&p| p < end).is_some() {}
                        position = end;
                        continue;
                    }
                }
                for slot in piece.slots {
                    let was_absent = captured_absent.next_if_eq(&position).is_some();
                    let now = cols.entry(slot);
                    let vanished = now.owner == OWNER_ABSENT && !was_absent;
                    if now.version != rr.version || vanished {
                        moved.push(position as i64);
                    }
                    position += 1;
                }
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
        self.keys[r.key.0 as usize].release(&r.runs);
        Ok(())
    }

    /// Pending reads holding each slot of `key` at its current version (diagnostics, tests).
    pub fn readers<S: RawSlot>(&self, slots: &[S], key: KeyId) -> Result<Vec<u32>> {
        self.check_key(key)?;
        self.check_slots(slots)?;
        let cols = &self.keys[key.0 as usize];
        Ok(slots
            .iter()
            .map(|s| cols.entry(s.to_i64() as usize).readers)
            .collect())
    }
}
