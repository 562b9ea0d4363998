//! Unit tests of the per-block representation (`slot_columns.rs`). No result depends on it
//! (the ledger's tests and its property test check results at several block sizes); only
//! speed does, so these check the representation itself: the pieces a run splits into, and
//! when a block is whole.

use super::*;

fn run(start: u32, len: u32) -> Run {
    Run { start, len }
}

fn pieces(cols: &KeyColumns, start: u32, len: u32) -> Vec<(usize, Range<usize>, bool)> {
    let pieces = cols.pieces(run(start, len));
    pieces.map(|p| (p.block, p.slots, p.whole)).collect()
}

#[test]
fn a_run_splits_into_pieces_block_by_block() {
    let cols = KeyColumns::new(16, 4);
    assert_eq!(pieces(&cols, 4, 4), vec![(1, 4..8, true)]);
    assert_eq!(
        pieces(&cols, 2, 9),
        vec![(0, 2..4, false), (1, 4..8, true), (2, 8..11, false)]
    );
    assert_eq!(
        pieces(&cols, 8, 8),
        vec![(2, 8..12, true), (3, 12..16, true)]
    );
    // Blocks of 3 over 16 slots: the last block (15..18) ends past the last slot, never whole.
    let odd = KeyColumns::new(16, 3);
    assert_eq!(
        pieces(&odd, 11, 5),
        vec![(3, 11..12, false), (4, 12..15, true), (5, 15..16, false)]
    );
    assert!(!odd.is_whole(5) && odd.is_whole(4));
}

#[test]
fn a_block_stays_whole_until_a_call_touches_part_of_it() {
    let mut handles = Handles::default();
    let (me, other) = (handles.take(TaskId(7)), handles.take(TaskId(8)));
    let mut cols = KeyColumns::new(16, 4);
    let mut out = ClaimOutcome::default();
    // A claim of the whole block 1 sets the block's entry only (its slots' entries are stale).
    cols.claim(&[run(4, 4)], me, 1, &handles, &mut out);
    assert!(cols.is_whole(1));
    assert_eq!(cols.slot_owners(4..8), &[OWNER_ABSENT; 4]);
    let mine = Entry {
        owner: me,
        version: 1,
        readers: 0,
    };
    assert_eq!(cols.entry(5), mine);
    // Its commit, a read of it and the read's release keep it whole.
    assert_eq!(cols.settle(&[run(4, 4)], me, OWNER_POOL), 4);
    let piece = cols.pieces(run(4, 4)).next().unwrap();
    assert!(matches!(cols.read_piece(&piece), ReadOf::Block(e) if e.owner == OWNER_POOL));
    assert!(cols.is_whole(1));
    assert_eq!(cols.entry(7).readers, 1);
    cols.release(&[ReadRun {
        run: run(4, 4),
        version: 1,
    }]);
    assert_eq!(cols.whole_entry(1).map(|e| e.readers), Some(0));
    // A read of part of it writes the entry to its slots, and counts the reader per slot.
    let piece = cols.pieces(run(4, 2)).next().unwrap();
    assert!(matches!(cols.read_piece(&piece), ReadOf::Slots(..)));
    assert!(!cols.is_whole(1));
    assert_eq!(cols.slot_owners(4..8), &[OWNER_POOL; 4]);
    let readers: Vec<u32> = (4..8).map(|s| cols.entry(s).readers).collect();
    assert_eq!(readers, vec![1, 1, 0, 0]);
    // A claim of part of it stays per slot; a claim of all of it makes it whole again.
    cols.claim(&[run(6, 1)], other, 2, &handles, &mut out);
    assert!(!cols.is_whole(1));
    assert_eq!(
        cols.slot_owners(4..8),
        &[OWNER_POOL, OWNER_POOL, other, OWNER_POOL]
    );
    assert_eq!(
        out,
        ClaimOutcome::default(),
        "no reader on slot 6, nobody's task"
    );
    cols.claim(&[run(4, 4)], me, 3, &handles, &mut out);
    assert!(cols.is_whole(1));
    assert_eq!(out.preserve_slots, vec![4, 5], "the partial read's rows");
    assert_eq!(
        (out.stolen_slots, out.stolen_from),
        (vec![6], vec![8]),
        "slot 6 was the other task's"
    );
}

#[test]
fn bytes_for_counts_what_the_columns_allocate() {
    // (block sizes that divide the slots and one that leaves a partial block; more than 64 blocks)
    for (num_slots, block_size) in [(1024, 16), (1000, 3), (5, 8), (1, 1)] {
        let cols = KeyColumns::new(num_slots, block_size);
        let allocated = cols.owner.capacity() * size_of::<u32>()
            + cols.version.capacity() * size_of::<u64>()
            + cols.readers.capacity() * size_of::<u32>()
            + cols.whole.capacity() * size_of::<u64>()
            + cols.blocks.capacity() * size_of::<Entry>();
        assert_eq!(
            KeyColumns::bytes_for(num_slots, block_size),
            allocated,
            "{num_slots} slots, blocks of {block_size}"
        );
    }
}
