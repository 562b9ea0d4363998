//! `omni_pcache._native`: a thin PyO3 binding of `pcache-core`.
//!
//! No logic lives here: each method converts its arguments to Rust first (numpy index arrays
//! are borrowed, not copied), releases the GIL for waits and for loops over long slot or token
//! lists (short calls keep it: see `convert::detach_for`), calls the core, and maps errors in
//! one place ([`errors`]).

mod batch;
mod block_table;
mod claims;
mod convert;
mod delivery;
mod errors;
mod hashing;
mod ledger;
mod prefetch;
mod registries;
mod row_bytes;
mod scatter;
mod tasks;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("SOURCE_ABSENT", pcache_core::ledger::SOURCE_ABSENT)?;
    m.add("SOURCE_POOL", pcache_core::ledger::SOURCE_POOL)?;
    m.add("HASH_SEED", pcache_core::hashing::HASH_SEED)?;
    m.add(
        "MAX_DROPPED_SAVES",
        pcache_core::delivery::MAX_DROPPED_SAVES,
    )?;
    m.add_class::<tasks::WriteTasks>()?;
    m.add_class::<ledger::Ledger>()?;
    m.add_class::<ledger::ClaimOutcome>()?;
    m.add_class::<ledger::ReadPlan>()?;
    m.add_class::<registries::StepIds>()?;
    m.add_class::<registries::StagingSlots>()?;
    m.add_class::<delivery::Deliveries>()?;
    m.add_function(wrap_pyfunction!(hashing::block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(batch::check_batch, m)?)?;
    m.add_function(wrap_pyfunction!(block_table::block_table, m)?)?;
    m.add_function(wrap_pyfunction!(block_table::block_slots, m)?)?;
    m.add_function(wrap_pyfunction!(claims::claim_step, m)?)?;
    m.add_function(wrap_pyfunction!(scatter::scatter_rows, m)?)?;
    m.add_function(wrap_pyfunction!(prefetch::prefetch_rows, m)?)?;
    m.add_function(wrap_pyfunction!(scatter::write_step_rows, m)?)?;
    m.add_function(wrap_pyfunction!(scatter::close_step_writes, m)?)?;
    m.add_function(wrap_pyfunction!(scatter::write_step_now, m)?)?;
    Ok(())
}
