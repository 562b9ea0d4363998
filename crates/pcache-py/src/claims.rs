//! `claim_step`: what `PrefixCache.save` does for a step's immediate keys, in one call: one
//! write task per request with rows, their slots claimed on every key, and their hold on the
//! step's staging page.

use pcache_core::{Holder, KeyId, TaskId};
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
/// built for it). A refused claim (`InvalidInputError`: the slots do not fit the counts, or a
/// slot is out of range or named twice) leaves no task behind. The caller holds the cache's
/// ledger lock, as for the claims it replaces.
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
    let tasks = tasks.get();
    let task_ids = tasks.create_ids(counts.len());
    let owners: Vec<TaskId> = task_ids.iter().copied().map(TaskId).collect();
    let ledger = ledger.get();
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
        let out = match claimed {
            Ok(out) => out,
            Err(err) => {
                // Refused (checked before it changed anything): the new tasks and any claim an
                // earlier key made for them go, so the refused call leaves no task behind.
                let mut ledger = ledger.lock();
                owners.iter().for_each(|&t| drop(ledger.abandon(t)));
                tasks.discard_new(&task_ids);
                return Err(err).py_err();
            }
        };
        let quiet = out.stolen_slots.is_empty() && out.preserve_slots.is_empty();
        outcomes.push((!quiet).then(|| outcome(py, out)));
    }
    let staging = staging.get();
    for &task in &owners {
        staging.hold_for(page, Holder::Task(task))?;
    }
    Ok((task_ids, outcomes))
}
