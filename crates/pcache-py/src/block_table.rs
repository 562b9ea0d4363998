//! `block_table` and `block_slots`: a request's block ids checked into an int64 array, and the
//! slot ids of a span of positions under such a table (engine thread; see
//! `pcache_core::block_table`). A step's slot mapping is checked by `check_batch`.

use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyTuple};

use crate::convert::{int_array, uint_arg, IndexSlice, Indices};
use crate::errors::{invalid_input, repr_of, IntoPy};

/// One block id of a list or tuple: an int (or numpy integer), never a bool.
fn block_id(item: &Bound<'_, PyAny>, position: usize) -> PyResult<i64> {
    if item.is_instance_of::<PyBool>() {
        return Err(invalid_input(format!(
            "block_ids must be a list of ints, got {item} at position {position}"
        )));
    }
    item.extract::<i64>().map_err(|_| {
        let shown = repr_of(item);
        invalid_input(format!(
            "block_ids must be a list of ints, got {shown} at position {position}"
        ))
    })
}

/// `blocks` (a list or tuple of ints, or a 1-D int64/int32 array) as an int64 array, every id
/// checked to be in `[0, num_blocks)`. Raises `InvalidInputError` naming the first bad entry.
#[pyfunction]
pub fn block_table(
    py: Python<'_>,
    blocks: &Bound<'_, PyAny>,
    num_blocks: &Bound<'_, PyAny>,
) -> PyResult<Py<PyArray1<i64>>> {
    let num_blocks = uint_arg(num_blocks, "num_blocks", u64::from(u32::MAX))? as u32;
    Ok(int_array(py, checked_table(blocks, num_blocks)?))
}

/// What `block_table` checks and returns, as a `Vec`.
pub fn checked_table(blocks: &Bound<'_, PyAny>, num_blocks: u32) -> PyResult<Vec<i64>> {
    let table: Vec<i64> = if let Ok(list) = blocks.cast::<PyList>() {
        list.iter()
            .enumerate()
            .map(|(i, item)| block_id(&item, i))
            .collect::<PyResult<_>>()?
    } else if let Ok(tuple) = blocks.cast::<PyTuple>() {
        tuple
            .iter()
            .enumerate()
            .map(|(i, item)| block_id(&item, i))
            .collect::<PyResult<_>>()?
    } else {
        match Indices::extract(blocks, "block_ids")?.slice() {
            IndexSlice::I64(s) => s.to_vec(),
            IndexSlice::I32(s) => s.iter().map(|&b| i64::from(b)).collect(),
        }
    };
    pcache_core::block_table::check_block_ids(&table, num_blocks).py_err()?;
    Ok(table)
}

/// Slot ids of positions `[start, stop)` under a checked int64 block table.
#[pyfunction]
pub fn block_slots(
    py: Python<'_>,
    table: &Bound<'_, PyAny>,
    start: &Bound<'_, PyAny>,
    stop: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
) -> PyResult<Py<PyArray1<i64>>> {
    let start = uint_arg(start, "start", i64::MAX as u64)? as usize;
    let stop = uint_arg(stop, "stop", i64::MAX as u64)? as usize;
    let block_size = uint_arg(block_size, "block_size", u64::from(u32::MAX))? as u32;
    let slots = match Indices::extract(table, "table")?.slice() {
        IndexSlice::I64(s) => pcache_core::block_table::slots_of(s, start, stop, block_size),
        IndexSlice::I32(s) => {
            let wide: Vec<i64> = s.iter().map(|&b| i64::from(b)).collect();
            pcache_core::block_table::slots_of(&wide, start, stop, block_size)
        }
    }
    .py_err()?;
    Ok(int_array(py, slots))
}
