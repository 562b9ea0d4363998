//! `claim_step`: what `PrefixCache.save` does for a step's immediate keys, in one call: one
//! write task per request with rows, their slots claimed on every key, and their hold on the
//! step's staging page.

use pcache_core::{Error, Holder, KeyId, TaskId};
use pyo3::prelude::*;

use crate::convert::{detach_for, with_slice, Indices};
use crate::errors::IntoPy;
use crate::ledger::{outcome, ClaimOutcome, Ledger};
use crate::registries::StagingSlots;
use crate::tasks::WriteTasks;

/// Creates `len(counts)` write tasks (PENDING; ids increasing), claims the step's `slots` for
/// them on each key of `key_ids` (the first `counts[0]` slots for the first task, and so on, as
/// `Ledger.claim_many`), and adds each task as a holder of staging page `page`. Returns the
/// task ids and, per key, its `ClaimOutcome`, or `None` when the claim took no slot from an
/// in-transit task and moved no row a pending read captured (the usual case: no arrays are
/// built for it). A refusal leaves nothing behind (no task, hold or claim): an unknown key, the
/// slots not fitting the counts, a slot out of range or named twice (`InvalidInputError`), or a
/// closed staging ring (`CacheClosedError`). The caller holds the cache's ledger lock, as for
/// the claims it replaces.
#[pyfunction]
#[allow(clippy::too_many_arguments)] // (the Python call's arguments, one per thing it touches)
pub fn claim_step(
    py: Python<'_>,
    tasks: &Bound<'_, WriteTasks>,
    ledger: &Bound<'_, Ledger>,
    staging: &Bound<'_, StagingSlots>,
    page: usize,
    slots: &Bound<'_, PyAny>,
    counts: Vec<usize>,
    key_ids: Vec<u32>,
) -> PyResult<(Vec<u64>, Vec<Option<ClaimOutcome>>)> {
    let idx = Indices::extract(slots, "slots")?;
    let view = idx.slice();
    let ledger = ledger.get();
    // Every key checked before anything is made: the claims of one call differ only by key,
    // so once the keys are known, the first claim's checks stand for all of them.
    let num_keys = ledger.lock().num_keys();
    if let Some(&key) = key_ids.iter().find(|&&k| k >= num_keys) {
        return Err(Error::UnknownKey {
            key: KeyId(key),
            num_keys,
        })
        .py_err();
    }
    let (tasks, staging) = (tasks.get(), staging.get());
    let task_ids = tasks.create_ids(counts.len());
    let owners: Vec<TaskId> = task_ids.iter().copied().map(TaskId).collect();
    // A refusal undoes what this call made: the holds taken, any claims, the new tasks.
    let undo = |held: &[TaskId]| {
        for &task in held {
            let _ = staging.release_for(page, Holder::Task(task));
        }
        let mut ledger = ledger.lock();
        owners.iter().for_each(|&t| drop(ledger.abandon(t)));
        drop(ledger);
        tasks.discard_new(&task_ids);
    };
    // The holds first: a closed staging ring (the cache failed or closed meanwhile) refuses
    // them before any slot moves.
    for (i, &task) in owners.iter().enumerate() {
        if let Err(err) = staging.hold_for(page, Holder::Task(task)) {
            undo(&owners[..i]);
            return Err(err);
        }
    }
    let mut outcomes = Vec::with_capacity(key_ids.len());
    for key_id in key_ids {
        let claimed = detach_for(py, view.len(), || {
            with_slice!(view, |s| ledger.lock().claim_many(
                s,
                &counts,
                KeyId(key_id),
                &owners
            ))
        });
        match claimed {
            Ok(out) => {
                let quiet = out.stolen_slots.is_empty() && out.preserve_slots.is_empty();
                outcomes.push((!quiet).then(|| outcome(py, out)));
            }
            Err(err) => {
                // (the slots do not fit the counts, or one is out of range or named twice:
                // refused by the first key's claim, before it changed anything)
                debug_assert!(
                    outcomes.is_empty(),
                    "only the first key's claim can be refused"
                );
                undo(&owners);
                return Err(err).py_err();
            }
        }
    }
    Ok((task_ids, outcomes))
}
