//! `Deliveries`: the live requests' delivered spans (`pcache_core::delivery`), with a step's
//! events checked and registered in one call (`begin`) and a save's rows taken in another
//! (`take_step`). Engine thread only: `PrefixCache.begin_step` and `PrefixCache.save`.

use std::collections::HashSet;

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString, PyTuple, PyType};

use crate::block_table::checked_table;
use crate::convert::int_array;
use crate::errors::{invalid_input, repr_of, IntoPy};

/// One checked new or resumed request of a step's events.
struct Scheduled {
    req_id: String,
    blocks: Vec<i64>,
    num_computed: usize,
}

/// A pool read `begin` planned: `(req_id, slots, room)`, ``room`` the positions the request's
/// table holds past the read (where this step's rows go).
type Planned = (String, Py<PyArray1<i64>>, usize);

/// What `begin` returns: `(hits, misses, reentered, planned)`.
type Begun = (usize, usize, Vec<String>, Vec<Planned>);

/// A request id: a `str` that is valid UTF-8 (not a lone surrogate); else
/// `InvalidInputError("{what} holds request ids (str, valid UTF-8), got ...")`. `what` is
/// formatted only for that error (callers pass `format_args!`: nothing is built per id).
fn req_id_of(value: &Bound<'_, PyAny>, what: &dyn std::fmt::Display) -> PyResult<String> {
    match value.cast::<PyString>().map(|s| s.to_str()) {
        Ok(Ok(text)) => Ok(text.to_owned()),
        _ => Err(invalid_input(format!(
            "{what} holds request ids (str, valid UTF-8), got {}",
            repr_of(value)
        ))),
    }
}

/// The `{req_id: n}` entries of `StepEvents.{field}`, each `n` an int >= 0 (else
/// `InvalidInputError` saying it must be `what`), with their keys as given.
fn id_counts<'py>(
    map: &Bound<'py, PyDict>,
    field: &str,
    what: &str,
) -> PyResult<Vec<(String, usize, Bound<'py, PyAny>)>> {
    let mut out = Vec::with_capacity(map.len());
    for (key, value) in map.iter() {
        let req_id = req_id_of(&key, &format_args!("StepEvents.{field}"))?;
        let n = value
            .extract::<usize>()
            .ok()
            .filter(|_| !value.is_instance_of::<PyBool>())
            .ok_or_else(|| {
                invalid_input(format!(
                    "StepEvents.{field}[{}] must be {what}, got {}",
                    repr_of(&key),
                    repr_of(&value)
                ))
            })?;
        out.push((req_id, n, key));
    }
    Ok(out)
}

/// The live requests' delivered spans, keyed by request id (see `pcache_core::delivery`).
#[pyclass(module = "omni_pcache._native")]
pub struct Deliveries {
    inner: pcache_core::delivery::Deliveries,
}

impl Deliveries {
    /// Checks one new or resumed request (nothing changes here).
    fn check_request(
        &self,
        kind: &str,
        req: &Bound<'_, PyAny>,
        ending: &HashSet<&str>,
        num_blocks: u32,
    ) -> PyResult<Scheduled> {
        let py_id = req.getattr(pyo3::intern!(req.py(), "req_id"))?;
        let req_id = req_id_of(&py_id, &format_args!("StepEvents.{kind} (its req_id)"))?;
        let id = || repr_of(&py_id); // (built only for an error message)
        let computed = req.getattr(pyo3::intern!(req.py(), "num_computed_tokens"))?;
        let num_computed = if computed.is_instance_of::<PyBool>() {
            None
        } else {
            computed.extract::<i64>().ok().filter(|&c| c >= 0)
        }
        .ok_or_else(|| {
            invalid_input(format!(
                "{}: num_computed_tokens must be an int >= 0, got {}",
                id(),
                repr_of(&computed)
            ))
        })? as usize;
        let blocks = checked_table(
            &req.getattr(pyo3::intern!(req.py(), "block_ids"))?,
            num_blocks,
        )
        .map_err(|err| {
            let why = err
                .value(req.py())
                .str()
                .map(|s| s.to_string())
                .unwrap_or_default();
            invalid_input(format!("{}: {why}", id()))
        })?;
        let bs = self.inner.block_size() as usize;
        if num_computed > blocks.len() * bs {
            return Err(invalid_input(format!(
                "{}: num_computed_tokens={num_computed} exceeds its {} blocks of {bs}",
                id(),
                blocks.len()
            )));
        }
        let hit = ending.contains(req_id.as_str()) || !self.inner.is_live(&req_id);
        if hit && !num_computed.is_multiple_of(bs) {
            return Err(invalid_input(format!(
                "{}: num_computed_tokens={num_computed} is not a whole number of blocks \
                 (block_size={bs}); prefix hits are whole blocks",
                id()
            )));
        }
        Ok(Scheduled {
            req_id,
            blocks,
            num_computed,
        })
    }
}

#[pymethods]
impl Deliveries {
    /// Raises `ConfigError` for a block size of 0.
    #[new]
    fn new(block_size: u32) -> PyResult<Self> {
        Ok(Self {
            inner: pcache_core::delivery::Deliveries::new(block_size).py_err()?,
        })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Checks a step's events, then registers them: the `finished` ids are forgotten, the
    /// `dropped` positions (`{req_id: position}`) of live requests scheduled again in these
    /// events (new or resumed; else refused) count as not delivered, as do the rows the last
    /// `n` saves returned for each `dropped_saves` entry `{req_id: n}` (the same conditions, and
    /// `n` from 1 to the saves it had, at most `MAX_DROPPED_SAVES`), then
    /// each `new` and `resumed` request (instances of `new_type` and `resumed_type`) is scheduled
    /// with its block table. A request that is not live (or finishes in these events) with
    /// `num_computed_tokens > 0` is a prefix hit and must cover whole blocks; a live one may
    /// have computed any count. Returns `(hits, misses, reentered, planned)`: the new hits and
    /// misses, the live requests scheduled again (resumed, or continued as new), in event
    /// order, and with `plan_reads` the pool reads planned for their next save, `(req_id, slots,
    /// room)` in event order (``room``: positions the table holds past the read; what a
    /// prefetch gathers early; none made without it, when nothing would prefetch them).
    /// Raises `InvalidInputError` for the first problem, having changed nothing.
    #[allow(clippy::too_many_arguments)] // (the events' parts, and the two request types)
    fn begin(
        &mut self,
        finished: &Bound<'_, PyAny>,
        new: &Bound<'_, PyAny>,
        resumed: &Bound<'_, PyAny>,
        new_type: &Bound<'_, PyType>,
        resumed_type: &Bound<'_, PyType>,
        num_blocks: u32,
        dropped: &Bound<'_, PyDict>,
        dropped_saves: &Bound<'_, PyDict>,
        plan_reads: bool,
    ) -> PyResult<Begun> {
        let finished = finished
            .try_iter()?
            .map(|id| req_id_of(&id?, &"StepEvents.finished"))
            .collect::<PyResult<Vec<_>>>()?;
        let undelivered = id_counts(dropped, "dropped", "a position (an int >= 0)")?;
        let saves_undelivered = id_counts(
            dropped_saves,
            "dropped_saves",
            "a number of saves (an int >= 1)",
        )?;
        let ending: HashSet<&str> = finished.iter().map(String::as_str).collect();
        let mut scheduled = Vec::new();
        let mut seen = HashSet::new();
        for (kind, requests, cls) in [("new", new, new_type), ("resumed", resumed, resumed_type)] {
            for req in requests.try_iter()? {
                let req = req?;
                if !req.is_instance(cls)? {
                    return Err(invalid_input(format!(
                        "StepEvents.{kind} holds {}s, got {}",
                        cls.name()?,
                        req.get_type().name()?
                    )));
                }
                let checked = self.check_request(kind, &req, &ending, num_blocks)?;
                if !seen.insert(checked.req_id.clone()) {
                    return Err(invalid_input(format!(
                        "request {} is scheduled twice in one step's events",
                        repr_of(&req.getattr(pyo3::intern!(req.py(), "req_id"))?)
                    )));
                }
                scheduled.push(checked);
            }
        }
        let named = undelivered
            .iter()
            .map(|(req_id, _, key)| ("dropped", req_id, key))
            .chain(
                saves_undelivered
                    .iter()
                    .map(|(req_id, _, key)| ("dropped_saves", req_id, key)),
            );
        for (field, req_id, key) in named {
            let not = if ending.contains(req_id.as_str()) || !self.inner.is_live(req_id) {
                "is not live (never scheduled, or finished): no rows saved for it were dropped"
            } else if !seen.contains(req_id) {
                "these events do not schedule again (new or resumed): its dropped rows would never be delivered"
            } else {
                continue;
            };
            return Err(invalid_input(format!(
                "StepEvents.{field} names request {}, which {not}",
                repr_of(key)
            )));
        }
        for (req_id, count, _) in &saves_undelivered {
            self.inner.check_dropped_saves(req_id, *count).py_err()?;
        }
        for req_id in &finished {
            self.inner.finish(req_id);
        }
        for (req_id, position, _) in &undelivered {
            self.inner.undeliver_from(req_id, *position);
        }
        for (req_id, count, _) in &saves_undelivered {
            // (cannot be refused: checked above)
            self.inner.undeliver_saves(req_id, *count).py_err()?;
        }
        let (mut hits, mut misses, mut reentered, mut planned) = (0, 0, Vec::new(), Vec::new());
        let bs = self.inner.block_size() as usize;
        let py = new.py();
        for req in scheduled {
            if self.inner.is_live(&req.req_id) {
                reentered.push(req.req_id.clone());
            } else if req.num_computed > 0 {
                hits += 1;
            } else {
                misses += 1;
            }
            // (cannot be refused: the span was checked against the table above)
            let reads = self
                .inner
                .schedule(&req.req_id, &req.blocks, req.num_computed)
                .py_err()?;
            if reads && plan_reads {
                let slots = self.inner.pending_read(&req.req_id).unwrap_or_default();
                let room = (req.blocks.len() * bs).saturating_sub(req.num_computed);
                planned.push((req.req_id, int_array(py, slots.to_vec()), room));
            }
        }
        Ok((hits, misses, reentered, planned))
    }

    /// A save of each request's `{req_id: (first_row, count)}` rows (`check_batch`'s, in batch
    /// order). Returns `{req_id: (first_row, count, drop)}` (``drop``: leading rows already
    /// delivered, not to be returned again) and the pool reads due now, `{req_id: slots}`.
    fn take_step<'py>(
        &mut self,
        rows: &Bound<'py, PyDict>,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
        let py = rows.py();
        let mut keys = Vec::with_capacity(rows.len());
        let mut spans = Vec::with_capacity(rows.len());
        let mut subclassed = false;
        for (req_id, span) in rows.iter() {
            let (first_row, count): (usize, usize) = span.extract()?;
            subclassed |= !req_id.is_exact_instance_of::<PyString>();
            spans.push((req_id_of(&req_id, &"StepBatch.req_ids")?, first_row, count));
            keys.push(req_id);
        }
        // A dict's exact-str keys are distinct strings; a str subclass with its own equality
        // can make two keys of one text, which the core takes as one request named twice.
        if subclassed {
            let mut seen = std::collections::HashSet::with_capacity(spans.len());
            if let Some((twice, _, _)) = spans.iter().find(|(r, _, _)| !seen.insert(r.as_str())) {
                return Err(invalid_input(format!(
                    "StepBatch.req_ids names request {twice:?} twice"
                )));
            }
        }
        let (out, reads) = self
            .inner
            .take_step(spans.iter().map(|(r, f, c)| (r.as_str(), *f, *c)))
            .py_err()?;
        let by_req = PyDict::new(py);
        for (key, step) in keys.iter().zip(out) {
            let span = PyTuple::new(py, [step.first_row, step.count, step.drop])?;
            by_req.set_item(key, span)?;
        }
        let due = PyDict::new(py);
        for (i, slots) in reads {
            due.set_item(&keys[i], int_array(py, slots))?;
        }
        Ok((by_req, due))
    }
}
