//! `block_hashes`: chained 128-bit block hashes over token ids.

use numpy::{PyArray2, PyArrayMethods};
use pcache_core::{BlockHash, BlockHasher};
use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::convert::{detach_for, with_slice, Indices};
use crate::errors::{invalid_input, repr_of, IntoPy};

/// Hashes every full block of `token_ids` (int64/int32 array or list), chained from `parent`
/// (a 128-bit int). `extra_keys`: one `bytes | None` per full block. Returns a `(num_blocks, 2)`
/// uint64 array of `[low, high]` halves; `omni_pcache.hashing.hash_blocks` gives Python ints.
/// An argument of the wrong type or out of range raises `InvalidInputError` naming it.
#[pyfunction]
#[pyo3(signature = (token_ids, block_size, parent=None, extra_keys=None))]
pub fn block_hashes<'py>(
    py: Python<'py>,
    token_ids: &Bound<'py, PyAny>,
    block_size: &Bound<'py, PyAny>,
    parent: Option<&Bound<'py, PyAny>>,
    extra_keys: Option<&Bound<'py, PyAny>>,
) -> PyResult<Bound<'py, PyArray2<u64>>> {
    let idx = Indices::extract(token_ids, "token_ids")?;
    let view = idx.slice();
    let block_size = block_size_of(block_size)?;
    let parent = parent
        .filter(|p| !p.is_none())
        .map(|p| {
            p.extract::<u128>().map_err(|_| {
                invalid_input(format!(
                    "parent must be a block hash (an int in [0, 2**128)) or None, got {}",
                    repr_of(p)
                ))
            })
        })
        .transpose()?;
    let extra_keys = extra_keys
        .filter(|e| !e.is_none())
        .map(|e| {
            e.extract::<Vec<Option<Vec<u8>>>>().map_err(|_| {
                invalid_input(format!(
                    "extra_keys must hold one bytes or None per full block, got {}",
                    repr_of(e)
                ))
            })
        })
        .transpose()?;
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

/// `block_size` as a count of tokens: an int (not a bool); the hasher checks its range. A
/// negative int is refused here with the hasher's message.
fn block_size_of(value: &Bound<'_, PyAny>) -> PyResult<usize> {
    let refused = || {
        invalid_input(format!(
            "block_size must be 1 to {} tokens, got {}",
            pcache_core::hashing::MAX_BLOCK_SIZE,
            repr_of(value)
        ))
    };
    if value.is_instance_of::<PyBool>() {
        return Err(refused());
    }
    let size = value.extract::<i64>().map_err(|_| refused())?;
    usize::try_from(size).map_err(|_| refused())
}
