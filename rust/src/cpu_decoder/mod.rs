//! The native CPU decoder: the whole forward of a dense decoder family over one engine step, in
//! one call. Built once at load from the model's weights (float weights borrowed from the torch
//! tensors, quantized ones shared with the layers that packed them for the int8 kernels) and a
//! `DecoderConfig` (the options `layers/attention_block.py` distinguishes: q/k norms per head or
//! across heads, layers without RoPE, biases, sliding windows, soft-capping, tied heads, the
//! norm placement, the MLP's activation); `CpuDecoder::step` then runs the step's flat plan —
//! prefill chunks and decode rows mixed, as the core schedules them — straight over the runner's
//! paged KV cache:
//!
//!   embedding → per layer: RMSNorm → QKV → q/k norm → RoPE → K/V into their cache slots →
//!   paged attention through the block table → O → residual add + norm → gate/up → act·mul →
//!   down → residual → final norm → the LM head for the sampled rows only.
//!
//! Activations are float32 between ops, except that a norm feeding an int8 layer (QKV, gate/up)
//! writes the layer's quantized rows itself (`kernels::rms_norm_quantize`); every op is one of `crate::kernels` on its persistent
//! pool (whose workers watch for the next op rather than sleep, so a step pays no wake-up per op).

mod forward;
pub mod kv;
pub mod weights;

#[cfg(feature = "python")]
pub(crate) mod py;
#[cfg(test)]
mod tests;

use std::sync::Mutex;

pub use forward::StepInputs;
pub use kv::{CacheShape, KvCaches, KvLayer};
pub use weights::{Buffer, LayerWeights, Linear, LinearWeights, RopeTable, Table};

use crate::kernels::KernelError;

/// The MLP's activation over [gate | up].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// silu(gate) · up (SwiGLU: Llama, Qwen, Phi-3, Granite, OLMo 2, SmolLM3).
    Silu,
    /// gelu_tanh(gate) · up (GeGLU: Gemma).
    GeluTanh,
}

/// Where a layer's norms sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormPlacement {
    /// Before attention and before the MLP (Llama).
    Pre,
    /// On the attention's and the MLP's outputs (OLMo 2).
    Post,
    /// Both (Gemma 2/3: four norms a layer).
    Sandwich,
}

#[derive(Debug, Clone)]
pub struct DecoderConfig {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    pub eps: f32,
    pub attention_scale: f32,
    pub attention_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
    /// The embeddings are multiplied by it (Granite's multiplier, Gemma's √hidden).
    pub embedding_scale: f32,
    /// Each pre-norm sublayer's output is multiplied by it (Granite).
    pub residual_scale: f32,
    /// The logits are divided by it (Granite).
    pub logits_scale: f32,
    pub activation: Activation,
    pub norms: NormPlacement,
    /// q/k norms per head (D weights) rather than across all heads.
    pub qk_norm_per_head: bool,
}

impl DecoderConfig {
    pub fn q_size(&self) -> usize {
        self.heads * self.head_dim
    }

    pub fn kv_size(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// The per-step buffers, kept between steps.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    /// The normed rows a linear layer reads: float32, or quantized for int8 weights.
    h: Vec<f32>,
    hq: crate::kernels::QuantizedRows,
    qkv: Vec<f32>,
    q_in: Vec<f32>,
    q_normed: Vec<f32>,
    k_in: Vec<f32>,
    k_normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    attn: Vec<f32>,
    o: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    mlp: Vec<f32>,
    tmp: Vec<f32>,
    rows: Vec<f32>,
    slots: Vec<i64>,
    cos_sin: Vec<(Vec<f32>, Vec<f32>)>,
}

pub struct CpuDecoder {
    pub config: DecoderConfig,
    pub embedding: Table,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub head: Linear,
    pub ropes: Vec<RopeTable>,
    scratch: Mutex<Scratch>,
}

fn invalid<T>(message: String) -> Result<T, KernelError> {
    Err(KernelError::InvalidArgument(message))
}

impl CpuDecoder {
    /// Checks every weight's shape against the config.
    pub fn new(
        config: DecoderConfig,
        embedding: Table,
        layers: Vec<LayerWeights>,
        final_norm: Vec<f32>,
        head: Linear,
        ropes: Vec<RopeTable>,
    ) -> Result<CpuDecoder, KernelError> {
        let c = &config;
        let (hidden, d) = (c.hidden, c.head_dim);
        if c.kv_heads == 0 || !c.heads.is_multiple_of(c.kv_heads) || d == 0 || hidden == 0 {
            return invalid(format!(
                "cpu decoder: {} heads over {} KV heads of {d}, hidden {hidden}",
                c.heads, c.kv_heads
            ));
        }
        if embedding.len() != c.vocab * hidden {
            return invalid(format!(
                "cpu decoder: the embedding holds {} values, not {} x {hidden}",
                embedding.len(),
                c.vocab
            ));
        }
        if final_norm.len() != hidden || (head.n, head.k) != (c.vocab, hidden) {
            return invalid("cpu decoder: the final norm or the LM head does not fit".into());
        }
        let half = d / 2;
        for (i, rope) in ropes.iter().enumerate() {
            if !d.is_multiple_of(2)
                || rope.cos.len() != rope.sin.len()
                || !rope.cos.len().is_multiple_of(half)
            {
                return invalid(format!(
                    "cpu decoder: RoPE table {i} is not (positions, {half})"
                ));
            }
        }
        let (q, kv, inter) = (c.q_size(), c.kv_size(), c.intermediate);
        for (i, l) in layers.iter().enumerate() {
            let fits = |lin: &Linear, n, k| lin.n == n && lin.k == k;
            let norm = |w: &Option<Vec<f32>>, n: usize| w.as_ref().is_none_or(|w| w.len() == n);
            let qk = |w: &Option<Vec<f32>>, across: usize| {
                w.as_ref()
                    .is_none_or(|w| w.len() == if c.qk_norm_per_head { d } else { across })
            };
            let placed = match c.norms {
                NormPlacement::Pre => l.input_norm.is_some(),
                NormPlacement::Post => l.post_feedforward_norm.is_some(),
                NormPlacement::Sandwich => {
                    l.input_norm.is_some()
                        && l.pre_feedforward_norm.is_some()
                        && l.post_feedforward_norm.is_some()
                }
            };
            let ok = fits(&l.qkv, q + 2 * kv, hidden)
                && fits(&l.o, hidden, q)
                && fits(&l.gate_up, 2 * inter, hidden)
                && fits(&l.down, hidden, inter)
                && placed
                && l.post_attention_norm.len() == hidden
                && norm(&l.input_norm, hidden)
                && norm(&l.pre_feedforward_norm, hidden)
                && norm(&l.post_feedforward_norm, hidden)
                && l.q_norm.is_some() == l.k_norm.is_some()
                && qk(&l.q_norm, q)
                && qk(&l.k_norm, kv)
                && l.rope.is_none_or(|r| r < ropes.len())
                && l.window != Some(0);
            if !ok {
                return invalid(format!(
                    "cpu decoder: layer {i}'s weights do not fit the config {c:?}"
                ));
            }
        }
        Ok(CpuDecoder {
            config,
            embedding,
            layers,
            final_norm,
            head,
            ropes,
            scratch: Mutex::new(Scratch::default()),
        })
    }

    /// Bytes of weights one decode step reads (every layer and the head).
    pub fn weight_bytes(&self) -> usize {
        self.head.weight_bytes()
            + self
                .layers
                .iter()
                .map(|l| {
                    l.qkv.weight_bytes()
                        + l.o.weight_bytes()
                        + l.gate_up.weight_bytes()
                        + l.down.weight_bytes()
                })
                .sum::<usize>()
    }
}
