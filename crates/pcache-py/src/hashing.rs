//! `block_hashes`: chained 128-bit block hashes over token ids.

use numpy::{PyArray2, PyArrayMethods};
use pcache_core::{BlockHash, BlockHasher};
use pyo3::prelude::*;

use crate::convert::{detach_for, with_slice, Indices};
use crate::errors::{invalid_input, IntoPy};

/// Hashes every full block of `token_ids` (int64/int32 array or list), chained from `parent`
/// (a 128-bit int). `extra_keys`: one `bytes | None` per full block. Returns a `(num_blocks, 2)`
/// uint64 array of `[low, high]` halves; `omni_pcache.hashing.hash_blocks` gives Python ints.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, parent=None, extra_keys=None))]
pub fn block_hashes<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    block_size: usize,
    parent: Option<u128>,
    extra_keys: Option<Vec<Option<Vec<u8>>>>,
) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let idx = Indices::extract(token_ids, "token_ids")?;
    let view = idx.slice();
    let mut hasher = BlockHasher::new(block_size).py_err()?;
    let extra: Option<Vec<Option<&[u8]>>> = extra_keys
        .as_ref()
        .map(|e| e.iter().map(|k| k.as_deref()).collect());
    let hashes = detach_for(py, view.len(), || {
        with_slice!(view, |s| hasher.hash_blocks(
            s,
            parent.map(BlockHash),
            extra.as_deref()
        ))
    })
    .py_err()?;
    let flat: Vec<u64> = hashes
        .iter()
        .flat_map(|h| [h.0 as u64, (h.0 >> 64) as u64])
        .collect();
    numpy::IntoPyArray::into_pyarray(flat, py)
        .reshape([hashes.len(), 2])
        .map_err(|e| invalid_input(format!("internal reshape failed: {e}")))
}
