//! Atomics and locks used by the lock-free parts, swapped for loom's under `--cfg loom`
//! so the loom models in `tests/loom_*.rs` explore every interleaving of the real code.

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(loom)]
pub use loom::sync::Mutex;

#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicU64, Ordering};
