//! Row scatter: copies a contiguous block of fixed-size rows into the pool rows named by a slot
//! list, one memory copy per run of consecutive slots (the engine's blocks) instead of one
//! indexed write per element (torch's CPU `index_copy_` walks elements; for wide rows that is
//! several times slower than copying each row whole).
//!
//! `gather_rows` copies a staging page's rows at given positions out back to back, run by run
//! (the rows a write task still owns when a newer tenant took some of its slots).
//!
//! Pure functions over borrowed byte slices: everything is checked before the first byte is
//! written (`check_scatter`, `check_gather`; a caller writing several keys checks them all
//! first), so a refused call changes nothing. The pool's single writer calls them (the
//! committer, or the engine thread writing a small step), without the GIL.

/// Why a scatter was refused (nothing was written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RowScatterError {
    /// Rows of zero bytes, or a pool (or page) that is not a whole number of rows.
    #[error("row_bytes={row_bytes} does not divide {pool_bytes} bytes into rows")]
    BadRowSize { row_bytes: usize, pool_bytes: usize },

    /// The source does not hold one row per slot.
    #[error("{num_slots} slots but {rows_bytes} bytes of rows (row_bytes={row_bytes})")]
    RowCountMismatch {
        num_slots: usize,
        rows_bytes: usize,
        row_bytes: usize,
    },

    /// A source row outside the rows gathered from (negative positions included).
    #[error("row position {row} at {position} is out of range [0, {num_rows})")]
    RowOutOfRange {
        row: i64,
        position: usize,
        num_rows: usize,
    },

    /// A slot outside the pool (negative ids included).
    #[error("slot id {slot} at position {position} is out of range [0, {num_rows})")]
    SlotOutOfRange {
        slot: i64,
        position: usize,
        num_rows: usize,
    },
}

/// What `scatter_rows` checks before writing anything, for a pool of `pool_bytes` and rows of
/// `rows_bytes`: a caller writing several keys checks every key first, so a refusal writes none.
pub fn check_scatter(
    pool_bytes: usize,
    rows_bytes: usize,
    row_bytes: usize,
    slots: &[i64],
) -> Result<(), RowScatterError> {
    let num_rows = whole_rows(pool_bytes, row_bytes)?;
    if slots.len().checked_mul(row_bytes) != Some(rows_bytes) {
        return Err(RowScatterError::RowCountMismatch {
            num_slots: slots.len(),
            rows_bytes,
            row_bytes,
        });
    }
    match first_outside(slots, num_rows) {
        Some((position, slot)) => Err(RowScatterError::SlotOutOfRange {
            slot,
            position,
            num_rows,
        }),
        None => Ok(()),
    }
}

/// Copies row `i` of `rows` to row `slots[i]` of `pool` (rows of `row_bytes` bytes), one
/// `copy_from_slice` per run of consecutive slots. A slot named twice gets its last row.
pub fn scatter_rows(
    pool: &mut [u8],
    rows: &[u8],
    row_bytes: usize,
    slots: &[i64],
) -> Result<(), RowScatterError> {
    check_scatter(pool.len(), rows.len(), row_bytes, slots)?;
    for_each_run(slots, |first, slot, len| {
        let (at, from, bytes) = (
            slot as usize * row_bytes,
            first * row_bytes,
            len * row_bytes,
        );
        pool[at..at + bytes].copy_from_slice(&rows[from..from + bytes]);
    });
    Ok(())
}

/// What `gather_rows` checks, for rows of `rows_bytes` in all: a whole number of rows of
/// `row_bytes`, and every position among them.
pub fn check_gather(
    rows_bytes: usize,
    row_bytes: usize,
    positions: &[i64],
) -> Result<(), RowScatterError> {
    let num_rows = whole_rows(rows_bytes, row_bytes)?;
    match first_outside(positions, num_rows) {
        Some((position, row)) => Err(RowScatterError::RowOutOfRange {
            row,
            position,
            num_rows,
        }),
        None => Ok(()),
    }
}

/// Rows `positions[0], positions[1], ..` of `rows` (rows of `row_bytes` bytes) copied out back
/// to back, one copy per run of consecutive positions: the rows a write task still owns when a
/// newer tenant took some of its slots. Refuses a position outside `rows`.
pub fn gather_rows(
    rows: &[u8],
    row_bytes: usize,
    positions: &[i64],
) -> Result<Vec<u8>, RowScatterError> {
    check_gather(rows.len(), row_bytes, positions)?;
    let mut out = Vec::with_capacity(positions.len() * row_bytes);
    for_each_run(positions, |_, row, len| {
        let at = row as usize * row_bytes;
        out.extend_from_slice(&rows[at..at + len * row_bytes]);
    });
    Ok(out)
}

/// How many rows of `row_bytes` fill `bytes` exactly (refused for rows of zero bytes).
fn whole_rows(bytes: usize, row_bytes: usize) -> Result<usize, RowScatterError> {
    if row_bytes == 0 || !bytes.is_multiple_of(row_bytes) {
        return Err(RowScatterError::BadRowSize {
            row_bytes,
            pool_bytes: bytes,
        });
    }
    Ok(bytes / row_bytes)
}

/// The first id outside `[0, num_rows)` (negative ids included), with its position.
fn first_outside(ids: &[i64], num_rows: usize) -> Option<(usize, i64)> {
    ids.iter()
        .position(|&id| id < 0 || id as u64 >= num_rows as u64)
        .map(|position| (position, ids[position]))
}

/// Calls `copy(position, id, len)` for each maximal run of consecutive ids starting at
/// `ids[position]` (`len` ids `id, id + 1, ..`), in order.
fn for_each_run(ids: &[i64], mut copy: impl FnMut(usize, i64, usize)) {
    let mut first = 0;
    while first < ids.len() {
        let mut end = first + 1;
        while end < ids.len() && ids[end] == ids[end - 1] + 1 {
            end += 1;
        }
        copy(first, ids[first], end - first);
        first = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference: one indexed write per row.
    fn indexed(pool: &mut [u8], rows: &[u8], row_bytes: usize, slots: &[i64]) {
        for (i, &s) in slots.iter().enumerate() {
            let at = s as usize * row_bytes;
            pool[at..at + row_bytes].copy_from_slice(&rows[i * row_bytes..(i + 1) * row_bytes]);
        }
    }

    #[test]
    fn runs_and_single_rows_land_where_an_indexed_write_puts_them() {
        let row_bytes = 3;
        for slots in [
            vec![8i64, 9, 10, 11, 0, 1, 2, 3, 20, 21],
            vec![5, 6, 7, 1, 2, 9, 0, 3],
            vec![4, 2, 9, 7],
            vec![],
        ] {
            let rows: Vec<u8> = (0..slots.len() * row_bytes).map(|b| b as u8 + 1).collect();
            let (mut got, mut want) = (vec![0u8; 24 * row_bytes], vec![0u8; 24 * row_bytes]);
            scatter_rows(&mut got, &rows, row_bytes, &slots).unwrap();
            indexed(&mut want, &rows, row_bytes, &slots);
            assert_eq!(got, want, "slots {slots:?}");
        }
    }

    #[test]
    fn gathered_rows_come_in_position_order() {
        let rows: Vec<u8> = (0..12).collect(); // six rows of two bytes
        assert_eq!(
            gather_rows(&rows, 2, &[4, 5, 0, 2, 3]).unwrap(),
            vec![8, 9, 10, 11, 0, 1, 4, 5, 6, 7]
        );
        assert!(gather_rows(&rows, 2, &[]).unwrap().is_empty());
        assert_eq!(
            gather_rows(&rows, 2, &[1, 6]).unwrap_err().to_string(),
            "row position 6 at 1 is out of range [0, 6)"
        );
        assert!(matches!(
            gather_rows(&rows, 2, &[-1]),
            Err(RowScatterError::RowOutOfRange { row: -1, .. })
        ));
        assert!(matches!(
            gather_rows(&rows, 5, &[0]),
            Err(RowScatterError::BadRowSize { .. })
        ));
    }

    #[test]
    fn a_slot_named_twice_gets_its_last_row() {
        let mut pool = vec![0u8; 4];
        scatter_rows(&mut pool, &[1, 2, 3], 1, &[2, 3, 2]).unwrap();
        assert_eq!(pool, vec![0, 0, 3, 2]);
    }

    #[test]
    fn a_refused_scatter_writes_nothing() {
        let mut pool = vec![0u8; 8];
        let err = scatter_rows(&mut pool, &[1, 1, 2, 2], 2, &[0, 4]).unwrap_err();
        assert_eq!(
            err,
            RowScatterError::SlotOutOfRange {
                slot: 4,
                position: 1,
                num_rows: 4
            }
        );
        assert_eq!(
            err.to_string(),
            "slot id 4 at position 1 is out of range [0, 4)"
        );
        assert!(matches!(
            scatter_rows(&mut pool, &[1, 1, 2, 2], 2, &[-1, 0]),
            Err(RowScatterError::SlotOutOfRange { slot: -1, .. })
        ));
        assert!(matches!(
            scatter_rows(&mut pool, &[1, 1, 2], 2, &[0, 1]),
            Err(RowScatterError::RowCountMismatch { .. })
        ));
        assert!(matches!(
            scatter_rows(&mut pool, &[], 3, &[]),
            Err(RowScatterError::BadRowSize { .. })
        ));
        assert!(matches!(
            scatter_rows(&mut pool, &[], 0, &[]),
            Err(RowScatterError::BadRowSize { .. })
        ));
        assert_eq!(pool, vec![0u8; 8]);
    }

    #[test]
    fn a_slot_repeated_back_to_back_is_one_row_not_a_run() {
        let mut pool = vec![0u8; 4];
        scatter_rows(&mut pool, &[1, 2, 3], 1, &[1, 1, 2]).unwrap();
        assert_eq!(pool, vec![0, 2, 3, 0]);
        let rows: Vec<u8> = (10..14).collect();
        assert_eq!(gather_rows(&rows, 1, &[2, 2, 0]).unwrap(), vec![12, 12, 10]);
    }
}
