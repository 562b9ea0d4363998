//! `scatter_rows`: a step's rows copied into the host pool's slots (see
//! `pcache_core::row_scatter`), without the GIL.

use numpy::{PyReadonlyArray2, PyReadwriteArray2, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::convert::{IndexSlice, Indices};
use crate::errors::invalid_input;

/// Copies row `i` of `rows` to row `slots[i]` of `pool`: both C-contiguous 2-D `uint8`
/// arrays with rows of the same byte width (the pool writer passes byte views of its torch
/// tensors), one copy per run of consecutive slots. Raises `InvalidInputError`, having
/// written nothing, for a slot outside the pool, a row count or width that does not match, or
/// a non-contiguous array. The pool's single writer calls it (see `omni_pcache.pool`).
///
/// The copy always runs without the GIL, however short: a writer thread that held it here
/// would keep the engine thread waiting for it after each of the engine's own GIL releases
/// (measured: +1.3 ms per decode step of 256 requests when held).
#[pyfunction]
pub fn scatter_rows(
    py: Python<'_>,
    mut pool: PyReadwriteArray2<'_, u8>,
    rows: PyReadonlyArray2<'_, u8>,
    slots: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let row_bytes = pool.shape()[1];
    if rows.shape()[1] != row_bytes {
        return Err(invalid_input(format!(
            "scatter_rows: rows of {} bytes into a pool of {row_bytes}-byte rows",
            rows.shape()[1]
        )));
    }
    let indices = Indices::extract(slots, "slots")?;
    let wide: Vec<i64>;
    let slots: &[i64] = match indices.slice() {
        IndexSlice::I64(s) => s,
        IndexSlice::I32(s) => {
            wide = s.iter().map(|&v| i64::from(v)).collect();
            &wide
        }
    };
    let not_contiguous =
        || invalid_input("scatter_rows: pool and rows must be C-contiguous".to_owned());
    let rows = rows.as_slice().map_err(|_| not_contiguous())?;
    let pool = pool.as_slice_mut().map_err(|_| not_contiguous())?;
    py.detach(|| pcache_core::row_scatter::scatter_rows(pool, rows, row_bytes, slots))
        .map_err(|err| invalid_input(format!("scatter_rows: {err}")))
}
