//! Scatter plans: how to move a contiguous block of rows into the pool rows named by a slot
//! list with one memory copy per run of consecutive slots instead of one indexed write per
//! element (torch's CPU `index_copy_` walks elements; for wide rows that is several times
//! slower than copying each run whole).
//!
//! Pure function over a borrowed slice; whichever thread writes the pool calls it.

/// Runs of consecutive slot ids in `slots` (row order), and the same runs sorted by slot.
///
/// Row `i` of the source goes to slot `slots[i]`. `lengths[r]` is the length of run `r`
/// (runs in row order, so the source splits by `lengths`); `bounds` holds `start, end` of
/// every run sorted by start slot (so the pool splits at `bounds` and every second piece is a
/// run's destination); `order[k]` is the row-order index of the `k`-th sorted run.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScatterPlan {
    pub lengths: Vec<i64>,
    pub bounds: Vec<i64>,
    pub order: Vec<i64>,
}

impl ScatterPlan {
    /// The plan for `slots`, or `None` when two runs overlap (a slot named twice) or a slot is
    /// negative or at the end of the `i64` range: the caller then scatters element by element
    /// (where the last row for a slot wins, and torch checks the range).
    pub fn new(slots: &[i64]) -> Option<Self> {
        let mut starts: Vec<(i64, usize)> = Vec::new(); // (first slot, run index)
        let mut lengths: Vec<i64> = Vec::new();
        for (i, &slot) in slots.iter().enumerate() {
            match lengths.last_mut() {
                Some(len) if i > 0 && slots[i - 1].checked_add(1) == Some(slot) => *len += 1,
                _ => {
                    starts.push((slot, lengths.len()));
                    lengths.push(1);
                }
            }
        }
        starts.sort_unstable();
        let mut bounds: Vec<i64> = Vec::with_capacity(2 * starts.len());
        let mut order = Vec::with_capacity(starts.len());
        for &(start, run) in &starts {
            let end = start.checked_add(lengths[run])?;
            if start < 0 || bounds.last().is_some_and(|&prev_end| start < prev_end) {
                return None;
            }
            bounds.push(start);
            bounds.push(end);
            order.push(run as i64);
        }
        Some(Self {
            lengths,
            bounds,
            order,
        })
    }

    /// Number of runs.
    pub fn num_runs(&self) -> usize {
        self.lengths.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies the plan to a pool of `n` cells the way the Python writer does.
    fn apply(plan: &ScatterPlan, rows: &[i64], n: usize) -> Vec<i64> {
        let mut pool = vec![-1; n];
        let mut row_start = vec![0i64; plan.num_runs()];
        for r in 1..plan.num_runs() {
            row_start[r] = row_start[r - 1] + plan.lengths[r - 1];
        }
        for (k, &run) in plan.order.iter().enumerate() {
            let (start, end) = (plan.bounds[2 * k], plan.bounds[2 * k + 1]);
            for (j, slot) in (start..end).enumerate() {
                pool[slot as usize] = rows[(row_start[run as usize] + j as i64) as usize];
            }
        }
        pool
    }

    #[test]
    fn blocks_in_request_order_become_sorted_runs() {
        let plan = ScatterPlan::new(&[8, 9, 10, 11, 12, 13, 0, 1]).unwrap();
        assert_eq!(plan.lengths, vec![6, 2]); // two blocks of 4 that touch are one run
        let plan = ScatterPlan::new(&[8, 9, 10, 11, 0, 1, 2, 3, 20, 21]).unwrap();
        assert_eq!(plan.lengths, vec![4, 4, 2]);
        assert_eq!(plan.bounds, vec![0, 4, 8, 12, 20, 22]);
        assert_eq!(plan.order, vec![1, 0, 2]);
    }

    #[test]
    fn applying_a_plan_is_an_indexed_scatter() {
        let slots = [5, 6, 7, 1, 2, 9, 0, 3];
        let rows: Vec<i64> = (100..108).collect();
        let mut want = vec![-1; 10];
        for (i, &s) in slots.iter().enumerate() {
            want[s as usize] = rows[i];
        }
        assert_eq!(apply(&ScatterPlan::new(&slots).unwrap(), &rows, 10), want);
        assert_eq!(ScatterPlan::new(&[]), Some(ScatterPlan::default()));
    }

    #[test]
    fn a_slot_named_twice_has_no_plan() {
        assert_eq!(ScatterPlan::new(&[4, 5, 6, 5]), None); // runs 4..7 and 5..6 overlap
        assert_eq!(ScatterPlan::new(&[3, 3]), None);
        assert!(ScatterPlan::new(&[4, 5, 6, 7, 0, 1, 2, 3]).is_some()); // touching is fine
    }
}
