//! The staging-slot registry: a ring of `N` host staging pages and who holds each.
//!
//! A slot is busy while any holder holds it: the step whose rows were copied into it (until
//! its step id is consumed) and each write task still reading from it (until it wrote the
//! pool). [`StagingSlots::claim`] takes the next free slot in ring order, waiting up to a
//! timeout (0 = fail at once) and then failing with the holders of every slot, so a stuck
//! consumer is named. [`StagingSlots::close`] wakes every waiter with an error.
//!
//! Threads: the engine thread claims; any thread adds and releases holders. The mutex is
//! released while waiting (condition variable), never held across a copy.

use std::fmt;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::ids::{StepId, TaskId};

/// Who holds a staging slot.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Holder {
    /// A step whose id is not yet consumed.
    Step(StepId),
    /// A write task that has not yet written the pool.
    Task(TaskId),
}

impl fmt::Debug for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Holder::Step(s) => write!(f, "{s}"),
            Holder::Task(t) => write!(f, "{t}"),
        }
    }
}

#[derive(Debug)]
struct Inner {
    holders: Vec<Vec<Holder>>,
    next: usize,
    closed: bool,
}

/// The staging-slot registry. Any thread.
#[derive(Debug)]
pub struct StagingSlots {
    inner: Mutex<Inner>,
    freed: Condvar,
}

/// Most staging slots a ring takes (each is one step's page; the cache's config allows 1,024).
pub const MAX_STAGING_SLOTS: usize = 1 << 20;

impl StagingSlots {
    /// `num_slots` free slots; zero, or more than [`MAX_STAGING_SLOTS`], is refused.
    pub fn new(num_slots: usize) -> Result<Self> {
        if num_slots == 0 {
            return Err(Error::InvalidConfig {
                what: "staging needs at least one slot".into(),
            });
        }
        if num_slots > MAX_STAGING_SLOTS {
            return Err(Error::InvalidConfig {
                what: format!("staging takes at most {MAX_STAGING_SLOTS} slots, got {num_slots}"),
            });
        }
        Ok(Self {
            inner: Mutex::new(Inner {
                holders: vec![Vec::new(); num_slots],
                next: 0,
                closed: false,
            }),
            freed: Condvar::new(),
        })
    }

    /// Number of slots.
    pub fn num_slots(&self) -> usize {
        self.inner.lock().holders.len()
    }

    /// Takes the next free slot in ring order for `holder`, waiting up to `timeout`.
    pub fn claim(&self, holder: Holder, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now().checked_add(timeout); // None: too far to represent, no deadline
        let mut g = self.inner.lock();
        loop {
            if g.closed {
                return Err(Error::StagingClosed);
            }
            let n = g.holders.len();
            if let Some(slot) = (0..n)
                .map(|i| (g.next + i) % n)
                .find(|&s| g.holders[s].is_empty())
            {
                g.holders[slot].push(holder);
                g.next = (slot + 1) % n;
                return Ok(slot);
            }
            let timed_out = match deadline {
                _ if timeout.is_zero() => true,
                Some(deadline) => self.freed.wait_until(&mut g, deadline).timed_out(),
                None => {
                    self.freed.wait(&mut g);
                    false
                }
            };
            if timed_out {
                if g.holders.iter().any(Vec::is_empty) && !g.closed {
                    continue;
                }
                if g.closed {
                    return Err(Error::StagingClosed);
                }
                return Err(Error::StagingTimeout {
                    timeout,
                    holders: g.holders.clone(),
                });
            }
        }
    }

    fn check_slot(g: &Inner, slot: usize) -> Result<()> {
        if slot < g.holders.len() {
            Ok(())
        } else {
            Err(Error::StagingSlotOutOfRange {
                slot,
                num_slots: g.holders.len(),
            })
        }
    }

    /// Adds a holder to a slot (a write task reading from the step's page).
    pub fn hold(&self, slot: usize, holder: Holder) -> Result<()> {
        self.hold_many(slot, &[holder])
    }

    /// Adds several holders to a busy slot at once (all, or none when refused).
    pub fn hold_many(&self, slot: usize, holders: &[Holder]) -> Result<()> {
        let mut g = self.inner.lock();
        Self::check_slot(&g, slot)?;
        if g.closed {
            return Err(Error::StagingClosed);
        }
        g.holders[slot].extend_from_slice(holders);
        Ok(())
    }

    /// Removes several holders from a slot at once. Returns whether the slot became free (and
    /// wakes waiters if so). Refused, changing nothing, if one of them does not hold the slot
    /// (a holder listed twice must hold it twice).
    pub fn release_many(&self, slot: usize, holders: &[Holder]) -> Result<bool> {
        let mut g = self.inner.lock();
        Self::check_slot(&g, slot)?;
        let mut left = g.holders[slot].clone();
        for &holder in holders {
            let Some(i) = left.iter().position(|h| *h == holder) else {
                return Err(Error::NotAHolder {
                    slot,
                    holder,
                    holders: g.holders[slot].clone(),
                });
            };
            left.swap_remove(i);
        }
        let freed = left.is_empty() && !holders.is_empty();
        g.holders[slot] = left;
        drop(g);
        if freed {
            self.freed.notify_all();
        }
        Ok(freed)
    }

    /// Removes one holder from a slot. Returns whether the slot became free (and wakes
    /// waiters if so). Refused, changing nothing, if `holder` does not hold the slot.
    pub fn release(&self, slot: usize, holder: Holder) -> Result<bool> {
        let mut g = self.inner.lock();
        Self::check_slot(&g, slot)?;
        let hs = &mut g.holders[slot];
        let Some(i) = hs.iter().position(|h| *h == holder) else {
            return Err(Error::NotAHolder {
                slot,
                holder,
                holders: hs.clone(),
            });
        };
        hs.swap_remove(i);
        let freed = hs.is_empty();
        drop(g);
        if freed {
            self.freed.notify_all();
        }
        Ok(freed)
    }

    /// Holders of every slot (diagnostics, stats).
    pub fn holders(&self) -> Vec<Vec<Holder>> {
        self.inner.lock().holders.clone()
    }

    /// Slots with no holder.
    pub fn num_free(&self) -> usize {
        self.inner
            .lock()
            .holders
            .iter()
            .filter(|h| h.is_empty())
            .count()
    }

    /// Refuses every later claim and wakes every waiter with [`Error::StagingClosed`].
    /// Releases still work, so holders can drain. Idempotent.
    pub fn close(&self) {
        self.inner.lock().closed = true;
        self.freed.notify_all();
    }

    /// Whether [`StagingSlots::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.inner.lock().closed
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    const S0: Holder = Holder::Step(StepId(0));
    const S1: Holder = Holder::Step(StepId(1));
    const T9: Holder = Holder::Task(TaskId(9));

    #[test]
    fn release_many_is_refused_whole_when_one_is_not_a_holder() {
        let st = StagingSlots::new(1).unwrap();
        assert_eq!(st.claim(S0, Duration::ZERO).unwrap(), 0);
        st.hold_many(0, &[T9, Holder::Task(TaskId(4))]).unwrap();
        let err = st.release_many(0, &[T9, Holder::Task(TaskId(99))]);
        assert!(matches!(err, Err(Error::NotAHolder { .. })));
        assert!(
            matches!(st.release_many(0, &[T9, T9]), Err(Error::NotAHolder { .. })),
            "a holder listed twice must hold the slot twice"
        );
        assert_eq!(st.holders()[0], vec![S0, T9, Holder::Task(TaskId(4))]);
        assert!(!st.release_many(0, &[Holder::Task(TaskId(4)), T9]).unwrap());
        assert!(
            st.release_many(0, &[S0]).unwrap(),
            "the last holder frees the slot"
        );
        assert!(
            !st.release_many(0, &[]).unwrap(),
            "nothing released: not freed again"
        );
    }

    #[test]
    fn busy_while_any_holder_holds_and_ring_order() {
        let st = StagingSlots::new(2).unwrap();
        assert_eq!(st.claim(S0, Duration::ZERO).unwrap(), 0);
        st.hold(0, T9).unwrap();
        assert_eq!(st.claim(S1, Duration::ZERO).unwrap(), 1);
        let err = st
            .claim(Holder::Step(StepId(2)), Duration::ZERO)
            .unwrap_err();
        assert!(
            err.to_string().contains("0: [step#0, task#9], 1: [step#1]"),
            "{err}"
        );
        assert!(!st.release(0, S0).unwrap(), "task#9 still holds slot 0");
        assert!(st.release(0, T9).unwrap());
        assert_eq!(
            st.claim(Holder::Step(StepId(2)), Duration::ZERO).unwrap(),
            0
        );
    }

    #[test]
    fn release_by_a_non_holder_is_refused() {
        let st = StagingSlots::new(1).unwrap();
        st.claim(S0, Duration::ZERO).unwrap();
        assert!(matches!(st.release(0, S1), Err(Error::NotAHolder { .. })));
        assert!(matches!(
            st.release(3, S0),
            Err(Error::StagingSlotOutOfRange { .. })
        ));
        assert_eq!(st.holders(), vec![vec![S0]]);
    }

    #[test]
    fn waiter_gets_a_slot_released_by_another_thread() {
        let st = Arc::new(StagingSlots::new(1).unwrap());
        st.claim(S0, Duration::ZERO).unwrap();
        let st2 = st.clone();
        let h = std::thread::spawn(move || st2.claim(S1, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        st.release(0, S0).unwrap();
        assert_eq!(h.join().unwrap().unwrap(), 0);
    }

    #[test]
    fn timeout_names_holders_and_close_wakes_waiters() {
        let st = Arc::new(StagingSlots::new(1).unwrap());
        st.claim(S0, Duration::ZERO).unwrap();
        let err = st.claim(S1, Duration::from_millis(10)).unwrap_err();
        assert!(
            matches!(err, Error::StagingTimeout { ref holders, .. } if holders == &vec![vec![S0]])
        );
        let st2 = st.clone();
        let h = std::thread::spawn(move || st2.claim(S1, Duration::from_secs(60)));
        std::thread::sleep(Duration::from_millis(20));
        st.close();
        assert_eq!(h.join().unwrap().unwrap_err(), Error::StagingClosed);
        assert!(st.release(0, S0).unwrap(), "holders can drain after close");
    }

    #[test]
    fn zero_slots_is_refused() {
        assert!(matches!(
            StagingSlots::new(0),
            Err(Error::InvalidConfig { .. })
        ));
    }

    #[test]
    fn ring_order_resumes_after_the_last_claimed_slot() {
        let st = StagingSlots::new(3).unwrap();
        assert_eq!((st.num_slots(), st.num_free()), (3, 3));
        assert_eq!(st.claim(S0, Duration::ZERO).unwrap(), 0);
        assert!(st.release(0, S0).unwrap());
        // Slot 0 is free again, but the ring moves on.
        let order: Vec<usize> = (1..4)
            .map(|i| st.claim(Holder::Step(StepId(i)), Duration::ZERO).unwrap())
            .collect();
        assert_eq!(order, vec![1, 2, 0]);
        assert_eq!(st.num_free(), 0);
        assert!(!st.is_closed());
        st.close();
        assert!(st.is_closed());
        assert_eq!(
            st.claim(T9, Duration::ZERO).unwrap_err(),
            Error::StagingClosed
        );
    }

    #[test]
    fn the_slot_past_the_last_is_out_of_range() {
        let st = StagingSlots::new(2).unwrap();
        assert_eq!(
            st.hold(2, T9).unwrap_err(),
            Error::StagingSlotOutOfRange {
                slot: 2,
                num_slots: 2
            }
        );
        assert!(matches!(
            st.release(2, T9),
            Err(Error::StagingSlotOutOfRange { slot: 2, .. })
        ));
    }

    #[test]
    fn a_slot_freed_as_the_wait_times_out_is_still_taken() {
        let st = Arc::new(StagingSlots::new(1).unwrap());
        st.claim(S0, Duration::ZERO).unwrap();
        let st2 = st.clone();
        let h = std::thread::spawn(move || st2.claim(S1, Duration::from_millis(50)));
        std::thread::sleep(Duration::from_millis(10));
        {
            // Free the slot without a wake-up and keep the lock past the waiter's deadline:
            // its wait ends timed out, with the slot free.
            let mut g = st.inner.lock();
            g.holders[0].clear();
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(h.join().unwrap().unwrap(), 0);
    }
}
