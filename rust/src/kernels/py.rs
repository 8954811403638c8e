//! The CPU kernels' Python bindings, registered by `crate::py`: numpy views of torch tensors in
//! (`tensor.numpy()` shares the buffer), checked for dtype, shape and contiguity, the output
//! written in place, the GIL released while the kernel runs.

use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3,
    PyReadonlyArrayDyn, PyReadwriteArray2, PyReadwriteArray3, PyUntypedArrayMethods,
};
use std::sync::Arc;

use pyo3::prelude::*;

use super::dense_gemv::{self as dense, DenseWeights};
use super::int8_matmul::int8_matmul;
use super::paged_attention as attn;
use super::{Activations, Isa, KernelError, PackedWeights, ThreadCount};
use crate::error::CoreError;

fn invalid(message: String) -> PyErr {
    CoreError::InvalidArgument(message).into()
}

fn kernel_error(err: KernelError) -> PyErr {
    CoreError::from(err).into()
}

/// numpy's `as_slice` also takes Fortran order: only C order is the (rows, columns) layout.
fn c_order(is_c_contiguous: bool, what: &str) -> PyResult<()> {
    if is_c_contiguous {
        Ok(())
    } else {
        Err(invalid(format!("{what} must be C-contiguous")))
    }
}

fn contiguous<S>(slice: Result<S, numpy::AsSliceError>, what: &str) -> PyResult<S> {
    slice.map_err(|_| invalid(format!("{what} must be C-contiguous")))
}

fn isa_or_active(isa: Option<&str>) -> PyResult<Isa> {
    match isa {
        None => Isa::active().map_err(kernel_error),
        Some(name) => Isa::choose(Some(name)).map_err(kernel_error),
    }
}

/// The instruction set the CPU kernels use (detected, or lowered by AIENG_CPU_ISA).
#[pyfunction]
fn cpu_isa() -> PyResult<&'static str> {
    Ok(Isa::active().map_err(kernel_error)?.name())
}

/// Every instruction-set path this CPU can run, lowest first.
#[pyfunction]
fn cpu_isa_paths() -> Vec<&'static str> {
    Isa::supported_paths().into_iter().map(Isa::name).collect()
}

/// A 4- or 8-bit weight repacked for the int8 dot-product kernels, from the integers q (N, K)
/// uint8 in [0, 2^bits), scales and zero points (N, G) float32: w = (q - z) * s per group.
#[pyclass(name = "Int8Weights", module = "aieng._core", frozen)]
pub(crate) struct PyInt8Weights {
    /// Shared with the native decoder (`crate::cpu_decoder`) that multiplies by it too.
    pub(crate) inner: Arc<PackedWeights>,
}

#[pymethods]
impl PyInt8Weights {
    #[new]
    fn new(
        py: Python<'_>,
        q: PyReadonlyArray2<'_, u8>,
        scales: PyReadonlyArray2<'_, f32>,
        zeros: PyReadonlyArray2<'_, f32>,
        bits: u8,
    ) -> PyResult<Self> {
        let (n, k) = (q.shape()[0], q.shape()[1]);
        if scales.shape() != zeros.shape() || scales.shape()[0] != n {
            return Err(invalid(format!(
                "scales {:?} and zeros {:?} must both be (N = {n}, groups)",
                scales.shape(),
                zeros.shape()
            )));
        }
        c_order(q.is_c_contiguous(), "q")?;
        c_order(scales.is_c_contiguous(), "scales")?;
        c_order(zeros.is_c_contiguous(), "zeros")?;
        let q = contiguous(q.as_slice(), "q")?;
        let s = contiguous(scales.as_slice(), "scales")?;
        let z = contiguous(zeros.as_slice(), "zeros")?;
        let inner = py
            .detach(|| PackedWeights::pack(q, s, z, n, k, bits))
            .map_err(kernel_error)?
            .into();
        Ok(PyInt8Weights { inner })
    }

    #[getter]
    fn out_features(&self) -> usize {
        self.inner.n
    }

    #[getter]
    fn in_features(&self) -> usize {
        self.inner.k
    }

    #[getter]
    fn bits(&self) -> u8 {
        self.inner.bits
    }

    #[getter]
    fn group_size(&self) -> usize {
        self.inner.group_size
    }

    /// Bytes of the packed weight and its scales.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.size_bytes()
    }

    /// out (M, N) float32 = x (M, K) float32 @ W^T, x quantized to int8 per block of 32 (with
    /// `split`, to two int8 terms: about 15 bits); on `threads` threads and the active
    /// instruction set (or `isa`, a lower one).
    #[pyo3(signature = (x, out, threads, isa = None, split = false))]
    fn matmul(
        &self,
        py: Python<'_>,
        x: PyReadonlyArray2<'_, f32>,
        mut out: PyReadwriteArray2<'_, f32>,
        threads: usize,
        isa: Option<&str>,
        split: bool,
    ) -> PyResult<()> {
        let w = &self.inner;
        let m = x.shape()[0];
        if x.shape()[1] != w.k || out.shape() != [m, w.n] {
            return Err(invalid(format!(
                "int8 matmul: x {:?} and out {:?} do not fit a ({}, {}) weight (x (M, {}), out \
                 (M, {}))",
                x.shape(),
                out.shape(),
                w.n,
                w.k,
                w.k,
                w.n
            )));
        }
        let isa = isa_or_active(isa)?;
        c_order(x.is_c_contiguous(), "x")?;
        c_order(out.is_c_contiguous(), "out")?;
        let x = contiguous(x.as_slice(), "x")?;
        let out = contiguous(out.as_slice_mut(), "out")?;
        let activations = if split {
            Activations::Int8x2
        } else {
            Activations::Int8
        };
        py.detach(|| int8_matmul(x, m, w, out, activations, isa, ThreadCount::new(threads)))
            .map_err(kernel_error)
    }

    /// The weight (N, K) float32 as the kernels multiply by it: q * s - s * z (the reference
    /// of a layer whose only copy is this one).
    fn dequantize<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let w = &self.inner;
        let values = py.detach(|| w.dequantize());
        PyArray1::from_vec(py, values).reshape([w.n, w.k])
    }

    fn __repr__(&self) -> String {
        let w = &self.inner;
        format!(
            "Int8Weights(out_features={}, in_features={}, bits={}, group_size={})",
            w.n, w.k, w.bits, w.group_size
        )
    }
}

/// out (M, N) float32 = x (M, K) float32 @ W^T for M <= 8, W (N, K) float32, or bfloat16 as
/// its int16 bit patterns (`w.view(torch.int16).numpy()`); the weights read once for all rows.
#[pyfunction]
#[pyo3(signature = (x, w, out, threads, isa = None))]
fn dense_gemv(
    py: Python<'_>,
    x: PyReadonlyArray2<'_, f32>,
    w: &Bound<'_, PyAny>,
    mut out: PyReadwriteArray2<'_, f32>,
    threads: usize,
    isa: Option<&str>,
) -> PyResult<()> {
    let isa = isa_or_active(isa)?;
    let (m, k) = (x.shape()[0], x.shape()[1]);
    c_order(x.is_c_contiguous(), "x")?;
    c_order(out.is_c_contiguous(), "out")?;
    let x = contiguous(x.as_slice(), "x")?;
    let n = out.shape()[1];
    let out = contiguous(out.as_slice_mut(), "out")?;
    let threads = ThreadCount::new(threads);
    let check = |shape: &[usize], c: bool| {
        if shape != [n, k] {
            return Err(invalid(format!(
                "dense GEMV: W {shape:?} does not fit x (M, {k}) and out (M, {n})"
            )));
        }
        c_order(c, "W")
    };
    if let Ok(w) = w.extract::<PyReadonlyArray2<'_, f32>>() {
        check(w.shape(), w.is_c_contiguous())?;
        let w = contiguous(w.as_slice(), "W")?;
        return py
            .detach(|| dense::dense_gemv(x, m, k, DenseWeights::F32(w), n, out, isa, threads))
            .map_err(kernel_error);
    }
    let w = w.extract::<PyReadonlyArray2<'_, i16>>().map_err(|_| {
        invalid("dense GEMV: W must be a float32 array or bfloat16 bits as int16".into())
    })?;
    check(w.shape(), w.is_c_contiguous())?;
    let bits = contiguous(w.as_slice(), "W")?;
    // SAFETY: i16 and u16 have one size and alignment; the bits are read as bfloat16.
    let bits = unsafe { std::slice::from_raw_parts(bits.as_ptr().cast::<u16>(), bits.len()) };
    py.detach(|| dense::dense_gemv(x, m, k, DenseWeights::Bf16(bits), n, out, isa, threads))
        .map_err(kernel_error)
}

/// out (T, H, D) float32 = paged attention of q (T, H, D) float32 over K and V caches
/// (num_blocks, block_size, H_kv, D) read in place: float32, bfloat16 (as its uint16 bits) or
/// int8 with `k_scale`/`v_scale` (one per position and KV head: float32 or bfloat16 bits), through
/// `block_tables` (R, W) int32, with `query_start_loc` (R + 1) and `seq_lens` (R) int32 (lengths
/// after the step, whose new K/V are already written). window 0: the whole context; softcap 0:
/// none.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale, window, softcap, threads, isa = None, k_scale = None, v_scale = None))]
#[allow(clippy::too_many_arguments)]
fn paged_attention<'py>(
    py: Python<'py>,
    q: PyReadonlyArray3<'py, f32>,
    k_cache: &Bound<'py, PyAny>,
    v_cache: &Bound<'py, PyAny>,
    mut out: PyReadwriteArray3<'py, f32>,
    query_start_loc: PyReadonlyArray1<'py, i32>,
    seq_lens: PyReadonlyArray1<'py, i32>,
    block_tables: PyReadonlyArray2<'py, i32>,
    scale: f32,
    window: usize,
    softcap: f32,
    threads: usize,
    isa: Option<&str>,
    k_scale: Option<&Bound<'py, PyAny>>,
    v_scale: Option<&Bound<'py, PyAny>>,
) -> PyResult<()> {
    let isa = isa_or_active(isa)?;
    let k = CacheArray::extract(k_cache, "k_cache")?;
    let v = CacheArray::extract(v_cache, "v_cache")?;
    let cache = k.shape();
    if cache.len() != 4
        || v.shape() != cache
        || out.shape() != q.shape()
        || q.shape()[2] != cache[3]
    {
        return Err(invalid(format!(
            "paged attention: q {:?}, out {:?}, K {:?} and V {:?} do not fit together",
            q.shape(),
            out.shape(),
            cache,
            v.shape()
        )));
    }
    let shape = attn::PagedShape {
        heads: q.shape()[1],
        kv_heads: cache[2],
        head_dim: cache[3],
        block_size: cache[1],
        num_blocks: cache[0],
    };
    let scales = match (k_scale, v_scale) {
        (Some(ks), Some(vs)) => Some((
            CacheArray::extract(ks, "k_scale")?,
            CacheArray::extract(vs, "v_scale")?,
        )),
        (None, None) => None,
        _ => {
            return Err(invalid(
                "paged attention: give both k_scale and v_scale".into(),
            ))
        }
    };
    let width = block_tables.shape()[1];
    for (c, what) in [
        (q.is_c_contiguous(), "q"),
        (out.is_c_contiguous(), "out"),
        (block_tables.is_c_contiguous(), "block_tables"),
    ] {
        c_order(c, what)?;
    }
    let q = contiguous(q.as_slice(), "q")?;
    let out = contiguous(out.as_slice_mut(), "out")?;
    let qsl = contiguous(query_start_loc.as_slice(), "query_start_loc")?;
    let lens = contiguous(seq_lens.as_slice(), "seq_lens")?;
    let tables = contiguous(block_tables.as_slice(), "block_tables")?;
    let kv = match (k.slice()?, v.slice()?, &scales) {
        (CacheSlice::F32(k), CacheSlice::F32(v), None) => attn::KvCache::F32 { k, v },
        (CacheSlice::U16(k), CacheSlice::U16(v), None) => attn::KvCache::Bf16 { k, v },
        (CacheSlice::I8(k), CacheSlice::I8(v), Some((ks, vs))) => attn::KvCache::Int8 {
            k,
            v,
            k_scale: ks.slice()?.scales("k_scale")?,
            v_scale: vs.slice()?.scales("v_scale")?,
        },
        _ => {
            return Err(invalid(
                "paged attention: K and V must both be float32, both bfloat16 (as uint16), or \
                 both int8 with k_scale and v_scale"
                    .into(),
            ))
        }
    };
    let rows = attn::StepRows {
        query_start_loc: qsl,
        seq_lens: lens,
        block_tables: tables,
        table_width: width,
    };
    let scoring = attn::Scoring {
        scale,
        window: (window > 0).then_some(window),
        softcap: (softcap != 0.0).then_some(softcap),
    };
    let threads = ThreadCount::new(threads);
    py.detach(|| attn::paged_attention(q, kv, out, shape, rows, scoring, isa, threads))
        .map_err(kernel_error)
}

/// A cache (or scale) array as numpy hands it over: float32, uint16 (bfloat16's bits) or int8.
enum CacheArray<'py> {
    F32(PyReadonlyArrayDyn<'py, f32>),
    U16(PyReadonlyArrayDyn<'py, u16>),
    I8(PyReadonlyArrayDyn<'py, i8>),
}

enum CacheSlice<'a> {
    F32(&'a [f32]),
    U16(&'a [u16]),
    I8(&'a [i8]),
}

impl<'py> CacheArray<'py> {
    fn extract(array: &Bound<'py, PyAny>, what: &str) -> PyResult<Self> {
        let array = if let Ok(a) = array.extract::<PyReadonlyArrayDyn<'py, f32>>() {
            CacheArray::F32(a)
        } else if let Ok(a) = array.extract::<PyReadonlyArrayDyn<'py, u16>>() {
            CacheArray::U16(a)
        } else if let Ok(a) = array.extract::<PyReadonlyArrayDyn<'py, i8>>() {
            CacheArray::I8(a)
        } else {
            return Err(invalid(format!(
                "{what} must be a float32, uint16 (bfloat16 bits) or int8 array"
            )));
        };
        let c = match &array {
            CacheArray::F32(a) => a.is_c_contiguous(),
            CacheArray::U16(a) => a.is_c_contiguous(),
            CacheArray::I8(a) => a.is_c_contiguous(),
        };
        c_order(c, what)?;
        Ok(array)
    }

    fn shape(&self) -> Vec<usize> {
        match self {
            CacheArray::F32(a) => a.shape().to_vec(),
            CacheArray::U16(a) => a.shape().to_vec(),
            CacheArray::I8(a) => a.shape().to_vec(),
        }
    }

    fn slice(&self) -> PyResult<CacheSlice<'_>> {
        Ok(match self {
            CacheArray::F32(a) => CacheSlice::F32(contiguous(a.as_slice(), "a cache")?),
            CacheArray::U16(a) => CacheSlice::U16(contiguous(a.as_slice(), "a cache")?),
            CacheArray::I8(a) => CacheSlice::I8(contiguous(a.as_slice(), "a cache")?),
        })
    }
}

impl<'a> CacheSlice<'a> {
    fn scales(self, what: &str) -> PyResult<attn::Scales<'a>> {
        match self {
            CacheSlice::F32(x) => Ok(attn::Scales::F32(x)),
            CacheSlice::U16(x) => Ok(attn::Scales::Bf16(x)),
            CacheSlice::I8(_) => Err(invalid(format!(
                "{what} must be float32 or uint16 (bfloat16 bits), not int8"
            ))),
        }
    }
}

/// Int8 operations per second of independent `vpdpbusd` chains on `threads` threads (the
/// int8 GEMM's ceiling); None without AVX-512 VNNI.
#[pyfunction]
#[pyo3(signature = (threads, iterations = 20_000_000))]
fn int8_peak_ops(py: Python<'_>, threads: usize, iterations: usize) -> Option<f64> {
    py.detach(|| super::peak::int8_peak_ops(ThreadCount::new(threads), iterations))
}

/// The CPU kernels' thread pools since the process started: calls handed to workers, times a
/// worker blocked (and was woken for a later call), times it found its core contended.
#[pyfunction]
fn cpu_pool_stats() -> (u64, u64, u64) {
    let s = super::pool_stats();
    (s.calls, s.blocks, s.backoffs)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(int8_peak_ops, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_pool_stats, m)?)?;
    m.add_function(wrap_pyfunction!(paged_attention, m)?)?;
    m.add_function(wrap_pyfunction!(dense_gemv, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_isa, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_isa_paths, m)?)?;
    m.add_class::<PyInt8Weights>()?;
    super::py_elementwise::register(m)
}
