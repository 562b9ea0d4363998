//! What each live request's consumer has been given: its delivered span `[0, delivered)`.
//!
//! The contract: the rows returned for a request over all its steps concatenate to its full
//! sequence, each row once. A fresh request gets that for free (its hit span from the pool,
//! then each step's rows). A request that comes back needs the bookkeeping here:
//!
//! - **preempted and resumed** with `H` tokens computed (it recomputes from `H`): the rows it
//!   recomputes in `[H, delivered)` are not returned again, and if `H > delivered` the rows
//!   `[delivered, H)` are read from the pool;
//! - **continued** (a live id scheduled as new again, `num_computed_tokens` being what it
//!   computed itself): not a hit; it gets exactly the rows it was not given yet.
//!
//! A save's rows count as delivered once taken. When the engine drops a saved output after all
//! (vLLM's `drop_stale_output`: the step in flight when a streaming turn ends), the caller says
//! from which position its rows never reached the consumer ([`Deliveries::undeliver_from`]),
//! before the request is scheduled again.
//!
//! Each live request has `next_pos`, the position of the next row the engine will save for it.
//! Engine thread only (`begin_step` and `save`); the binding holds it under its own borrow.

use std::collections::{HashMap, VecDeque};

use crate::block_table::slots_of;
use crate::error::{Error, Result};

/// One request's rows in one save: its first row in the step, its row count, and how many of
/// the leading rows its consumer already has (`drop <= count`: not returned again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepRows {
    /// The request's first row in the step's batch.
    pub first_row: usize,
    /// Rows the engine computed for it this step.
    pub count: usize,
    /// Leading rows already delivered.
    pub drop: usize,
}

/// How many of a request's latest saves [`Deliveries::undeliver_saves`] can undo: more than
/// any engine keeps in flight (vLLM: the pipeline depth, plus one with async scheduling).
pub const MAX_DROPPED_SAVES: usize = 16;

/// One live request's positions, and the pool read due with its next save.
#[derive(Debug, Default)]
struct Delivery {
    next_pos: usize,
    delivered: usize,
    /// `delivered` before each of its latest saves took its rows, oldest first (at most
    /// [`MAX_DROPPED_SAVES`]).
    before_saves: VecDeque<usize>,
    /// Slots of positions `[read_from, next_pos)`, read with the next save.
    read: Option<Vec<i64>>,
}

/// The delivered spans of the live requests, by request id.
#[derive(Debug)]
pub struct Deliveries {
    block_size: u32,
    live: HashMap<String, Delivery>,
}

/// The pool reads due at a save: `(index of the request in the save's rows, slots)`.
pub type DueReads = Vec<(usize, Vec<i64>)>;

impl Deliveries {
    /// No live request; tables of blocks of `block_size` positions (refused for 0).
    pub fn new(block_size: u32) -> Result<Self> {
        if block_size == 0 {
            return Err(Error::InvalidConfig {
                what: "a delivery table needs a block size of at least 1".into(),
            });
        }
        Ok(Self {
            block_size,
            live: HashMap::new(),
        })
    }

    /// Positions per block of the tables this tracker reads.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether `req_id` is live: scheduled or saved and not finished since.
    pub fn is_live(&self, req_id: &str) -> bool {
        self.live.contains_key(req_id)
    }

    /// Number of live requests.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    /// Whether no request is live.
    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Forgets a finished or aborted request; whether it was live.
    pub fn finish(&mut self, req_id: &str) -> bool {
        self.live.remove(req_id).is_some()
    }

    /// The consumer of live request `req_id` never got its rows from `position` on (the engine
    /// dropped the output that carried them): they count as not delivered, so a later
    /// [`Deliveries::schedule`] reads those below its resume point from the pool and the rest are
    /// returned when computed again. Returns whether the request is live (else nothing to do).
    pub fn undeliver_from(&mut self, req_id: &str, position: usize) -> bool {
        match self.live.get_mut(req_id) {
            Some(state) => {
                state.delivered = state.delivered.min(position);
                true
            }
            None => false,
        }
    }

    /// Checks [`Deliveries::undeliver_saves`]'s `count` for `req_id` (changing nothing): 0, more
    /// than [`MAX_DROPPED_SAVES`], or more saves than a live request had, is refused.
    pub fn check_dropped_saves(&self, req_id: &str, count: usize) -> Result<()> {
        let saves = self
            .live
            .get(req_id)
            .map_or(0, |state| state.before_saves.len());
        let why = if count == 0 {
            "a count is 1 or more".to_string()
        } else if count > MAX_DROPPED_SAVES {
            format!("at most {MAX_DROPPED_SAVES} (the latest saves of a request that are kept)")
        } else if saves > 0 && count > saves {
            format!("it has {saves}")
        } else {
            return Ok(());
        };
        Err(Error::InvalidInput {
            what: format!("request {req_id:?}: {count} dropped saves; {why}"),
        })
    }

    /// The consumer of live request `req_id` never got the rows of its last `count` saves (the
    /// engine dropped those outputs: vLLM's `reset_prefix_cache(reset_running_requests=True)`
    /// with steps in flight): what they returned for it, pool reads included, counts as not
    /// delivered, as in [`Deliveries::undeliver_from`]. Returns whether the request is live and
    /// was saved (else nothing to do). Refuses, changing nothing, what
    /// [`Deliveries::check_dropped_saves`] refuses.
    pub fn undeliver_saves(&mut self, req_id: &str, count: usize) -> Result<bool> {
        self.check_dropped_saves(req_id, count)?;
        let Some(state) = self.live.get_mut(req_id) else {
            return Ok(false);
        };
        match state.before_saves.len().checked_sub(count) {
            Some(at) => {
                state.delivered = state.delivered.min(state.before_saves[at]);
                Ok(true)
            }
            None => Ok(false), // (never saved)
        }
    }

    /// A request (re)enters with `num_computed` tokens computed under `blocks`: plans the pool
    /// read of what its consumer has not been given below that, `[delivered, num_computed)`,
    /// due with its next save. Returns whether it reads. Refuses a span past the table
    /// (changing nothing).
    pub fn schedule(&mut self, req_id: &str, blocks: &[i64], num_computed: usize) -> Result<bool> {
        let delivered = self.live.get(req_id).map_or(0, |d| d.delivered);
        let read = if num_computed > delivered {
            Some(slots_of(blocks, delivered, num_computed, self.block_size)?)
        } else {
            None
        };
        let reads = read.is_some();
        let state = match self.live.get_mut(req_id) {
            Some(state) => state,
            None => self.live.entry(req_id.to_owned()).or_default(),
        };
        state.read = read;
        state.next_pos = num_computed;
        Ok(reads)
    }

    /// The slots of the pool read planned for `req_id`'s next save (by [`Deliveries::schedule`]),
    /// if any: what a prefetch of its committed rows may gather before that save.
    pub fn pending_read(&self, req_id: &str) -> Option<&[i64]> {
        self.live.get(req_id)?.read.as_deref()
    }

    /// One save of each request's `(req_id, first_row, count)` rows, in batch order (each
    /// request once: a request named twice may panic). Returns per request its [`StepRows`], and the pool reads due now as
    /// `(index of the request in `rows`, slots)`. A request never scheduled becomes live at
    /// position 0. Refused, changing nothing, if a request's positions would pass `usize::MAX`.
    pub fn take_step<'a>(
        &mut self,
        rows: impl IntoIterator<Item = (&'a str, usize, usize)>,
    ) -> Result<(Vec<StepRows>, DueReads)> {
        let rows: Vec<_> = rows.into_iter().collect();
        for &(req_id, _, count) in &rows {
            let start = self.live.get(req_id).map_or(0, |state| state.next_pos);
            if start.checked_add(count).is_none() {
                return Err(Error::InvalidInput {
                    what: format!(
                        "request {req_id:?}: {count} rows from position {start} pass the largest position"
                    ),
                });
            }
        }
        let mut out = Vec::new();
        let mut reads = Vec::new();
        for (i, (req_id, first_row, count)) in rows.into_iter().enumerate() {
            let state = match self.live.get_mut(req_id) {
                Some(state) => state,
                None => self.live.entry(req_id.to_owned()).or_default(),
            };
            let start = state.next_pos;
            if state.before_saves.len() == MAX_DROPPED_SAVES {
                state.before_saves.pop_front();
            }
            state.before_saves.push_back(state.delivered);
            if let Some(slots) = state.read.take() {
                reads.push((i, slots));
                state.delivered = state.delivered.max(start);
            }
            let drop = state.delivered.saturating_sub(start).min(count);
            out.push(StepRows {
                first_row,
                count,
                drop,
            });
            // (checked above for each request named once, as callers must: a request named
            // twice whose positions pass the largest is a caller's bug, not a silent wrap)
            state.next_pos = start
                .checked_add(count)
                .expect("take_step: a request named twice in one save");
            state.delivered = state.delivered.max(state.next_pos);
        }
        Ok((out, reads))
    }
}

#[cfg(test)]
#[path = "delivery_tests.rs"]
mod tests;
