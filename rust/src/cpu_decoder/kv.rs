//! The paged KV cache as the decoder writes and reads it: per layer a K and a V array
//! (num_blocks, block_size, H_kv, D) in float32 or bfloat16 bits — the runner's own cache
//! tensors, shared with the torch path and the block pool (borrowed, never copied), or owned
//! here (tests).

use std::any::Any;
use std::sync::{Mutex, MutexGuard};

use crate::kernels::elementwise::CacheMut;
use crate::kernels::paged_attention::KvCache;

/// One layer's K and V storage.
#[derive(Clone, Copy)]
pub enum KvLayer {
    F32 { k: *mut f32, v: *mut f32 },
    Bf16 { k: *mut u16, v: *mut u16 },
}

/// The shape every layer's K (and V) has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl CacheShape {
    pub fn elements(&self) -> usize {
        self.num_blocks * self.block_size * self.kv_heads * self.head_dim
    }
}

pub struct KvCaches {
    layers: Vec<KvLayer>,
    pub shape: CacheShape,
    /// One step at a time writes and reads the arrays.
    busy: Mutex<()>,
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the arrays are only touched while `busy` is held (`KvCaches::lock`).
unsafe impl Send for KvCaches {}
unsafe impl Sync for KvCaches {}

impl KvCaches {
    /// Caches over arrays the caller owns.
    ///
    /// # Safety
    /// Each layer's K and V must point at `shape.elements()` values that stay valid while
    /// `owner` lives, and nothing else may touch them during a step.
    pub unsafe fn borrowed(
        layers: Vec<KvLayer>,
        shape: CacheShape,
        owner: Box<dyn Any + Send + Sync>,
    ) -> Self {
        KvCaches {
            layers,
            shape,
            busy: Mutex::new(()),
            _owner: owner,
        }
    }

    /// Zeroed float32 (or bfloat16) caches owned here.
    pub fn zeros(num_layers: usize, shape: CacheShape, bf16: bool) -> Self {
        let n = shape.elements();
        if bf16 {
            let mut arrays: Vec<Vec<u16>> = (0..2 * num_layers).map(|_| vec![0; n]).collect();
            let layers = arrays
                .chunks_exact_mut(2)
                .map(|kv| KvLayer::Bf16 {
                    k: kv[0].as_mut_ptr(),
                    v: kv[1].as_mut_ptr(),
                })
                .collect();
            // SAFETY: the vectors' heap storage does not move with them into the owner box.
            unsafe { Self::borrowed(layers, shape, Box::new(arrays)) }
        } else {
            let mut arrays: Vec<Vec<f32>> = (0..2 * num_layers).map(|_| vec![0.0; n]).collect();
            let layers = arrays
                .chunks_exact_mut(2)
                .map(|kv| KvLayer::F32 {
                    k: kv[0].as_mut_ptr(),
                    v: kv[1].as_mut_ptr(),
                })
                .collect();
            // SAFETY: as above.
            unsafe { Self::borrowed(layers, shape, Box::new(arrays)) }
        }
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn is_bf16(&self) -> bool {
        matches!(self.layers.first(), Some(KvLayer::Bf16 { .. }))
    }

    /// Exclusive use of the arrays for one step.
    pub fn lock(&self) -> KvGuard<'_> {
        KvGuard {
            caches: self,
            _busy: self.busy.lock().unwrap_or_else(|e| e.into_inner()),
        }
    }
}

/// The arrays of one step, lent one layer at a time.
pub struct KvGuard<'a> {
    caches: &'a KvCaches,
    _busy: MutexGuard<'a, ()>,
}

impl KvGuard<'_> {
    /// Layer `i`'s K and V to write into.
    pub fn writable(&mut self, i: usize) -> (CacheMut<'_>, CacheMut<'_>) {
        let n = self.caches.shape.elements();
        // SAFETY: `KvCaches::borrowed`'s contract, the lock held, and `&mut self` keeps these
        // slices the only ones alive.
        unsafe {
            match self.caches.layers[i] {
                KvLayer::F32 { k, v } => (
                    CacheMut::F32(std::slice::from_raw_parts_mut(k, n)),
                    CacheMut::F32(std::slice::from_raw_parts_mut(v, n)),
                ),
                KvLayer::Bf16 { k, v } => (
                    CacheMut::Bf16(std::slice::from_raw_parts_mut(k, n)),
                    CacheMut::Bf16(std::slice::from_raw_parts_mut(v, n)),
                ),
            }
        }
    }

    /// Layer `i`'s K and V to read.
    pub fn readable(&self, i: usize) -> KvCache<'_> {
        let n = self.caches.shape.elements();
        // SAFETY: as in `writable`; no writable slice outlives its call's borrow of self.
        unsafe {
            match self.caches.layers[i] {
                KvLayer::F32 { k, v } => KvCache::F32 {
                    k: std::slice::from_raw_parts(k, n),
                    v: std::slice::from_raw_parts(v, n),
                },
                KvLayer::Bf16 { k, v } => KvCache::Bf16 {
                    k: std::slice::from_raw_parts(k, n),
                    v: std::slice::from_raw_parts(v, n),
                },
            }
        }
    }
}

impl KvGuard<'_> {
    pub fn shape(&self) -> CacheShape {
        self.caches.shape
    }
}
