//! The memory under a plan's numpy columns, and its reuse from step to step.
//!
//! A plan's columns are the core's own `StepPlan` columns, held by a [`PlanBuffer`] (opaque to
//! Python: the `base` of every column) and each read through a numpy view made when first read:
//! no copy. When a plan is dropped its buffer and views come back to the core ([`SpareArrays`]);
//! a later step hands the buffer's `StepPlan` to the core to plan into (its columns' memory
//! reused) and moves each view to its column's new place, but only while nothing outside the
//! core holds the buffer or any view (reference counts, read with the GIL held) and each view is
//! as it was made: an array someone still holds never changes. Otherwise the step plans into new
//! columns, as it would with no reuse at all.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicPtr, Ordering};

use numpy::npyffi::{self, PY_ARRAY_API};
use numpy::{Element, PyArray1, PyArrayDescrMethods};
use parking_lot::Mutex;
use pyo3::ffi;
use pyo3::prelude::*;

use crate::step_plan::StepPlan;

/// The columns of a plan, numbered.
pub(super) const COLUMNS: usize = 14;
pub(super) const INPUT_IDS: usize = 0;
pub(super) const POSITIONS: usize = 1;
pub(super) const SLOT_MAPPING: usize = 2;
pub(super) const QUERY_START_LOC: usize = 3;
pub(super) const NUM_COMPUTED_TOKENS: usize = 4;
pub(super) const SEQ_LENS: usize = 5;
pub(super) const LOGITS_INDICES: usize = 6;
pub(super) const SAMPLE_REQUEST_ROWS: usize = 7;
pub(super) const SLOTS: usize = 8;
pub(super) const NEW_BLOCK_SLOTS: usize = 9;
pub(super) const NEW_BLOCK_INDICES: usize = 10;
pub(super) const NEW_BLOCK_IDS: usize = 11;
pub(super) const BANNED_ROWS: usize = 12;
pub(super) const BANNED_IDS: usize = 13;

/// The flags of a view as made: contiguous both ways, aligned, writeable (no others).
const VIEW_FLAGS: i32 = npyffi::NPY_ARRAY_C_CONTIGUOUS
    | npyffi::NPY_ARRAY_F_CONTIGUOUS
    | npyffi::NPY_ARRAY_ALIGNED
    | npyffi::NPY_ARRAY_WRITEABLE;

/// The core's plan whose columns a step's views read: the base of each view, with no methods.
#[pyclass(name = "PlanBuffer", module = "aieng._core", frozen)]
pub(super) struct PlanBuffer {
    /// Its columns, read through views; the plan is taken out and put back only while no one
    /// else refers to the buffer or a view ([`PlanArrays::reusable`]).
    plan: UnsafeCell<StepPlan>,
}

// SAFETY: the plan is mutated only with the GIL held and while nothing but the core refers to
// the buffer (its views included); otherwise it is read, or written through numpy views (as
// any array's memory is).
unsafe impl Sync for PlanBuffer {}

impl PlanBuffer {
    /// Column k of the plan (numbered above).
    fn column(&self, k: usize) -> &[i32] {
        // SAFETY: see `Sync` above: no one mutates the plan while it is shared.
        let plan = unsafe { &*self.plan.get() };
        match k {
            INPUT_IDS => &plan.input_ids,
            POSITIONS => &plan.positions,
            SLOT_MAPPING => &plan.slot_mapping,
            QUERY_START_LOC => &plan.query_start_loc,
            NUM_COMPUTED_TOKENS => &plan.num_computed_tokens,
            SEQ_LENS => &plan.seq_lens,
            LOGITS_INDICES => &plan.logits_indices,
            SAMPLE_REQUEST_ROWS => &plan.sample_request_rows,
            SLOTS => &plan.slots,
            NEW_BLOCK_SLOTS => &plan.new_block_slots,
            NEW_BLOCK_INDICES => &plan.new_block_indices,
            NEW_BLOCK_IDS => &plan.new_block_ids,
            BANNED_ROWS => &plan.banned_rows,
            BANNED_IDS => &plan.banned_ids,
            _ => unreachable!("a plan has {COLUMNS} columns"),
        }
    }
}

/// A plan's buffer and the views of its columns: view k is null until made, then held (one
/// reference each).
pub(super) struct PlanArrays {
    buffer: Py<PlanBuffer>,
    views: [AtomicPtr<ffi::PyObject>; COLUMNS],
}

impl PlanArrays {
    /// Arrays of `plan`'s columns (its ids and masks taken out before), no view made yet.
    pub(super) fn new(py: Python<'_>, plan: StepPlan) -> PyResult<Self> {
        Ok(PlanArrays {
            buffer: Py::new(
                py,
                PlanBuffer {
                    plan: UnsafeCell::new(plan),
                },
            )?,
            views: Default::default(),
        })
    }

    /// Takes the buffer's plan out, for the core to plan the next step into. The caller holds
    /// these arrays alone ([`SpareArrays::take`]) and puts a plan back before a view is read.
    pub(super) fn take_plan(&mut self) -> StepPlan {
        // SAFETY: no one else refers to the buffer or a view (see `reusable`).
        std::mem::take(unsafe { &mut *self.buffer.get().plan.get() })
    }

    /// Puts `plan` (its ids and masks taken out) in the buffer and moves each view made to its
    /// column. The caller holds these arrays alone, as for [`PlanArrays::take_plan`].
    pub(super) fn put_plan(&mut self, plan: StepPlan) {
        let buffer = self.buffer.get();
        // SAFETY: as above.
        unsafe { *buffer.plan.get() = plan };
        for (k, view) in self.views.iter_mut().enumerate() {
            let view = *view.get_mut();
            if view.is_null() {
                continue;
            }
            let column = buffer.column(k);
            // SAFETY: a one-dimensional view of this buffer (checked by `reusable`) that no
            // one else refers to: its place and length are set to column k's.
            unsafe {
                let fields = &mut (*view.cast::<npyffi::PyArrayObject>()).fields;
                fields.data = column.as_ptr().cast_mut().cast();
                *fields.dimensions = column.len() as npyffi::npy_intp;
            }
        }
    }

    /// Whether no one but the holder refers to the buffer or any view; each view that is no
    /// longer as it was made (its shape, strides, dtype, flags changed, or weakly referenced)
    /// is dropped meanwhile, to be made anew when read.
    fn reusable(&mut self, py: Python<'_>, int32: *mut npyffi::PyArray_Descr) -> bool {
        let buffer = self.buffer.as_ptr();
        let mut made = 0;
        for view in &mut self.views {
            let view = *view.get_mut();
            // SAFETY: a live object the arrays hold a reference to; the GIL is held.
            if !view.is_null() {
                if unsafe { ffi::Py_REFCNT(view) } != 1 {
                    return false;
                }
                made += 1;
            }
        }
        // SAFETY: as above; each view holds a reference to the buffer (its base).
        if unsafe { ffi::Py_REFCNT(buffer) } != 1 + made {
            return false;
        }
        for view in &mut self.views {
            let ptr = *view.get_mut();
            if ptr.is_null() {
                continue;
            }
            // SAFETY: a view numpy made (an ndarray) that only these arrays refer to.
            let as_made = unsafe {
                let fields = &(*ptr.cast::<npyffi::PyArrayObject>()).fields;
                fields.nd == 1
                    && *fields.strides == size_of::<i32>() as npyffi::npy_intp
                    && fields.flags == VIEW_FLAGS
                    && fields.descr == int32
                    && fields.base == buffer
                    && fields.weakreflist.is_null()
            };
            if !as_made {
                *view.get_mut() = std::ptr::null_mut();
                // SAFETY: the arrays' own reference, given back once.
                drop(unsafe { Bound::from_owned_ptr(py, ptr) });
            }
        }
        true
    }

    /// Column k as a numpy view of the buffer (which it keeps alive), made on first read and
    /// the same object after. The cache never blocks: a thread that finds it set by another
    /// meanwhile drops its own view.
    pub(super) fn column<'py>(
        &self,
        py: Python<'py>,
        k: usize,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let mut cached = self.views[k].load(Ordering::Acquire);
        if cached.is_null() {
            let view = self.view(py, k)?.into_ptr();
            cached = match self.views[k].compare_exchange(
                std::ptr::null_mut(),
                view,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => view,
                Err(theirs) => {
                    // SAFETY: `view` is our own reference, never shared.
                    drop(unsafe { Bound::from_owned_ptr(py, view) });
                    theirs
                }
            };
        }
        // SAFETY: the arrays hold a reference to this view of column k while they live; the
        // caller gets one of its own.
        Ok(unsafe { Bound::from_borrowed_ptr(py, cached).cast_into_unchecked() })
    }

    /// A new view of column k: numpy's constructor called with the ndarray type and the int32
    /// dtype, the buffer as its base.
    fn view<'py>(&self, py: Python<'py>, k: usize) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let buffer = self.buffer.bind(py);
        let column = buffer.get().column(k);
        let mut dims = [column.len() as npyffi::npy_intp];
        // SAFETY: the column's memory does not move while the buffer is shared (the plan is
        // changed only while no one else refers to it); the descr is passed with a reference
        // of its own (the constructor takes it); the view takes a reference to the buffer as
        // its base, so the memory outlives it.
        unsafe {
            let view = PY_ARRAY_API.PyArray_NewFromDescr(
                py,
                npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
                i32::get_dtype(py).into_dtype_ptr(),
                1,
                dims.as_mut_ptr(),
                std::ptr::null_mut(),
                column.as_ptr().cast_mut().cast(),
                npyffi::NPY_ARRAY_WRITEABLE,
                std::ptr::null_mut(),
            );
            let view = Bound::from_owned_ptr_or_err(py, view)?;
            let base = buffer.clone().into_ptr();
            if PY_ARRAY_API.PyArray_SetBaseObject(py, view.as_ptr().cast(), base) < 0 {
                return Err(PyErr::fetch(py));
            }
            Ok(view.cast_into_unchecked())
        }
    }

    /// Column k, read in place.
    pub(super) fn slice(&self, k: usize) -> &[i32] {
        self.buffer.get().column(k)
    }
}

impl Drop for PlanArrays {
    fn drop(&mut self) {
        let made = |view: &mut AtomicPtr<ffi::PyObject>| !view.get_mut().is_null();
        if !self.views.iter_mut().any(made) {
            return;
        }
        // Arrays are dropped with the GIL held (a plan's deallocation, or a step), so this
        // attaches at once; a destructor never panics: when Python cannot be attached (at its
        // shutdown) the views are left to it.
        Python::try_attach(|py| {
            for view in self
                .views
                .iter_mut()
                .filter_map(|v| made(v).then(|| *v.get_mut()))
            {
                // SAFETY: the arrays' own reference to a view, given back once.
                drop(unsafe { Bound::from_owned_ptr(py, view) });
            }
        });
    }
}

/// The arrays of dropped plans, kept for later steps (at most [`SpareArrays::KEEP`]).
#[derive(Default)]
pub(super) struct SpareArrays {
    spare: Mutex<Vec<PlanArrays>>,
}

impl SpareArrays {
    /// A plan in use, the last one dropped and the one before: a loop that holds a step's
    /// columns until the next step's are read finds one to reuse.
    const KEEP: usize = 2;

    /// Keeps the arrays of a dropped plan for a later step.
    pub(super) fn give_back(&self, arrays: PlanArrays) {
        let mut spare = self.spare.lock();
        if spare.len() < Self::KEEP {
            spare.push(arrays);
            return;
        }
        drop(spare);
        drop(arrays);
    }

    /// The last arrays given back that no one else holds, if any (the others are let go).
    pub(super) fn take(&self, py: Python<'_>) -> Option<PlanArrays> {
        let mut int32 = None;
        loop {
            let mut spare = self.spare.lock().pop()?;
            let int32 = *int32.get_or_insert_with(|| i32::get_dtype(py).as_dtype_ptr());
            if spare.reusable(py, int32) {
                return Some(spare);
            }
        }
    }
}
