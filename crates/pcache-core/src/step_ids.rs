//! Exactly-once step ids: issued in increasing order on the engine thread, each consumed
//! once (by materialize or discard), in any order, from any thread.

use std::collections::BTreeSet;

use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::ids::StepId;

#[derive(Debug, Default)]
struct Inner {
    first: u64,
    next: u64,
    outstanding: BTreeSet<u64>,
}

/// The largest first id [`StepIds::starting_at`] takes: 2^63 - 1, leaving 2^63 ids to issue.
pub const MAX_FIRST_STEP_ID: u64 = u64::MAX >> 1;

/// The step-id registry. Any thread; the lock covers a set insert/remove.
#[derive(Debug, Default)]
pub struct StepIds {
    inner: Mutex<Inner>,
}

impl StepIds {
    /// An empty registry; the first id issued is `step#0`.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty registry whose first id is `step#first` (so the ids of several registries in
    /// one process need not overlap). Refused above [`MAX_FIRST_STEP_ID`], so that issuing can
    /// never run past `u64::MAX` (ids would wrap and repeat).
    pub fn starting_at(first: u64) -> Result<Self> {
        if first > MAX_FIRST_STEP_ID {
            return Err(Error::InvalidConfig {
                what: format!("the first step id must be at most {MAX_FIRST_STEP_ID}, got {first}"),
            });
        }
        Ok(Self {
            inner: Mutex::new(Inner {
                first,
                next: first,
                outstanding: BTreeSet::new(),
            }),
        })
    }

    /// Issues the next id; it is outstanding until consumed.
    pub fn issue(&self) -> StepId {
        let mut g = self.inner.lock();
        let id = g.next;
        g.next += 1;
        g.outstanding.insert(id);
        StepId(id)
    }

    /// Consumes `step`. A second consumption, or an id never issued, is refused with the
    /// list of outstanding ids; nothing changes.
    pub fn consume(&self, step: StepId) -> Result<()> {
        let mut g = self.inner.lock();
        if g.outstanding.remove(&step.0) {
            return Ok(());
        }
        let outstanding = g.outstanding.iter().copied().map(StepId).collect();
        if (g.first..g.next).contains(&step.0) {
            Err(Error::StepAlreadyConsumed { step, outstanding })
        } else {
            Err(Error::UnknownStep { step, outstanding })
        }
    }

    /// Whether `step` was issued and not yet consumed.
    pub fn is_outstanding(&self, step: StepId) -> bool {
        self.inner.lock().outstanding.contains(&step.0)
    }

    /// Issued and not yet consumed, oldest first.
    pub fn outstanding(&self) -> Vec<StepId> {
        self.inner
            .lock()
            .outstanding
            .iter()
            .copied()
            .map(StepId)
            .collect()
    }

    /// Number of outstanding ids.
    pub fn num_outstanding(&self) -> usize {
        self.inner.lock().outstanding.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_registry_starting_elsewhere_refuses_the_ids_of_another() {
        let (first, second) = (StepIds::new(), StepIds::starting_at(1 << 40).unwrap());
        let a = first.issue();
        let b = second.issue();
        assert_eq!((a, b), (StepId(0), StepId(1 << 40)));
        assert!(matches!(second.consume(a), Err(Error::UnknownStep { .. })));
        second.consume(b).unwrap();
    }

    #[test]
    fn a_first_id_that_could_run_past_u64_max_is_refused() {
        assert_eq!(MAX_FIRST_STEP_ID, (1 << 63) - 1);
        let last = StepIds::starting_at(MAX_FIRST_STEP_ID).unwrap();
        assert_eq!(last.issue(), StepId(MAX_FIRST_STEP_ID));
        assert_eq!(last.issue(), StepId(1 << 63));
        let err = StepIds::starting_at(MAX_FIRST_STEP_ID + 1).unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid configuration: the first step id must be at most 9223372036854775807, got 9223372036854775808"
        );
    }

    #[test]
    fn out_of_order_consumption_and_errors_list_outstanding() {
        let ids = StepIds::new();
        let a = ids.issue();
        let b = ids.issue();
        let c = ids.issue();
        assert!(a < b && b < c);
        ids.consume(c).unwrap();
        ids.consume(a).unwrap();
        assert_eq!(
            ids.consume(a).unwrap_err(),
            Error::StepAlreadyConsumed {
                step: a,
                outstanding: vec![b]
            }
        );
        let err = ids.consume(StepId(42)).unwrap_err();
        assert_eq!(
            err,
            Error::UnknownStep {
                step: StepId(42),
                outstanding: vec![b]
            }
        );
        assert!(
            err.to_string().ends_with("outstanding step ids: [1]"),
            "{err}"
        );
        ids.consume(b).unwrap();
        assert_eq!(ids.num_outstanding(), 0);
    }

    #[test]
    fn consumed_from_other_threads_exactly_once() {
        let ids = std::sync::Arc::new(StepIds::new());
        let issued: Vec<_> = (0..1000).map(|_| ids.issue()).collect();
        let oks: usize = std::thread::scope(|s| {
            (0..4)
                .map(|_| {
                    let ids = ids.clone();
                    let issued = issued.clone();
                    s.spawn(move || issued.iter().filter(|&&i| ids.consume(i).is_ok()).count())
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .sum()
        });
        assert_eq!(oks, 1000);
        assert!(ids.outstanding().is_empty());
    }

    #[test]
    fn outstanding_ids_are_listed_until_consumed() {
        let ids = StepIds::new();
        let (a, b, c) = (ids.issue(), ids.issue(), ids.issue());
        ids.consume(b).unwrap();
        assert_eq!(ids.outstanding(), vec![a, c]);
        assert_eq!(ids.num_outstanding(), 2);
        assert!(ids.is_outstanding(a) && !ids.is_outstanding(b));
        assert!(!ids.is_outstanding(StepId(3)), "never issued");
    }
}
