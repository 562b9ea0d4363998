//! `scatter_plan`: a slot list as runs of consecutive slots, for the pool writer's run-by-run
//! copy (see `pcache_core::scatter_plan`).

use numpy::PyArray1;
use pyo3::prelude::*;

use crate::convert::{int_array, IndexSlice, Indices};

/// `(lengths, bounds, order)` of the runs of `slots` (an int64 or int32 array): run lengths in
/// row order, `start, end` of each run sorted by slot, and the row-order index of each sorted
/// run; `None` when a slot appears twice (runs overlap).
#[pyfunction]
#[allow(clippy::type_complexity)]
pub fn scatter_plan(
    py: Python<'_>,
    slots: &Bound<'_, PyAny>,
) -> PyResult<Option<(Py<PyArray1<i64>>, Py<PyArray1<i64>>, Py<PyArray1<i64>>)>> {
    let plan = match Indices::extract(slots, "slots")?.slice() {
        IndexSlice::I64(s) => pcache_core::scatter_plan::ScatterPlan::new(s),
        IndexSlice::I32(s) => {
            let wide: Vec<i64> = s.iter().map(|&v| i64::from(v)).collect();
            pcache_core::scatter_plan::ScatterPlan::new(&wide)
        }
    };
    Ok(plan.map(|plan| {
        (
            int_array(py, plan.lengths),
            int_array(py, plan.bounds),
            int_array(py, plan.order),
        )
    }))
}
