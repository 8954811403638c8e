//! The decoder's Python bindings, registered by `crate::py`: `CpuDecoder` built once from the
//! model's arrays (numpy views of torch tensors, borrowed: the decoder holds a reference to each
//! array, so the storage it reads lives as long as it does), `CpuKvCaches` over the runner's
//! K/V tensors, and `CpuDecoder.step`, which runs a whole step with the GIL released.

use std::sync::Arc;

use numpy::{
    PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArrayDyn, PyReadwriteArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use super::kv::{CacheShape, KvCaches, KvLayer, ScalePtr};
use super::{
    Activation, Buffer, CpuDecoder, DecoderConfig, LayerWeights, Linear, LinearWeights,
    NormPlacement, RopeTable, StepInputs, Table,
};
use crate::error::CoreError;
use crate::kernels::py::PyInt8Weights;
use crate::kernels::{Activations, Isa, KernelError, ThreadCount};

fn invalid(message: String) -> PyErr {
    CoreError::InvalidArgument(message).into()
}

fn kernel_error(err: KernelError) -> PyErr {
    CoreError::from(err).into()
}

/// A C-contiguous array of `T` borrowed as a `Buffer` (the array itself keeps its storage).
fn borrow<T: numpy::Element + Sync>(array: &Bound<'_, PyAny>, what: &str) -> PyResult<Buffer<T>> {
    let view = array
        .extract::<PyReadonlyArrayDyn<'_, T>>()
        .map_err(|_| invalid(format!("{what}: not an array of the expected dtype")))?;
    if !view.is_c_contiguous() {
        return Err(invalid(format!("{what} must be C-contiguous")));
    }
    let slice = view
        .as_slice()
        .map_err(|_| invalid(format!("{what} must be C-contiguous")))?;
    let owner: Py<PyAny> = array.clone().unbind();
    // SAFETY: the array (held by `owner`) keeps its buffer; the decoder never writes to it.
    Ok(unsafe { Buffer::borrowed(slice.as_ptr(), slice.len(), Box::new(owner)) })
}

/// float32 values, or bfloat16 bits as int16 / uint16.
enum Floats {
    F32(Buffer<f32>),
    Bf16(Buffer<u16>),
}

fn floats(array: &Bound<'_, PyAny>, what: &str) -> PyResult<(Floats, Vec<usize>)> {
    let shape = array
        .extract::<PyReadonlyArrayDyn<'_, f32>>()
        .map(|a| a.shape().to_vec())
        .or_else(|_| {
            array
                .extract::<PyReadonlyArrayDyn<'_, u16>>()
                .map(|a| a.shape().to_vec())
        })
        .or_else(|_| {
            array
                .extract::<PyReadonlyArrayDyn<'_, i16>>()
                .map(|a| a.shape().to_vec())
        })
        .map_err(|_| {
            invalid(format!(
                "{what} must be a float32 array or bfloat16 bits as int16 / uint16"
            ))
        })?;
    if let Ok(b) = borrow::<f32>(array, what) {
        return Ok((Floats::F32(b), shape));
    }
    if let Ok(b) = borrow::<u16>(array, what) {
        return Ok((Floats::Bf16(b), shape));
    }
    let b = borrow::<i16>(array, what)?;
    // SAFETY: i16 and u16 share size and alignment; the bits are read as bfloat16.
    let bits =
        unsafe { Buffer::borrowed(b.as_slice().as_ptr().cast::<u16>(), b.len(), Box::new(b)) };
    Ok((Floats::Bf16(bits), shape))
}

fn vector(value: Option<Bound<'_, PyAny>>, what: &str) -> PyResult<Option<Vec<f32>>> {
    match value {
        None => Ok(None),
        Some(v) if v.is_none() => Ok(None),
        Some(v) => {
            let a = v
                .extract::<PyReadonlyArray1<'_, f32>>()
                .map_err(|_| invalid(format!("{what} must be a 1-D float32 array")))?;
            Ok(Some(a.as_array().to_vec()))
        }
    }
}

/// (weight, bias or None, split): weight a float32 / bfloat16-bits (N, K) array or an
/// `Int8Weights`; split: its activations as two int8 terms.
fn linear(spec: &Bound<'_, PyAny>, what: &str) -> PyResult<Linear> {
    let tuple = spec
        .cast::<PyTuple>()
        .map_err(|_| invalid(format!("{what} must be (weight, bias, split)")))?;
    if tuple.len() != 3 {
        return Err(invalid(format!("{what} must be (weight, bias, split)")));
    }
    let weight = tuple.get_item(0)?;
    let bias = vector(Some(tuple.get_item(1)?), &format!("{what} bias"))?;
    let split: bool = tuple.get_item(2)?.extract()?;
    let (n, k, weights) = if let Ok(packed) = weight.extract::<PyRef<'_, PyInt8Weights>>() {
        let w = Arc::clone(&packed.inner);
        let activations = if split {
            Activations::Int8x2
        } else {
            Activations::Int8
        };
        (w.n, w.k, LinearWeights::Packed(w, activations))
    } else {
        let (values, shape) = floats(&weight, what)?;
        if shape.len() != 2 {
            return Err(invalid(format!("{what} must be 2-D, got {shape:?}")));
        }
        let weights = match values {
            Floats::F32(b) => LinearWeights::F32(b),
            Floats::Bf16(b) => LinearWeights::Bf16(b),
        };
        (shape[0], shape[1], weights)
    };
    Linear::new(n, k, weights, bias).map_err(kernel_error)
}

fn item<'py>(dict: &Bound<'py, PyDict>, key: &str) -> PyResult<Bound<'py, PyAny>> {
    dict.get_item(key)?
        .ok_or_else(|| invalid(format!("the decoder's spec lacks {key:?}")))
}

fn optional<'py>(dict: &Bound<'py, PyDict>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    Ok(dict.get_item(key)?.filter(|v| !v.is_none()))
}

fn decoder_config(d: &Bound<'_, PyDict>) -> PyResult<DecoderConfig> {
    let activation = match item(d, "activation")?.extract::<String>()?.as_str() {
        "silu" => Activation::Silu,
        "gelu_tanh" => Activation::GeluTanh,
        other => return Err(invalid(format!("activation {other:?}: silu or gelu_tanh"))),
    };
    let norms = match item(d, "norms")?.extract::<String>()?.as_str() {
        "pre" => NormPlacement::Pre,
        "post" => NormPlacement::Post,
        "sandwich" => NormPlacement::Sandwich,
        other => return Err(invalid(format!("norms {other:?}: pre, post or sandwich"))),
    };
    Ok(DecoderConfig {
        hidden: item(d, "hidden")?.extract()?,
        heads: item(d, "heads")?.extract()?,
        kv_heads: item(d, "kv_heads")?.extract()?,
        head_dim: item(d, "head_dim")?.extract()?,
        intermediate: item(d, "intermediate")?.extract()?,
        vocab: item(d, "vocab")?.extract()?,
        eps: item(d, "eps")?.extract()?,
        attention_scale: item(d, "attention_scale")?.extract()?,
        attention_softcap: optional(d, "attention_softcap")?
            .map(|v| v.extract())
            .transpose()?,
        final_softcap: optional(d, "final_softcap")?
            .map(|v| v.extract())
            .transpose()?,
        embedding_scale: item(d, "embedding_scale")?.extract()?,
        residual_scale: item(d, "residual_scale")?.extract()?,
        logits_scale: item(d, "logits_scale")?.extract()?,
        activation,
        norms,
        qk_norm_per_head: item(d, "qk_norm_per_head")?.extract()?,
    })
}

fn layer(d: &Bound<'_, PyDict>, index: usize) -> PyResult<LayerWeights> {
    let name = |key: &str| format!("layer {index} {key}");
    let norm = |key: &str| vector(d.get_item(key).ok().flatten(), &name(key));
    Ok(LayerWeights {
        input_norm: norm("input_norm")?,
        post_attention_norm: norm("post_attention_norm")?
            .ok_or_else(|| invalid(name("post_attention_norm is missing")))?,
        pre_feedforward_norm: norm("pre_feedforward_norm")?,
        post_feedforward_norm: norm("post_feedforward_norm")?,
        q_norm: norm("q_norm")?,
        k_norm: norm("k_norm")?,
        qkv: linear(&item(d, "qkv")?, &name("qkv"))?,
        o: linear(&item(d, "o")?, &name("o"))?,
        gate_up: linear(&item(d, "gate_up")?, &name("gate_up"))?,
        down: linear(&item(d, "down")?, &name("down"))?,
        window: optional(d, "window")?.map(|v| v.extract()).transpose()?,
        rope: optional(d, "rope")?.map(|v| v.extract()).transpose()?,
    })
}

/// The whole forward of a dense decoder on the CPU, one call per engine step.
#[pyclass(name = "CpuDecoder", module = "aieng._core", frozen)]
struct PyCpuDecoder {
    inner: CpuDecoder,
}

#[pymethods]
impl PyCpuDecoder {
    /// config: the `DecoderConfig` fields by name; embedding (V, hidden); layers: one dict
    /// each (norm arrays, (weight, bias, split) linears, window, rope); head: (weight, bias,
    /// split); ropes: (cos, sin) (positions, D/2) float32 tables.
    #[new]
    fn new(
        config: &Bound<'_, PyDict>,
        embedding: &Bound<'_, PyAny>,
        layers: Vec<Bound<'_, PyDict>>,
        final_norm: PyReadonlyArray1<'_, f32>,
        head: &Bound<'_, PyAny>,
        ropes: Vec<(Bound<'_, PyAny>, Bound<'_, PyAny>)>,
    ) -> PyResult<Self> {
        let config = decoder_config(config)?;
        let embedding = match floats(embedding, "embedding")?.0 {
            Floats::F32(b) => Table::F32(b),
            Floats::Bf16(b) => Table::Bf16(b),
        };
        let layers = layers
            .iter()
            .enumerate()
            .map(|(i, d)| layer(d, i))
            .collect::<PyResult<Vec<_>>>()?;
        let ropes = ropes
            .iter()
            .map(|(cos, sin)| {
                Ok(RopeTable {
                    cos: borrow::<f32>(cos, "rope cos")?,
                    sin: borrow::<f32>(sin, "rope sin")?,
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let head = linear(head, "head")?;
        let final_norm = final_norm.as_array().to_vec();
        let inner = CpuDecoder::new(config, embedding, layers, final_norm, head, ropes)
            .map_err(kernel_error)?;
        Ok(PyCpuDecoder { inner })
    }

    /// Bytes of weights one decode step reads.
    #[getter]
    fn weight_bytes(&self) -> usize {
        self.inner.weight_bytes()
    }

    /// One step: int32 arrays as the core's plan holds them; writes the final hidden states
    /// (T, hidden) into `hidden_out` and the logits of `logits_rows` (S, vocab) into
    /// `logits_out`, and the step's K/V into `caches`.
    #[pyo3(signature = (input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, logits_rows, caches, hidden_out, logits_out, threads, isa = None))]
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        py: Python<'_>,
        input_ids: PyReadonlyArray1<'_, i32>,
        positions: PyReadonlyArray1<'_, i32>,
        slot_mapping: PyReadonlyArray1<'_, i32>,
        query_start_loc: PyReadonlyArray1<'_, i32>,
        seq_lens: PyReadonlyArray1<'_, i32>,
        block_tables: PyReadonlyArray2<'_, i32>,
        logits_rows: PyReadonlyArray1<'_, i32>,
        caches: PyRef<'_, PyCpuKvCaches>,
        mut hidden_out: PyReadwriteArray2<'_, f32>,
        mut logits_out: PyReadwriteArray2<'_, f32>,
        threads: usize,
        isa: Option<&str>,
    ) -> PyResult<()> {
        let isa = match isa {
            None => Isa::active(),
            Some(name) => Isa::choose(Some(name)),
        }
        .map_err(kernel_error)?;
        let owned =
            |a: &PyReadonlyArray1<'_, i32>| a.as_array().iter().copied().collect::<Vec<_>>();
        let ids = owned(&input_ids);
        let positions = owned(&positions);
        let slots = owned(&slot_mapping);
        let qsl = owned(&query_start_loc);
        let lens = owned(&seq_lens);
        let rows = owned(&logits_rows);
        let width = block_tables.shape()[1];
        let tables: Vec<i32> = block_tables.as_array().iter().copied().collect();
        for (c, what) in [
            (hidden_out.is_c_contiguous(), "hidden_out"),
            (logits_out.is_c_contiguous(), "logits_out"),
        ] {
            if !c {
                return Err(invalid(format!("{what} must be C-contiguous")));
            }
        }
        let hidden = hidden_out
            .as_slice_mut()
            .map_err(|_| invalid("hidden_out must be C-contiguous".into()))?;
        let logits = logits_out
            .as_slice_mut()
            .map_err(|_| invalid("logits_out must be C-contiguous".into()))?;
        let inputs = StepInputs {
            input_ids: &ids,
            positions: &positions,
            slot_mapping: &slots,
            query_start_loc: &qsl,
            seq_lens: &lens,
            block_tables: &tables,
            table_width: width,
            logits_rows: &rows,
        };
        let caches = &caches.inner;
        let threads = ThreadCount::new(threads);
        py.detach(|| {
            self.inner
                .step(inputs, caches, hidden, logits, isa, threads)
        })
        .map_err(kernel_error)
    }

    fn __repr__(&self) -> String {
        let c = &self.inner.config;
        format!(
            "CpuDecoder(layers={}, hidden={}, heads={}, kv_heads={}, head_dim={}, vocab={})",
            self.inner.layers.len(),
            c.hidden,
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.vocab
        )
    }
}

/// The runner's KV cache as the decoder reads it: one (K, V) pair of (num_blocks, block_size,
/// H_kv, D) arrays per layer, float32 or bfloat16 bits (uint16), borrowed for as long as this
/// object lives.
#[pyclass(name = "CpuKvCaches", module = "aieng._core", frozen)]
struct PyCpuKvCaches {
    inner: KvCaches,
}

fn cache_array(array: &Bound<'_, PyAny>, what: &str) -> PyResult<(KvSide, Vec<usize>)> {
    macro_rules! try_dtype {
        ($t:ty, $side:ident) => {
            if let Ok(mut a) = array.extract::<numpy::PyReadwriteArrayDyn<'_, $t>>() {
                let shape = a.shape().to_vec();
                let s = a
                    .as_slice_mut()
                    .map_err(|_| invalid(format!("{what} must be C-contiguous")))?;
                return Ok((KvSide::$side(s.as_mut_ptr()), shape));
            }
        };
    }
    try_dtype!(f32, F32);
    try_dtype!(u16, Bf16);
    try_dtype!(i8, Int8);
    Err(invalid(format!(
        "{what} must be a writable float32, uint16 (bfloat16 bits) or int8 array"
    )))
}

enum KvSide {
    F32(*mut f32),
    Bf16(*mut u16),
    Int8(*mut i8),
}

fn scale_ptr(side: KvSide, what: &str) -> PyResult<ScalePtr> {
    match side {
        KvSide::F32(p) => Ok(ScalePtr::F32(p)),
        KvSide::Bf16(p) => Ok(ScalePtr::Bf16(p)),
        KvSide::Int8(_) => Err(invalid(format!("{what} must be float32 or bfloat16 bits"))),
    }
}

/// One layer's (K, V) or INT8 (K, V, K scales, V scales), checked against `shape` (the first
/// layer's); the owners of its arrays pushed onto `owners`.
fn cache_layer(
    i: usize,
    arrays: &Bound<'_, PyTuple>,
    shape: &mut Option<Vec<usize>>,
    owners: &mut Vec<Py<PyAny>>,
) -> PyResult<KvLayer> {
    let items: Vec<Bound<'_, PyAny>> = arrays.iter().collect();
    if items.len() != 2 && items.len() != 4 {
        return Err(invalid(format!(
            "layer {i}: (K, V) or (K, V, K scales, V scales), not {} arrays",
            items.len()
        )));
    }
    let (ks, k_shape) = cache_array(&items[0], &format!("layer {i} K"))?;
    let (vs, v_shape) = cache_array(&items[1], &format!("layer {i} V"))?;
    if k_shape.len() != 4 || v_shape != k_shape || shape.as_ref().is_some_and(|s| *s != k_shape) {
        return Err(invalid(format!(
            "layer {i}: K {k_shape:?} and V {v_shape:?} must be one (num_blocks, block_size, \
             H_kv, D) shape for every layer"
        )));
    }
    let mut scale_shape = k_shape.clone();
    scale_shape[3] = 1;
    *shape = Some(k_shape);
    owners.extend(items.iter().map(|a| a.clone().unbind()));
    let layer = match (ks, vs, items.len()) {
        (KvSide::F32(k), KvSide::F32(v), 2) => KvLayer::F32 { k, v },
        (KvSide::Bf16(k), KvSide::Bf16(v), 2) => KvLayer::Bf16 { k, v },
        (KvSide::Int8(k), KvSide::Int8(v), 4) => {
            let (kss, ks_shape) = cache_array(&items[2], &format!("layer {i} K scales"))?;
            let (vss, vs_shape) = cache_array(&items[3], &format!("layer {i} V scales"))?;
            if ks_shape != scale_shape || vs_shape != scale_shape {
                return Err(invalid(format!(
                    "layer {i}: scales {ks_shape:?} and {vs_shape:?}, not {scale_shape:?}"
                )));
            }
            let (k_scale, v_scale) = (scale_ptr(kss, "K scales")?, scale_ptr(vss, "V scales")?);
            if matches!(k_scale, ScalePtr::F32(_)) != matches!(v_scale, ScalePtr::F32(_)) {
                return Err(invalid(format!(
                    "layer {i}: K and V scales differ in dtype"
                )));
            }
            KvLayer::Int8 {
                k,
                v,
                k_scale,
                v_scale,
            }
        }
        _ => {
            return Err(invalid(format!(
                "layer {i}: K and V both float32 or both bfloat16 bits, or both int8 with \
                 their scales"
            )))
        }
    };
    Ok(layer)
}

#[pymethods]
impl PyCpuKvCaches {
    #[new]
    fn new(layers: Vec<Bound<'_, PyTuple>>) -> PyResult<Self> {
        let mut views: Vec<KvLayer> = Vec::with_capacity(layers.len());
        let mut shape: Option<Vec<usize>> = None;
        let mut owners: Vec<Py<PyAny>> = Vec::with_capacity(4 * layers.len());
        for (i, arrays) in layers.iter().enumerate() {
            let layer = cache_layer(i, arrays, &mut shape, &mut owners)?;
            let kind = |l: &KvLayer| std::mem::discriminant(l);
            if views
                .first()
                .is_some_and(|first| kind(first) != kind(&layer))
            {
                return Err(invalid("every layer's cache must have one dtype".into()));
            }
            views.push(layer);
        }
        let shape = shape.unwrap_or_else(|| vec![0, 1, 1, 1]);
        let shape = CacheShape {
            num_blocks: shape[0],
            block_size: shape[1],
            kv_heads: shape[2],
            head_dim: shape[3],
        };
        // SAFETY: each pointer covers its array's elements (checked C-contiguous, one shape),
        // kept alive by `owners`; steps run one at a time (`KvCaches::lock`).
        let inner = unsafe { KvCaches::borrowed(views, shape, Box::new(owners)) };
        Ok(PyCpuKvCaches { inner })
    }

    #[getter]
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyCpuDecoder>()?;
    m.add_class::<PyCpuKvCaches>()
}
