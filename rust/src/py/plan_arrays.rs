//! The memory under a plan's numpy columns, and its reuse from step to step.
//!
//! A plan's columns lie one after another in one int32 buffer (a [`PlanBuffer`], opaque to
//! Python: the `base` of every column), each column a numpy view of it made when first read.
//! When a plan is dropped its buffer and views come back to the core ([`SpareArrays`]); a
//! later step refills them in place, moving each view to its column's new place, but only
//! while nothing outside the core holds the buffer or any view (reference counts, read with
//! the GIL held) and each view is as it was made: an array someone still holds never
//! changes. Otherwise the step takes a new buffer, as it would with no reuse at all.

use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicPtr, Ordering};

use numpy::npyffi::{self, PY_ARRAY_API};
use numpy::{Element, PyArray1, PyArrayDescrMethods};
use parking_lot::Mutex;
use pyo3::ffi;
use pyo3::prelude::*;

/// The columns of a plan, in the order they lie in its buffer.
pub(super) const COLUMNS: usize = 14;

/// The flags of a view as made: contiguous both ways, aligned, writeable (no others).
const VIEW_FLAGS: i32 = npyffi::NPY_ARRAY_C_CONTIGUOUS
    | npyffi::NPY_ARRAY_F_CONTIGUOUS
    | npyffi::NPY_ARRAY_ALIGNED
    | npyffi::NPY_ARRAY_WRITEABLE;

/// The int32 memory of one plan's columns: the base of each column's view, with no methods.
#[pyclass(name = "PlanBuffer", module = "aieng._core", frozen)]
pub(super) struct PlanBuffer {
    /// `capacity` elements, allocated as a boxed slice; written only through views and while
    /// the core holds the buffer alone.
    data: NonNull<MaybeUninit<i32>>,
    capacity: usize,
}

// SAFETY: the memory is owned by the buffer alone; it is written only with the GIL held, by
// the core while nothing else refers to the buffer, or through numpy views (as any array).
unsafe impl Send for PlanBuffer {}
// SAFETY: as above.
unsafe impl Sync for PlanBuffer {}

impl PlanBuffer {
    fn new(capacity: usize) -> Self {
        let data = Box::<[i32]>::new_uninit_slice(capacity);
        let data = NonNull::new(Box::into_raw(data).cast()).expect("a box is not null");
        PlanBuffer { data, capacity }
    }

    fn ptr(&self) -> *mut i32 {
        self.data.as_ptr().cast()
    }
}

impl Drop for PlanBuffer {
    fn drop(&mut self) {
        let slice = std::ptr::slice_from_raw_parts_mut(self.data.as_ptr(), self.capacity);
        // SAFETY: the boxed slice made in `new`, given back once.
        drop(unsafe { Box::from_raw(slice) });
    }
}

/// A plan's buffer and the views of its columns: view k is null until made, then held (one
/// reference each).
pub(super) struct PlanArrays {
    buffer: Py<PlanBuffer>,
    views: [AtomicPtr<ffi::PyObject>; COLUMNS],
}

impl PlanArrays {
    fn new(py: Python<'_>, capacity: usize) -> PyResult<Self> {
        Ok(PlanArrays {
            buffer: Py::new(py, PlanBuffer::new(capacity))?,
            views: Default::default(),
        })
    }

    /// Writes `columns` one after another (column k at `bounds[k]..bounds[k + 1]`) and moves
    /// each view made to its column. The caller holds these arrays alone (new, or
    /// [`PlanArrays::reusable`]) and the buffer holds `bounds[COLUMNS]` elements.
    fn fill(&mut self, columns: &[&[i32]; COLUMNS], bounds: &[usize; COLUMNS + 1]) {
        let buffer = self.buffer.get();
        debug_assert!(bounds[COLUMNS] <= buffer.capacity);
        let data = buffer.ptr();
        for (k, column) in columns.iter().enumerate() {
            // SAFETY: `bounds` splits the first `bounds[COLUMNS]` elements of the buffer,
            // which nothing else reads or writes now.
            unsafe {
                std::ptr::copy_nonoverlapping(column.as_ptr(), data.add(bounds[k]), column.len())
            };
        }
        for (k, view) in self.views.iter_mut().enumerate() {
            let view = *view.get_mut();
            if view.is_null() {
                continue;
            }
            // SAFETY: a view of this buffer, one-dimensional (checked by `reusable`), that no
            // one else refers to: its place and length are set to column k's.
            unsafe {
                let fields = &mut (*view.cast::<npyffi::PyArrayObject>()).fields;
                fields.data = data.add(bounds[k]).cast();
                *fields.dimensions = (bounds[k + 1] - bounds[k]) as npyffi::npy_intp;
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

    /// Column k (`bounds[k]..bounds[k + 1]`) as a numpy view of the buffer (which it keeps
    /// alive), made on first read and the same object after. The cache never blocks: a thread
    /// that finds it set by another meanwhile drops its own view.
    pub(super) fn column<'py>(
        &self,
        py: Python<'py>,
        k: usize,
        bounds: &[usize; COLUMNS + 1],
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let mut cached = self.views[k].load(Ordering::Acquire);
        if cached.is_null() {
            let view = self.view(py, bounds[k], bounds[k + 1])?.into_ptr();
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

    /// A new view of `start..end`: numpy's constructor called with the ndarray type and the
    /// int32 dtype, the buffer as its base.
    fn view<'py>(
        &self,
        py: Python<'py>,
        start: usize,
        end: usize,
    ) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let buffer = self.buffer.bind(py);
        let mut dims = [(end - start) as npyffi::npy_intp];
        // SAFETY: `start..end` lies in the written part of the buffer, whose memory never
        // moves; the descr is passed with a reference of its own (the constructor takes it);
        // the view takes a reference to the buffer as its base, so the memory outlives it.
        unsafe {
            let view = PY_ARRAY_API.PyArray_NewFromDescr(
                py,
                npyffi::get_type_object(py, npyffi::NpyTypes::PyArray_Type),
                i32::get_dtype(py).into_dtype_ptr(),
                1,
                dims.as_mut_ptr(),
                std::ptr::null_mut(),
                buffer.get().ptr().add(start).cast(),
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

    /// `start..end` of the buffer, read in place (the GIL held: no view writes meanwhile).
    pub(super) fn slice<'a>(&'a self, _py: Python<'a>, start: usize, end: usize) -> &'a [i32] {
        let buffer = self.buffer.get();
        assert!(start <= end && end <= buffer.capacity);
        // SAFETY: in bounds, and written by `fill` (a plan reads only its columns).
        unsafe { std::slice::from_raw_parts(buffer.ptr().add(start), end - start) }
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

    /// Arrays holding `columns`, each view made before moved to its column: the last arrays
    /// given back that no one else holds and that are large enough, or new ones.
    pub(super) fn fill(
        &self,
        py: Python<'_>,
        columns: &[&[i32]; COLUMNS],
        bounds: &[usize; COLUMNS + 1],
    ) -> PyResult<PlanArrays> {
        let len = bounds[COLUMNS];
        let mut arrays = None;
        let mut int32 = None;
        loop {
            let Some(mut spare) = self.spare.lock().pop() else {
                break;
            };
            let int32 = *int32.get_or_insert_with(|| i32::get_dtype(py).as_dtype_ptr());
            if spare.buffer.get().capacity >= len && spare.reusable(py, int32) {
                arrays = Some(spare);
                break;
            }
        }
        let mut arrays = match arrays {
            Some(arrays) => arrays,
            // Room to grow: steps of the same kind fit in the arrays again.
            None => PlanArrays::new(py, len.next_power_of_two().max(64))?,
        };
        arrays.fill(columns, bounds);
        Ok(arrays)
    }
}
