//! `scatter_rows`: a step's rows copied into the host pool's slots (see
//! `pcache_core::row_scatter`), without the GIL.

use numpy::{PyArray2, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::convert::{IndexSlice, Indices};
use crate::errors::invalid_input;

/// Copies row `i` of `rows` to row `slots[i]` of `pool`: both C-contiguous 2-D `uint8`
/// arrays with rows of the same byte width (the pool writer passes byte views of its torch
/// tensors), one copy per run of consecutive slots. Raises `InvalidInputError`, having
/// written nothing, for a slot outside the pool, a row count or width that does not match, an
/// array that is not C-contiguous (column-major included), the same array or overlapping
/// views as both, or a read-only pool. The pool's single writer calls it (see
/// `omni_pcache.pool`).
///
/// The copy always runs without the GIL, however short: a writer thread that held it here
/// would keep the engine thread waiting for it after each of the engine's own GIL releases
/// (measured: +1.3 ms per decode step of 256 requests when held).
#[pyfunction]
pub fn scatter_rows(
    py: Python<'_>,
    pool: &Bound<'_, PyArray2<u8>>,
    rows: &Bound<'_, PyArray2<u8>>,
    slots: &Bound<'_, PyAny>,
) -> PyResult<()> {
    // Row-major only: a column-major array is contiguous too, but its bytes are not rows.
    if !pool.is_c_contiguous() || !rows.is_c_contiguous() {
        return Err(invalid_input(
            "scatter_rows: pool and rows must be C-contiguous".to_owned(),
        ));
    }
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
    // Borrow-checked: the same array twice, overlapping views of one array or a read-only
    // pool are refused here (as InvalidInputError, not a panic).
    let rows = rows
        .try_readonly()
        .map_err(|err| invalid_input(format!("scatter_rows: rows: {err}")))?;
    let mut pool = pool
        .try_readwrite()
        .map_err(|err| invalid_input(format!("scatter_rows: pool: {err}")))?;
    let rows = rows.as_slice().expect("checked C-contiguous");
    let pool = pool.as_slice_mut().expect("checked C-contiguous");
    py.detach(|| pcache_core::row_scatter::scatter_rows(pool, rows, row_bytes, slots))
        .map_err(|err| invalid_input(format!("scatter_rows: {err}")))
}
