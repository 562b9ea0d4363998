//! Slot lists as runs of consecutive ids: validation (range and duplicates) and the run
//! decomposition the ledger's per-run loops walk. The engine hands out slots in blocks of
//! consecutive ids, so a 16,384-slot list is typically 1,024 runs of 16; a scattered list
//! degrades to runs of one.

use std::ops::Range;

use crate::error::{Error, Result};

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

/// A run of consecutive slot ids `start, start + 1, .., start + len - 1` (`len >= 1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) start: u32,
    pub(crate) len: u32,
}

impl Run {
    pub(crate) fn range(self) -> Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
}

/// Collects slot ids, in order, into maximal runs of consecutive ids.
#[derive(Default)]
pub(crate) struct RunBuilder {
    runs: Vec<Run>,
    /// The current run, `start..end`; empty (`start == end`) before the first id.
    start: u32,
    end: u32,
}

impl RunBuilder {
    /// Adds the ids `first..first + len` (`first + len <= num_slots`, so no overflow).
    pub(crate) fn add(&mut self, first: u32, len: u32) {
        if first != self.end || self.start == self.end {
            self.finish_run();
            self.start = first;
        }
        self.end = first + len;
    }

    pub(crate) fn finish_run(&mut self) {
        if self.end != self.start {
            self.runs.push(Run {
                start: self.start,
                len: self.end - self.start,
            });
        }
    }

    pub(crate) fn finish(mut self) -> Vec<Run> {
        self.finish_run();
        self.runs
    }
}

/// Slots checked at once by [`blocks_to_runs`]'s fast path: a wide chunk first (a block of
/// 16 or more slots in one check), then a narrow one.
pub(crate) const WIDE_CHUNK: usize = 16;
pub(crate) const CHUNK: usize = 8;

/// Slots [`split_runs`] looks at to tell a list of blocks from a scattered one.
pub(crate) const SAMPLE: usize = 64;

/// Checks that every slot is in `[0, num_slots)` and splits the list into runs of
/// consecutive ids, in list order. The error is for the first bad position, as
/// [`Error::SlotOutOfRange`] documents.
///
/// Runs need not be maximal: a list whose first [`SAMPLE`] slots are mostly not consecutive
/// is taken slot by slot (one run each), which is several times cheaper for a scattered
/// list than looking for runs that are not there.
pub(crate) fn split_runs<S: RawSlot>(slots: &[S], num_slots: u32) -> Result<Vec<Run>> {
    let sample = &slots[..slots.len().min(SAMPLE)];
    let next = |w: &[S]| w[1].to_i64() == w[0].to_i64().wrapping_add(1);
    let links = sample.windows(2).filter(|w| next(w)).count();
    if 2 * links < sample.len() {
        slots_to_runs(slots, num_slots)
    } else {
        blocks_to_runs(slots, num_slots)
    }
}

/// [`split_runs`] for a scattered list: one run per slot.
pub(crate) fn slots_to_runs<S: RawSlot>(slots: &[S], num_slots: u32) -> Result<Vec<Run>> {
    let limit = u64::from(num_slots);
    // Bit 63 of `s | !(s - limit)` is set iff `s` (negative ids wrap to huge ones) is not
    // below `limit <= 2^32`: a branch-free range check, which the compiler vectorises.
    let outside = slots.iter().fold(0, |acc, s| {
        let s = s.to_i64() as u64;
        acc | s | !s.wrapping_sub(limit)
    });
    if outside >> 63 != 0 {
        let position = (slots.iter())
            .position(|s| s.to_i64() as u64 >= limit)
            .unwrap_or(0);
        return Err(Error::SlotOutOfRange {
            slot: slots[position].to_i64(),
            position,
            num_slots,
        });
    }
    let run = |s: &S| Run {
        start: s.to_i64() as u32,
        len: 1,
    };
    Ok(slots.iter().map(run).collect())
}

/// The first id of `slots[position..position + N]` if those `N` ids are consecutive and in
/// `[0, num_slots)` (branch-free checks over a fixed length, which the compiler unrolls).
#[inline(always)]
fn consecutive<S: RawSlot, const N: usize>(
    slots: &[S],
    position: usize,
    num_slots: u32,
) -> Option<u32> {
    let chunk: &[S; N] = slots.get(position..position + N)?.try_into().ok()?;
    let first = chunk[0].to_i64();
    let in_range = 0 <= first && first <= i64::from(num_slots) - N as i64;
    let steps = (chunk.iter().zip(0..)).fold(0, |diff, (s, k)| {
        diff | (s.to_i64().wrapping_sub(first) ^ k)
    });
    (in_range && steps == 0).then_some(first as u32)
}

/// [`split_runs`] for a list of blocks: maximal runs. A chunk of [`WIDE_CHUNK`] or [`CHUNK`]
/// consecutive in-range ids is taken whole; anything else (a run boundary, a bad id) goes
/// one slot at a time.
pub(crate) fn blocks_to_runs<S: RawSlot>(slots: &[S], num_slots: u32) -> Result<Vec<Run>> {
    let mut runs = RunBuilder {
        // (a run per block of 16, the engine's usual size, without regrowing)
        runs: Vec::with_capacity(slots.len() / WIDE_CHUNK + 1),
        ..RunBuilder::default()
    };
    let mut position = 0;
    while position < slots.len() {
        if let Some(first) = consecutive::<S, WIDE_CHUNK>(slots, position, num_slots) {
            runs.add(first, WIDE_CHUNK as u32);
            position += WIDE_CHUNK;
            continue;
        }
        if let Some(first) = consecutive::<S, CHUNK>(slots, position, num_slots) {
            runs.add(first, CHUNK as u32);
            position += CHUNK;
            continue;
        }
        let slot = slots[position].to_i64();
        // A negative id wraps to a huge unsigned one: one comparison covers both ends.
        if slot as u64 >= u64::from(num_slots) {
            return Err(Error::SlotOutOfRange {
                slot,
                position,
                num_slots,
            });
        }
        runs.add(slot as u32, 1);
        position += 1;
    }
    Ok(runs.finish())
}

/// The (word index, bit mask) pairs covering `run` in a bitmap of one bit per slot.
pub(crate) fn run_words(run: Run) -> impl Iterator<Item = (usize, u64)> {
    let (mut lo, hi) = (run.start as usize, run.start as usize + run.len as usize);
    std::iter::from_fn(move || {
        (lo < hi).then(|| {
            let word = lo / 64;
            let end = hi.min((word + 1) * 64);
            let width = end - lo;
            let mask = if width == 64 {
                u64::MAX
            } else {
                ((1u64 << width) - 1) << (lo % 64)
            };
            lo = end;
            (word, mask)
        })
    })
}

/// Checks that no slot appears twice in a claim, given its runs. `seen` is a bitmap of one
/// bit per slot, all clear on entry and left all clear. The error names the earliest
/// position whose slot appeared before (and where it first appeared), as a slot-by-slot
/// check would.
pub(crate) fn check_unique<S: RawSlot>(seen: &mut [u64], runs: &[Run], slots: &[S]) -> Result<()> {
    let is_set = |seen: &[u64], s: u32| seen[s as usize / 64] & (1 << (s % 64)) != 0;
    // Marks each run, up to the first with a slot marked before (the slots within a run are
    // distinct, so a repeat is a bit an earlier run set).
    let mut position = 0;
    let repeat = runs.iter().position(|&run| {
        let (word, last_word) = (run.start / 64, (run.start + run.len - 1) / 64);
        let repeat = if word == last_word {
            // (one word: a block of 64 or fewer slots that does not straddle a word)
            let mask = (u64::MAX >> (64 - run.len)) << (run.start % 64);
            let repeat = seen[word as usize] & mask != 0;
            seen[word as usize] |= if repeat { 0 } else { mask };
            repeat
        } else {
            let repeat = run_words(run).any(|(w, mask)| seen[w] & mask != 0);
            if !repeat {
                run_words(run).for_each(|(w, mask)| seen[w] |= mask);
            }
            repeat
        };
        position += if repeat { 0 } else { run.len as usize };
        repeat
    });
    let verdict = match repeat {
        None => Ok(()),
        Some(i) => {
            let run = runs[i];
            let offset = (0..run.len)
                .find(|&j| is_set(seen, run.start + j))
                .unwrap_or(0);
            let slot = run.start + offset;
            let first = slots
                .iter()
                .position(|x| x.to_i64() == i64::from(slot))
                .unwrap_or(0);
            Err(Error::DuplicateSlot {
                slot,
                first,
                second: position + offset as usize,
            })
        }
    };
    let marked = &runs[..repeat.unwrap_or(runs.len())];
    if marked.len() >= seen.len() / 16 {
        // Many runs: clearing the whole bitmap (one bit per slot) is cheaper than run by run.
        seen.fill(0);
    } else {
        for &run in marked {
            run_words(run).for_each(|(w, mask)| seen[w] &= !mask);
        }
    }
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A claim's check as the ledger makes it: the slots split into runs, then checked
    /// against `seen` (a bitmap of `seen.len() * 64` slots).
    fn check(seen: &mut [u64], slots: &[i64]) -> Result<()> {
        let runs = split_runs(slots, (seen.len() * 64) as u32)?;
        check_unique(seen, &runs, slots)
    }

    fn duplicate(result: Result<()>) -> (u32, usize, usize) {
        match result {
            Err(Error::DuplicateSlot {
                slot,
                first,
                second,
            }) => (slot, first, second),
            other => panic!("expected a duplicate slot, got {other:?}"),
        }
    }

    /// Runs of consecutive blocks cross the bitmap's 64-slot words; a repeat of one of their
    /// slots is found wherever the run starts, and a claim of a few runs in a large bitmap
    /// (where each run clears its own bits rather than the whole map) leaves it all clear,
    /// refused or not, so the next claim of the same slots is not taken for a repeat.
    #[test]
    fn repeats_within_runs_across_words_are_found_and_the_bitmap_is_left_clear() {
        let mut seen = vec![0u64; 4096 / 64];
        let clear = |seen: &[u64]| seen.iter().all(|&w| w == 0);
        // one run over two words (48..80), then a repeat of its slot 70
        let slots: Vec<i64> = (48..80).chain([70]).collect();
        assert_eq!(duplicate(check(&mut seen, &slots)), (70, 22, 32));
        assert!(clear(&seen), "left clear after a refusal");
        // a run of a word's length starting at 66 (words 1 and 2), then its last slot again
        let slots: Vec<i64> = (66..130).chain([129]).collect();
        assert_eq!(duplicate(check(&mut seen, &slots)), (129, 63, 64));
        assert!(clear(&seen));
        // a run covering word 1 whole (60..140), then a repeat inside that word
        let slots: Vec<i64> = (60..140).chain([100]).collect();
        assert_eq!(duplicate(check(&mut seen, &slots)), (100, 40, 80));
        assert!(clear(&seen));
        // no repeat: accepted, and accepted again, the bitmap clear after each
        let slots: Vec<i64> = (48..80).chain(200..216).chain([3]).collect();
        for _ in 0..2 {
            check(&mut seen, &slots).expect("distinct slots");
            assert!(clear(&seen), "left clear after an accepted claim");
        }
    }
}
