//! A step's batch checked before anything changes (the engine thread, at every save): its
//! token count against the staging page, and its slot mapping, copied to int64, against the
//! KV cache (every slot in range and named once). Also each request's first row in the step.

use crate::block_table::check_slot_ids;
use crate::error::Error;
use crate::slot_runs::RawSlot;

/// Why a batch was refused (nothing was changed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// More scheduled tokens than a staging page holds.
    #[error(
        "a step of {tokens} tokens exceeds staging_capacity_tokens={capacity}; size it to the \
         scheduler's max_num_batched_tokens"
    )]
    TooManyTokens { tokens: usize, capacity: usize },

    /// Fewer slot ids than scheduled tokens.
    #[error("slot_mapping has {entries} entries for {tokens} scheduled tokens")]
    ShortSlotMapping { entries: usize, tokens: usize },

    /// A slot id out of range, or named twice.
    #[error("slot_mapping: {0}")]
    Slots(Error),
}

/// A checked batch of `n` rows: request `i` has rows `starts[i] .. starts[i] + counts[i]`, and
/// row `r` goes to slot `slots[r]` (the mapping's first `n` entries; padding is dropped).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchRows {
    pub n: usize,
    pub starts: Vec<usize>,
    pub slots: Vec<i64>,
}

/// Checks a step of per-request token `counts` whose rows go to `mapping` (the engine's slot
/// mapping, possibly padded past the scheduled tokens), against a staging page of `capacity`
/// rows and a KV cache of `num_slots` slots. Checks in that order and reports the first problem.
pub fn check_batch<S: RawSlot>(
    counts: &[usize],
    mapping: &[S],
    capacity: usize,
    num_slots: u32,
) -> Result<BatchRows, BatchError> {
    let mut starts = Vec::with_capacity(counts.len());
    let mut n = 0usize;
    for &count in counts {
        starts.push(n);
        n = n.saturating_add(count);
    }
    if n > capacity {
        return Err(BatchError::TooManyTokens {
            tokens: n,
            capacity,
        });
    }
    if mapping.len() < n {
        return Err(BatchError::ShortSlotMapping {
            entries: mapping.len(),
            tokens: n,
        });
    }
    let slots: Vec<i64> = mapping[..n].iter().map(|s| s.to_i64()).collect();
    check_slot_ids(&slots, num_slots).map_err(BatchError::Slots)?;
    Ok(BatchRows { n, starts, slots })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_follow_the_counts_and_padding_is_dropped() {
        let rows = check_batch(&[2, 0, 3], &[10i64, 11, 4, 5, 6, 7, 7], 8, 16).unwrap();
        assert_eq!(rows.n, 5);
        assert_eq!(rows.starts, vec![0, 2, 2]);
        assert_eq!(rows.slots, vec![10, 11, 4, 5, 6]);
    }

    #[test]
    fn int32_mappings_widen() {
        let rows = check_batch(&[2], &[3i32, 1], 4, 4).unwrap();
        assert_eq!(rows.slots, vec![3, 1]);
    }

    #[test]
    fn an_empty_step_is_fine() {
        let rows = check_batch::<i64>(&[], &[], 0, 1).unwrap();
        assert_eq!(rows.n, 0);
        assert!(rows.starts.is_empty() && rows.slots.is_empty());
    }

    #[test]
    fn refusals_name_the_first_problem() {
        let too_many = check_batch(&[5, 4], &[0i64; 9], 8, 16).unwrap_err();
        assert_eq!(
            too_many,
            BatchError::TooManyTokens {
                tokens: 9,
                capacity: 8
            }
        );
        assert!(too_many
            .to_string()
            .starts_with("a step of 9 tokens exceeds staging_capacity_tokens=8"));
        let short = check_batch(&[3], &[0i64, 1], 8, 16).unwrap_err();
        assert_eq!(
            short.to_string(),
            "slot_mapping has 2 entries for 3 scheduled tokens"
        );
        let out = check_batch(&[2], &[0i64, 16], 8, 16).unwrap_err();
        assert_eq!(
            out.to_string(),
            "slot_mapping: slot id 16 at position 1 is out of range [0, 16)"
        );
        let twice = check_batch(&[2], &[5i64, 5, 9], 8, 16).unwrap_err();
        assert_eq!(
            twice.to_string(),
            "slot_mapping: slot id 5 appears twice (positions 0 and 1)"
        );
        // The padding past the scheduled rows is not checked: the engine fills it as it likes.
        assert!(check_batch(&[1], &[5i64, -1, 5], 8, 16).is_ok());
    }
}
