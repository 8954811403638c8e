//! The decoder's weights as the kernels read them, built once at load: a `Buffer` is either
//! owned here or borrowed from the caller (a torch tensor's storage, kept alive by its owner
//! handle), so a float weight the torch model also holds is never copied.

mod linear;

use std::any::Any;

pub use linear::{Linear, LinearWeights};

/// A read-only run of `T` whose storage lives as long as the buffer.
pub struct Buffer<T> {
    ptr: *const T,
    len: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the buffer is never written through, and its owner is Send + Sync.
unsafe impl<T: Sync> Send for Buffer<T> {}
unsafe impl<T: Sync> Sync for Buffer<T> {}

impl<T: Send + Sync + 'static> Buffer<T> {
    /// A buffer owning `values`.
    pub fn owned(values: Vec<T>) -> Self {
        let (ptr, len) = (values.as_ptr(), values.len());
        // Moving the Vec into the box moves its handle, not its heap storage.
        Buffer {
            ptr,
            len,
            _owner: Box::new(values),
        }
    }
}

impl<T> Buffer<T> {
    /// A buffer over `len` values at `ptr`, kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay valid, and unwritten, for as long as `owner` lives.
    pub unsafe fn borrowed(ptr: *const T, len: usize, owner: Box<dyn Any + Send + Sync>) -> Self {
        Buffer {
            ptr,
            len,
            _owner: owner,
        }
    }

    pub fn as_slice(&self) -> &[T] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see `borrowed` and `owned`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A table of rows: the token embedding (V, hidden), float32 or bfloat16 bits.
pub enum Table {
    F32(Buffer<f32>),
    Bf16(Buffer<u16>),
}

impl Table {
    pub fn len(&self) -> usize {
        match self {
            Table::F32(b) => b.len(),
            Table::Bf16(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Row `row` of `width` values, widened to float32 and multiplied by `scale`, into `out`.
    pub fn row_into(&self, row: usize, width: usize, scale: f32, out: &mut [f32]) {
        match self {
            Table::F32(b) => {
                for (o, &v) in out.iter_mut().zip(&b.as_slice()[row * width..][..width]) {
                    *o = v * scale;
                }
            }
            Table::Bf16(b) => {
                for (o, &v) in out.iter_mut().zip(&b.as_slice()[row * width..][..width]) {
                    *o = f32::from_bits((v as u32) << 16) * scale;
                }
            }
        }
    }
}

/// One decoder layer's weights and options.
pub struct LayerWeights {
    /// Before attention (pre-norm and sandwich layers).
    pub input_norm: Option<Vec<f32>>,
    /// Pre-norm: before the MLP; post-norm and sandwich: on the attention's output.
    pub post_attention_norm: Vec<f32>,
    /// Sandwich (Gemma): before the MLP.
    pub pre_feedforward_norm: Option<Vec<f32>>,
    /// Post-norm and sandwich: on the MLP's output.
    pub post_feedforward_norm: Option<Vec<f32>>,
    /// q and k norms: per head (D weights) or across heads (H·D and H_kv·D weights).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub qkv: Linear,
    pub o: Linear,
    pub gate_up: Linear,
    pub down: Linear,
    /// The last `window` positions only (None: the whole context).
    pub window: Option<usize>,
    /// The index of this layer's RoPE table (None: no RoPE on this layer).
    pub rope: Option<usize>,
}

/// A RoPE table: cos and sin (positions, D/2) float32, any attention factor applied.
pub struct RopeTable {
    pub cos: Buffer<f32>,
    pub sin: Buffer<f32>,
}
