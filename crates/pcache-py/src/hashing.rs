//! `block_hashes`: chained 128-bit block hashes over token ids.

use numpy::{PyArray2, PyArrayMethods};
use pcache_core::{BlockHash, BlockHasher};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyList, PyTuple};

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
            let not_bool = (!p.is_instance_of::<PyBool>()).then_some(p);
            not_bool
                .and_then(|p| p.extract::<u128>().ok())
                .ok_or_else(|| {
                    invalid_input(format!(
                        "parent must be a block hash (an int in [0, 2**128)) or None, got {}",
                        repr_of(p)
                    ))
                })
        })
        .transpose()?;
    let extra_keys = extra_keys
        .filter(|e| !e.is_none())
        .map(extra_keys_of)
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

/// One `bytes` (or `bytearray`) or `None` per full block, from a list or tuple: anything else
/// (a str, a dict, a tuple of ints that would read as bytes) is refused, so keys of another
/// type never hash like some bytes.
fn extra_keys_of(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Option<Vec<u8>>>> {
    let refused = || {
        invalid_input(format!(
            "extra_keys must be a list of bytes or None, one per full block, got {}",
            repr_of(keys)
        ))
    };
    let items: Vec<Bound<'_, PyAny>> = if let Ok(list) = keys.cast::<PyList>() {
        list.iter().collect()
    } else if let Ok(tuple) = keys.cast::<PyTuple>() {
        tuple.iter().collect()
    } else {
        return Err(refused());
    };
    items
        .iter()
        .map(|k| {
            if k.is_none() {
                Ok(None)
            } else if let Ok(b) = k.cast::<PyBytes>() {
                Ok(Some(b.as_bytes().to_vec()))
            } else if let Ok(b) = k.cast::<PyByteArray>() {
                Ok(Some(b.to_vec()))
            } else {
                Err(refused())
            }
        })
        .collect()
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
