//! Paged attention read in place: each query token attends over its request's context straight
//! from the block pool's K/V cache through the block table — decode rows and (chunked) prefill
//! rows alike, the step's new K/V already written to their slots — with no gathered copy.
//!
//! Cache layout (torch's): K and V (num_blocks, block_size, H_kv, D) in float32, bfloat16 or
//! int8 (`KvCache`; an int8 cache has one scale per position and KV head, float32 or bfloat16,
//! x = q · scale, the scale applied to each score and each weighted V row); position j of a
//! request is block `table[j / block_size]`, offset `j % block_size`. Queries and outputs are
//! float32, and so is all arithmetic. A work item is one KV head
//! and a block of up to QB = 16 consecutive query tokens of one request (a decode row is a block
//! of one): the block's tokens and the G = H / H_kv query heads that share the KV head read each
//! K/V row once (GQA), and a prefill block scores a key for its QB queries with D multiply-adds
//! over QB lanes (queries stored transposed), so prefill reads its context T / QB times, not T.
//! Scores go through an online softmax over chunks of 32 positions (a running max and
//! sum per head, the output rescaled when the max grows), so memory stays O(G·D) whatever the
//! context length. Sliding windows keep the last `window` positions; soft-capping maps a score
//! s to cap·tanh(s / cap) before the softmax (Gemma 2).

use super::elementwise::exp;
use super::isa::Isa;
use super::pool::{split, ThreadCount};
use super::quantize::SharedMut;
use super::KernelError;

/// Positions scored before each softmax update.
const CHUNK: usize = 32;

/// Positions between a decode row's prefetch of a K/V row and its use.
pub(super) const AHEAD: usize = 32;

/// The cache's and the heads' shape.
#[derive(Debug, Clone, Copy)]
pub struct PagedShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

/// The step's requests: R + 1 query starts, R context lengths (after the step), R block tables
/// of `table_width` entries.
#[derive(Debug, Clone, Copy)]
pub struct StepRows<'a> {
    pub query_start_loc: &'a [i32],
    pub seq_lens: &'a [i32],
    pub block_tables: &'a [i32],
    pub table_width: usize,
}

/// How scores are made: q·k · scale, capped (cap · tanh(s / cap)) when `softcap` is set, over
/// the last `window` positions when it is set.
#[derive(Debug, Clone, Copy)]
pub struct Scoring {
    pub scale: f32,
    pub window: Option<usize>,
    pub softcap: Option<f32>,
}

/// A scale per cached position and KV head: float32 values or bfloat16 bits.
#[derive(Debug, Clone, Copy)]
pub enum Scales<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

/// The K and V caches as the kernel reads them (see the module note).
#[derive(Debug, Clone, Copy)]
pub enum KvCache<'a> {
    F32 {
        k: &'a [f32],
        v: &'a [f32],
    },
    /// bfloat16's bits
    Bf16 {
        k: &'a [u16],
        v: &'a [u16],
    },
    Int8 {
        k: &'a [i8],
        v: &'a [i8],
        k_scale: Scales<'a>,
        v_scale: Scales<'a>,
    },
}

impl KvCache<'_> {
    /// Elements of K and of V, and scales of each (0 for a float cache).
    fn lens(&self) -> (usize, usize, usize, usize) {
        let scales = |s: &Scales| match s {
            Scales::F32(x) => x.len(),
            Scales::Bf16(x) => x.len(),
        };
        match self {
            KvCache::F32 { k, v } => (k.len(), v.len(), 0, 0),
            KvCache::Bf16 { k, v } => (k.len(), v.len(), 0, 0),
            KvCache::Int8 {
                k,
                v,
                k_scale,
                v_scale,
            } => (k.len(), v.len(), scales(k_scale), scales(v_scale)),
        }
    }
}

#[inline(always)]
fn bf16(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// How the kernel reads one cached K or V row (`at`: the row's first element; `q` and `acc`
/// are one head's D values).
pub(super) trait Rows: Copy + Sync {
    fn k_dot(&self, at: usize, q: &[f32]) -> f32;
    fn v_add(&self, at: usize, p: f32, acc: &mut [f32]);
    /// The K row's values as float32 (an int8 row times its scale) into `buf` (D values).
    fn k_row(&self, at: usize, buf: &mut [f32]);
    /// The V row's values as float32 (an int8 row times its scale) into `buf` (D values).
    fn v_row(&self, at: usize, buf: &mut [f32]);
    /// Asks the memory system for the K row at `at` (D values) ahead of its use.
    fn prefetch_k(&self, at: usize, d: usize);
    /// Asks the memory system for the V row at `at` (D values) ahead of its use.
    fn prefetch_v(&self, at: usize, d: usize);
    /// Asks the memory system for the K and V rows at `at` (D values each) ahead of their use.
    #[inline(always)]
    fn prefetch(&self, at: usize, d: usize) {
        self.prefetch_k(at, d);
        self.prefetch_v(at, d);
    }
}

/// Asks for the cache lines of `count` elements from `first` (a hint: never faults).
#[inline(always)]
fn prefetch_lines<T>(first: &[T], count: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = count * std::mem::size_of::<T>();
        let base = first.as_ptr() as *const i8;
        let mut off = 0;
        while off < bytes {
            // SAFETY: a prefetch is a hint and never faults; the address lies within `first`'s row.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off)) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (first, count);
}

#[derive(Clone, Copy)]
pub(super) struct F32Rows<'a> {
    pub(super) k: &'a [f32],
    pub(super) v: &'a [f32],
}

impl Rows for F32Rows<'_> {
    #[inline(always)]
    fn k_dot(&self, at: usize, q: &[f32]) -> f32 {
        dot_by(q, &self.k[at..][..q.len()], |&x| x)
    }
    #[inline(always)]
    fn v_add(&self, at: usize, p: f32, acc: &mut [f32]) {
        let d = acc.len();
        for (a, x) in acc.iter_mut().zip(&self.v[at..][..d]) {
            *a += p * x;
        }
    }
    #[inline(always)]
    fn k_row(&self, at: usize, buf: &mut [f32]) {
        buf.copy_from_slice(&self.k[at..][..buf.len()]);
    }
    #[inline(always)]
    fn v_row(&self, at: usize, buf: &mut [f32]) {
        buf.copy_from_slice(&self.v[at..][..buf.len()]);
    }
    #[inline(always)]
    fn prefetch_k(&self, at: usize, d: usize) {
        prefetch_lines(&self.k[at..], d);
    }
    #[inline(always)]
    fn prefetch_v(&self, at: usize, d: usize) {
        prefetch_lines(&self.v[at..], d);
    }
}

#[derive(Clone, Copy)]
pub(super) struct Bf16Rows<'a> {
    pub(super) k: &'a [u16],
    pub(super) v: &'a [u16],
}

impl Rows for Bf16Rows<'_> {
    #[inline(always)]
    fn k_dot(&self, at: usize, q: &[f32]) -> f32 {
        dot_by(q, &self.k[at..][..q.len()], |&x| bf16(x))
    }
    #[inline(always)]
    fn v_add(&self, at: usize, p: f32, acc: &mut [f32]) {
        let d = acc.len();
        for (a, &x) in acc.iter_mut().zip(&self.v[at..][..d]) {
            *a += p * bf16(x);
        }
    }
    #[inline(always)]
    fn k_row(&self, at: usize, buf: &mut [f32]) {
        let d = buf.len();
        for (b, &x) in buf.iter_mut().zip(&self.k[at..][..d]) {
            *b = bf16(x);
        }
    }
    #[inline(always)]
    fn v_row(&self, at: usize, buf: &mut [f32]) {
        let d = buf.len();
        for (b, &x) in buf.iter_mut().zip(&self.v[at..][..d]) {
            *b = bf16(x);
        }
    }
    #[inline(always)]
    fn prefetch_k(&self, at: usize, d: usize) {
        prefetch_lines(&self.k[at..], d);
    }
    #[inline(always)]
    fn prefetch_v(&self, at: usize, d: usize) {
        prefetch_lines(&self.v[at..], d);
    }
}

pub(super) trait Scale: Copy + Sync {
    fn at(&self, i: usize) -> f32;
}

impl Scale for &[f32] {
    #[inline(always)]
    fn at(&self, i: usize) -> f32 {
        self[i]
    }
}

#[derive(Clone, Copy)]
pub(super) struct Bf16Scale<'a>(&'a [u16]);

impl Scale for Bf16Scale<'_> {
    #[inline(always)]
    fn at(&self, i: usize) -> f32 {
        bf16(self.0[i])
    }
}

#[derive(Clone, Copy)]
pub(super) struct Int8Rows<'a, S: Scale> {
    pub(super) k: &'a [i8],
    pub(super) v: &'a [i8],
    pub(super) k_scale: S,
    pub(super) v_scale: S,
}

impl<S: Scale> Rows for Int8Rows<'_, S> {
    #[inline(always)]
    fn k_dot(&self, at: usize, q: &[f32]) -> f32 {
        let d = q.len();
        dot_by(q, &self.k[at..][..d], |&x| x as f32) * self.k_scale.at(at / d)
    }
    #[inline(always)]
    fn v_add(&self, at: usize, p: f32, acc: &mut [f32]) {
        let d = acc.len();
        let p = p * self.v_scale.at(at / d);
        for (a, &x) in acc.iter_mut().zip(&self.v[at..][..d]) {
            *a += p * x as f32;
        }
    }
    #[inline(always)]
    fn k_row(&self, at: usize, buf: &mut [f32]) {
        let d = buf.len();
        let scale = self.k_scale.at(at / d);
        for (b, &x) in buf.iter_mut().zip(&self.k[at..][..d]) {
            *b = x as f32 * scale;
        }
    }
    #[inline(always)]
    fn v_row(&self, at: usize, buf: &mut [f32]) {
        let d = buf.len();
        let scale = self.v_scale.at(at / d);
        for (b, &x) in buf.iter_mut().zip(&self.v[at..][..d]) {
            *b = x as f32 * scale;
        }
    }
    #[inline(always)]
    fn prefetch_k(&self, at: usize, d: usize) {
        prefetch_lines(&self.k[at..], d);
    }
    #[inline(always)]
    fn prefetch_v(&self, at: usize, d: usize) {
        prefetch_lines(&self.v[at..], d);
    }
}

/// The rows every cache kind offers: on x86-64 also read 16 or 8 values at a time (decode).
#[cfg(target_arch = "x86_64")]
pub(super) trait AnyRows:
    super::decode_lanes::LaneRows<super::decode_lanes::W16>
    + super::decode_lanes::LaneRows<super::decode_lanes::W8>
{
}
#[cfg(target_arch = "x86_64")]
impl<T> AnyRows for T where
    T: super::decode_lanes::LaneRows<super::decode_lanes::W16>
        + super::decode_lanes::LaneRows<super::decode_lanes::W8>
{
}

/// The vector width a decode row's attention is compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Simd {
    /// 16 float32 lanes (AVX-512F).
    Lanes16,
    /// 8 float32 lanes (AVX2 + FMA).
    Lanes8,
    /// The portable path.
    Portable,
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) trait AnyRows: Rows {}
#[cfg(not(target_arch = "x86_64"))]
impl<T: Rows> AnyRows for T {}

/// One query token's request: (request, its position in the context).
fn token_rows(
    rows: &StepRows,
    shape: &PagedShape,
    tokens: usize,
) -> Result<Vec<(u32, u32)>, KernelError> {
    let invalid = |m: String| Err(KernelError::InvalidArgument(m));
    let qsl = rows.query_start_loc;
    let requests = rows.seq_lens.len();
    if qsl.len() != requests + 1 || rows.block_tables.len() != requests * rows.table_width {
        return invalid(format!(
            "paged attention: {} query starts, {} lengths and {} table entries do not describe \
             {requests} requests of {} blocks",
            qsl.len(),
            requests,
            rows.block_tables.len(),
            rows.table_width
        ));
    }
    if qsl.first() != Some(&0) || qsl[requests] as usize != tokens {
        return invalid(format!(
            "paged attention: query starts must run from 0 to the {tokens} tokens"
        ));
    }
    let mut out = Vec::with_capacity(tokens);
    for r in 0..requests {
        let (start, end, len) = (qsl[r], qsl[r + 1], rows.seq_lens[r]);
        if end < start || len < end - start {
            return invalid(format!(
                "paged attention: request {r} has {} query tokens and a context of {len}",
                end - start
            ));
        }
        let blocks = (len as usize).div_ceil(shape.block_size);
        if blocks > rows.table_width {
            return invalid(format!(
                "paged attention: request {r} needs {blocks} blocks, the table holds {}",
                rows.table_width
            ));
        }
        let table = &rows.block_tables[r * rows.table_width..][..blocks];
        if let Some(b) = table
            .iter()
            .find(|&&b| b < 0 || b as usize >= shape.num_blocks)
        {
            return invalid(format!(
                "paged attention: request {r} names block {b} of {}",
                shape.num_blocks
            ));
        }
        for i in 0..end - start {
            out.push((r as u32, (len - (end - start) + i) as u32));
        }
    }
    Ok(out)
}

/// q · k with k's elements converted by `f`.
#[inline(always)]
fn dot_by<T>(a: &[f32], b: &[T], f: impl Fn(&T) -> f32) -> f32 {
    let mut lanes = [0f32; 16];
    let (a16, b16) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (a16.remainder(), b16.remainder());
    for (x, y) in a16.zip(b16) {
        for i in 0..16 {
            lanes[i] += x[i] * f(&y[i]);
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * f(y)).sum();
    lanes.iter().sum::<f32>() + tail
}

/// Query tokens scored together by a prefill work item (the float32 lanes of a zmm register).
const QB: usize = 16;

/// A work item's queries: `count` (1..=QB) consecutive tokens from `token` of one request, at
/// consecutive positions from `position`.
#[derive(Debug, Clone, Copy)]
struct QueryBlock {
    token: u32,
    count: u32,
    position: u32,
    request: u32,
}

/// Each request's tokens cut into blocks of at most QB (a decode row is a block of one).
fn query_blocks(tokens: &[(u32, u32)]) -> Vec<QueryBlock> {
    let mut blocks: Vec<QueryBlock> = Vec::with_capacity(tokens.len().div_ceil(QB));
    for (t, &(request, position)) in tokens.iter().enumerate() {
        match blocks.last_mut() {
            Some(b) if b.request == request && (b.count as usize) < QB => b.count += 1,
            _ => blocks.push(QueryBlock {
                token: t as u32,
                count: 1,
                position,
                request,
            }),
        }
    }
    blocks
}

/// The blocks reordered first, last, second, second to last, ...: a block's cost grows with its
/// position, and the threads take contiguous ranges of work items, so each gets a fair share.
fn balanced(blocks: Vec<QueryBlock>) -> Vec<QueryBlock> {
    let n = blocks.len();
    (0..n)
        .map(|i| blocks[if i % 2 == 0 { i / 2 } else { n - 1 - i / 2 }])
        .collect()
}

/// One work item: a query block, the KV heads [heads.0, heads.1) it attends with and, for a
/// decode row, the positions [positions.0, positions.1) it reads. A prefill block takes one KV
/// head per item and its whole context. A decode row's item takes a span of KV heads and walks
/// its positions once for the span (a position's rows of the span are adjacent in the cache,
/// so a page of the cache is read once, not once per head); where the rows alone would leave a
/// thread idle, a long context is cut into parts of consecutive positions with every head (each
/// part's softmax state is kept in `partial` slot and the parts are merged after), a short one
/// into spans of KV heads.
#[derive(Debug, Clone, Copy)]
struct WorkItem {
    block: QueryBlock,
    heads: (u32, u32),
    positions: (u32, u32),
    /// The item's slot among the partial results, or `WHOLE`.
    partial: u32,
}

/// A work item that writes its output itself (not one part of a decode row).
const WHOLE: u32 = u32::MAX;

/// The fewest positions a decode row's part reads.
const MIN_PART: usize = 256;

/// A decode row cut into parts: its token and the slots of its parts.
#[derive(Debug, Clone, Copy)]
struct Parts {
    token: u32,
    first: u32,
    count: u32,
}

/// The work items of the (balanced) blocks for `threads` threads, and the decode rows cut into
/// parts.
fn work_items(
    blocks: &[QueryBlock],
    scoring: &Scoring,
    kv_heads: usize,
    threads: usize,
) -> (Vec<WorkItem>, Vec<Parts>) {
    let decode_rows = blocks.iter().filter(|b| b.count == 1).count();
    // Two items per thread where the rows alone would leave a thread idle or unbalanced.
    let wanted = (2 * threads).div_ceil(decode_rows.max(1));
    let mut items = Vec::with_capacity(blocks.len() * kv_heads);
    let mut parts = Vec::new();
    let mut slots = 0u32;
    let all = (0, kv_heads as u32);
    for &block in blocks {
        let hi = block.position as usize + 1;
        let lo = first_visible(scoring, block.position as usize);
        let whole = (lo as u32, hi as u32);
        if block.count > 1 {
            items.extend((0..kv_heads as u32).map(|g| WorkItem {
                block,
                heads: (g, g + 1),
                positions: whole,
                partial: WHOLE,
            }));
            continue;
        }
        let cuts = wanted.min((hi - lo) / MIN_PART);
        if cuts > 1 {
            let first = slots;
            slots += cuts as u32;
            parts.push(Parts {
                token: block.token,
                first,
                count: cuts as u32,
            });
            items.extend((0..cuts).map(|c| WorkItem {
                block,
                heads: all,
                positions: (
                    (lo + c * (hi - lo) / cuts) as u32,
                    (lo + (c + 1) * (hi - lo) / cuts) as u32,
                ),
                partial: first + c as u32,
            }));
        } else {
            let spans = wanted.clamp(1, kv_heads);
            items.extend((0..spans).map(|s| WorkItem {
                block,
                heads: (
                    (s * kv_heads / spans) as u32,
                    ((s + 1) * kv_heads / spans) as u32,
                ),
                positions: whole,
                partial: WHOLE,
            }));
        }
    }
    (items, parts)
}

/// A part's softmax state: per head its running max, its sum and its (unnormalised) output.
fn part_len(heads: usize, d: usize) -> usize {
    heads * (d + 2)
}

/// Each decode row cut into parts gets its output from its parts' states: with M the largest
/// of the parts' maxima m_p, out = Σ_p acc_p · e^(m_p − M) / Σ_p sum_p · e^(m_p − M).
fn merge_parts(parts: &[Parts], states: &[f32], out: &mut [f32], heads: usize, d: usize) {
    let size = part_len(heads, d);
    for p in parts {
        let states = &states[p.first as usize * size..(p.first + p.count) as usize * size];
        let row = &mut out[p.token as usize * heads * d..][..heads * d];
        for h in 0..heads {
            let max = states
                .chunks(size)
                .fold(f32::NEG_INFINITY, |m, s| m.max(s[h]));
            let dest = &mut row[h * d..(h + 1) * d];
            dest.fill(0.0);
            let mut sum = 0f32;
            for state in states.chunks(size) {
                let w = exp(state[h] - max);
                sum += state[heads + h] * w;
                let acc = &state[2 * heads + h * d..][..d];
                for (o, a) in dest.iter_mut().zip(acc) {
                    *o += a * w;
                }
            }
            let inverse = if sum > 0.0 { 1.0 / sum } else { 0.0 };
            for o in dest.iter_mut() {
                *o *= inverse;
            }
        }
    }
}

/// The first position a query at `position` sees.
#[inline(always)]
fn first_visible(scoring: &Scoring, position: usize) -> usize {
    scoring
        .window
        .map_or(0, |w| (position + 1).saturating_sub(w))
}

/// One work item's scratch memory, made once per thread.
struct Scratch {
    qs: Vec<f32>,
    acc: Vec<f32>,
    scores: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
    /// A chunk of K and of V rows as float32 (CHUNK x D each).
    k: Vec<f32>,
    v: Vec<f32>,
    /// Queries transposed per head (G x D x QB), their block scores (CHUNK x QB), running max
    /// and sum (G x QB) and outputs (G x QB x D).
    qt: Vec<[f32; QB]>,
    block_scores: Vec<[f32; QB]>,
    block_max: Vec<[f32; QB]>,
    block_sum: Vec<[f32; QB]>,
    block_acc: Vec<f32>,
    /// A decode row's visible cache rows.
    rows: Vec<usize>,
}

impl Scratch {
    /// Scratch for `group` query heads per KV head, `kv_heads` of them, head size `d`.
    fn new(group: usize, kv_heads: usize, d: usize) -> Self {
        let heads = group * kv_heads;
        Scratch {
            qs: vec![0.0; heads * d],
            acc: vec![0.0; heads * d],
            scores: vec![0.0; group * CHUNK],
            max: vec![0.0; heads],
            sum: vec![0.0; heads],
            k: vec![0.0; CHUNK * d],
            v: vec![0.0; CHUNK * d],
            qt: vec![[0.0; QB]; group * d],
            block_scores: vec![[0.0; QB]; CHUNK],
            block_max: vec![[0.0; QB]; group],
            block_sum: vec![[0.0; QB]; group],
            block_acc: vec![0.0; group * QB * d],
            rows: Vec::new(),
        }
    }
}

/// Work items [items.start, items.end) of (query block, KV head), written into `out`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_items<R: AnyRows>(
    items: &[WorkItem],
    q: &[f32],
    cache: R,
    out: SharedMut<f32>,
    states: SharedMut<f32>,
    shape: &PagedShape,
    rows: &StepRows,
    scoring: &Scoring,
    simd: Simd,
) {
    let (d, kvh) = (shape.head_dim, shape.kv_heads);
    let mut scratch = Scratch::new(shape.heads / kvh, kvh, d);
    for item in items {
        if item.block.count == 1 {
            attend_token(
                item,
                q,
                cache,
                out,
                states,
                shape,
                rows,
                scoring,
                &mut scratch,
                simd,
            );
        } else {
            let (block, g) = (item.block, item.heads.0 as usize);
            attend_block(block, g, q, cache, out, shape, rows, scoring, &mut scratch);
        }
    }
}

/// The cache rows (in the (block, offset, KV head) grid: element `row · D`) of positions
/// [lo, hi) of request r's KV head g, into `out`: one table read per cache block, no division
/// per position.
fn visible_rows(
    shape: &PagedShape,
    rows: &StepRows,
    r: usize,
    g: usize,
    (lo, hi): (usize, usize),
    out: &mut Vec<usize>,
) {
    let table = &rows.block_tables[r * rows.table_width..];
    let (bs, kvh) = (shape.block_size, shape.kv_heads);
    out.clear();
    let mut j = lo;
    while j < hi {
        let (b, offset) = (j / bs, j % bs);
        let end = (j - offset + bs).min(hi);
        let first = (table[b] as usize * bs + offset) * kvh + g;
        out.extend((0..end - j).map(|i| first + i * kvh));
        j = end;
    }
}

/// One decode row's work item: the KV heads and positions it names; the G query heads of
/// each KV head read its K/V rows once. A whole item writes its output; a part leaves its
/// softmax state in its slot of `states`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_token<R: AnyRows>(
    item: &WorkItem,
    q: &[f32],
    cache: R,
    out: SharedMut<f32>,
    states: SharedMut<f32>,
    shape: &PagedShape,
    rows: &StepRows,
    scoring: &Scoring,
    scratch: &mut Scratch,
    simd: Simd,
) {
    let (block, (g0, g1)) = (item.block, item.heads);
    let (g0, span) = (g0 as usize, (g1 - g0) as usize);
    let d = shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    // The item's query heads are consecutive: g0 · G .. (g0 + span) · G.
    let n = span * group;
    let first = (block.token as usize * shape.heads + g0 * group) * d;
    let Scratch {
        qs,
        acc,
        scores,
        max,
        sum,
        rows: visible,
        ..
    } = scratch;
    let (qs, acc) = (&mut qs[..n * d], &mut acc[..n * d]);
    let (max, sum) = (&mut max[..n], &mut sum[..n]);
    for (o, v) in qs.iter_mut().zip(&q[first..first + n * d]) {
        *o = v * scoring.scale;
    }
    let window = (item.positions.0 as usize, item.positions.1 as usize);
    visible_rows(shape, rows, block.request as usize, g0, window, visible);
    token_state(
        visible,
        span,
        qs,
        cache,
        scoring.softcap,
        scores,
        (max, sum, acc),
        d,
        simd,
    );
    if item.partial == WHOLE {
        // SAFETY: the item's (token, head) output rows are consecutive and belong to it alone.
        let dest = unsafe { std::slice::from_raw_parts_mut(out.get().add(first), n * d) };
        for h in 0..n {
            let inverse = if sum[h] > 0.0 { 1.0 / sum[h] } else { 0.0 };
            for (o, a) in dest[h * d..(h + 1) * d].iter_mut().zip(&acc[h * d..]) {
                *o = a * inverse;
            }
        }
    } else {
        // SAFETY: a part covers every head and its slot belongs to it alone.
        let size = part_len(n, d);
        let slot = unsafe {
            std::slice::from_raw_parts_mut(states.get().add(item.partial as usize * size), size)
        };
        slot[..n].copy_from_slice(max);
        slot[n..2 * n].copy_from_slice(sum);
        slot[2 * n..].copy_from_slice(acc);
    }
}

/// A decode row's softmax state (running max, sum, unnormalised output of each query head)
/// over the cache rows `visible` (of the first KV head; `span` KV heads follow each) with the
/// queries `qs` (scaled).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn token_state<R: AnyRows>(
    visible: &[usize],
    span: usize,
    qs: &[f32],
    cache: R,
    softcap: Option<f32>,
    scores: &mut [f32],
    (max, sum, acc): (&mut [f32], &mut [f32], &mut [f32]),
    d: usize,
    simd: Simd,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::paged_decode_x86::{attend_token_avx2, attend_token_avx512};
        let (v, m, a) = (visible, &mut *max, &mut *acc);
        // The entry for this head dim: D = lanes · NV.
        macro_rules! by_head_dim {
            ($entry:ident, $($dim:literal => $nv:literal),*) => {
                match d {
                    $($dim => return $entry::<R, $nv>(v, span, qs, &cache, softcap, m, sum, a),)*
                    _ => {}
                }
            };
        }
        // SAFETY: `simd` names a width only where its instructions were detected.
        unsafe {
            match simd {
                Simd::Lanes16 => {
                    by_head_dim!(attend_token_avx512, 32 => 2, 64 => 4, 128 => 8, 256 => 16)
                }
                Simd::Lanes8 => {
                    by_head_dim!(attend_token_avx2, 32 => 4, 64 => 8, 128 => 16, 256 => 32)
                }
                Simd::Portable => {}
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    let group = max.len() / span;
    let per_head = group * d;
    for s in 0..span {
        let part = s * per_head..(s + 1) * per_head;
        let heads = s * group..(s + 1) * group;
        token_kv_head(
            visible,
            s,
            &qs[part.clone()],
            cache,
            softcap,
            (scores, &mut max[heads.clone()], &mut sum[heads]),
            &mut acc[part],
            d,
        );
    }
}

/// A decode row's softmax state against one KV head (`offset` past the rows of `visible`),
/// portable: its G heads' queries `qs` (scaled); scratch scores; state (max, sum, acc).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn token_kv_head<R: Rows>(
    visible: &[usize],
    offset: usize,
    qs: &[f32],
    cache: R,
    softcap: Option<f32>,
    (scores, max, sum): (&mut [f32], &mut [f32], &mut [f32]),
    acc: &mut [f32],
    d: usize,
) {
    let group = max.len();
    acc.fill(0.0);
    max.fill(f32::NEG_INFINITY);
    sum.fill(0.0);
    for (c, chunk_rows) in visible.chunks(CHUNK).enumerate() {
        let n = chunk_rows.len();
        for (i, &row) in chunk_rows.iter().enumerate() {
            let at = (row + offset) * d;
            if let Some(&ahead) = visible.get(c * CHUNK + i + AHEAD) {
                cache.prefetch((ahead + offset) * d, d);
            }
            for h in 0..group {
                let mut s = cache.k_dot(at, &qs[h * d..(h + 1) * d]);
                if let Some(cap) = softcap {
                    s = cap * (s / cap).tanh();
                }
                scores[h * CHUNK + i] = s;
            }
        }
        for h in 0..group {
            let chunk = &mut scores[h * CHUNK..h * CHUNK + n];
            let new_max = chunk.iter().fold(max[h], |m, &s| m.max(s));
            let rescale = exp(max[h] - new_max);
            for p in chunk.iter_mut() {
                *p = exp(*p - new_max);
            }
            sum[h] = sum[h] * rescale + chunk.iter().sum::<f32>();
            max[h] = new_max;
            for a in &mut acc[h * d..(h + 1) * d] {
                *a *= rescale;
            }
        }
        for (i, &row) in chunk_rows.iter().enumerate() {
            for h in 0..group {
                let p = scores[h * CHUNK + i];
                cache.v_add((row + offset) * d, p, &mut acc[h * d..(h + 1) * d]);
            }
        }
    }
}

/// q (QB lanes, transposed: D x QB) · each of `K` rows: the lanes' scores, no horizontal sum.
#[inline(always)]
fn block_scores<const K: usize>(qt: &[[f32; QB]], k: &[f32], d: usize) -> [[f32; QB]; K] {
    let mut s = [[0f32; QB]; K];
    for (i, qi) in qt.iter().enumerate() {
        for (r, sr) in s.iter_mut().enumerate() {
            let x = k[r * d + i];
            for l in 0..QB {
                sr[l] += qi[l] * x;
            }
        }
    }
    s
}

/// Output values held in registers while a chunk's V rows are added to them.
const TILE: usize = 32;

/// acc (W values from column `at` of lane l's output) = acc · rescale + Σ_r p[r][l] · v_r, the
/// W values kept in registers across the chunk's rows.
#[inline(always)]
fn add_weighted_rows<const W: usize>(
    acc: &mut [f32],
    rescale: f32,
    p: &[[f32; QB]],
    l: usize,
    v: &[f32],
    d: usize,
    at: usize,
) {
    let mut t = [0f32; W];
    for (x, a) in t.iter_mut().zip(acc.iter()) {
        *x = a * rescale;
    }
    for (r, pr) in p.iter().enumerate() {
        let (w, row) = (pr[l], &v[r * d + at..][..W]);
        for i in 0..W {
            t[i] += w * row[i];
        }
    }
    acc.copy_from_slice(&t);
}

/// A block of 2..=QB consecutive query tokens of one request and one KV head: each K/V row is
/// read (and converted to float32) once for the block and every head of the group; the scores
/// of the block's queries for a key are D multiply-adds over QB lanes.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_block<R: Rows>(
    block: QueryBlock,
    g: usize,
    q: &[f32],
    cache: R,
    out: SharedMut<f32>,
    shape: &PagedShape,
    rows: &StepRows,
    scoring: &Scoring,
    scratch: &mut Scratch,
) {
    let d = shape.head_dim;
    let group = shape.heads / shape.kv_heads;
    let Scratch {
        k: kbuf,
        v: vbuf,
        qt,
        block_scores: scores,
        block_max: max,
        block_sum: sum,
        block_acc: acc,
        rows: visible,
        ..
    } = scratch;
    let (t0, n, p0) = (
        block.token as usize,
        block.count as usize,
        block.position as usize,
    );
    // Lane l is the query at position p0 + l; it sees keys [first[l], last[l]]. Lanes past the
    // block's tokens score zeros and see every key; they are never written out.
    let (mut first, mut last) = ([0usize; QB], [usize::MAX; QB]);
    for l in 0..n {
        first[l] = first_visible(scoring, p0 + l);
        last[l] = p0 + l;
    }
    let (lo, hi) = (first[0], p0 + n);
    let (unmasked_from, unmasked_to) = (first[n - 1], p0);
    for h in 0..group {
        let head = g * group + h;
        for (i, lanes) in qt[h * d..(h + 1) * d].iter_mut().enumerate() {
            for (l, x) in lanes.iter_mut().enumerate() {
                *x = if l < n {
                    q[((t0 + l) * shape.heads + head) * d + i] * scoring.scale
                } else {
                    0.0
                };
            }
        }
    }
    acc.fill(0.0);
    max.fill([f32::NEG_INFINITY; QB]);
    sum.fill([0.0; QB]);
    visible_rows(shape, rows, block.request as usize, g, (lo, hi), visible);
    let mut start = lo;
    while start < hi {
        let end = (start + CHUNK).min(hi);
        let m = end - start;
        for j in start..end {
            let at = visible[j - lo] * d;
            let r = j - start;
            cache.k_row(at, &mut kbuf[r * d..(r + 1) * d]);
            cache.v_row(at, &mut vbuf[r * d..(r + 1) * d]);
        }
        for h in 0..group {
            let qh = &qt[h * d..(h + 1) * d];
            let mut r = 0;
            while r + 4 <= m {
                let s4 = block_scores::<4>(qh, &kbuf[r * d..], d);
                scores[r..r + 4].copy_from_slice(&s4);
                r += 4;
            }
            while r < m {
                scores[r] = block_scores::<1>(qh, &kbuf[r * d..], d)[0];
                r += 1;
            }
            let chunk = &mut scores[..m];
            for (r, s) in chunk.iter_mut().enumerate() {
                if let Some(cap) = scoring.softcap {
                    for x in s.iter_mut() {
                        *x = cap * (*x / cap).tanh();
                    }
                }
                let j = start + r;
                if j < unmasked_from || j > unmasked_to {
                    for l in 0..QB {
                        if j < first[l] || j > last[l] {
                            s[l] = f32::NEG_INFINITY;
                        }
                    }
                }
            }
            let mut new_max = max[h];
            for s in chunk.iter() {
                for l in 0..QB {
                    new_max[l] = new_max[l].max(s[l]);
                }
            }
            // A lane with every key so far masked keeps a max of −∞; its weights stay ~0.
            let mut base = [0f32; QB];
            let mut rescale = [0f32; QB];
            for l in 0..QB {
                base[l] = if new_max[l] == f32::NEG_INFINITY {
                    0.0
                } else {
                    new_max[l]
                };
                rescale[l] = exp(max[h][l] - base[l]);
            }
            let mut total = [0f32; QB];
            for s in chunk.iter_mut() {
                for l in 0..QB {
                    s[l] = exp(s[l] - base[l]);
                    total[l] += s[l];
                }
            }
            for l in 0..QB {
                sum[h][l] = sum[h][l] * rescale[l] + total[l];
            }
            max[h] = new_max;
            let acc_h = &mut acc[h * QB * d..(h + 1) * QB * d];
            for l in 0..n {
                let row = &mut acc_h[l * d..(l + 1) * d];
                let mut i = 0;
                while i + TILE <= d {
                    add_weighted_rows::<TILE>(
                        &mut row[i..i + TILE],
                        rescale[l],
                        chunk,
                        l,
                        vbuf,
                        d,
                        i,
                    );
                    i += TILE;
                }
                while i < d {
                    add_weighted_rows::<1>(&mut row[i..i + 1], rescale[l], chunk, l, vbuf, d, i);
                    i += 1;
                }
            }
        }
        start = end;
    }
    for h in 0..group {
        let head = g * group + h;
        for l in 0..n {
            let s = sum[h][l];
            let inverse = if s > 0.0 { 1.0 / s } else { 0.0 };
            let row = &acc[(h * QB + l) * d..(h * QB + l + 1) * d];
            for (i, a) in row.iter().enumerate() {
                // SAFETY: each (token, head) output row belongs to one work item.
                unsafe { *out.get().add(((t0 + l) * shape.heads + head) * d + i) = a * inverse };
            }
        }
    }
}

macro_rules! compiled_for {
    ($name:ident, $features:literal, $simd:expr) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name<R: AnyRows>(
            items: &[WorkItem],
            q: &[f32],
            cache: R,
            out: SharedMut<f32>,
            states: SharedMut<f32>,
            shape: &PagedShape,
            rows: &StepRows,
            scoring: &Scoring,
        ) {
            attend_items(items, q, cache, out, states, shape, rows, scoring, $simd)
        }
    };
}

compiled_for!(attend_items_avx512, "avx512f,avx2,fma", Simd::Lanes16);
compiled_for!(attend_items_avx2, "avx2,fma", Simd::Lanes8);

/// out (T, H, D) = attention of q (T, H, D) over the caches (see the module note).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    q: &[f32],
    cache: KvCache,
    out: &mut [f32],
    shape: PagedShape,
    rows: StepRows,
    scoring: Scoring,
    isa: Isa,
    threads: ThreadCount,
) -> Result<(), KernelError> {
    let invalid = |m: String| Err(KernelError::InvalidArgument(m));
    if !isa.supported() {
        return invalid(format!("this CPU cannot run {isa}"));
    }
    let PagedShape {
        heads,
        kv_heads,
        head_dim,
        block_size,
        num_blocks,
    } = shape;
    if kv_heads == 0 || heads % kv_heads != 0 || head_dim == 0 || block_size == 0 {
        return invalid(format!(
            "paged attention: {heads} heads over {kv_heads} KV heads, head_dim {head_dim}, \
             block_size {block_size}"
        ));
    }
    let positions = num_blocks * block_size * kv_heads;
    let (k_len, v_len, k_scales, v_scales) = cache.lens();
    let scales_fit = matches!(cache, KvCache::F32 { .. } | KvCache::Bf16 { .. })
        || (k_scales == positions && v_scales == positions);
    if !q.len().is_multiple_of(heads * head_dim)
        || out.len() != q.len()
        || k_len != positions * head_dim
        || v_len != positions * head_dim
        || !scales_fit
    {
        return invalid(format!(
            "paged attention: q ({}), out ({}), K ({k_len}), V ({v_len}) and their scales \
             ({k_scales}, {v_scales}) do not fit {heads} heads of {head_dim} and a cache of \
             {num_blocks} x {block_size} x {kv_heads} x {head_dim}",
            q.len(),
            out.len(),
        ));
    }
    if scoring.window == Some(0) || scoring.softcap.is_some_and(|c| c.is_nan() || c <= 0.0) {
        return invalid("paged attention: a window and a soft cap must be positive".into());
    }
    let tokens = q.len() / (heads * head_dim);
    let owners = token_rows(&rows, &shape, tokens)?;
    let blocks = balanced(query_blocks(&owners));
    let (items, parts) = work_items(&blocks, &scoring, kv_heads, threads.get());
    let slots = parts.iter().map(|p| p.count as usize).sum::<usize>();
    let mut states = vec![0f32; slots * part_len(heads, head_dim)];
    let work = Work {
        q,
        out: SharedMut::new(out.as_mut_ptr()),
        states: SharedMut::new(states.as_mut_ptr()),
        shape: &shape,
        rows: &rows,
        scoring: &scoring,
        items: items.as_slice(),
        isa,
        threads,
    };
    match cache {
        KvCache::F32 { k, v } => work.run(F32Rows { k, v }),
        KvCache::Bf16 { k, v } => work.run(Bf16Rows { k, v }),
        KvCache::Int8 {
            k,
            v,
            k_scale: Scales::F32(k_scale),
            v_scale: Scales::F32(v_scale),
        } => work.run(Int8Rows {
            k,
            v,
            k_scale,
            v_scale,
        }),
        KvCache::Int8 {
            k,
            v,
            k_scale: Scales::Bf16(k_scale),
            v_scale: Scales::Bf16(v_scale),
        } => work.run(Int8Rows {
            k,
            v,
            k_scale: Bf16Scale(k_scale),
            v_scale: Bf16Scale(v_scale),
        }),
        KvCache::Int8 { .. } => {
            return invalid("paged attention: K's and V's scales differ in type".into())
        }
    }
    merge_parts(&parts, &states, out, heads, head_dim);
    Ok(())
}

/// One call's work, split over the threads and run on the instruction set chosen.
struct Work<'a> {
    q: &'a [f32],
    out: SharedMut<f32>,
    /// The softmax states of decode rows' parts.
    states: SharedMut<f32>,
    shape: &'a PagedShape,
    rows: &'a StepRows<'a>,
    scoring: &'a Scoring,
    items: &'a [WorkItem],
    isa: Isa,
    threads: ThreadCount,
}

impl Work<'_> {
    fn run<R: AnyRows>(&self, cache: R) {
        let Work {
            q,
            out,
            states,
            shape,
            rows,
            scoring,
            items,
            isa,
            threads,
        } = *self;
        split(threads, items.len(), |range| {
            let items = &items[range];
            #[cfg(target_arch = "x86_64")]
            match isa {
                // SAFETY: the instruction sets were detected (`isa.supported()`).
                Isa::Avx512Vnni => unsafe {
                    return attend_items_avx512(items, q, cache, out, states, shape, rows, scoring);
                },
                Isa::Avx2 | Isa::AvxVnni => unsafe {
                    return attend_items_avx2(items, q, cache, out, states, shape, rows, scoring);
                },
                Isa::Scalar => {}
            }
            attend_items(
                items,
                q,
                cache,
                out,
                states,
                shape,
                rows,
                scoring,
                Simd::Portable,
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(count: usize, seed: u64) -> Vec<f32> {
        let mut s = seed | 1;
        (0..count)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn to_bf16(x: &[f32]) -> Vec<u16> {
        x.iter().map(|v| (v.to_bits() >> 16) as u16).collect()
    }

    fn from_bf16(x: &[u16]) -> Vec<f32> {
        x.iter().map(|&b| bf16(b)).collect()
    }

    /// Symmetric int8 per row of `d`: (values, one scale per row).
    fn to_int8(x: &[f32], d: usize) -> (Vec<i8>, Vec<f32>) {
        let mut q = Vec::with_capacity(x.len());
        let mut scales = Vec::with_capacity(x.len() / d);
        for row in x.chunks(d) {
            let scale = row.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            scales.push(scale);
            q.extend(row.iter().map(|v| (v / scale).round() as i8));
        }
        (q, scales)
    }

    fn from_int8(q: &[i8], scales: &[f32], d: usize) -> Vec<f32> {
        q.iter()
            .enumerate()
            .map(|(i, &x)| x as f32 * scales[i / d])
            .collect()
    }

    /// The plain softmax over each token's allowed positions, in f64.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        shape: &PagedShape,
        rows: &StepRows,
        scoring: &Scoring,
    ) -> Vec<f64> {
        let (h, kvh, d, bs) = (
            shape.heads,
            shape.kv_heads,
            shape.head_dim,
            shape.block_size,
        );
        let tokens = token_rows(rows, shape, q.len() / (h * d)).unwrap();
        let mut out = vec![0f64; q.len()];
        for (t, &(r, p)) in tokens.iter().enumerate() {
            let hi = p as usize + 1;
            let lo = scoring.window.map_or(0, |w| hi.saturating_sub(w));
            for head in 0..h {
                let g = head / (h / kvh);
                let at = |cache: &[f32], j: usize, i: usize| {
                    let block = rows.block_tables[r as usize * rows.table_width + j / bs] as usize;
                    cache[((block * bs + j % bs) * kvh + g) * d + i] as f64
                };
                let mut s: Vec<f64> = (lo..hi)
                    .map(|j| {
                        let mut x = (0..d)
                            .map(|i| q[(t * h + head) * d + i] as f64 * at(k, j, i))
                            .sum::<f64>();
                        x *= scoring.scale as f64;
                        if let Some(c) = scoring.softcap {
                            x = c as f64 * (x / c as f64).tanh();
                        }
                        x
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                s.iter_mut().for_each(|x| *x = (*x - m).exp());
                let total: f64 = s.iter().sum();
                for i in 0..d {
                    out[(t * h + head) * d + i] =
                        (lo..hi).zip(&s).map(|(j, p)| p * at(v, j, i)).sum::<f64>() / total;
                }
            }
        }
        out
    }

    #[test]
    fn every_path_matches_the_softmax_reference() {
        // Three requests: a prefill with nothing cached, a chunk after a cached context, a decode.
        let shape = PagedShape {
            heads: 6,
            kv_heads: 2,
            head_dim: 40,
            block_size: 4,
            num_blocks: 20,
        };
        let (qsl, lens) = ([0, 5, 8, 9], [5, 70, 11]);
        let width = 18;
        let mut tables = vec![0i32; 3 * width];
        let ids: Vec<i32> = (0..20).rev().collect();
        tables[..2].copy_from_slice(&ids[..2]);
        tables[width..2 * width].copy_from_slice(&ids[2..20]);
        tables[2 * width..2 * width + 3].copy_from_slice(&[1, 0, 19]);
        let rows = StepRows {
            query_start_loc: &qsl,
            seq_lens: &lens,
            block_tables: &tables,
            table_width: width,
        };
        check_every_cache(
            shape,
            rows,
            &[
                Scoring {
                    scale: 0.3,
                    window: None,
                    softcap: None,
                },
                Scoring {
                    scale: 0.3,
                    window: Some(7),
                    softcap: None,
                },
                Scoring {
                    scale: 0.9,
                    window: Some(40),
                    softcap: Some(2.0),
                },
            ],
        );
    }

    #[test]
    fn query_blocks_match_the_reference_at_every_edge() {
        // GQA (4 heads per KV head); prefills of 37 (not a multiple of QB) and 16 tokens with
        // nothing cached, a chunk of 21 after 50 cached positions, decodes between them.
        let shape = PagedShape {
            heads: 8,
            kv_heads: 2,
            head_dim: 24,
            block_size: 8,
            num_blocks: 24,
        };
        let (qsl, lens) = ([0, 37, 38, 59, 75, 76], [37, 30, 71, 16, 9]);
        let width = 9;
        let mut tables = vec![0i32; 5 * width];
        let ids: Vec<i32> = (0..24).map(|i| (i * 7) % 24).collect();
        let mut next = 0;
        for (r, &len) in lens.iter().enumerate() {
            let blocks = (len as usize).div_ceil(8);
            tables[r * width..r * width + blocks].copy_from_slice(&ids[next..next + blocks]);
            next += blocks;
        }
        let rows = StepRows {
            query_start_loc: &qsl,
            seq_lens: &lens,
            block_tables: &tables,
            table_width: width,
        };
        let blocks = query_blocks(&token_rows(&rows, &shape, 76).unwrap());
        let counts: Vec<u32> = blocks.iter().map(|b| b.count).collect();
        assert_eq!(counts, [16, 16, 5, 1, 16, 5, 16, 1]);
        check_every_cache(
            shape,
            rows,
            &[
                Scoring {
                    scale: 0.4,
                    window: None,
                    softcap: None,
                },
                // A window shorter than a block: the lanes see partly disjoint keys.
                Scoring {
                    scale: 0.4,
                    window: Some(5),
                    softcap: None,
                },
                Scoring {
                    scale: 0.8,
                    window: Some(33),
                    softcap: Some(1.5),
                },
                Scoring {
                    scale: 1.1,
                    window: None,
                    softcap: Some(3.0),
                },
            ],
        );
    }

    /// Every cache kind, instruction set and thread count against the f64 reference.
    #[test]
    fn decode_rows_match_the_reference_at_every_head_dim() {
        // Decode rows alone (the AVX-512 decode path where D is 32, 64, 128 or 256): contexts
        // of 1, 15, 16, 17, 33 and 100 positions (groups of 16 keys with and without a tail),
        // blocks in scrambled order, windows that start inside a block, GQA and MHA; 20 heads
        // span tiles of 16 + 4 and 8 + 8 + 4 query heads, cut inside a KV head's group.
        let lens = [1i32, 15, 16, 17, 33, 100];
        let qsl: Vec<i32> = (0..=lens.len() as i32).collect();
        for (heads, kv_heads, head_dim) in [
            (8, 2, 64),
            (4, 4, 32),
            (6, 3, 128),
            (2, 1, 256),
            (20, 4, 64),
        ] {
            let block_size = 8;
            let width = 13;
            let num_blocks = lens.len() * width;
            let shape = PagedShape {
                heads,
                kv_heads,
                head_dim,
                block_size,
                num_blocks,
            };
            let tables: Vec<i32> = (0..num_blocks as i32)
                .map(|i| (i * 37 + 11) % num_blocks as i32)
                .collect();
            let rows = StepRows {
                query_start_loc: &qsl,
                seq_lens: &lens,
                block_tables: &tables,
                table_width: width,
            };
            check_every_cache(
                shape,
                rows,
                &[
                    Scoring {
                        scale: 0.2,
                        window: None,
                        softcap: None,
                    },
                    Scoring {
                        scale: 0.2,
                        window: Some(21),
                        softcap: None,
                    },
                    Scoring {
                        scale: 0.7,
                        window: Some(5),
                        softcap: Some(3.0),
                    },
                ],
            );
        }
    }

    #[test]
    fn long_decode_rows_cut_into_parts_match_the_reference() {
        // Two decode rows with long contexts: with 3 threads each is cut into parts of
        // consecutive positions whose softmax states are merged (with 1 thread they are not);
        // a window keeps a part's range inside it; D 64 (AVX-512 decode) and 40 (portable).
        let lens = [1100i32, 600];
        let qsl = [0i32, 1, 2];
        for (heads, kv_heads, head_dim) in [(8, 2, 64), (4, 4, 40)] {
            let block_size = 16;
            let width = 70;
            let num_blocks = 2 * width;
            let shape = PagedShape {
                heads,
                kv_heads,
                head_dim,
                block_size,
                num_blocks,
            };
            let tables: Vec<i32> = (0..num_blocks as i32)
                .map(|i| (i * 53 + 7) % num_blocks as i32)
                .collect();
            let rows = StepRows {
                query_start_loc: &qsl,
                seq_lens: &lens,
                block_tables: &tables,
                table_width: width,
            };
            check_every_cache(
                shape,
                rows,
                &[
                    Scoring {
                        scale: 0.15,
                        window: None,
                        softcap: None,
                    },
                    Scoring {
                        scale: 0.15,
                        window: Some(700),
                        softcap: Some(4.0),
                    },
                ],
            );
        }
    }

    #[test]
    fn work_items_cut_long_decode_rows_and_spread_short_ones() {
        let scoring = Scoring {
            scale: 1.0,
            window: None,
            softcap: None,
        };
        let row = |position: u32| QueryBlock {
            token: 0,
            count: 1,
            position,
            request: 0,
        };
        // One long row, two threads: four parts of every head, consecutive positions.
        let (items, parts) = work_items(&[row(4095)], &scoring, 12, 2);
        assert_eq!(items.len(), 4);
        assert_eq!(parts.len(), 1);
        assert_eq!(parts[0].count, 4);
        let mut next = 0;
        for (i, item) in items.iter().enumerate() {
            assert_eq!((item.heads, item.partial), ((0, 12), i as u32));
            assert_eq!(item.positions.0, next);
            next = item.positions.1;
        }
        assert_eq!(next, 4096);
        // One short row: spans of KV heads, whole.
        let (items, parts) = work_items(&[row(100)], &scoring, 12, 2);
        assert!(parts.is_empty());
        let spans: Vec<_> = items.iter().map(|i| i.heads).collect();
        assert_eq!(spans, vec![(0, 3), (3, 6), (6, 9), (9, 12)]);
        assert!(items
            .iter()
            .all(|i| i.partial == WHOLE && i.positions == (0, 101)));
        // Many rows: one item per row with every head.
        let rows: Vec<_> = (0..8).map(|i| row(4000 + i)).collect();
        let (items, parts) = work_items(&rows, &scoring, 12, 2);
        assert!(parts.is_empty());
        assert!(items.iter().all(|i| i.heads == (0, 12)));
        assert_eq!(items.len(), 8);
    }

    fn check_every_cache(shape: PagedShape, rows: StepRows, scorings: &[Scoring]) {
        let (d, kvh) = (shape.head_dim, shape.kv_heads);
        let cache = shape.num_blocks * shape.block_size * kvh * d;
        let tokens = *rows.query_start_loc.last().unwrap() as usize;
        let (k, v) = (values(cache, 1), values(cache, 2));
        let q = values(tokens * shape.heads * d, 3);
        // The same values as bfloat16 (truncated to 16 bits) and as int8 with a scale per row.
        let (kb, vb) = (to_bf16(&k), to_bf16(&v));
        let ((ki, ks), (vi, vs)) = (to_int8(&k, d), to_int8(&v, d));
        let (ksb, vsb) = (to_bf16(&ks), to_bf16(&vs));
        let caches = [
            (KvCache::F32 { k: &k, v: &v }, k.clone(), v.clone()),
            (
                KvCache::Bf16 { k: &kb, v: &vb },
                from_bf16(&kb),
                from_bf16(&vb),
            ),
            (
                KvCache::Int8 {
                    k: &ki,
                    v: &vi,
                    k_scale: Scales::F32(&ks),
                    v_scale: Scales::F32(&vs),
                },
                from_int8(&ki, &ks, d),
                from_int8(&vi, &vs, d),
            ),
            (
                KvCache::Int8 {
                    k: &ki,
                    v: &vi,
                    k_scale: Scales::Bf16(&ksb),
                    v_scale: Scales::Bf16(&vsb),
                },
                from_int8(&ki, &from_bf16(&ksb), d),
                from_int8(&vi, &from_bf16(&vsb), d),
            ),
        ];
        for &scoring in scorings {
            for (cache, k, v) in &caches {
                let want = reference(&q, k, v, &shape, &rows, &scoring);
                for isa in Isa::supported_paths() {
                    for threads in [1, 3] {
                        let mut out = vec![f32::NAN; q.len()];
                        paged_attention(
                            &q,
                            *cache,
                            &mut out,
                            shape,
                            rows,
                            scoring,
                            isa,
                            ThreadCount::new(threads),
                        )
                        .unwrap();
                        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
                            assert!(
                                (g as f64 - w).abs() < 1e-5,
                                "{isa} {scoring:?}: out[{i}] = {g}, want {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn bad_tables_are_named() {
        let shape = PagedShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 8,
            block_size: 4,
            num_blocks: 2,
        };
        let cache = vec![0f32; 2 * 4 * 8];
        let q = vec![0f32; 16];
        let mut out = vec![0f32; 16];
        let scoring = Scoring {
            scale: 1.0,
            window: None,
            softcap: None,
        };
        let run = |tables: &[i32], lens: &[i32], out: &mut [f32]| {
            let rows = StepRows {
                query_start_loc: &[0, 1],
                seq_lens: lens,
                block_tables: tables,
                table_width: 2,
            };
            paged_attention(
                &q,
                KvCache::F32 {
                    k: &cache,
                    v: &cache,
                },
                out,
                shape,
                rows,
                scoring,
                Isa::Scalar,
                ThreadCount::new(1),
            )
        };
        assert!(run(&[0, 1], &[8], &mut out).is_ok());
        assert!(run(&[0, 2], &[8], &mut out)
            .unwrap_err()
            .to_string()
            .contains("names block 2"));
        assert!(run(&[0, 1], &[9], &mut out)
            .unwrap_err()
            .to_string()
            .contains("needs 3 blocks"));
        assert!(run(&[0, 1], &[0], &mut out).is_err());
        // An int8 cache without a scale per position and KV head is named.
        let int8 = vec![0i8; 2 * 4 * 8];
        let scales = vec![1f32; 7];
        let rows = StepRows {
            query_start_loc: &[0, 1],
            seq_lens: &[8],
            block_tables: &[0, 1],
            table_width: 2,
        };
        let cache = KvCache::Int8 {
            k: &int8,
            v: &int8,
            k_scale: Scales::F32(&scales),
            v_scale: Scales::F32(&scales),
        };
        let error = paged_attention(
            &q,
            cache,
            &mut out,
            shape,
            rows,
            scoring,
            Isa::Scalar,
            ThreadCount::new(1),
        )
        .unwrap_err();
        assert!(error.to_string().contains("their scales (7, 7)"), "{error}");
    }

    #[test]
    fn the_softmax_exp_is_close_to_exp() {
        assert!(exp(-100.0) < 1e-37 && exp(f32::NEG_INFINITY) < 1e-37);
        for i in 0..1600 {
            let x = -(i as f32) * 0.05;
            let (got, want) = (exp(x), x.exp());
            assert!(
                (got - want).abs() <= 3e-7 * want + 1e-38,
                "{x}: {got} vs {want}"
            );
        }
    }
}
