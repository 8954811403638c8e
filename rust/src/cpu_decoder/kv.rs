//! The paged KV cache as the decoder writes and reads it: per layer a K and a V array
//! (num_blocks, block_size, H_kv, D) in float32, bfloat16 bits, or int8 with one scale per
//! position and KV head (float32 or bfloat16 bits, shape (num_blocks, block_size, H_kv, 1)) —
//! the runner's own cache tensors, shared with the torch path and the block pool (borrowed,
//! never copied), or owned here (tests). An INT8 row is written as the torch reference does
//! (`quantize_int8`): scale = max(max|x| / 127, the smallest normal), rounded to the scale's
//! type, and q = round-half-even(x / scale) in −127..=127, with the scale as stored.

use std::any::Any;
use std::sync::{Mutex, MutexGuard};

use crate::kernels::elementwise::{kv_write, to_bf16, CacheMut, Heads};
use crate::kernels::paged_attention::{KvCache, Scales};
use crate::kernels::KernelError;

/// An INT8 cache's scales: float32, or bfloat16 bits.
#[derive(Clone, Copy)]
pub enum ScalePtr {
    F32(*mut f32),
    Bf16(*mut u16),
}

/// One layer's K and V storage.
#[derive(Clone, Copy)]
pub enum KvLayer {
    F32 {
        k: *mut f32,
        v: *mut f32,
    },
    Bf16 {
        k: *mut u16,
        v: *mut u16,
    },
    Int8 {
        k: *mut i8,
        v: *mut i8,
        k_scale: ScalePtr,
        v_scale: ScalePtr,
    },
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

    pub fn is_int8(&self) -> bool {
        matches!(self.layers.first(), Some(KvLayer::Int8 { .. }))
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
    /// Writes the step's K and V (T, H_kv, D) into slots `slots` of layer `i`.
    pub fn write(
        &mut self,
        i: usize,
        k: Heads,
        v: Heads,
        slots: &[i64],
    ) -> Result<(), KernelError> {
        let n = self.caches.shape.elements();
        let rows = n / self.caches.shape.head_dim.max(1);
        // SAFETY: `KvCaches::borrowed`'s contract, the lock held, and `&mut self` keeps these
        // slices the only ones alive.
        unsafe {
            match self.caches.layers[i] {
                KvLayer::F32 { k: kc, v: vc } => kv_write(
                    k,
                    v,
                    slots,
                    CacheMut::F32(std::slice::from_raw_parts_mut(kc, n)),
                    CacheMut::F32(std::slice::from_raw_parts_mut(vc, n)),
                ),
                KvLayer::Bf16 { k: kc, v: vc } => kv_write(
                    k,
                    v,
                    slots,
                    CacheMut::Bf16(std::slice::from_raw_parts_mut(kc, n)),
                    CacheMut::Bf16(std::slice::from_raw_parts_mut(vc, n)),
                ),
                KvLayer::Int8 {
                    k: kc,
                    v: vc,
                    k_scale,
                    v_scale,
                } => {
                    let capacity = self.caches.shape.num_blocks * self.caches.shape.block_size;
                    if let Some(bad) = slots.iter().find(|&&s| s < 0 || s as usize >= capacity) {
                        return Err(KernelError::InvalidArgument(format!(
                            "kv_write: slot {bad} is outside the cache's {capacity}"
                        )));
                    }
                    let (kc, vc) = (
                        std::slice::from_raw_parts_mut(kc, n),
                        std::slice::from_raw_parts_mut(vc, n),
                    );
                    write_int8(k, slots, kc, k_scale, rows);
                    write_int8(v, slots, vc, v_scale, rows);
                    Ok(())
                }
            }
        }
    }

    /// Layer `i`'s K and V to read.
    pub fn readable(&self, i: usize) -> KvCache<'_> {
        let n = self.caches.shape.elements();
        // SAFETY: as in `write`; no writable slice outlives its call's borrow of self.
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
                KvLayer::Int8 {
                    k,
                    v,
                    k_scale,
                    v_scale,
                } => {
                    let rows = n / self.caches.shape.head_dim.max(1);
                    let scales = |s: ScalePtr| match s {
                        ScalePtr::F32(p) => Scales::F32(std::slice::from_raw_parts(p, rows)),
                        ScalePtr::Bf16(p) => Scales::Bf16(std::slice::from_raw_parts(p, rows)),
                    };
                    KvCache::Int8 {
                        k: std::slice::from_raw_parts(k, n),
                        v: std::slice::from_raw_parts(v, n),
                        k_scale: scales(k_scale),
                        v_scale: scales(v_scale),
                    }
                }
            }
        }
    }
}

/// Token t's (H_kv, D) rows of `x`, quantized (see the module note) into slot `slots[t]` of
/// `values`, their scales into `scales` (`rows` of them: one per position and KV head).
///
/// # Safety
/// `scales` must point at `rows` writable values no one else touches during the call.
unsafe fn write_int8(x: Heads, slots: &[i64], values: &mut [i8], scales: ScalePtr, rows: usize) {
    let d = x.head_dim;
    for (t, &slot) in slots.iter().enumerate() {
        for h in 0..x.heads {
            let src = &x.data[t * x.row_stride + h * x.head_stride..][..d];
            let row = slot as usize * x.heads + h;
            let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = (amax / 127.0).max(f32::MIN_POSITIVE);
            let stored = match scales {
                ScalePtr::F32(p) => {
                    std::slice::from_raw_parts_mut(p, rows)[row] = scale;
                    scale
                }
                ScalePtr::Bf16(p) => {
                    let bits = to_bf16(scale);
                    std::slice::from_raw_parts_mut(p, rows)[row] = bits;
                    f32::from_bits((bits as u32) << 16)
                }
            };
            for (q, &v) in values[row * d..][..d].iter_mut().zip(src) {
                *q = crate::kernels::round_small(v / stored).clamp(-127.0, 127.0) as i8;
            }
        }
    }
}

impl KvGuard<'_> {
    pub fn shape(&self) -> CacheShape {
        self.caches.shape
    }
}
