//! One engine step through the decoder (see the module note of `super`): T tokens of R rows,
//! laid out row after row, as the core's StepPlan holds them.

use super::kv::KvCaches;
use super::{invalid, Activation, CpuDecoder, LayerWeights, Linear, NormPlacement, Scratch};
use crate::kernels::elementwise::{add_rms_norm, gelu_tanh_and_mul, rotary, silu_and_mul, Heads};
use crate::kernels::paged_attention::{paged_attention, PagedShape, Scoring, StepRows};
use crate::kernels::{rms_norm_quantize, Isa, KernelError, QuantizedRows, ThreadCount};

/// The step's arrays (the runner's plan): T tokens, R rows.
#[derive(Debug, Clone, Copy)]
pub struct StepInputs<'a> {
    pub input_ids: &'a [i32],       // (T,)
    pub positions: &'a [i32],       // (T,)
    pub slot_mapping: &'a [i32],    // (T,) block · block_size + offset
    pub query_start_loc: &'a [i32], // (R + 1,)
    pub seq_lens: &'a [i32],        // (R,) context length after the step
    pub block_tables: &'a [i32],    // (R, table_width)
    pub table_width: usize,
    pub logits_rows: &'a [i32], // (S,) the token rows whose logits are wanted
}

/// `buffer` resized to `len` (its old values are overwritten before they are read).
fn sized(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buffer.resize(len, 0.0);
    &mut buffer[..len]
}

/// Where a norm that feeds a linear layer writes its rows: float32 rows for float weights, the
/// int8 rows the layer's kernels read for quantized ones.
struct NormedRows<'a> {
    h: &'a mut Vec<f32>,
    hq: &'a mut QuantizedRows,
}

/// out (T, n) = linear(norm(x += branch)), x (T, hidden), the add when a branch is given. For a
/// layer of int8 weights the norm writes its rows quantized, in the same pass
/// (`rms_norm_quantize`), and the layer reads them as they are: the normed rows are never
/// written in float32 (the same bits as norm, then quantize).
#[allow(clippy::too_many_arguments)]
fn norm_linear(
    x: &mut [f32],
    branch: Option<&[f32]>,
    norm: &[f32],
    eps: f32,
    linear: &Linear,
    rows: NormedRows,
    out: &mut [f32],
    isa: Isa,
    threads: ThreadCount,
) -> Result<(), KernelError> {
    match linear.quantized_activations() {
        Some(activations) => {
            rms_norm_quantize(x, branch, norm, eps, activations, threads, rows.hq)?;
            linear.apply_quantized(rows.hq, out, isa, threads)
        }
        None => {
            let h = sized(rows.h, x.len());
            add_rms_norm(x, branch, norm, eps, h, threads)?;
            linear.apply(h, x.len() / norm.len(), out, isa, threads)
        }
    }
}

/// A (T, H, D) view of `data` whose rows are `row` values apart, heads from `offset`.
fn heads(
    data: &[f32],
    tokens: usize,
    heads: usize,
    d: usize,
    row: usize,
    offset: usize,
) -> Heads<'_> {
    let data = if tokens == 0 {
        &data[..0]
    } else {
        &data[offset..]
    };
    Heads {
        data,
        tokens,
        heads,
        head_dim: d,
        row_stride: row,
        head_stride: d,
    }
}

impl CpuDecoder {
    /// Runs the step: writes the final (normed) hidden states (T, hidden) into `hidden_out`
    /// and the logits (S, vocab) of `logits_rows` into `logits_out`, and the step's K/V into
    /// `caches`.
    pub fn step(
        &self,
        inputs: StepInputs,
        caches: &KvCaches,
        hidden_out: &mut [f32],
        logits_out: &mut [f32],
        isa: Isa,
        threads: ThreadCount,
    ) -> Result<(), KernelError> {
        self.check(&inputs, caches, hidden_out, logits_out)?;
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        let s = &mut *scratch;
        let c = &self.config;
        let t = inputs.input_ids.len();
        let hidden = c.hidden;
        let x = sized(&mut s.x, t * hidden);
        for (row, &id) in x.chunks_exact_mut(hidden).zip(inputs.input_ids) {
            self.embedding
                .row_into(id as usize, hidden, c.embedding_scale, row);
        }
        let half = c.head_dim / 2;
        s.cos_sin.resize_with(self.ropes.len(), Default::default);
        for (rope, (cos, sin)) in self.ropes.iter().zip(s.cos_sin.iter_mut()) {
            let (table_cos, table_sin) = (rope.cos.as_slice(), rope.sin.as_slice());
            cos.clear();
            sin.clear();
            for &p in inputs.positions {
                let at = p as usize * half;
                cos.extend_from_slice(&table_cos[at..at + half]);
                sin.extend_from_slice(&table_sin[at..at + half]);
            }
        }
        s.slots.clear();
        s.slots
            .extend(inputs.slot_mapping.iter().map(|&v| v as i64));
        let mut guard = caches.lock();
        for (index, layer) in self.layers.iter().enumerate() {
            self.attention(index, layer, &inputs, s, &mut guard, isa, threads)?;
            self.mlp(layer, t, s, isa, threads)?;
        }
        drop(guard);
        add_rms_norm(&mut s.x, None, &self.final_norm, c.eps, hidden_out, threads)?;
        let rows = sized(&mut s.rows, inputs.logits_rows.len() * hidden);
        for (dst, &r) in rows.chunks_exact_mut(hidden).zip(inputs.logits_rows) {
            dst.copy_from_slice(&hidden_out[r as usize * hidden..][..hidden]);
        }
        self.head
            .apply(rows, inputs.logits_rows.len(), logits_out, isa, threads)?;
        if c.logits_scale != 1.0 {
            logits_out.iter_mut().for_each(|v| *v /= c.logits_scale);
        }
        if let Some(cap) = c.final_softcap {
            logits_out
                .iter_mut()
                .for_each(|v| *v = (*v / cap).tanh() * cap);
        }
        Ok(())
    }

    fn check(
        &self,
        inputs: &StepInputs,
        caches: &KvCaches,
        hidden_out: &[f32],
        logits_out: &[f32],
    ) -> Result<(), KernelError> {
        let c = &self.config;
        let t = inputs.input_ids.len();
        if inputs.positions.len() != t || inputs.slot_mapping.len() != t {
            return invalid(format!(
                "cpu decoder: {t} input ids, {} positions and {} slots",
                inputs.positions.len(),
                inputs.slot_mapping.len()
            ));
        }
        if let Some(id) = inputs
            .input_ids
            .iter()
            .find(|&&id| id < 0 || id as usize >= c.vocab)
        {
            return invalid(format!(
                "cpu decoder: token id {id} is outside the vocabulary of {}",
                c.vocab
            ));
        }
        let half = c.head_dim / 2;
        let max_positions = self
            .ropes
            .iter()
            .map(|r| r.cos.len() / half.max(1))
            .min()
            .unwrap_or(usize::MAX);
        if let Some(p) = inputs
            .positions
            .iter()
            .find(|&&p| p < 0 || p as usize >= max_positions)
        {
            return invalid(format!(
                "cpu decoder: position {p} is outside the model's {max_positions}"
            ));
        }
        if let Some(r) = inputs
            .logits_rows
            .iter()
            .find(|&&r| r < 0 || r as usize >= t)
        {
            return invalid(format!(
                "cpu decoder: logits row {r} is not one of the step's {t} tokens"
            ));
        }
        let shape = caches.shape;
        if caches.num_layers() != self.layers.len()
            || shape.kv_heads != c.kv_heads
            || shape.head_dim != c.head_dim
        {
            return invalid(format!(
                "cpu decoder: caches of {} layers of {} KV heads of {} for a model of {} layers \
                 of {} KV heads of {}",
                caches.num_layers(),
                shape.kv_heads,
                shape.head_dim,
                self.layers.len(),
                c.kv_heads,
                c.head_dim
            ));
        }
        let capacity = shape.num_blocks * shape.block_size;
        if let Some(slot) = inputs
            .slot_mapping
            .iter()
            .find(|&&s| s < 0 || s as usize >= capacity)
        {
            return invalid(format!(
                "cpu decoder: slot {slot} is outside the cache's {capacity}"
            ));
        }
        if hidden_out.len() != t * c.hidden
            || logits_out.len() != inputs.logits_rows.len() * c.vocab
        {
            return invalid(format!(
                "cpu decoder: outputs of {} and {} values for ({t}, {}) hidden states and ({}, \
                 {}) logits",
                hidden_out.len(),
                logits_out.len(),
                c.hidden,
                inputs.logits_rows.len(),
                c.vocab
            ));
        }
        Ok(())
    }

    /// The attention sublayer of layer `index` and its residual add (pre-norm: `s.o` scaled,
    /// added by the MLP's norm).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        index: usize,
        layer: &LayerWeights,
        inputs: &StepInputs,
        s: &mut Scratch,
        guard: &mut super::kv::KvGuard<'_>,
        isa: Isa,
        threads: ThreadCount,
    ) -> Result<(), KernelError> {
        let c = &self.config;
        let (t, hidden, d) = (inputs.input_ids.len(), c.hidden, c.head_dim);
        let (q_size, kv_size) = (c.q_size(), c.kv_size());
        let width = q_size + 2 * kv_size;
        let qkv = sized(&mut s.qkv, t * width);
        match &layer.input_norm {
            Some(norm) => {
                let rows = NormedRows {
                    h: &mut s.h,
                    hq: &mut s.hq,
                };
                let x = &mut s.x[..t * hidden];
                norm_linear(x, None, norm, c.eps, &layer.qkv, rows, qkv, isa, threads)?;
            }
            None => layer.qkv.apply(&s.x, t, qkv, isa, threads)?,
        }
        let qkv = &s.qkv[..t * width];
        // q and k as (T, heads, D) views: of the projection, or of their normed copies.
        let (q_src, k_src) = match (&layer.q_norm, &layer.k_norm) {
            (Some(qn), Some(kn)) => {
                let (q_in, k_in) = (
                    sized(&mut s.q_in, t * q_size),
                    sized(&mut s.k_in, t * kv_size),
                );
                for (row, (qr, kr)) in qkv.chunks_exact(width).zip(
                    q_in.chunks_exact_mut(q_size)
                        .zip(k_in.chunks_exact_mut(kv_size)),
                ) {
                    qr.copy_from_slice(&row[..q_size]);
                    kr.copy_from_slice(&row[q_size..q_size + kv_size]);
                }
                let q_normed = sized(&mut s.q_normed, t * q_size);
                add_rms_norm(q_in, None, qn, c.eps, q_normed, threads)?;
                let k_normed = sized(&mut s.k_normed, t * kv_size);
                add_rms_norm(k_in, None, kn, c.eps, k_normed, threads)?;
                (
                    heads(&s.q_normed, t, c.heads, d, q_size, 0),
                    heads(&s.k_normed, t, c.kv_heads, d, kv_size, 0),
                )
            }
            _ => (
                heads(qkv, t, c.heads, d, width, 0),
                heads(qkv, t, c.kv_heads, d, width, q_size),
            ),
        };
        let v_src = heads(qkv, t, c.kv_heads, d, width, q_size + kv_size);
        let (q, k) = (sized(&mut s.q, t * q_size), sized(&mut s.k, t * kv_size));
        match layer.rope {
            Some(r) => {
                let (cos, sin) = &s.cos_sin[r];
                rotary(q_src, cos, sin, q, threads)?;
                rotary(k_src, cos, sin, k, threads)?;
            }
            None => {
                copy_heads(q_src, q);
                copy_heads(k_src, k);
            }
        }
        let k_heads = heads(&s.k, t, c.kv_heads, d, kv_size, 0);
        guard.write(index, k_heads, v_src, &s.slots)?;
        let shape = guard_shape(guard, c.heads);
        let rows = StepRows {
            query_start_loc: inputs.query_start_loc,
            seq_lens: inputs.seq_lens,
            block_tables: inputs.block_tables,
            table_width: inputs.table_width,
        };
        let scoring = Scoring {
            scale: c.attention_scale,
            window: layer.window,
            softcap: c.attention_softcap,
        };
        let attn = sized(&mut s.attn, t * q_size);
        paged_attention(
            &s.q,
            guard.readable(index),
            attn,
            shape,
            rows,
            scoring,
            isa,
            threads,
        )?;
        let o = sized(&mut s.o, t * hidden);
        layer.o.apply(attn, t, o, isa, threads)?;
        match c.norms {
            // The residual add is the MLP's: fused with the norm before it.
            NormPlacement::Pre => scale(o, c.residual_scale),
            NormPlacement::Post | NormPlacement::Sandwich => {
                let normed = sized(&mut s.tmp, t * hidden);
                add_rms_norm(o, None, &layer.post_attention_norm, c.eps, normed, threads)?;
                add(&mut s.x, normed);
            }
        }
        Ok(())
    }

    /// The MLP sublayer and its residual add. Its input: pre-norm, the attention's residual
    /// add (`s.o` into `s.x`) and the norm after it; sandwich, the norm before the MLP; post-norm,
    /// `s.x` as it is.
    fn mlp(
        &self,
        layer: &LayerWeights,
        t: usize,
        s: &mut Scratch,
        isa: Isa,
        threads: ThreadCount,
    ) -> Result<(), KernelError> {
        let c = &self.config;
        let (hidden, inter) = (c.hidden, c.intermediate);
        let gate_up = sized(&mut s.gate_up, t * 2 * inter);
        let x = &mut s.x[..t * hidden];
        let (branch, norm) = match c.norms {
            NormPlacement::Pre => (Some(&s.o[..t * hidden]), Some(&layer.post_attention_norm)),
            NormPlacement::Sandwich => (None, layer.pre_feedforward_norm.as_ref()),
            NormPlacement::Post => (None, None),
        };
        match norm {
            Some(norm) => {
                let rows = NormedRows {
                    h: &mut s.h,
                    hq: &mut s.hq,
                };
                let up = &layer.gate_up;
                norm_linear(x, branch, norm, c.eps, up, rows, gate_up, isa, threads)?
            }
            None => layer.gate_up.apply(x, t, gate_up, isa, threads)?,
        }
        let act = sized(&mut s.act, t * inter);
        match c.activation {
            Activation::Silu => silu_and_mul(gate_up, act, inter, t, threads)?,
            Activation::GeluTanh => gelu_tanh_and_mul(gate_up, act, inter, t, threads)?,
        }
        let out = sized(&mut s.mlp, t * hidden);
        layer.down.apply(act, t, out, isa, threads)?;
        match &layer.post_feedforward_norm {
            Some(norm) => {
                let normed = sized(&mut s.tmp, t * hidden);
                add_rms_norm(out, None, norm, c.eps, normed, threads)?;
                add(&mut s.x, normed);
            }
            None => {
                scale(out, c.residual_scale);
                add(&mut s.x, out);
            }
        }
        Ok(())
    }
}

fn guard_shape(guard: &super::kv::KvGuard<'_>, heads: usize) -> PagedShape {
    let shape = guard.shape();
    PagedShape {
        heads,
        kv_heads: shape.kv_heads,
        head_dim: shape.head_dim,
        block_size: shape.block_size,
        num_blocks: shape.num_blocks,
    }
}

/// A strided (T, H, D) view into contiguous `out`.
fn copy_heads(src: Heads, out: &mut [f32]) {
    let d = src.head_dim;
    for t in 0..src.tokens {
        for h in 0..src.heads {
            let at = t * src.row_stride + h * src.head_stride;
            out[(t * src.heads + h) * d..][..d].copy_from_slice(&src.data[at..at + d]);
        }
    }
}

fn scale(x: &mut [f32], by: f32) {
    if by != 1.0 {
        x.iter_mut().for_each(|v| *v *= by);
    }
}

fn add(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
