//! The decoder against a plain reference for one token (attention over one position is its V),
//! and against itself: a prompt run whole, in chunks, and batched with another gives the same
//! logits; bad steps are refused with a named error.

use std::sync::Arc;

use super::*;
use crate::kernels::{Activations, Isa, PackedWeights, ThreadCount};

struct Rng(u64);

impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % 2001) as f32 / 1000.0 - 1.0
    }
    fn values(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const D: usize = 8;
const INTER: usize = 48;
const VOCAB: usize = 40;
const LAYERS: usize = 2;
const POSITIONS: usize = 64;
const BLOCK: usize = 4;

fn config(norms: NormPlacement, activation: Activation) -> DecoderConfig {
    DecoderConfig {
        hidden: HIDDEN,
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: D,
        intermediate: INTER,
        vocab: VOCAB,
        eps: 1e-6,
        attention_scale: 0.3,
        attention_softcap: None,
        final_softcap: Some(20.0),
        embedding_scale: 1.5,
        residual_scale: 0.8,
        logits_scale: 1.25,
        activation,
        norms,
        qk_norm_per_head: true,
    }
}

fn dense(rng: &mut Rng, n: usize, k: usize, bias: bool) -> Linear {
    let w = LinearWeights::F32(Buffer::owned(rng.values(n * k, 0.3)));
    Linear::new(n, k, w, bias.then(|| rng.values(n, 0.1))).unwrap()
}

fn norm(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| 1.0 + 0.2 * rng.uniform()).collect()
}

fn decoder(c: DecoderConfig, qk_norm: bool, seed: u64) -> CpuDecoder {
    let mut rng = Rng(seed);
    let (q, kv) = (c.q_size(), c.kv_size());
    let layers = (0..LAYERS)
        .map(|i| LayerWeights {
            input_norm: (c.norms != NormPlacement::Post).then(|| norm(&mut rng, HIDDEN)),
            post_attention_norm: norm(&mut rng, HIDDEN),
            pre_feedforward_norm: (c.norms == NormPlacement::Sandwich)
                .then(|| norm(&mut rng, HIDDEN)),
            post_feedforward_norm: (c.norms != NormPlacement::Pre).then(|| norm(&mut rng, HIDDEN)),
            q_norm: qk_norm.then(|| norm(&mut rng, D)),
            k_norm: qk_norm.then(|| norm(&mut rng, D)),
            qkv: dense(&mut rng, q + 2 * kv, HIDDEN, true),
            o: dense(&mut rng, HIDDEN, q, false),
            gate_up: dense(&mut rng, 2 * INTER, HIDDEN, true),
            down: dense(&mut rng, HIDDEN, INTER, false),
            window: (i == 1).then_some(5),
            rope: (i == 0).then_some(0),
        })
        .collect();
    let table = rng.values(VOCAB * HIDDEN, 1.0);
    let head = Linear::new(
        VOCAB,
        HIDDEN,
        LinearWeights::F32(Buffer::owned(table.clone())),
        None,
    )
    .unwrap();
    let half = D / 2;
    let (mut cos, mut sin) = (vec![0f32; POSITIONS * half], vec![0f32; POSITIONS * half]);
    for p in 0..POSITIONS {
        for i in 0..half {
            let angle = p as f32 / 10000f32.powf(2.0 * i as f32 / D as f32);
            cos[p * half + i] = angle.cos();
            sin[p * half + i] = angle.sin();
        }
    }
    let rope = RopeTable {
        cos: Buffer::owned(cos),
        sin: Buffer::owned(sin),
    };
    let final_norm = norm(&mut rng, HIDDEN);
    CpuDecoder::new(
        c,
        Table::F32(Buffer::owned(table)),
        layers,
        final_norm,
        head,
        vec![rope],
    )
    .unwrap()
}

fn caches() -> KvCaches {
    let shape = CacheShape {
        num_blocks: 16,
        block_size: BLOCK,
        kv_heads: KV_HEADS,
        head_dim: D,
    };
    KvCaches::zeros(LAYERS, shape, false)
}

/// A request: its tokens run so far, the tokens of this step, its blocks.
struct Row<'a> {
    done: usize,
    tokens: &'a [i32],
    blocks: &'a [i32],
}

/// One step over `rows`; the logits of each row's last token.
fn step(decoder: &CpuDecoder, caches: &KvCaches, rows: &[Row]) -> Vec<Vec<f32>> {
    let (mut ids, mut positions, mut slots, mut qsl, mut lens, mut tables, mut last) =
        (vec![], vec![], vec![], vec![0], vec![], vec![], vec![]);
    let width = rows.iter().map(|r| r.blocks.len()).max().unwrap();
    for row in rows {
        for (i, &id) in row.tokens.iter().enumerate() {
            let p = row.done + i;
            ids.push(id);
            positions.push(p as i32);
            slots.push(row.blocks[p / BLOCK] * BLOCK as i32 + (p % BLOCK) as i32);
        }
        qsl.push(ids.len() as i32);
        lens.push((row.done + row.tokens.len()) as i32);
        let mut table = row.blocks.to_vec();
        table.resize(width, 0);
        tables.extend(table);
        last.push(ids.len() as i32 - 1);
    }
    let inputs = StepInputs {
        input_ids: &ids,
        positions: &positions,
        slot_mapping: &slots,
        query_start_loc: &qsl,
        seq_lens: &lens,
        block_tables: &tables,
        table_width: width,
        logits_rows: &last,
    };
    let mut hidden = vec![0f32; ids.len() * HIDDEN];
    let mut logits = vec![0f32; last.len() * VOCAB];
    let isa = Isa::active().unwrap();
    decoder
        .step(
            inputs,
            caches,
            &mut hidden,
            &mut logits,
            isa,
            ThreadCount::new(2),
        )
        .unwrap();
    logits.chunks(VOCAB).map(|c| c.to_vec()).collect()
}

fn close(a: &[f32], b: &[f32], tolerance: f32) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tolerance * (1.0 + y.abs()),
            "[{i}] {x} against {y}"
        );
    }
}

fn rms(x: &[f64], w: &[f32], eps: f32) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps as f64).sqrt();
    x.iter().zip(w).map(|(v, &w)| v * inv * w as f64).collect()
}

fn matvec(lin: &Linear, x: &[f64]) -> Vec<f64> {
    let LinearWeights::F32(w) = &lin.weights else {
        unreachable!()
    };
    let w = w.as_slice();
    (0..lin.n)
        .map(|o| {
            let dot: f64 = (0..lin.k).map(|c| w[o * lin.k + c] as f64 * x[c]).sum();
            dot + lin.bias.as_ref().map_or(0.0, |b| b[o] as f64)
        })
        .collect()
}

/// The forward of one token at position 0 in float64: attention over one position returns V
/// (each query head its KV head's), so no RoPE and no softmax are involved.
fn reference_first_token(decoder: &CpuDecoder, id: usize) -> Vec<f64> {
    let c = &decoder.config;
    let Table::F32(table) = &decoder.embedding else {
        unreachable!()
    };
    let mut x: Vec<f64> = table.as_slice()[id * HIDDEN..][..HIDDEN]
        .iter()
        .map(|&v| (v * c.embedding_scale) as f64)
        .collect();
    let add =
        |x: &mut Vec<f64>, y: &[f64], s: f64| x.iter_mut().zip(y).for_each(|(a, b)| *a += s * b);
    for l in &decoder.layers {
        let input = match &l.input_norm {
            Some(w) => rms(&x, w, c.eps),
            None => x.clone(),
        };
        let qkv = matvec(&l.qkv, &input);
        let v = &qkv[c.q_size() + c.kv_size()..];
        let group = HEADS / KV_HEADS;
        let attn: Vec<f64> = (0..HEADS)
            .flat_map(|h| v[(h / group) * D..][..D].to_vec())
            .collect();
        let o = matvec(&l.o, &attn);
        match c.norms {
            NormPlacement::Pre => add(&mut x, &o, c.residual_scale as f64),
            _ => add(&mut x, &rms(&o, &l.post_attention_norm, c.eps), 1.0),
        }
        let mlp_in = match c.norms {
            NormPlacement::Pre => rms(&x, &l.post_attention_norm, c.eps),
            NormPlacement::Post => x.clone(),
            NormPlacement::Sandwich => rms(&x, l.pre_feedforward_norm.as_ref().unwrap(), c.eps),
        };
        let gu = matvec(&l.gate_up, &mlp_in);
        let act: Vec<f64> = (0..INTER)
            .map(|i| {
                let (g, u) = (gu[i], gu[INTER + i]);
                let a = match c.activation {
                    Activation::Silu => g / (1.0 + (-g).exp()),
                    Activation::GeluTanh => {
                        0.5 * g
                            * (1.0
                                + ((2.0 / std::f64::consts::PI).sqrt()
                                    * (g + 0.044715 * g * g * g))
                                    .tanh())
                    }
                };
                a * u
            })
            .collect();
        let down = matvec(&l.down, &act);
        match &l.post_feedforward_norm {
            Some(w) => add(&mut x, &rms(&down, w, c.eps), 1.0),
            None => add(&mut x, &down, c.residual_scale as f64),
        }
    }
    let h = rms(&x, &decoder.final_norm, c.eps);
    let cap = c.final_softcap.unwrap() as f64;
    matvec(&decoder.head, &h)
        .iter()
        .map(|v| (v / c.logits_scale as f64 / cap).tanh() * cap)
        .collect()
}

#[test]
fn one_token_matches_the_float64_reference_for_every_norm_placement() {
    for (norms, act) in [
        (NormPlacement::Pre, Activation::Silu),
        (NormPlacement::Post, Activation::Silu),
        (NormPlacement::Sandwich, Activation::GeluTanh),
    ] {
        // q/k norms change q and k only: a one-position attention returns V whatever they are.
        let d = decoder(config(norms, act), true, 7);
        let caches = caches();
        let got = step(
            &d,
            &caches,
            &[Row {
                done: 0,
                tokens: &[3],
                blocks: &[5],
            }],
        );
        let want: Vec<f32> = reference_first_token(&d, 3)
            .iter()
            .map(|&v| v as f32)
            .collect();
        close(&got[0], &want, 1e-4);
    }
}

#[test]
fn chunks_and_batches_give_the_logits_of_one_whole_prompt() {
    let prompt: Vec<i32> = (0..11).map(|i| (i * 7 + 3) % VOCAB as i32).collect();
    let other: Vec<i32> = (0..6).map(|i| (i * 5 + 1) % VOCAB as i32).collect();
    for qk_norm in [false, true] {
        let d = decoder(config(NormPlacement::Pre, Activation::Silu), qk_norm, 11);
        let blocks = [2, 7, 4];
        let whole = step(
            &d,
            &caches(),
            &[Row {
                done: 0,
                tokens: &prompt,
                blocks: &blocks,
            }],
        );
        // In chunks of 4, 5 and a decode token, with another request beside the second chunk.
        let cache = caches();
        step(
            &d,
            &cache,
            &[Row {
                done: 0,
                tokens: &prompt[..4],
                blocks: &blocks,
            }],
        );
        let batched = step(
            &d,
            &cache,
            &[
                Row {
                    done: 4,
                    tokens: &prompt[4..10],
                    blocks: &blocks,
                },
                Row {
                    done: 0,
                    tokens: &other,
                    blocks: &[9, 10],
                },
            ],
        );
        let alone = step(
            &d,
            &caches(),
            &[Row {
                done: 0,
                tokens: &other,
                blocks: &[1, 3],
            }],
        );
        close(&batched[1], &alone[0], 1e-5);
        let decode = step(
            &d,
            &cache,
            &[Row {
                done: 10,
                tokens: &prompt[10..],
                blocks: &blocks,
            }],
        );
        close(&decode[0], &whole[0], 1e-5);
    }
}

#[test]
fn bad_steps_are_refused_by_name() {
    let d = decoder(config(NormPlacement::Pre, Activation::Silu), false, 3);
    let cache = caches();
    let mut hidden = vec![0f32; HIDDEN];
    let mut logits = vec![0f32; VOCAB];
    let isa = Isa::active().unwrap();
    let run =
        |ids: &[i32], positions: &[i32], slots: &[i32], hidden: &mut [f32], logits: &mut [f32]| {
            let inputs = StepInputs {
                input_ids: ids,
                positions,
                slot_mapping: slots,
                query_start_loc: &[0, 1],
                seq_lens: &[1],
                block_tables: &[0],
                table_width: 1,
                logits_rows: &[0],
            };
            d.step(inputs, &cache, hidden, logits, isa, ThreadCount::new(1))
                .unwrap_err()
                .to_string()
        };
    assert!(run(&[VOCAB as i32], &[0], &[0], &mut hidden, &mut logits).contains("vocabulary"));
    assert!(run(&[1], &[POSITIONS as i32], &[0], &mut hidden, &mut logits).contains("position"));
    assert!(run(&[1], &[0], &[16 * BLOCK as i32], &mut hidden, &mut logits).contains("slot"));
    assert!(run(&[1], &[0], &[0], &mut hidden[..1], &mut logits).contains("outputs"));
}

#[test]
fn weights_that_do_not_fit_the_config_are_refused() {
    let mut rng = Rng(1);
    let c = config(NormPlacement::Pre, Activation::Silu);
    let head = dense(&mut rng, VOCAB, HIDDEN, false);
    let table = Table::F32(Buffer::owned(vec![0.0; (VOCAB - 1) * HIDDEN]));
    let err = CpuDecoder::new(c, table, vec![], vec![1.0; HIDDEN], head, vec![]);
    assert!(err.is_err());
}

/// `d` again, every layer's linear layers through `convert`, with this embedding and head.
fn rebuild(
    d: &CpuDecoder,
    convert: impl Fn(&Linear) -> Linear,
    table: Table,
    head: Linear,
) -> CpuDecoder {
    let layers = d
        .layers
        .iter()
        .map(|l| LayerWeights {
            input_norm: l.input_norm.clone(),
            post_attention_norm: l.post_attention_norm.clone(),
            pre_feedforward_norm: l.pre_feedforward_norm.clone(),
            post_feedforward_norm: l.post_feedforward_norm.clone(),
            q_norm: l.q_norm.clone(),
            k_norm: l.k_norm.clone(),
            qkv: convert(&l.qkv),
            o: convert(&l.o),
            gate_up: convert(&l.gate_up),
            down: convert(&l.down),
            window: l.window,
            rope: l.rope,
        })
        .collect();
    let rope = &d.ropes[0];
    CpuDecoder::new(
        d.config.clone(),
        table,
        layers,
        d.final_norm.clone(),
        head,
        vec![RopeTable {
            cos: Buffer::owned(rope.cos.as_slice().to_vec()),
            sin: Buffer::owned(rope.sin.as_slice().to_vec()),
        }],
    )
    .unwrap()
}

fn f32_weights(lin: &Linear) -> &[f32] {
    let LinearWeights::F32(w) = &lin.weights else {
        unreachable!()
    };
    w.as_slice()
}

fn f32_table(d: &CpuDecoder) -> Vec<f32> {
    let Table::F32(table) = &d.embedding else {
        unreachable!()
    };
    table.as_slice().to_vec()
}

/// The decoder with every weight rounded to bfloat16, as bfloat16 bits.
fn bf16_decoder(seed: u64) -> CpuDecoder {
    let f32_decoder = decoder(config(NormPlacement::Pre, Activation::Silu), true, seed);
    let to_bits =
        |w: &[f32]| -> Vec<u16> { w.iter().map(|v| (v.to_bits() >> 16) as u16).collect() };
    let bits = |lin: &Linear| {
        let w = to_bits(f32_weights(lin));
        let w = LinearWeights::Bf16(Buffer::owned(w));
        Linear::new(lin.n, lin.k, w, lin.bias.clone()).unwrap()
    };
    let table = Table::Bf16(Buffer::owned(to_bits(&f32_table(&f32_decoder))));
    let head = bits(&f32_decoder.head);
    rebuild(&f32_decoder, bits, table, head)
}

/// `d`'s layers with 8-bit weights (per row, symmetric), packed for the int8 kernels reading
/// `activations`, and the same weights dequantized as float32: (int8 decoder, float twin).
fn int8_decoder_and_twin(d: &CpuDecoder, activations: Activations) -> (CpuDecoder, CpuDecoder) {
    let packed = |lin: &Linear| {
        let w = f32_weights(lin);
        let mut q = Vec::with_capacity(w.len());
        let mut scales = Vec::with_capacity(lin.n);
        for row in w.chunks(lin.k) {
            let s = row.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            q.extend(row.iter().map(|v| ((v / s).round() + 128.0) as u8));
            scales.push(s);
        }
        let zeros = vec![128.0; lin.n];
        Arc::new(PackedWeights::pack(&q, &scales, &zeros, lin.n, lin.k, 8).unwrap())
    };
    let int8 = |lin: &Linear| {
        let w = LinearWeights::Packed(packed(lin), activations);
        Linear::new(lin.n, lin.k, w, lin.bias.clone()).unwrap()
    };
    let twin = |lin: &Linear| {
        let w = LinearWeights::F32(Buffer::owned(packed(lin).dequantize()));
        Linear::new(lin.n, lin.k, w, lin.bias.clone()).unwrap()
    };
    let head = || {
        let w = LinearWeights::F32(Buffer::owned(f32_weights(&d.head).to_vec()));
        Linear::new(d.head.n, d.head.k, w, None).unwrap()
    };
    let table = || Table::F32(Buffer::owned(f32_table(d)));
    (
        rebuild(d, int8, table(), head()),
        rebuild(d, twin, table(), head()),
    )
}

#[test]
fn int8_weights_fed_by_the_fused_norm_match_their_float_twin_for_every_norm_placement() {
    // Pre-norm and sandwich layers' norms write the quantized rows of QKV and gate/up
    // (`rms_norm_quantize`); against the same weights dequantized, only the activations'
    // rounding differs: ~2^-15 of a block's largest value with two terms, 2^-8 with one (up
    // to ~0.1 on these logits, measured; a norm fed the wrong rows moves them by ~1).
    let prompt: Vec<i32> = (0..9).map(|i| (i * 7 + 3) % VOCAB as i32).collect();
    let blocks = [2, 7, 4];
    for (norms, act) in [
        (NormPlacement::Pre, Activation::Silu),
        (NormPlacement::Post, Activation::Silu),
        (NormPlacement::Sandwich, Activation::GeluTanh),
    ] {
        let d = decoder(config(norms, act), true, 13);
        for (activations, tolerance) in [(Activations::Int8x2, 2e-3), (Activations::Int8, 0.2)] {
            let (int8, twin) = int8_decoder_and_twin(&d, activations);
            let row = |done: usize, tokens| Row {
                done,
                tokens,
                blocks: &blocks,
            };
            let want = step(&twin, &caches(), &[row(0, &prompt)]);
            let whole = step(&int8, &caches(), &[row(0, &prompt)]);
            close(&whole[0], &want[0], tolerance);
            // In a chunk and decode rows: the same logits as the whole prompt (one row and many).
            let cache = caches();
            step(&int8, &cache, &[row(0, &prompt[..5])]);
            step(&int8, &cache, &[row(5, &prompt[5..8])]);
            let last = step(&int8, &cache, &[row(8, &prompt[8..])]);
            close(&last[0], &whole[0], 1e-5);
        }
    }
}

#[test]
fn bfloat16_weights_and_cache_give_one_prompts_logits_whole_or_in_chunks() {
    let d = bf16_decoder(5);
    let shape = CacheShape {
        num_blocks: 16,
        block_size: BLOCK,
        kv_heads: KV_HEADS,
        head_dim: D,
    };
    let prompt: Vec<i32> = (0..9).map(|i| (i * 3 + 2) % VOCAB as i32).collect();
    let blocks = [3, 1, 8];
    let whole_cache = KvCaches::zeros(LAYERS, shape, true);
    let whole = step(
        &d,
        &whole_cache,
        &[Row {
            done: 0,
            tokens: &prompt,
            blocks: &blocks,
        }],
    );
    let cache = KvCaches::zeros(LAYERS, shape, true);
    assert!(cache.is_bf16());
    step(
        &d,
        &cache,
        &[Row {
            done: 0,
            tokens: &prompt[..5],
            blocks: &blocks,
        }],
    );
    let rest = step(
        &d,
        &cache,
        &[Row {
            done: 5,
            tokens: &prompt[5..],
            blocks: &blocks,
        }],
    );
    close(&rest[0], &whole[0], 1e-5);
    assert!(whole[0].iter().all(|v| v.is_finite()));
}

#[test]
fn an_int8_cache_is_written_as_the_reference_quantizes() {
    let d = decoder(config(NormPlacement::Pre, Activation::Silu), false, 9);
    let shape = CacheShape {
        num_blocks: 16,
        block_size: BLOCK,
        kv_heads: KV_HEADS,
        head_dim: D,
    };
    let rows = shape.num_blocks * shape.block_size * KV_HEADS;
    let (mut k, mut v) = (vec![0i8; rows * D], vec![0i8; rows * D]);
    let (mut ks, mut vs) = (vec![0f32; rows], vec![0f32; rows]);
    let layers: Vec<KvLayer> = (0..LAYERS)
        .map(|_| KvLayer::Int8 {
            k: k.as_mut_ptr(),
            v: v.as_mut_ptr(),
            k_scale: kv::ScalePtr::F32(ks.as_mut_ptr()),
            v_scale: kv::ScalePtr::F32(vs.as_mut_ptr()),
        })
        .collect();
    // Both layers share one cache here: the last layer's rows are what is left to check.
    // SAFETY: the vectors outlive the caches and nothing else touches them during a step.
    let cache = unsafe { KvCaches::borrowed(layers, shape, Box::new(())) };
    assert!(cache.is_int8());
    let prompt = [4, 9, 13];
    let float = KvCaches::zeros(LAYERS, shape, false);
    let got = step(
        &d,
        &cache,
        &[Row {
            done: 0,
            tokens: &prompt,
            blocks: &[2],
        }],
    );
    let want = step(
        &d,
        &float,
        &[Row {
            done: 0,
            tokens: &prompt,
            blocks: &[2],
        }],
    );
    close(&got[0], &want[0], 0.05);
    for slot in 8..11 {
        for h in 0..KV_HEADS {
            let row = slot * KV_HEADS + h;
            let scale = ks[row];
            let qs = &k[row * D..][..D];
            assert!(scale > 0.0 && qs.iter().any(|&q| q.abs() == 127), "{qs:?}");
        }
    }
    drop(cache);
    assert!(vs.iter().any(|&s| s > 0.0));
}
