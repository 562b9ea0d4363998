//! `RowBytes`: a C-contiguous numpy array borrowed read-only as the bytes of its rows (its
//! first dimension), whatever its element type. The step writers read a staging page this way
//! (uint8 rows), and a small step's rows straight from the caller's arrays in the dtype they
//! have (`write_step_now`), so the saving thread needs no uint8 view of them first.

use numpy::{PyArrayDyn, PyArrayMethods, PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;

/// A borrowed array of one of the element types numpy arrays of a torch tensor have after
/// `omni_pcache.row_arrays.numpy_rows` (floats other than 32/64-bit and bools arrive as
/// same-width integers).
pub enum RowBytes<'py> {
    U8(PyReadonlyArrayDyn<'py, u8>),
    I8(PyReadonlyArrayDyn<'py, i8>),
    I16(PyReadonlyArrayDyn<'py, i16>),
    I32(PyReadonlyArrayDyn<'py, i32>),
    I64(PyReadonlyArrayDyn<'py, i64>),
    F32(PyReadonlyArrayDyn<'py, f32>),
    F64(PyReadonlyArrayDyn<'py, f64>),
}

/// Evaluates `$body` with `$a` bound to the typed readonly array of a [`RowBytes`].
macro_rules! each_array {
    ($rows:expr, |$a:ident| $body:expr) => {
        match $rows {
            RowBytes::U8($a) => $body,
            RowBytes::I8($a) => $body,
            RowBytes::I16($a) => $body,
            RowBytes::I32($a) => $body,
            RowBytes::I64($a) => $body,
            RowBytes::F32($a) => $body,
            RowBytes::F64($a) => $body,
        }
    };
}

impl<'py> RowBytes<'py> {
    /// Borrows `obj` read-only. Refused, with the reason (for the caller's error message): not
    /// a numpy array of a supported element type, no dimensions, not C-contiguous (a
    /// column-major array is contiguous too, but its bytes are not rows), or an array another
    /// Rust borrow is writing.
    pub fn borrow(obj: &Bound<'py, PyAny>) -> Result<Self, String> {
        macro_rules! typed {
            ($($t:ty => $variant:ident),*) => {
                $(if let Ok(array) = obj.cast::<PyArrayDyn<$t>>() {
                    if array.ndim() == 0 || !array.is_c_contiguous() {
                        return Err("rows must be a C-contiguous array of at least one dimension".into());
                    }
                    if !crate::convert::is_aligned(array) {
                        return Err("rows must be aligned for their element type (not a view at an odd byte offset)".into());
                    }
                    return array.try_readonly().map(RowBytes::$variant).map_err(|err| err.to_string());
                })*
            };
        }
        typed!(u8 => U8, f32 => F32, i16 => I16, i64 => I64, i32 => I32, i8 => I8, f64 => F64);
        Err(format!(
            "rows must be a numpy array of uint8, int8, int16, int32, int64, float32 or float64, got {}",
            crate::errors::describe(obj)
        ))
    }

    /// Rows: the length of the first dimension.
    pub fn rows(&self) -> usize {
        each_array!(self, |a| a.shape()[0])
    }

    /// Bytes per row: the other dimensions' elements times the element size (`None` past
    /// `usize::MAX`), whatever the number of rows.
    pub fn row_bytes(&self) -> Option<usize> {
        each_array!(self, |a| row_bytes_of(a))
    }

    /// Every row's bytes, in order; an error if the array is no longer C-contiguous (checked
    /// at [`RowBytes::borrow`], but another Python thread may have set its strides since).
    pub fn bytes(&self) -> Result<&[u8], numpy::NotContiguousError> {
        each_array!(self, |a| a.as_slice().map(bytemuck::cast_slice))
    }
}

/// [`RowBytes::row_bytes`] of one typed array.
fn row_bytes_of<T: numpy::Element>(array: &PyReadonlyArrayDyn<'_, T>) -> Option<usize> {
    (array.shape()[1..].iter()).try_fold(std::mem::size_of::<T>(), |n, &d| n.checked_mul(d))
}
