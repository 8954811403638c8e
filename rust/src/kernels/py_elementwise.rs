//! Bindings of the element-wise CPU kernels (`super::elementwise`), registered by `super::py`:
//! numpy views of torch tensors (float32; a cache in bfloat16 as its uint16 bits), checked for
//! shape and layout, outputs written in place, the GIL released while a kernel runs. (T, H, D)
//! inputs may be strided views (q, k and v as slices of one projection's output) as long as
//! each head's D values are contiguous.

use numpy::{
    PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3, PyReadwriteArray2,
    PyReadwriteArray3, PyReadwriteArrayDyn, PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use super::elementwise::{self as ew, CacheMut, Heads};
use super::{KernelError, ThreadCount};
use crate::error::CoreError;

fn invalid(message: String) -> PyErr {
    CoreError::InvalidArgument(message).into()
}

fn kernel_error(err: KernelError) -> PyErr {
    CoreError::from(err).into()
}

fn c_slice<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    array: &'a numpy::PyReadonlyArray<'_, T, D>,
    what: &str,
) -> PyResult<&'a [T]> {
    if !array.is_c_contiguous() {
        return Err(invalid(format!("{what} must be C-contiguous")));
    }
    array
        .as_slice()
        .map_err(|_| invalid(format!("{what} must be C-contiguous")))
}

/// A (T, H, D) float32 array with each head's values contiguous, as strided `Heads`.
fn heads<'a>(array: &'a PyReadonlyArray3<'_, f32>, what: &str) -> PyResult<Heads<'a>> {
    let shape = array.shape();
    let (tokens, heads, head_dim) = (shape[0], shape[1], shape[2]);
    let strides = array.strides(); // bytes
    let size = std::mem::size_of::<f32>() as isize;
    if strides.iter().any(|&s| s < 0 || s % size != 0) || (head_dim > 1 && strides[2] != size) {
        return Err(invalid(format!(
            "{what}: each head's values must be contiguous (strides {strides:?} bytes)"
        )));
    }
    let (row_stride, head_stride) = ((strides[0] / size) as usize, (strides[1] / size) as usize);
    let extent = Heads::extent(tokens, heads, head_dim, row_stride, head_stride);
    // SAFETY: numpy's view covers every element [t, h, i] at these non-negative strides, the
    // furthest at extent - 1; the slice lives as long as the borrowed array.
    let data = unsafe { std::slice::from_raw_parts(array.data() as *const f32, extent) };
    Ok(Heads {
        data,
        tokens,
        heads,
        head_dim,
        row_stride,
        head_stride,
    })
}

/// out (T, H) = weight · (x / sqrt(mean(x²) + eps)) per row of x (T, H) float32; with
/// `branch` (T, H), x += branch first, in place (a pre-norm decoder's residual add).
#[pyfunction]
#[pyo3(signature = (x, weight, eps, out, threads, branch = None))]
fn rms_norm(
    py: Python<'_>,
    mut x: PyReadwriteArray2<'_, f32>,
    weight: PyReadonlyArray1<'_, f32>,
    eps: f32,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
    branch: Option<PyReadonlyArray2<'_, f32>>,
) -> PyResult<()> {
    if out.shape() != x.shape() || branch.as_ref().is_some_and(|b| b.shape() != x.shape()) {
        return Err(invalid(format!(
            "rms_norm: x {:?}, out {:?} and branch {:?} must have one shape",
            x.shape(),
            out.shape(),
            branch.as_ref().map(|b| b.shape().to_vec())
        )));
    }
    let weight = c_slice(&weight, "weight")?;
    let branch = match &branch {
        Some(b) => Some(c_slice(b, "branch")?),
        None => None,
    };
    let x = x
        .as_slice_mut()
        .map_err(|_| invalid("x must be C-contiguous".into()))?;
    let out = out
        .as_slice_mut()
        .map_err(|_| invalid("out must be C-contiguous".into()))?;
    py.detach(|| ew::add_rms_norm(x, branch, weight, eps, out, ThreadCount::new(threads)))
        .map_err(kernel_error)
}

/// out (T, I) = silu(gate) · up for x (T, 2·I) = [gate | up], float32.
#[pyfunction]
fn silu_and_mul(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    let (rows, width) = (out.shape()[0], out.shape()[1]);
    if x.shape() != [rows, 2 * width] {
        return Err(invalid(format!(
            "silu_and_mul: x {:?} must be out {:?} with twice the columns",
            x.shape(),
            out.shape()
        )));
    }
    let x = c_slice(&x, "x")?;
    let out = out
        .as_slice_mut()
        .map_err(|_| invalid("out must be C-contiguous".into()))?;
    py.detach(|| ew::silu_and_mul(x, out, width, rows, ThreadCount::new(threads)))
        .map_err(kernel_error)
}

/// out (T, H, D) contiguous = rotate-half RoPE of x (T, H, D) float32 (strided rows allowed)
/// with cos and sin (T, D/2).
#[pyfunction]
fn rotary(
    py: Python<'_>,
    x: PyReadonlyArray3<'_, f32>,
    cos: PyReadonlyArray2<'_, f32>,
    sin: PyReadonlyArray2<'_, f32>,
    mut out: PyReadwriteArray3<'_, f32>,
    threads: usize,
) -> PyResult<()> {
    if out.shape() != x.shape() {
        return Err(invalid(format!(
            "rotary: out {:?} must have x's shape {:?}",
            out.shape(),
            x.shape()
        )));
    }
    let x = heads(&x, "rotary x")?;
    let (cos, sin) = (c_slice(&cos, "cos")?, c_slice(&sin, "sin")?);
    let out = out
        .as_slice_mut()
        .map_err(|_| invalid("out must be C-contiguous".into()))?;
    py.detach(|| ew::rotary(x, cos, sin, out, ThreadCount::new(threads)))
        .map_err(kernel_error)
}

enum CacheArrayMut<'py> {
    F32(PyReadwriteArrayDyn<'py, f32>),
    U16(PyReadwriteArrayDyn<'py, u16>),
}

impl<'py> CacheArrayMut<'py> {
    fn extract(array: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        if let Ok(a) = array.extract::<PyReadwriteArrayDyn<'py, f32>>() {
            return Ok(CacheArrayMut::F32(a));
        }
        if let Ok(a) = array.extract::<PyReadwriteArrayDyn<'py, u16>>() {
            return Ok(CacheArrayMut::U16(a));
        }
        Err(invalid(format!(
            "{what} must be a writable float32 or uint16 (bfloat16 bits) array"
        )))
    }

    fn shape(&self) -> Vec<usize> {
        match self {
            CacheArrayMut::F32(a) => a.shape().to_vec(),
            CacheArrayMut::U16(a) => a.shape().to_vec(),
        }
    }

    fn slice(&mut self, what: &str) -> PyResult<CacheMut<'_>> {
        let error = || invalid(format!("{what} must be C-contiguous"));
        Ok(match self {
            CacheArrayMut::F32(a) => CacheMut::F32(a.as_slice_mut().map_err(|_| error())?),
            CacheArrayMut::U16(a) => CacheMut::Bf16(a.as_slice_mut().map_err(|_| error())?),
        })
    }
}

/// k and v (T, H_kv, D) float32 (strided rows allowed) into slot `slots[t]` (int64) of the
/// caches (num_blocks, block_size, H_kv, D): both float32 or both bfloat16 as uint16 bits.
#[pyfunction]
fn kv_write(
    py: Python<'_>,
    k: PyReadonlyArray3<'_, f32>,
    v: PyReadonlyArray3<'_, f32>,
    slots: PyReadonlyArray1<'_, i64>,
    k_cache: &Bound<'_, PyAny>,
    v_cache: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let mut kc = CacheArrayMut::extract(k_cache, "k_cache")?;
    let mut vc = CacheArrayMut::extract(v_cache, "v_cache")?;
    let shape = kc.shape();
    if shape.len() != 4 || vc.shape() != shape || shape[2..] != k.shape()[1..] {
        return Err(invalid(format!(
            "kv_write: caches {:?} and {:?} must be (blocks, block_size, {}, {})",
            shape,
            vc.shape(),
            k.shape()[1],
            k.shape()[2]
        )));
    }
    let (k, v) = (heads(&k, "kv_write k")?, heads(&v, "kv_write v")?);
    let slots = c_slice(&slots, "slot_mapping")?;
    let (kc, vc) = (kc.slice("k_cache")?, vc.slice("v_cache")?);
    if matches!(
        (&kc, &vc),
        (CacheMut::F32(_), CacheMut::Bf16(_)) | (CacheMut::Bf16(_), CacheMut::F32(_))
    ) {
        return Err(invalid(
            "kv_write: K and V caches must have one dtype".into(),
        ));
    }
    py.detach(|| ew::kv_write(k, v, slots, kc, vc))
        .map_err(kernel_error)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(silu_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(rotary, m)?)?;
    m.add_function(wrap_pyfunction!(kv_write, m)?)?;
    Ok(())
}
