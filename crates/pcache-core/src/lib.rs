//! Core of omni_pcache: every decision about *which* per-token rows go *where* and *when*.
//!
//! This crate is pure Rust (no Python) and holds no tensors. It owns:
//!
//! - [`task_state`]: the write-task state machine
//!   (PENDING → QUEUED → COPYING → HOST_READY → WRITTEN, FAILED from any non-terminal state),
//!   one atomic word per task;
//! - [`tasks`]: the table of live write tasks, addressed by [`TaskId`];
//! - [`queues`]: the lock-free copy queues (escalated, high, low) and the completion queue;
//! - [`ledger`]: per (slot, key) occupancy and versions, pending reads and the
//!   copy-on-write preservation lists;
//! - [`step_ids`]: exactly-once step ids;
//! - [`staging`]: the staging-slot registry (a ring of pages with holders and timeouts);
//! - [`batch`]: a step's batch checked (token count, slot mapping) and its requests' rows;
//! - [`block_table`]: block tables checked, and the slots of a span of positions;
//! - [`delivery`]: what each live request's consumer has been given (resumed and continued
//!   requests get each row once);
//! - [`row_scatter`]: rows copied into the pool slots a slot list names, run by run;
//! - [`hashing`]: chained 128-bit block hashes over token ids.
//!
//! The Python binding (`crates/pcache-py`) is a thin layer over these types.

pub mod batch;
pub mod block_table;
pub mod delivery;
pub mod error;
pub mod hashing;
pub mod ids;
pub mod ledger;
pub mod ledger_outcomes;
pub mod prefetch;
pub mod queues;
pub mod row_scatter;
mod slot_columns;
pub mod slot_runs;
pub mod staging;
pub mod step_ids;
pub mod sync;
pub mod task_state;
pub mod tasks;

pub use error::{Error, Result};
pub use hashing::{BlockHash, BlockHasher};
pub use ids::{KeyId, ReadId, SlotId, StepId, TaskId, Version};
pub use ledger::{ClaimOutcome, Ledger, ReadPlan, Source};
pub use queues::{CopyQueues, Escalation, Priority};
pub use staging::{Holder, StagingSlots};
pub use step_ids::StepIds;
pub use task_state::{Snapshot, TaskState, TaskStateCell};
pub use tasks::{Task, TaskTable};
