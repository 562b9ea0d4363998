//! A hit prefetch's gather of committed rows, done outside any registered read (the binding's
//! `prefetch_rows`; see `omni_pcache.prefetch`).
//!
//! The gather copies pool rows to output rows run by run, and the ledger is asked where each
//! slot's row is before and after it ([`crate::Ledger::peek`]). A row is *vouched for* at
//! version `v` when its slot was committed at `v` both times: no write touched it in between,
//! since every pool write follows a claim, which gives its slots a new version, and each write
//! scatters its rows before it commits them. Every other row gets 0, a version no claim gives.

/// `(first pool row, first output row, rows)` runs of `slots` copied to `dest` (the output
/// row of each slot, one per slot): both sides consecutive throughout a run, so one memory
/// copy per run (a block of the engine's usually).
pub fn paired_runs<'a>(
    slots: &'a [i64],
    dest: &'a [i64],
) -> impl Iterator<Item = (usize, usize, usize)> + 'a {
    let mut i = 0;
    std::iter::from_fn(move || {
        let start = i;
        let (&s, &d) = (slots.get(i)?, dest.get(i)?);
        i += 1; // (the run's first pair, always: each call moves on, whatever the test below says)
        while i < slots.len().min(dest.len())
            && slots[i] == s + (i - start) as i64
            && dest[i] == d + (i - start) as i64
        {
            i += 1;
        }
        Some((s as usize, d as usize, i - start))
    })
}

/// Per slot, the version its row is vouched for at (see the module docs), else 0: `before`
/// and `after` are `(sources, versions)` of the same slots from [`crate::Ledger::peek`].
pub fn vouched(before: (&[i64], &[u64]), after: (&[i64], &[u64])) -> Vec<u64> {
    let pool = crate::ledger::SOURCE_POOL;
    let (sources, versions) = before;
    let (sources_after, versions_after) = after;
    (sources.iter().zip(versions))
        .zip(sources_after.iter().zip(versions_after))
        .map(|((&s, &v), (&s2, &v2))| {
            if s == pool && s2 == pool && v == v2 {
                v
            } else {
                0
            }
        })
        .collect()
}

/// Runs `copy` between two looks at where the copied slots' rows are and returns the version
/// each copied row is vouched for ([`vouched`]). `peek` is [`crate::Ledger::peek`] of those
/// slots on the prefetch's key, taking the ledger's lock for itself each time: `copy` runs
/// without it, so a write may land meanwhile, and the second look is what catches it.
pub fn copy_vouched<P, C>(mut peek: P, copy: C) -> crate::Result<Vec<u64>>
where
    P: FnMut() -> crate::Result<(Vec<i64>, Vec<u64>)>,
    C: FnOnce(),
{
    let before = peek()?;
    copy();
    let after = peek()?;
    Ok(vouched((&before.0, &before.1), (&after.0, &after.1)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::TaskId;
    use crate::Ledger;

    #[test]
    fn runs_break_where_either_side_stops_being_consecutive() {
        let slots = [4, 5, 6, 7, 12, 13, 14, 9];
        let dest = [0, 1, 2, 10, 11, 12, 13, 14];
        let runs: Vec<_> = paired_runs(&slots, &dest).collect();
        assert_eq!(runs, vec![(4, 0, 3), (7, 10, 1), (12, 11, 3), (9, 14, 1)]);
        assert_eq!(paired_runs(&[], &[]).count(), 0);
    }

    #[test]
    fn only_rows_committed_at_one_version_throughout_are_vouched_for() {
        let mut ledger = Ledger::new(16, 4).unwrap();
        let key = ledger.add_key();
        let slots: Vec<i64> = (0..12).collect();
        ledger.claim(&slots[..8], key, TaskId(1)).unwrap();
        ledger.commit(TaskId(1)).unwrap(); // slots 0..8 committed
        ledger.claim(&slots[8..], key, TaskId(2)).unwrap(); // 8..12 in flight
        let before = ledger.peek(&slots, key).unwrap();
        // During the gather: slots 4..8 claimed and committed again (a newer tenant).
        ledger.claim(&slots[4..8], key, TaskId(3)).unwrap();
        ledger.commit(TaskId(3)).unwrap();
        let after = ledger.peek(&slots, key).unwrap();
        let got = vouched((&before.0, &before.1), (&after.0, &after.1));
        let v1 = before.1[0];
        assert!(v1 > 0);
        assert_eq!(&got[..4], &[v1; 4], "committed throughout");
        assert_eq!(&got[4..], &[0; 8], "rewritten meanwhile, or in flight");
        // A later read of the same slots keeps the vouched rows whose version it captured.
        let plan = ledger.plan_read(&slots, key).unwrap();
        let stale = ledger.unvouched(plan.read, &got).unwrap();
        assert_eq!(stale, (4..12).collect::<Vec<i64>>());
        assert!(
            ledger.unvouched(plan.read, &got[1..]).is_err(),
            "another length"
        );
    }

    #[test]
    fn a_write_that_lands_during_the_copy_unvouches_its_rows() {
        let ledger = std::cell::RefCell::new(Ledger::new(16, 4).unwrap());
        let key = ledger.borrow_mut().add_key();
        let slots: Vec<i64> = (0..8).collect();
        ledger.borrow_mut().claim(&slots, key, TaskId(1)).unwrap();
        ledger.borrow_mut().commit(TaskId(1)).unwrap();
        let v1 = ledger.borrow().peek(&slots, key).unwrap().1[0];
        let got = copy_vouched(
            || ledger.borrow().peek(&slots, key),
            || {
                // A new tenant's rows of slots 2..4 are written while the prefetch copies.
                let mut l = ledger.borrow_mut();
                l.claim(&slots[2..4], key, TaskId(2)).unwrap();
                l.commit(TaskId(2)).unwrap();
            },
        )
        .unwrap();
        assert_eq!(got, vec![v1, v1, 0, 0, v1, v1, v1, v1]);
        // A peek that fails (a slot outside the ledger) is the call's error, copying nothing.
        let mut copied = false;
        let outside = copy_vouched(|| ledger.borrow().peek(&[99_i64], key), || copied = true);
        assert!(outside.is_err() && !copied);
    }

    #[test]
    fn a_read_keeps_only_rows_vouched_at_the_version_it_captured() {
        let mut ledger = Ledger::new(16, 4).unwrap();
        let key = ledger.add_key();
        let slots: Vec<i64> = (0..12).collect();
        ledger.claim(&slots, key, TaskId(1)).unwrap();
        ledger.commit(TaskId(1)).unwrap();
        let v1 = ledger.peek(&slots, key).unwrap().1[0];
        // A prefetch vouched for every row at v1 but one (position 2); then slots 4..8 were
        // rewritten (v2) before the read was planned.
        let mut vouched_at = vec![v1; 12];
        vouched_at[2] = 0;
        ledger.claim(&slots[4..8], key, TaskId(2)).unwrap();
        ledger.commit(TaskId(2)).unwrap();
        let plan = ledger.plan_read(&slots, key).unwrap();
        let stale = ledger.unvouched(plan.read, &vouched_at).unwrap();
        assert_eq!(
            stale,
            vec![2, 4, 5, 6, 7],
            "the unvouched row, and the rows vouched at an older version than the read's"
        );
        // A read of slots nobody wrote captured no row (version 0): never served from a prefetch.
        let never: Vec<i64> = (12..16).collect();
        let empty = ledger.plan_read(&never, key).unwrap();
        assert_eq!(
            ledger.unvouched(empty.read, &[0; 4]).unwrap(),
            vec![0, 1, 2, 3]
        );
    }
}
