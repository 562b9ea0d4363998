//! Block tables: a request's KV block ids as the engine hands them over, checked against the
//! KV cache size, and the slot ids of a span of token positions under a table.
//!
//! Engine thread only; pure functions over borrowed slices. A position `p` of a request lives
//! in slot `table[p / block_size] * block_size + p % block_size`.

use std::cell::RefCell;

use crate::error::{Error, Result};
use crate::slot_columns::filled;

/// Position of the first id outside `[0, limit)`, if any (one pass, no allocation).
fn first_out_of_range(ids: &[i64], limit: u32) -> Option<usize> {
    ids.iter().position(|&id| id < 0 || id >= i64::from(limit))
}

/// Checks that every block id is in `[0, num_blocks)`; reports the first one that is not.
pub fn check_block_ids(blocks: &[i64], num_blocks: u32) -> Result<()> {
    first_out_of_range(blocks, num_blocks).map_or(Ok(()), |position| {
        Err(Error::BlockOutOfRange {
            block: blocks[position],
            position,
            num_blocks,
        })
    })
}

/// Checks that every slot id is in `[0, num_slots)` and appears once; reports the first one
/// that is not (the engine's slot mapping is checked with it at every save, before anything
/// changes: a step's rows go to distinct slots).
pub fn check_slot_ids(slots: &[i64], num_slots: u32) -> Result<()> {
    if let Some(position) = first_out_of_range(slots, num_slots) {
        return Err(Error::SlotOutOfRange {
            slot: slots[position],
            position,
            num_slots,
        });
    }
    first_repeat(slots, num_slots).map_or(Ok(()), |(first, second)| {
        Err(Error::DuplicateSlot {
            slot: slots[second] as u32,
            first,
            second,
        })
    })
}

thread_local! {
    /// The bitmap `first_repeat` marks slots in, kept per thread between calls (all zero
    /// between them): one allocation of `num_slots / 8` bytes, not one per save (2 MiB at
    /// 16M slots, whose zeroing alone was ~18 µs per save).
    static SEEN: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Positions of the first slot seen twice, if any (`slots` in range). One bit per slot in
/// this thread's `SEEN` bitmap, set while scanning and cleared after, so a call costs what
/// it touches; by sorting instead when the bitmap cannot be allocated.
fn first_repeat(slots: &[i64], num_slots: u32) -> Option<(usize, usize)> {
    if slots.len() < 2 {
        return None;
    }
    let words = (num_slots as usize).div_ceil(64);
    SEEN.with(|seen| {
        let mut seen = seen.borrow_mut();
        if seen.len() < words {
            // (all zero between calls: replaced by fresh zero pages, touched only where used)
            match filled(words, 0u64) {
                Some(bigger) => *seen = bigger,
                None => return first_repeat_sorted(slots),
            }
        }
        let mut found = None;
        let mut scanned = slots.len();
        for (second, &slot) in slots.iter().enumerate() {
            let (word, bit) = (slot as usize / 64, 1u64 << (slot % 64));
            if seen[word] & bit != 0 {
                let first = slots.iter().position(|&s| s == slot).unwrap_or(0);
                found = Some((first, second));
                scanned = second;
                break;
            }
            seen[word] |= bit;
        }
        for &slot in &slots[..scanned] {
            seen[slot as usize / 64] = 0;
        }
        found
    })
}

/// `first_repeat` without a bitmap: the positions sorted by slot, then the repeat whose
/// second occurrence comes first.
fn first_repeat_sorted(slots: &[i64]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&i| (slots[i], i));
    let second = order
        .windows(2)
        .filter(|pair| slots[pair[0]] == slots[pair[1]])
        .map(|pair| pair[1])
        .min()?;
    let first = slots.iter().position(|&s| s == slots[second]).unwrap_or(0);
    Some((first, second))
}

/// Slot ids of positions `start..stop` under `blocks`, in position order. Refuses a span that
/// runs past the table, a zero block size, and a block id whose slots are not representable
/// (negative, or past `i64` once multiplied by the block size).
pub fn slots_of(blocks: &[i64], start: usize, stop: usize, block_size: u32) -> Result<Vec<i64>> {
    let bs = block_size as usize;
    if bs == 0 || start > stop || blocks.len().checked_mul(bs).is_none_or(|len| stop > len) {
        return Err(Error::InvalidInput {
            what: format!(
                "positions {start}..{stop} do not fit a table of {} blocks of {block_size}",
                blocks.len()
            ),
        });
    }
    let last_slot = |b: i64| {
        b.checked_mul(i64::from(block_size))?
            .checked_add(i64::from(block_size) - 1)
    };
    let touched = &blocks[start / bs..stop.div_ceil(bs)];
    if let Some(i) = touched
        .iter()
        .position(|&b| b < 0 || last_slot(b).is_none())
    {
        return Err(Error::InvalidInput {
            what: format!(
                "block id {} at position {} has no slots of {block_size}",
                touched[i],
                start / bs + i
            ),
        });
    }
    let mut out = Vec::new();
    if out.try_reserve_exact(stop - start).is_err() {
        return Err(Error::InvalidInput {
            what: format!("the slots of positions {start}..{stop} cannot be allocated"),
        });
    }
    let mut pos = start;
    while pos < stop {
        let (block, offset) = (pos / bs, pos % bs);
        let run = (bs - offset).min(stop - pos);
        let first = blocks[block] * i64::from(block_size) + offset as i64;
        // (inclusive: the run's last slot fits, checked above; one past it may not)
        out.extend(first..=first + (run as i64 - 1));
        pos += run;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_whose_last_slot_is_i64_max_gives_every_slot() {
        let b = i64::MAX / 16; // its last slot, b * 16 + 15, is i64::MAX
        let slots = slots_of(&[b], 0, 16, 16).unwrap();
        assert_eq!(slots.len(), 16);
        assert_eq!(*slots.last().unwrap(), i64::MAX);
    }

    #[test]
    fn slots_follow_the_table_across_block_edges() {
        let slots = slots_of(&[7, 2, 5], 3, 10, 4).unwrap();
        assert_eq!(slots, vec![31, 8, 9, 10, 11, 20, 21]);
        assert!(slots_of(&[7, 2, 5], 4, 4, 4).unwrap().is_empty());
    }

    #[test]
    fn spans_past_the_table_are_refused() {
        assert!(matches!(
            slots_of(&[1, 2], 0, 9, 4),
            Err(Error::InvalidInput { .. })
        ));
        assert!(slots_of(&[1, 2], 5, 3, 4).is_err());
        assert!(slots_of(&[1], 0, 1, 0).is_err());
    }

    #[test]
    fn block_ids_without_representable_slots_are_refused() {
        let err = slots_of(&[1, -3], 0, 8, 4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid input: block id -3 at position 1 has no slots of 4"
        );
        assert!(slots_of(&[1 << 62], 0, 4, 16).is_err());
        assert_eq!(slots_of(&[1, -3], 0, 4, 4).unwrap(), vec![4, 5, 6, 7]);
    }

    #[test]
    fn a_slot_listed_twice_is_reported_with_both_positions() {
        assert!(check_slot_ids(&[5], 8).is_ok());
        assert!(check_slot_ids(&[0, 1, 7, 2], 8).is_ok());
        let err = check_slot_ids(&[3, 0, 1, 0], 8).unwrap_err();
        assert_eq!(
            err.to_string(),
            "slot id 0 appears twice (positions 1 and 3)"
        );
        assert!(check_slot_ids(&[0, 64, 129, 64], 130).is_err());
    }

    #[test]
    fn the_bitmap_is_left_clear_after_a_repeat_and_across_table_sizes() {
        // A repeat found mid-scan leaves no bit behind: the same slots without it pass.
        assert!(check_slot_ids(&[3, 70, 9, 70, 5], 128).is_err());
        assert!(check_slot_ids(&[3, 70, 9, 5], 128).is_ok());
        assert!(check_slot_ids(&[127, 3], 128).is_ok());
        // A larger KV cache grows the bitmap; a smaller one uses its front.
        assert!(check_slot_ids(&[1 << 20, 3, 1 << 20], 1 << 21).is_err());
        assert!(check_slot_ids(&[1 << 20, 3], 1 << 21).is_ok());
        assert!(check_slot_ids(&[3, 5, 3], 8).is_err());
        assert!(check_slot_ids(&[3, 5], 8).is_ok());
    }

    proptest::proptest! {
        #[test]
        fn bitmap_and_sorting_find_the_same_first_repeat(
            slots in proptest::collection::vec(0i64..40, 0..30),
        ) {
            let by_bitmap = first_repeat(&slots, 40);
            proptest::prop_assert_eq!(by_bitmap, first_repeat_sorted(&slots));
            // (the reference: the earliest second occurrence, with its value's first position)
            let second = (1..slots.len()).find(|&j| slots[..j].contains(&slots[j]));
            let expected = second.map(|j| (slots.iter().position(|&s| s == slots[j]).unwrap(), j));
            proptest::prop_assert_eq!(by_bitmap, expected);
            proptest::prop_assert_eq!(first_repeat(&slots, 40), expected, "the bitmap was left clear");
        }
    }

    #[test]
    fn first_out_of_range_slot_is_reported() {
        assert!(check_slot_ids(&[], 4).is_ok());
        assert!(check_slot_ids(&[0, 3], 4).is_ok());
        let err = check_slot_ids(&[2, 4, -1], 4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "slot id 4 at position 1 is out of range [0, 4)"
        );
        assert!(check_slot_ids(&[-1], 4).is_err());
    }

    #[test]
    fn first_out_of_range_block_is_reported() {
        assert!(check_block_ids(&[0, 3], 4).is_ok());
        let err = check_block_ids(&[0, 4, -1], 4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "block id 4 at position 1 is out of range [0, 4)"
        );
    }

    #[test]
    fn only_the_blocks_a_span_touches_are_checked_and_block_zero_is_a_block() {
        // A span starting in the third block ignores a bad id in the first two.
        assert_eq!(
            slots_of(&[-1, -1, 0, 3], 8, 14, 4).unwrap(),
            vec![0, 1, 2, 3, 12, 13]
        );
        assert_eq!(slots_of(&[0], 1, 3, 4).unwrap(), vec![1, 2]);
    }
}
