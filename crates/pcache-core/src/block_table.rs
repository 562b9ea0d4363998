//! Block tables: a request's KV block ids as the engine hands them over, checked against the
//! KV cache size, and the slot ids of a span of token positions under a table.
//!
//! Engine thread only; pure functions over borrowed slices. A position `p` of a request lives
//! in slot `table[p / block_size] * block_size + p % block_size`.

use crate::error::{Error, Result};

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

/// Checks that every slot id is in `[0, num_slots)`; reports the first one that is not (the
/// engine's slot mapping is checked with it at every save).
pub fn check_slot_ids(slots: &[i64], num_slots: u32) -> Result<()> {
    first_out_of_range(slots, num_slots).map_or(Ok(()), |position| {
        Err(Error::SlotOutOfRange {
            slot: slots[position],
            position,
            num_slots,
        })
    })
}

/// Slot ids of positions `start..stop` under `blocks` (already checked), in position order.
/// Refuses a span that runs past the table or a zero block size.
pub fn slots_of(blocks: &[i64], start: usize, stop: usize, block_size: u32) -> Result<Vec<i64>> {
    let bs = block_size as usize;
    if bs == 0 || start > stop || stop > blocks.len() * bs {
        return Err(Error::InvalidInput {
            what: format!(
                "positions {start}..{stop} do not fit a table of {} blocks of {block_size}",
                blocks.len()
            ),
        });
    }
    let mut out = Vec::with_capacity(stop - start);
    let mut pos = start;
    while pos < stop {
        let (block, offset) = (pos / bs, pos % bs);
        let run = (bs - offset).min(stop - pos);
        let first = blocks[block] * i64::from(block_size) + offset as i64;
        out.extend(first..first + run as i64);
        pos += run;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
