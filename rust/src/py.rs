//! The Python bindings: `aieng._core`. The one place where Rust meets Python;
//! the logic lives in the plain-Rust modules.

use numpy::{PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString, PyTuple, PyType};

use crate::block_pool::{BlockPool, BlockTable, PoolStats};
use crate::error::CoreError;
use crate::request::{RequestParams, SlotIds, StopReason};
use crate::scheduler::{EngineCore, FinishedRequest, SchedulerConfig, StepUpdate};
use crate::step_plan::StepPlan;
use crate::structured::{Grammar, GrammarCompiler, GrammarSpec, PendingMasks};
use crate::text::{ChatTemplate, Tokenizer};

mod plan_arrays;

use plan_arrays::*;
use std::borrow::Cow;
use std::mem::ManuallyDrop;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

// ---------------------------------------------------------------- errors

struct ErrorTypes {
    base: Py<PyType>,
    invalid_argument: Py<PyType>,
    request_too_large: Py<PyType>,
    out_of_blocks: Py<PyType>,
    unknown_request: Py<PyType>,
    state: Py<PyType>,
    tokenizer: Py<PyType>,
    chat_template: Py<PyType>,
}

static ERRORS: PyOnceLock<ErrorTypes> = PyOnceLock::new();

fn new_exception<'py>(
    py: Python<'py>,
    name: &str,
    bases: Vec<Bound<'py, PyAny>>,
    doc: &str,
) -> PyResult<Bound<'py, PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "aieng")?;
    namespace.set_item("__doc__", doc)?;
    let class = py.import("builtins")?.getattr("type")?.call1((
        name,
        PyTuple::new(py, bases)?,
        namespace,
    ))?;
    Ok(class.cast_into::<PyType>()?)
}

fn error_types(py: Python<'_>) -> PyResult<ErrorTypes> {
    let builtin = |name: &str| py.import("builtins")?.getattr(name);
    let base = new_exception(
        py,
        "AiengError",
        vec![builtin("Exception")?],
        "Base class of every error aieng raises.",
    )?;
    let invalid = new_exception(
        py,
        "InvalidArgumentError",
        vec![base.clone().into_any(), builtin("ValueError")?],
        "A bad argument: a value out of range, an empty prompt, a duplicate id.",
    )?;
    let too_large = new_exception(
        py,
        "RequestTooLargeError",
        vec![invalid.clone().into_any()],
        "A request that can never be served: longer than max_model_len or the KV pool.",
    )?;
    let out_of_blocks = new_exception(
        py,
        "OutOfBlocksError",
        vec![base.clone().into_any(), builtin("RuntimeError")?],
        "The block pool has fewer free blocks than an allocation needs.",
    )?;
    let unknown = new_exception(
        py,
        "UnknownRequestError",
        vec![base.clone().into_any(), builtin("KeyError")?],
        "No live request has this id.",
    )?;
    let state = new_exception(
        py,
        "EngineStateError",
        vec![base.clone().into_any(), builtin("RuntimeError")?],
        "A call made in the wrong state: a released table, update() without schedule().",
    )?;
    let tokenizer = new_exception(
        py,
        "TokenizerError",
        vec![base.clone().into_any(), builtin("ValueError")?],
        "A tokenizer file that cannot be read or parsed, or a failed encode or decode.",
    )?;
    let chat_template = new_exception(
        py,
        "ChatTemplateError",
        vec![base.clone().into_any(), builtin("ValueError")?],
        "The model has no chat template, or the template failed (raise_exception included).",
    )?;
    Ok(ErrorTypes {
        tokenizer: tokenizer.unbind(),
        chat_template: chat_template.unbind(),
        base: base.unbind(),
        invalid_argument: invalid.unbind(),
        request_too_large: too_large.unbind(),
        out_of_blocks: out_of_blocks.unbind(),
        unknown_request: unknown.unbind(),
        state: state.unbind(),
    })
}

impl From<CoreError> for PyErr {
    fn from(err: CoreError) -> PyErr {
        Python::attach(|py| {
            let Some(types) = ERRORS.get(py) else {
                return PyValueError::new_err(err.to_string());
            };
            let class = match &err {
                CoreError::InvalidArgument(_) => &types.invalid_argument,
                CoreError::RequestTooLarge(_) => &types.request_too_large,
                CoreError::OutOfBlocks(_) => &types.out_of_blocks,
                CoreError::UnknownRequest(_) => &types.unknown_request,
                CoreError::State(_) => &types.state,
                CoreError::Tokenizer(_) => &types.tokenizer,
                CoreError::ChatTemplate(_) => &types.chat_template,
            };
            PyErr::from_type(class.bind(py).clone(), err.to_string())
        })
    }
}

fn released() -> PyErr {
    CoreError::State("this block table was already released".into()).into()
}

// ---------------------------------------------------------------- helpers

fn pool_stats_dict<'py>(py: Python<'py>, s: &PoolStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("num_blocks", s.num_blocks)?;
    d.set_item("block_size", s.block_size)?;
    d.set_item("num_free_blocks", s.num_free_blocks)?;
    d.set_item("num_cached_blocks", s.num_cached_blocks)?;
    d.set_item("usage", s.usage)?;
    d.set_item("prefix_cache_queries", s.prefix_cache_queries)?;
    d.set_item("prefix_cache_hits", s.prefix_cache_hits)?;
    d.set_item("evictions", s.evictions)?;
    Ok(d)
}

/// Integers from a numpy integer array or any sequence of ints.
fn ints(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<i64>> {
    // A contiguous int64 array is copied without the borrow bookkeeping of a readonly view.
    if let Some(v) = obj
        .cast::<PyArray1<i64>>()
        .ok()
        .and_then(|a| a.to_vec().ok())
    {
        return Ok(v);
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(a.as_array().to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return Ok(a.as_array().iter().map(|&t| t as i64).collect());
    }
    obj.extract::<Vec<i64>>().map_err(|_| {
        CoreError::InvalidArgument(format!("{what} must be a sequence of ints or an int array"))
            .into()
    })
}

/// Integers from `obj`, read in place when it is a contiguous int64 numpy array (the caller
/// holds the GIL while it reads them and runs no Python code), else copied as `ints` does.
fn ints_in_place<'a>(obj: &'a Bound<'_, PyAny>, what: &str) -> PyResult<Cow<'a, [i64]>> {
    if let Ok(a) = obj.cast::<PyArray1<i64>>() {
        // SAFETY: with the GIL held and no Python code run while the slice lives, nothing
        // writes the array under it.
        if let Ok(v) = unsafe { a.as_slice() } {
            return Ok(Cow::Borrowed(v));
        }
    }
    ints(obj, what).map(Cow::Owned)
}

fn u32_tokens(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    ints(obj, what)?
        .into_iter()
        .map(|t| {
            u32::try_from(t).map_err(|_| {
                CoreError::InvalidArgument(format!("{what}: token id {t} is out of range")).into()
            })
        })
        .collect()
}

/// The value of `cell`, built by `init` on first use.
fn once<'py, T>(
    py: Python<'py>,
    cell: &PyOnceLock<Py<T>>,
    init: impl FnOnce() -> PyResult<Bound<'py, T>>,
) -> PyResult<Bound<'py, T>> {
    let value = cell.get_or_try_init(py, || init().map(Bound::unbind))?;
    Ok(value.bind(py).clone())
}

// ---------------------------------------------------------------- BlockPool

/// A pool of paged KV blocks with prefix caching, for embedding alone.
#[pyclass(name = "BlockPool", module = "aieng._core", frozen)]
struct PyBlockPool {
    pool: BlockPool,
}

#[pymethods]
impl PyBlockPool {
    #[new]
    #[pyo3(signature = (num_blocks, block_size, enable_prefix_caching = true))]
    fn new(num_blocks: usize, block_size: usize, enable_prefix_caching: bool) -> PyResult<Self> {
        Ok(PyBlockPool {
            pool: BlockPool::new(num_blocks, block_size, enable_prefix_caching)?,
        })
    }

    /// Blocks for `token_ids`, reusing the longest cached prefix of full blocks.
    fn allocate(&self, py: Python<'_>, token_ids: &Bound<'_, PyAny>) -> PyResult<PyBlockTable> {
        let tokens = u32_tokens(token_ids, "token_ids")?;
        let pool = &self.pool;
        let table = py.detach(|| pool.allocate(&tokens))?;
        Ok(PyBlockTable {
            table: parking_lot::Mutex::new(Some(table)),
        })
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.pool.block_size()
    }

    #[getter]
    fn enable_prefix_caching(&self) -> bool {
        self.pool.prefix_caching()
    }

    #[getter]
    fn num_free_blocks(&self) -> usize {
        self.pool.stats().num_free_blocks
    }

    #[getter]
    fn usage(&self) -> f64 {
        self.pool.stats().usage
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        pool_stats_dict(py, &self.pool.stats())
    }

    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.pool.check_invariants()?)
    }

    fn __repr__(&self) -> String {
        let s = self.pool.stats();
        format!(
            "BlockPool(num_blocks={}, block_size={}, free={})",
            s.num_blocks, s.block_size, s.num_free_blocks
        )
    }
}

/// Blocks held for one sequence; freed exactly once by release(), a `with`
/// block or garbage collection, whichever comes first.
#[pyclass(name = "BlockTable", module = "aieng._core", frozen)]
struct PyBlockTable {
    table: parking_lot::Mutex<Option<BlockTable>>,
}

impl PyBlockTable {
    fn with<T>(&self, f: impl FnOnce(&mut BlockTable) -> T) -> PyResult<T> {
        let mut guard = self.table.lock();
        guard.as_mut().map(f).ok_or_else(released)
    }
}

#[pymethods]
impl PyBlockTable {
    #[getter]
    fn block_ids(&self) -> PyResult<Vec<u32>> {
        self.with(|t| t.block_ids())
    }

    #[getter]
    fn num_tokens(&self) -> PyResult<usize> {
        self.with(|t| t.num_tokens())
    }

    #[getter]
    fn num_cached_tokens(&self) -> PyResult<usize> {
        self.with(|t| t.num_cached_tokens())
    }

    #[getter]
    fn released(&self) -> bool {
        self.table.lock().is_none()
    }

    /// Extends the sequence, taking new blocks as needed (all or nothing).
    fn append(&self, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let tokens = u32_tokens(token_ids, "token_ids")?;
        self.with(|t| t.append(&tokens))?.map_err(Into::into)
    }

    /// Marks the first `num_computed` tokens (default: all) as holding valid KV,
    /// which makes their full blocks reusable by later allocations.
    #[pyo3(signature = (num_computed = None))]
    fn commit(&self, num_computed: Option<usize>) -> PyResult<()> {
        self.with(|t| {
            let n = num_computed.unwrap_or_else(|| t.num_tokens());
            t.commit(n)
        })
    }

    /// Returns the blocks to the pool. A second call does nothing.
    fn release(&self) {
        let table = self.table.lock().take();
        drop(table);
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, _args: &Bound<'_, PyTuple>) -> bool {
        self.release();
        false
    }

    fn __len__(&self) -> PyResult<usize> {
        self.with(|t| t.block_ids().len())
    }

    fn __repr__(&self) -> String {
        match self.table.lock().as_ref() {
            Some(t) => format!(
                "BlockTable(blocks={:?}, num_tokens={}, num_cached_tokens={})",
                t.block_ids(),
                t.num_tokens(),
                t.num_cached_tokens()
            ),
            None => "BlockTable(released)".into(),
        }
    }
}

// ---------------------------------------------------------------- EngineCore

/// The arrays of one engine step (see `_core.pyi` for their meaning): the core's plan, its
/// columns read in place. Each named column is a numpy view of one of them, made when first
/// read (then the same object); the `request_ids` list is built when first read. A dropped
/// plan gives its columns and views back to the core for a later step (`plan_arrays`).
#[pyclass(name = "StepPlan", module = "aieng._core", frozen)]
struct PyStepPlan {
    #[pyo3(get)]
    num_requests: usize,
    #[pyo3(get)]
    num_tokens: usize,
    /// The columns and the views made; given back to `spare` when the plan is dropped.
    arrays: ManuallyDrop<PlanArrays>,
    spare: Arc<SpareArrays>,
    /// Each slot's request id as the core held them when it planned the step (shared,
    /// not copied): the `request_ids` list is built from them and `slots`.
    slot_ids: SlotIds,
    id_list: PyOnceLock<Py<PyList>>,
    grammar_masks: Option<PendingMasks>,
}

impl PyStepPlan {
    /// The arrays of `plan`: its columns held as they are, in `reused` (arrays no one else
    /// holds) or new ones; its ids and masks taken apart.
    fn new(
        py: Python<'_>,
        mut plan: StepPlan,
        reused: Option<PlanArrays>,
        spare: &Arc<SpareArrays>,
    ) -> PyResult<Self> {
        let slot_ids = std::mem::take(&mut plan.request_ids);
        let grammar_masks = plan.grammar_masks.take();
        let (num_requests, num_tokens) = (plan.num_requests(), plan.num_tokens());
        let arrays = match reused {
            Some(mut arrays) => {
                arrays.put_plan(plan);
                arrays
            }
            None => PlanArrays::new(py, plan)?,
        };
        Ok(PyStepPlan {
            num_requests,
            num_tokens,
            arrays: ManuallyDrop::new(arrays),
            spare: Arc::clone(spare),
            slot_ids,
            id_list: PyOnceLock::new(),
            grammar_masks,
        })
    }

    /// Column `k` as a numpy view, made on first read and the same object after.
    fn column<'py>(&self, py: Python<'py>, k: usize) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.arrays.column(py, k)
    }

    /// Column `k`, read in place.
    fn column_slice(&self, k: usize) -> &[i32] {
        self.arrays.slice(k)
    }
}

impl Drop for PyStepPlan {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the plan is not used after.
        let arrays = unsafe { ManuallyDrop::take(&mut self.arrays) };
        self.spare.give_back(arrays);
    }
}

#[pymethods]
impl PyStepPlan {
    #[getter]
    fn input_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, INPUT_IDS)
    }

    #[getter]
    fn positions<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, POSITIONS)
    }

    #[getter]
    fn slot_mapping<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, SLOT_MAPPING)
    }

    #[getter]
    fn query_start_loc<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, QUERY_START_LOC)
    }

    #[getter]
    fn num_computed_tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, NUM_COMPUTED_TOKENS)
    }

    #[getter]
    fn seq_lens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, SEQ_LENS)
    }

    #[getter]
    fn logits_indices<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, LOGITS_INDICES)
    }

    #[getter]
    fn sample_request_rows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, SAMPLE_REQUEST_ROWS)
    }

    #[getter]
    fn slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, SLOTS)
    }

    #[getter]
    fn new_block_slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, NEW_BLOCK_SLOTS)
    }

    #[getter]
    fn new_block_indices<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, NEW_BLOCK_INDICES)
    }

    #[getter]
    fn new_block_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, NEW_BLOCK_IDS)
    }

    #[getter]
    fn banned_rows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, BANNED_ROWS)
    }

    #[getter]
    fn banned_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.column(py, BANNED_IDS)
    }

    #[getter]
    fn request_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        once(py, &self.id_list, || {
            PyList::new(
                py,
                self.column_slice(SLOTS).iter().map(|&slot| {
                    self.slot_ids
                        .get(slot as u32)
                        .expect("a planned slot is named")
                }),
            )
        })
    }

    /// The token masks of the constrained sampling rows, waited for (without the GIL):
    /// (rows (M,) int64, bitmask (M, ceil(vocab / 32)) int32: token t allowed at bit t % 32
    /// of word t / 32), or None when no row has a grammar.
    #[allow(clippy::type_complexity)]
    fn grammar_bitmask<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, PyArray1<i64>>, Bound<'py, PyArray2<i32>>)>> {
        let Some(pending) = &self.grammar_masks else {
            return Ok(None);
        };
        let masks = py.detach(|| pending.wait());
        let rows: Vec<i64> = masks.rows.iter().map(|&r| r as i64).collect();
        let words: Vec<i32> = masks.words.iter().map(|&w| w as i32).collect();
        let bitmask = PyArray1::from_vec(py, words).reshape([rows.len(), masks.words_per_row])?;
        Ok(Some((PyArray1::from_vec(py, rows), bitmask)))
    }

    fn __len__(&self) -> usize {
        self.num_tokens
    }

    fn __repr__(&self) -> String {
        format!(
            "StepPlan(num_requests={}, num_tokens={})",
            self.num_requests, self.num_tokens
        )
    }
}

/// A request that ended: why, and how many tokens it produced.
#[pyclass(name = "FinishedRequest", module = "aieng._core", frozen, get_all)]
struct PyFinishedRequest {
    request_id: String,
    slot: u32,
    finish_reason: &'static str,
    stop_reason: Option<Py<PyAny>>,
    num_output_tokens: usize,
}

impl PyFinishedRequest {
    fn new(py: Python<'_>, f: FinishedRequest) -> PyResult<Self> {
        let stop_reason = match f.stop_reason {
            Some(StopReason::Token(t)) => Some(t.into_pyobject(py)?.into_any().unbind()),
            Some(StopReason::Text(s)) => Some(s.into_pyobject(py)?.into_any().unbind()),
            None => None,
        };
        Ok(PyFinishedRequest {
            request_id: f.request_id,
            slot: f.slot,
            finish_reason: f.reason.as_str(),
            stop_reason,
            num_output_tokens: f.num_output_tokens,
        })
    }
}

#[pymethods]
impl PyFinishedRequest {
    fn __repr__(&self) -> String {
        format!(
            "FinishedRequest(request_id={:?}, finish_reason={:?}, num_output_tokens={})",
            self.request_id, self.finish_reason, self.num_output_tokens
        )
    }
}

/// What update() changed: one entry per token appended, in plan order. Each
/// field is built on first read.
#[pyclass(name = "StepOutputs", module = "aieng._core", frozen)]
struct PyStepOutputs {
    update: StepUpdate,
    rows: PyOnceLock<Py<PyArray1<i32>>>,
    slots: PyOnceLock<Py<PyArray1<i32>>>,
    token_ids: PyOnceLock<Py<PyArray1<i64>>>,
    texts: PyOnceLock<Py<PyList>>,
    finished: PyOnceLock<Py<PyList>>,
}

impl PyStepOutputs {
    fn new(update: StepUpdate) -> Self {
        PyStepOutputs {
            update,
            rows: PyOnceLock::new(),
            slots: PyOnceLock::new(),
            token_ids: PyOnceLock::new(),
            texts: PyOnceLock::new(),
            finished: PyOnceLock::new(),
        }
    }
}

#[pymethods]
impl PyStepOutputs {
    #[getter]
    fn rows<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        once(py, &self.rows, || {
            Ok(PyArray1::from_iter(
                py,
                self.update.rows.iter().map(|&r| r as i32),
            ))
        })
    }

    #[getter]
    fn slots<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        once(py, &self.slots, || {
            Ok(PyArray1::from_iter(
                py,
                self.update.slots.iter().map(|&s| s as i32),
            ))
        })
    }

    #[getter]
    fn token_ids<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        once(py, &self.token_ids, || {
            Ok(PyArray1::from_iter(
                py,
                self.update.token_ids.iter().map(|&t| i64::from(t)),
            ))
        })
    }

    /// Without a tokenizer every text is "".
    #[getter]
    fn texts<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        once(py, &self.texts, || {
            let empty = PyString::intern(py, "");
            let texts = &self.update.texts;
            PyList::new(
                py,
                (0..self.update.token_ids.len()).map(|i| match texts.get(i) {
                    Some(t) if !t.is_empty() => PyString::new(py, t),
                    _ => empty.clone(),
                }),
            )
        })
    }

    #[getter]
    fn finished<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        once(py, &self.finished, || {
            let finished = self
                .update
                .finished
                .iter()
                .map(|f| PyFinishedRequest::new(py, f.clone()))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, finished)
        })
    }
}

/// The scheduler and its block pool; the Python engine loop drives it with
/// schedule() and update(), a constant number of calls per step.
#[pyclass(name = "EngineCore", module = "aieng._core")]
struct PyEngineCore {
    core: EngineCore,
    /// The arrays of dropped plans, refilled by later steps.
    spare_arrays: Arc<SpareArrays>,
}

#[pymethods]
impl PyEngineCore {
    #[new]
    #[pyo3(signature = (
        num_blocks, block_size = 16, max_num_seqs = 256, max_num_batched_tokens = 2048,
        max_model_len = 4096, enable_prefix_caching = true, long_prefill_token_threshold = 0,
        tokenizer = None, shared_step_ms = 0.0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_blocks: usize,
        block_size: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        enable_prefix_caching: bool,
        long_prefill_token_threshold: usize,
        tokenizer: Option<PyRef<'_, PyTokenizer>>,
        shared_step_ms: f64,
    ) -> PyResult<Self> {
        if !(shared_step_ms.is_finite() && shared_step_ms >= 0.0) {
            return Err(CoreError::InvalidArgument(format!(
                "shared_step_ms must be a finite number >= 0, got {shared_step_ms}"
            ))
            .into());
        }
        let config = SchedulerConfig {
            num_blocks,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_prefix_caching,
            long_prefill_token_threshold,
        };
        let tokenizer = tokenizer.map(|t| Arc::clone(&t.inner));
        let mut core = EngineCore::with_tokenizer(config, tokenizer)?;
        core.set_shared_step(Some(Duration::from_secs_f64(shared_step_ms / 1e3)));
        Ok(PyEngineCore {
            core,
            spare_arrays: Arc::default(),
        })
    }

    /// Queues a request and returns its slot; refuses one that can never fit.
    #[pyo3(signature = (
        request_id, prompt_token_ids, *, max_tokens = 16, min_tokens = 0, ignore_eos = false,
        eos_token_ids = None, stop_token_ids = None, priority = 0, stop = None,
        include_stop_str_in_output = false, skip_special_tokens = true, grammar = None,
        skip_prefix_cache = false, client = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        request_id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: i64,
        min_tokens: i64,
        ignore_eos: bool,
        eos_token_ids: Option<&Bound<'_, PyAny>>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        priority: i32,
        stop: Option<Vec<String>>,
        include_stop_str_in_output: bool,
        skip_special_tokens: bool,
        grammar: Option<PyRef<'_, PyGrammar>>,
        skip_prefix_cache: bool,
        client: Option<String>,
    ) -> PyResult<u32> {
        let count = |name: &str, v: i64| {
            usize::try_from(v).map_err(|_| {
                PyErr::from(CoreError::InvalidArgument(format!(
                    "{name} must be >= 0, got {v}"
                )))
            })
        };
        let ids = |obj: Option<&Bound<'_, PyAny>>, what| match obj {
            Some(o) => u32_tokens(o, what),
            None => Ok(Vec::new()),
        };
        let params = RequestParams {
            max_tokens: count("max_tokens", max_tokens)?,
            min_tokens: count("min_tokens", min_tokens)?,
            ignore_eos,
            eos_token_ids: ids(eos_token_ids, "eos_token_ids")?,
            stop_token_ids: ids(stop_token_ids, "stop_token_ids")?,
            priority,
            stop: stop.unwrap_or_default(),
            include_stop_str_in_output,
            skip_special_tokens,
            skip_prefix_cache,
            client,
        };
        let prompt = u32_tokens(prompt_token_ids, "prompt_token_ids")?;
        let grammar = grammar.as_ref().map(|g| g.inner.as_ref());
        Ok(self
            .core
            .add_request_with_grammar(request_id, &prompt, params, grammar)?)
    }

    /// Ends a request now and frees its blocks.
    fn abort(&mut self, py: Python<'_>, request_id: &str) -> PyResult<PyFinishedRequest> {
        let finished = self.core.abort(request_id)?;
        PyFinishedRequest::new(py, finished)
    }

    /// Plans the next step. The GIL is released only for a step that may be long.
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyStepPlan> {
        // A dropped plan's columns that no one holds any more are planned into again.
        let mut reused = self.spare_arrays.take(py);
        if let Some(arrays) = &mut reused {
            self.core.recycle(arrays.take_plan());
        }
        let core = &mut self.core;
        let plan = match core.schedule_may_be_long() {
            true => py.detach(|| core.schedule()),
            false => core.schedule(),
        }?;
        PyStepPlan::new(py, plan, reused, &self.spare_arrays)
    }

    /// Applies the tokens sampled for the last plan: one per sampling row, or
    /// `num_sampled[i]` for the i-th.
    #[pyo3(signature = (sampled, num_sampled = None))]
    fn update(
        &mut self,
        py: Python<'_>,
        sampled: &Bound<'_, PyAny>,
        num_sampled: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepOutputs> {
        let counts = num_sampled.map(|c| ints(c, "num_sampled")).transpose()?;
        let core = &mut self.core;
        let apply = |core: &mut EngineCore, tokens: &[i64]| match &counts {
            Some(counts) => core.update_with_counts(tokens, counts),
            None => core.update(tokens),
        };
        let update = if core.update_may_be_long() {
            // Without the GIL another thread may write `sampled`: the core reads a copy.
            let tokens = ints(sampled, "sampled")?;
            py.detach(|| apply(core, &tokens))
        } else {
            apply(core, &ints_in_place(sampled, "sampled")?)
        }?;
        Ok(PyStepOutputs::new(update))
    }

    /// Sets the draft tokens that follow a request's tokens now (speculative decoding),
    /// replacing any it had; the next step that decodes it verifies them.
    fn set_draft(&mut self, request_id: &str, token_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let draft = u32_tokens(token_ids, "token_ids")?;
        Ok(self.core.set_draft(request_id, &draft)?)
    }

    fn has_unfinished(&self) -> bool {
        self.core.has_unfinished()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.core.stats().num_running
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.core.stats().num_waiting
    }

    /// The token budget of the last step planned: max_num_batched_tokens, or less when the
    /// step was bounded in time because several clients share the engine.
    #[getter]
    fn step_token_budget(&self) -> usize {
        self.core.step_token_budget()
    }

    #[getter]
    fn block_pool(&self) -> PyBlockPool {
        PyBlockPool {
            pool: self.core.pool().clone(),
        }
    }

    /// Prompt followed by generated tokens of a live request.
    fn request_token_ids(&self, request_id: &str) -> PyResult<Vec<u32>> {
        Ok(self.core.request_tokens(request_id)?.0.to_vec())
    }

    /// The KV blocks a live request holds now, in order; empty while it waits.
    fn block_ids(&self, request_id: &str) -> PyResult<Vec<u32>> {
        Ok(self.core.block_ids(request_id)?)
    }

    /// Prefix-cache hits of the request's first admission (None before it).
    fn num_cached_tokens(&self, request_id: &str) -> Option<usize> {
        self.core.num_cached_tokens(request_id)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.core.stats();
        let d = PyDict::new(py);
        d.set_item("num_running", s.num_running)?;
        d.set_item("num_waiting", s.num_waiting)?;
        d.set_item("num_preemptions", s.num_preemptions)?;
        d.set_item("num_steps", s.num_steps)?;
        d.set_item("step_token_budget", self.core.step_token_budget())?;
        d.set_item("pool", pool_stats_dict(py, &self.core.pool_stats())?)?;
        Ok(d)
    }

    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.core.check_invariants()?)
    }
}

// ---------------------------------------------------------------- Tokenizer

/// A Python `str` as UTF-8, with a clear error for lone surrogates.
fn utf8<'a>(text: &'a Bound<'_, PyString>) -> PyResult<std::borrow::Cow<'a, str>> {
    text.to_cow().map_err(|_| {
        CoreError::InvalidArgument(
            "text cannot be encoded as UTF-8 (it contains a lone surrogate)".into(),
        )
        .into()
    })
}

/// Python objects -> JSON, through the json module (messages, template variables).
fn to_json(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<serde_json::Value> {
    let text: String = py
        .import("json")?
        .call_method1("dumps", (obj,))?
        .extract()?;
    serde_json::from_str(&text)
        .map_err(|e| CoreError::InvalidArgument(format!("not JSON-serializable: {e}")).into())
}

/// The Hugging Face `tokenizers` crate behind a model's tokenizer files.
#[pyclass(name = "Tokenizer", module = "aieng._core", frozen)]
struct PyTokenizer {
    inner: Arc<Tokenizer>,
    template: OnceLock<Result<ChatTemplate, String>>,
}

impl PyTokenizer {
    fn wrap(inner: Tokenizer) -> Self {
        PyTokenizer {
            inner: Arc::new(inner),
            template: OnceLock::new(),
        }
    }
}

#[pymethods]
impl PyTokenizer {
    /// A `tokenizer.json` alone.
    #[staticmethod]
    fn from_file(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let tok = py
            .detach(|| Tokenizer::from_file(&path))
            .map_err(CoreError::from)?;
        Ok(Self::wrap(tok))
    }

    /// A model folder: `tokenizer.json` with `tokenizer_config.json`,
    /// `chat_template.jinja` and `generation_config.json` where present.
    #[staticmethod]
    fn from_dir(py: Python<'_>, path: std::path::PathBuf) -> PyResult<Self> {
        let tok = py
            .detach(|| Tokenizer::from_dir(&path))
            .map_err(CoreError::from)?;
        Ok(Self::wrap(tok))
    }

    #[pyo3(signature = (text, add_special_tokens = true))]
    fn encode(
        &self,
        py: Python<'_>,
        text: &Bound<'_, PyString>,
        add_special_tokens: bool,
    ) -> PyResult<Vec<u32>> {
        let text = utf8(text)?;
        let tok = &self.inner;
        Ok(py
            .detach(|| tok.encode(&text, add_special_tokens))
            .map_err(CoreError::from)?)
    }

    /// Encodes many texts in parallel with the GIL released.
    #[pyo3(signature = (texts, add_special_tokens = true))]
    fn encode_batch(
        &self,
        py: Python<'_>,
        texts: Vec<Bound<'_, PyString>>,
        add_special_tokens: bool,
    ) -> PyResult<Vec<Vec<u32>>> {
        let owned = texts
            .iter()
            .map(|t| utf8(t).map(|c| c.into_owned()))
            .collect::<PyResult<Vec<String>>>()?;
        let tok = &self.inner;
        Ok(py
            .detach(|| tok.encode_batch(&owned, add_special_tokens))
            .map_err(CoreError::from)?)
    }

    /// Ids outside the vocabulary decode to nothing.
    #[pyo3(signature = (token_ids, skip_special_tokens = true))]
    fn decode(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        skip_special_tokens: bool,
    ) -> PyResult<String> {
        let ids = u32_tokens(token_ids, "token_ids")?;
        let tok = &self.inner;
        Ok(py
            .detach(|| tok.decode(&ids, skip_special_tokens))
            .map_err(CoreError::from)?)
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.inner.eos_token_ids().to_vec()
    }

    #[getter]
    fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_token_id()
    }

    #[getter]
    fn bos_token(&self) -> Option<String> {
        self.inner.bos_token().map(str::to_string)
    }

    #[getter]
    fn eos_token(&self) -> Option<String> {
        self.inner.eos_token().map(str::to_string)
    }

    #[getter]
    fn add_bos_token(&self) -> Option<bool> {
        self.inner.add_bos_token()
    }

    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.chat_template().map(str::to_string)
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn id_to_token(&self, token_id: u32) -> Option<String> {
        self.inner.id_to_token(token_id)
    }

    fn is_special(&self, token_id: u32) -> bool {
        self.inner.is_special(token_id)
    }

    /// Renders `messages` with the model's chat template (or `chat_template`), as
    /// transformers' `apply_chat_template(..., tokenize=False)` does.
    #[pyo3(signature = (messages, add_generation_prompt = false, chat_template = None, **kwargs))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        chat_template: Option<&str>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        let messages = to_json(py, messages)?;
        let mut extra = self.inner.special_tokens_map();
        if let Some(kwargs) = kwargs {
            if let serde_json::Value::Object(map) = to_json(py, kwargs.as_any())? {
                extra.extend(map);
            }
        }
        let render = |t: &ChatTemplate| t.render(&messages, add_generation_prompt, &extra);
        let result = match chat_template {
            Some(source) => ChatTemplate::new(source).and_then(|t| render(&t)),
            None => {
                let compiled = self
                    .template
                    .get_or_init(|| match self.inner.chat_template() {
                        Some(source) => ChatTemplate::new(source).map_err(|e| e.to_string()),
                        None => Err(
                            "this model has no chat template (tokenizer_config.json has no \
                                 chat_template and there is no chat_template.jinja)"
                                .to_string(),
                        ),
                    });
                match compiled {
                    Ok(t) => py.detach(|| render(t)),
                    Err(message) => return Err(CoreError::ChatTemplate(message.clone()).into()),
                }
            }
        };
        Ok(result.map_err(CoreError::from)?)
    }

    fn __repr__(&self) -> String {
        format!("Tokenizer(vocab_size={})", self.inner.vocab_size())
    }
}

// ---------------------------------------------------------------- structured outputs

/// Compiles structured-output constraints over a tokenizer's vocabulary, for a model whose
/// logits are `vocab_size` wide.
#[pyclass(name = "GrammarCompiler", module = "aieng._core", frozen)]
struct PyGrammarCompiler {
    inner: Arc<GrammarCompiler>,
}

#[pymethods]
impl PyGrammarCompiler {
    #[new]
    fn new(py: Python<'_>, tokenizer: PyRef<'_, PyTokenizer>, vocab_size: usize) -> PyResult<Self> {
        let tok = Arc::clone(&tokenizer.inner);
        let compiler = py.detach(|| GrammarCompiler::new(&tok, vocab_size))?;
        Ok(PyGrammarCompiler {
            inner: Arc::new(compiler),
        })
    }

    /// `kind`: json (source: a JSON schema's text), json_object, regex, choice (source: a
    /// JSON list of strings) or grammar (Lark). Raises InvalidArgumentError naming the problem.
    #[pyo3(signature = (kind, source = ""))]
    fn compile(&self, py: Python<'_>, kind: &str, source: &str) -> PyResult<PyGrammar> {
        let spec = GrammarSpec::parse(kind, source)?;
        let compiler = Arc::clone(&self.inner);
        let grammar = py.detach(|| compiler.compile(&spec))?;
        Ok(PyGrammar { inner: grammar })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab().mask_width()
    }

    fn __repr__(&self) -> String {
        format!("GrammarCompiler(vocab_size={})", self.vocab_size())
    }
}

/// A compiled constraint; each request added with it gets a matcher of its own.
#[pyclass(name = "Grammar", module = "aieng._core", frozen)]
struct PyGrammar {
    inner: Arc<Grammar>,
}

#[pymethods]
impl PyGrammar {
    #[getter]
    fn kind(&self) -> &'static str {
        self.inner.spec().kind()
    }

    /// Of `token_ids`, those the grammar allows as the first output token; `stop_ids` are
    /// allowed if it may end at its start.
    fn allowed_first(
        &self,
        token_ids: &Bound<'_, PyAny>,
        stop_ids: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u32>> {
        let tokens = u32_tokens(token_ids, "token_ids")?;
        let stops = u32_tokens(stop_ids, "stop_ids")?;
        Ok(self.inner.allowed_first(&tokens, &stops))
    }

    fn __repr__(&self) -> String {
        format!("Grammar(kind={:?})", self.kind())
    }
}

// ---------------------------------------------------------------- module

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let types = ERRORS.get_or_try_init(py, || error_types(py))?;
    m.add("AiengError", types.base.bind(py))?;
    m.add("InvalidArgumentError", types.invalid_argument.bind(py))?;
    m.add("RequestTooLargeError", types.request_too_large.bind(py))?;
    m.add("OutOfBlocksError", types.out_of_blocks.bind(py))?;
    m.add("UnknownRequestError", types.unknown_request.bind(py))?;
    m.add("EngineStateError", types.state.bind(py))?;
    m.add("TokenizerError", types.tokenizer.bind(py))?;
    m.add("ChatTemplateError", types.chat_template.bind(py))?;
    m.add_class::<PyTokenizer>()?;
    m.add_class::<PyBlockPool>()?;
    m.add_class::<PyBlockTable>()?;
    m.add_class::<PyEngineCore>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<plan_arrays::PlanBuffer>()?;
    m.add_class::<PyStepOutputs>()?;
    m.add_class::<PyFinishedRequest>()?;
    m.add_class::<PyGrammarCompiler>()?;
    m.add_class::<PyGrammar>()?;
    crate::kernels::py::register(m)?;
    crate::cpu_decoder::py::register(m)?;
    crate::body_scan::py::register(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
