//! Errors are data: every variant carries what a caller needs to act on it, and the binding
//! maps each variant to a Python exception class in one exhaustive `match`.
//!
//! Expected outcomes on hot paths (a stale queue entry, a slot stolen by a newer tenant,
//! a read whose slots moved) are return values, never errors.

use std::time::Duration;

use crate::ids::{KeyId, ReadId, StepId, TaskId};
use crate::staging::Holder;
use crate::task_state::TaskState;

/// Step ids as the numbers a caller passes back (`[0, 3]`), as the binding's `outstanding`
/// attribute lists them.
fn plain_ids(ids: &[StepId]) -> String {
    format!("{:?}", ids.iter().map(|id| id.0).collect::<Vec<_>>())
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every way a core operation can be refused. A refused operation changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A write-task transition that is not an edge of the state machine.
    #[error("{task}: illegal transition {} -> {}", from.name(), to.name())]
    IllegalTransition {
        task: TaskId,
        from: TaskState,
        to: TaskState,
    },

    /// A task id that was never issued or has already been removed.
    #[error("unknown {task}")]
    UnknownTask { task: TaskId },

    /// A task id that is already live (ids are issued once).
    #[error("{task} already exists")]
    DuplicateTask { task: TaskId },

    /// A slot id outside `[0, num_slots)` (negative ids included).
    #[error("slot id {slot} at position {position} is out of range [0, {num_slots})")]
    SlotOutOfRange {
        slot: i64,
        position: usize,
        num_slots: u32,
    },

    /// The same slot twice in one claim (or one step's slot mapping).
    #[error("slot id {slot} appears twice (positions {first} and {second})")]
    DuplicateSlot {
        slot: u32,
        first: usize,
        second: usize,
    },

    /// A key id that was never registered.
    #[error("unknown {key} (registered keys: {num_keys})")]
    UnknownKey { key: KeyId, num_keys: u32 },

    /// A read id that was never planned or has already been released.
    #[error("unknown {read} (never planned, or already released)")]
    UnknownRead { read: ReadId },

    /// A step id consumed a second time.
    #[error(
        "{step} was already consumed; outstanding step ids: {}",
        plain_ids(outstanding)
    )]
    StepAlreadyConsumed {
        step: StepId,
        outstanding: Vec<StepId>,
    },

    /// A step id that was never issued.
    #[error(
        "{step} was never issued; outstanding step ids: {}",
        plain_ids(outstanding)
    )]
    UnknownStep {
        step: StepId,
        outstanding: Vec<StepId>,
    },

    /// No staging slot became free within the timeout.
    #[error(
        "no staging slot free after {timeout:?}; holders per slot: {}",
        fmt_holders(holders)
    )]
    StagingTimeout {
        timeout: Duration,
        holders: Vec<Vec<Holder>>,
    },

    /// A staging slot index outside the registry.
    #[error("staging slot {slot} is out of range [0, {num_slots})")]
    StagingSlotOutOfRange { slot: usize, num_slots: usize },

    /// Releasing a holder that does not hold that staging slot.
    #[error("{holder:?} does not hold staging slot {slot} (holders: {holders:?})")]
    NotAHolder {
        slot: usize,
        holder: Holder,
        holders: Vec<Holder>,
    },

    /// The staging registry was closed; every waiter is woken with this.
    #[error("staging registry is closed")]
    StagingClosed,

    /// A block table entry outside the engine's KV cache.
    #[error("block id {block} at position {position} is out of range [0, {num_blocks})")]
    BlockOutOfRange {
        block: i64,
        position: usize,
        num_blocks: u32,
    },

    /// A registry or ledger asked to be built with no capacity, or a bad size.
    #[error("invalid configuration: {what}")]
    InvalidConfig { what: String },

    /// Arguments that do not fit together (lengths, token ids, block sizes).
    #[error("invalid input: {what}")]
    InvalidInput { what: String },
}

fn fmt_holders(holders: &[Vec<Holder>]) -> String {
    let parts: Vec<String> = holders
        .iter()
        .enumerate()
        .map(|(slot, h)| format!("{slot}: {h:?}"))
        .collect();
    format!("{{{}}}", parts.join(", "))
}
