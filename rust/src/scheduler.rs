//! The continuous-batching scheduler, owned by [`EngineCore`].
//!
//! Each step fills a token budget under a cap on running requests: running
//! requests first (one decode token each, or the next chunk of an unfinished
//! prefill), then waiting ones, in (priority, arrival) order. Prefill chunks and
//! decodes share a step. A prefill chunk never takes the budget reserved for the
//! decodes behind it. When blocks run out the lowest-priority, latest-arrived
//! running request is preempted by recompute: it frees its blocks and waits again
//! with its generated tokens kept.
//!
//! With requests of several clients, each step's prefill budget is split between the
//! clients (`fair_share`), and capped so that the step stays under a target duration
//! (`shared_step`); with one, nothing changes.
//!
//! An update may append several tokens to a row; those past the first are
//! scheduled in the next step like the rest of a prefill.
//!
//! Speculative decoding: a decoding request with draft tokens (`set_draft`) runs
//! its last token and the drafts in one step, each position sampled; the update
//! counts as computed only the drafts that the tokens it takes confirm, and gives
//! back the blocks that held only rejected positions.

use std::collections::BTreeSet;
use std::sync::Arc;

use rustc_hash::FxHashMap;

use crate::block_pool::{BlockPool, PoolInner, PoolStats};
use crate::block_size::BlockSize;
use crate::error::{CoreError, Result};
use crate::fair_share::FairShare;
use crate::request::{
    FinishReason, Request, RequestParams, SlotIds, Status, StopReason, TailBlock, TextState,
};
use crate::shared_step::{SharedStep, StepWork, MIN_PREFILL};
use crate::step_plan::StepPlan;
use crate::structured::{Grammar, PendingMasks};
use crate::text::Tokenizer;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// Largest prefill chunk one request may take in a step (0: no cap beyond the budget).
    pub long_prefill_token_threshold: usize,
}

impl SchedulerConfig {
    fn validate(&self) -> Result<()> {
        let positive = [
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(CoreError::InvalidArgument(format!(
                    "{name} must be at least 1"
                )));
            }
        }
        if self.max_model_len < 2 {
            return Err(CoreError::InvalidArgument(
                "max_model_len must be at least 2 (one prompt and one output token)".into(),
            ));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return Err(CoreError::InvalidArgument(format!(
                "max_num_batched_tokens ({}) must be at least max_num_seqs ({}), \
                 so every running request can decode in a step",
                self.max_num_batched_tokens, self.max_num_seqs
            )));
        }
        Ok(())
    }
}

/// A request that ended in this update (or was aborted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FinishedRequest {
    pub request_id: String,
    pub slot: u32,
    pub reason: FinishReason,
    pub stop_reason: Option<StopReason>,
    pub num_output_tokens: usize,
}

/// What an update changed: one entry per token appended, in plan order (a row
/// that took several tokens repeats).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepUpdate {
    /// Plan row of each appended token.
    pub rows: Vec<u32>,
    /// Its slot.
    pub slots: Vec<u32>,
    /// The tokens, as appended.
    pub token_ids: Vec<u32>,
    /// The text each token adds (after stop-string hold-back), when the core has
    /// a tokenizer; without one, no texts at all.
    pub texts: Vec<String>,
    /// Requests that finished, in plan order.
    pub finished: Vec<FinishedRequest>,
}

impl StepUpdate {
    /// Writes the `appended`-th token of the step (its columns are sized beforehand).
    #[inline(always)]
    fn put(&mut self, appended: &mut usize, row: usize, slot: u32, token: u32) {
        self.rows[*appended] = row as u32;
        self.slots[*appended] = slot;
        self.token_ids[*appended] = token;
        *appended += 1;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_preemptions: u64,
    pub num_steps: u64,
}

#[derive(Debug, Clone, Copy)]
struct Scheduled {
    slot: u32,
    arrival: u64,
    /// Tokens of the request in the cache before this step.
    start: usize,
    num_new: usize,
    /// Of `num_new`, the draft tokens at the end (each position samples).
    num_draft: usize,
    samples: bool,
    /// A plain decode row read whole when scheduled (its token, the block holding its
    /// position, every block reported, min_tokens out): the plan needs nothing more.
    plain: Option<PlainRow>,
}

/// What the plan needs of a plain decode row, read when it is scheduled.
#[derive(Debug, Clone, Copy)]
struct PlainRow {
    token: u32,
    /// The cache slot of its position: block id * block_size + offset.
    cache_slot: i32,
    /// Its block is new to the runner: the plan reports it (marked reported when scheduled).
    reports: bool,
}

/// The scheduler and the block pool it allocates from.
pub struct EngineCore {
    config: SchedulerConfig,
    block_size: BlockSize,
    pool: BlockPool,
    requests: Vec<Option<Request>>,
    free_slots: Vec<u32>,
    slot_of: FxHashMap<Arc<str>, u32>,
    /// Each slot's request id, handed to every plan by reference.
    slot_ids: SlotIds,
    /// Live requests with a grammar: the step starts masks only when some are.
    num_grammars: usize,
    /// Live requests holding draft tokens: the step reads drafts only when some are.
    num_drafted: usize,
    waiting: BTreeSet<(i32, u64, u32)>,
    /// Slots of running requests, sorted by (priority, arrival).
    running: Vec<u32>,
    next_arrival: u64,
    in_flight: Option<Vec<Scheduled>>,
    /// The in-flight step's sampling rows (entries that sample), counted as its plan is built.
    in_flight_sampling_rows: usize,
    /// The step being scheduled's plain decode rows, counted as they are scheduled: when
    /// every row is one, the plan is written in one run without looking for where runs end.
    step_plain_rows: usize,
    /// The last applied step's entries and the last plan handed back (`recycle`), kept
    /// for their buffers: a step in the steady state allocates none of them.
    spare_entries: Vec<Scheduled>,
    spare_plan: StepPlan,
    /// The in-flight step's masks: update() waits for them before advancing matchers.
    in_flight_masks: Option<PendingMasks>,
    num_preemptions: u64,
    num_steps: u64,
    tokenizer: Option<Arc<Tokenizer>>,
    /// The clients' shares of each step's prefill budget (idle with one client).
    fair: FairShare,
    /// The time bound of a step while clients share the engine (idle with one client).
    shared: SharedStep,
    /// The token budget of the last step planned.
    step_budget: usize,
}

impl EngineCore {
    pub fn new(config: SchedulerConfig) -> Result<Self> {
        Self::with_tokenizer(config, None)
    }

    /// A core that detokenizes its outputs and honours stop strings.
    pub fn with_tokenizer(
        config: SchedulerConfig,
        tokenizer: Option<Arc<Tokenizer>>,
    ) -> Result<Self> {
        config.validate()?;
        let pool = BlockPool::new(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
        )?;
        Ok(EngineCore {
            block_size: BlockSize::new(config.block_size),
            step_budget: config.max_num_batched_tokens,
            config,
            pool,
            requests: Vec::new(),
            free_slots: Vec::new(),
            slot_of: FxHashMap::default(),
            slot_ids: SlotIds::default(),
            num_grammars: 0,
            num_drafted: 0,
            waiting: BTreeSet::new(),
            running: Vec::new(),
            next_arrival: 0,
            in_flight: None,
            in_flight_sampling_rows: 0,
            step_plain_rows: 0,
            spare_entries: Vec::new(),
            spare_plan: StepPlan::default(),
            in_flight_masks: None,
            num_preemptions: 0,
            num_steps: 0,
            tokenizer,
            fair: FairShare::default(),
            shared: SharedStep::default(),
        })
    }

    /// Sets the target duration of a step while several clients have work in the engine
    /// (and for `shared_step::HOLD_OFF` after); None or zero: steps are never bounded.
    pub fn set_shared_step(&mut self, target: Option<std::time::Duration>) {
        self.shared.set_target(target);
    }

    /// The time bound of shared steps and its cost model.
    pub fn shared_step(&self) -> &SharedStep {
        &self.shared
    }

    /// The token budget of the last step planned: `max_num_batched_tokens` unless the step
    /// was bounded in time.
    pub fn step_token_budget(&self) -> usize {
        self.step_budget
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_preemptions: self.num_preemptions,
            num_steps: self.num_steps,
        }
    }

    pub fn has_unfinished(&self) -> bool {
        !self.slot_of.is_empty()
    }

    pub fn num_requests(&self) -> usize {
        self.slot_of.len()
    }

    fn req(&self, slot: u32) -> &Request {
        self.requests[slot as usize].as_ref().expect("live slot")
    }

    fn req_mut(&mut self, slot: u32) -> &mut Request {
        self.requests[slot as usize].as_mut().expect("live slot")
    }

    /// The tokens (prompt, then output) of a live request.
    pub fn request_tokens(&self, request_id: &str) -> Result<(&[u32], usize)> {
        let slot = *self
            .slot_of
            .get(request_id)
            .ok_or_else(|| CoreError::UnknownRequest(request_id.to_string()))?;
        let r = self.req(slot);
        Ok((&r.tokens, r.prompt_len))
    }

    /// Queues a request; returns its slot. Refuses what could never be served.
    pub fn add_request(&mut self, id: &str, prompt: &[u32], params: RequestParams) -> Result<u32> {
        self.add_request_with_grammar(id, prompt, params, None)
    }

    /// Queues a request whose output `grammar` constrains (a fresh matcher of its own).
    pub fn add_request_with_grammar(
        &mut self,
        id: &str,
        prompt: &[u32],
        params: RequestParams,
        grammar: Option<&Grammar>,
    ) -> Result<u32> {
        params.validate()?;
        if self.slot_of.contains_key(id) {
            return Err(CoreError::InvalidArgument(format!(
                "request id {id:?} is already in use"
            )));
        }
        if prompt.is_empty() {
            return Err(CoreError::InvalidArgument("the prompt is empty".into()));
        }
        let max_len = self.config.max_model_len;
        if prompt.len() >= max_len {
            return Err(CoreError::RequestTooLarge(format!(
                "the prompt has {} tokens but max_model_len is {max_len}: at most {} prompt \
                 tokens leave room for one output token",
                prompt.len(),
                max_len - 1
            )));
        }
        // The last token's KV is never computed.
        let slots_needed = (prompt.len() + params.max_tokens).min(max_len) - 1;
        let blocks_needed = slots_needed.div_ceil(self.config.block_size);
        if blocks_needed > self.config.num_blocks {
            return Err(CoreError::RequestTooLarge(format!(
                "the request needs up to {blocks_needed} KV blocks ({slots_needed} tokens of \
                 {} per block) but the pool has only {}",
                self.config.block_size, self.config.num_blocks
            )));
        }
        let text = match &self.tokenizer {
            Some(_) => Some(Box::new(TextState::new(&params)?)),
            None if !params.stop.is_empty() => {
                return Err(CoreError::InvalidArgument(
                    "stop strings need a core with a tokenizer".into(),
                ))
            }
            None => None,
        };
        let slot = self.free_slots.pop().unwrap_or_else(|| {
            self.requests.push(None);
            (self.requests.len() - 1) as u32
        });
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        self.waiting.insert((params.priority, arrival, slot));
        let id: Arc<str> = Arc::from(id);
        let client = self.fair.join(params.client.as_deref());
        let mut request = Request::new(Arc::clone(&id), arrival, prompt, params, max_len, text);
        request.client = client;
        if let Some(grammar) = grammar {
            request.grammar = Some(grammar.matcher(request.stop_ids().to_vec()).shared());
            self.num_grammars += 1;
        }
        self.requests[slot as usize] = Some(request);
        self.slot_of.insert(Arc::clone(&id), slot);
        self.slot_ids.set(slot, id);
        Ok(slot)
    }

    /// Ends a request now and frees its blocks. A token sampled for it in the
    /// step in flight is dropped.
    pub fn abort(&mut self, id: &str) -> Result<FinishedRequest> {
        let slot = *self
            .slot_of
            .get(id)
            .ok_or_else(|| CoreError::UnknownRequest(id.to_string()))?;
        let r = self.req(slot);
        match r.status {
            Status::Waiting => {
                self.waiting.remove(&(r.params.priority, r.arrival, slot));
            }
            Status::Running => self.running.retain(|&s| s != slot),
        }
        let finished = self.retire(slot, FinishReason::Abort, None);
        self.debug_check();
        Ok(finished)
    }

    fn retire(
        &mut self,
        slot: u32,
        reason: FinishReason,
        stop_reason: Option<StopReason>,
    ) -> FinishedRequest {
        let r = self.requests[slot as usize].take().expect("live slot");
        self.slot_of.remove(&*r.id);
        self.free_slots.push(slot);
        self.num_grammars -= usize::from(r.grammar.is_some());
        self.num_drafted -= usize::from(!r.draft.is_empty());
        self.fair.leave(r.client);
        let finished = FinishedRequest {
            num_output_tokens: r.num_output_tokens(),
            request_id: r.id.to_string(),
            slot,
            reason,
            stop_reason,
        };
        drop(r.table);
        finished
    }

    /// The KV blocks a live request holds now, in order; none while it waits.
    pub fn block_ids(&self, request_id: &str) -> Result<Vec<u32>> {
        let slot = *self
            .slot_of
            .get(request_id)
            .ok_or_else(|| CoreError::UnknownRequest(request_id.to_string()))?;
        let pool = self.pool.lock();
        Ok(self
            .req(slot)
            .table
            .as_ref()
            .map(|t| pool.table(t.id()).blocks.clone())
            .unwrap_or_default())
    }

    /// The id of the request in `slot`, if one lives there.
    pub fn request_id(&self, slot: u32) -> Option<&str> {
        self.requests
            .get(slot as usize)
            .and_then(|r| r.as_ref())
            .map(|r| &*r.id)
    }

    /// Number of prefix-cache hits of a request's first admission (None before it).
    pub fn num_cached_tokens(&self, id: &str) -> Option<usize> {
        self.slot_of
            .get(id)
            .and_then(|&s| self.req(s).num_cached_tokens)
    }

    pub fn schedule(&mut self) -> Result<StepPlan> {
        if self.in_flight.is_some() {
            return Err(CoreError::State(
                "schedule() was called again before update() applied the last step".into(),
            ));
        }
        let pool = self.pool.clone();
        let mut guard = pool.lock();
        let mut entries = std::mem::take(&mut self.spare_entries);
        let mut budget = self.config.max_num_batched_tokens;
        if self.shared.bounds(self.fair.num_clients() > 1) {
            budget = self.bounded_budget(&guard, budget);
        }
        self.step_budget = budget;
        self.begin_fair_step(budget);
        let preempted = self.schedule_running(&mut guard, &mut entries, &mut budget);
        if !preempted {
            self.schedule_waiting(&mut guard, &mut entries, &mut budget);
            self.top_up_prefills(&mut guard, &mut entries, &mut budget);
        }
        if self.shared.learning() {
            let mut work = StepWork::default();
            for e in &entries {
                work.add_row(e.start, e.num_new);
            }
            self.shared.start(work);
        }
        let mut plan = std::mem::take(&mut self.spare_plan);
        let num_tokens = self.step_budget - budget;
        debug_assert_eq!(num_tokens, entries.iter().map(|e| e.num_new).sum::<usize>());
        self.in_flight_sampling_rows = self.build_plan(&guard, &entries, num_tokens, &mut plan);
        drop(guard);
        plan.request_ids = self.slot_ids.clone();
        if self.num_grammars > 0 {
            plan.grammar_masks = self.start_masks(&entries);
            self.in_flight_masks = plan.grammar_masks.clone();
        }
        self.in_flight = Some(entries);
        self.debug_check();
        Ok(plan)
    }

    /// Whether the next schedule() may take long: it admits a request (hashing its prompt
    /// for the prefix cache) or starts grammar masks. A step of running requests alone is a
    /// few microseconds, too short to hand the GIL away and take it back.
    pub fn schedule_may_be_long(&self) -> bool {
        !self.waiting.is_empty() || self.num_grammars > 0
    }

    /// Whether the next update() may take long: it detokenizes, or waits for masks and
    /// advances grammars (masks in flight included: their request may have been aborted since).
    pub fn update_may_be_long(&self) -> bool {
        self.tokenizer.is_some() || self.num_grammars > 0 || self.in_flight_masks.is_some()
    }

    /// Takes back a plan its caller is done with: the next schedule() refills its
    /// buffers instead of allocating new ones (build_plan sizes and writes over each one).
    pub fn recycle(&mut self, mut plan: StepPlan) {
        plan.clear_for_reuse();
        self.spare_plan = plan;
    }

    /// Starts the masks of the sampling rows whose requests have a grammar.
    fn start_masks(&self, entries: &[Scheduled]) -> Option<PendingMasks> {
        let mut logits_row = 0;
        let rows: Vec<_> = entries
            .iter()
            .filter(|e| e.samples)
            .filter_map(|e| {
                let row = logits_row;
                logits_row += 1 + e.num_draft;
                let r = self.req(e.slot);
                let grammar = r.grammar.as_ref()?;
                let draft = r.draft[..e.num_draft].to_vec();
                Some((row as i32, Arc::clone(grammar), draft))
            })
            .collect();
        (!rows.is_empty()).then(|| PendingMasks::start(rows))
    }

    fn remaining(&self, slot: u32) -> usize {
        let r = self.req(slot);
        r.tokens.len() - r.num_computed
    }

    fn chunk_cap(&self) -> usize {
        match self.config.long_prefill_token_threshold {
            0 => usize::MAX,
            cap => cap,
        }
    }

    /// Returns whether anything was preempted.
    fn schedule_running(
        &mut self,
        pool: &mut PoolInner,
        entries: &mut Vec<Scheduled>,
        budget: &mut usize,
    ) -> bool {
        let preemptions = self.num_preemptions;
        let drafted = self.num_drafted > 0;
        self.step_plain_rows = 0;
        // Decoding requests behind the current one, counted the first time a row reads it
        // (a chunk or a draft reserves their budget; a step of plain decodes never does).
        let mut behind: Option<usize> = None;
        let mut i = 0;
        'requests: while i < self.running.len() {
            if !drafted {
                let taken = self.schedule_plain_decodes(pool, i, entries, budget);
                self.step_plain_rows += taken;
                if taken > 0 {
                    behind = behind.map(|d| d - taken);
                    i += taken;
                    continue;
                }
            }
            let slot = self.running[i];
            let r = self.req(slot);
            let remaining = r.tokens.len() - r.num_computed;
            let decoding = remaining == 1;
            if decoding {
                behind = behind.map(|d| d - 1);
            }
            if decoding && !drafted {
                // The common row, one decode token: the request is read once.
                if *budget == 0 {
                    i += 1;
                    continue;
                }
                // Not a plain decode in its reported tail block (schedule_plain_decodes took
                // those): its block may need reserving, or min_tokens are not out.
                let (start, arrival) = (r.num_computed, r.arrival);
                let Some(plain) = self.plain_or_reserve(pool, slot, start, &mut behind) else {
                    break 'requests;
                };
                self.step_plain_rows += usize::from(plain.is_some());
                entries.push(Scheduled {
                    slot,
                    arrival,
                    start,
                    num_new: 1,
                    num_draft: 0,
                    samples: true,
                    plain,
                });
                *budget -= 1;
                i += 1;
                continue;
            }
            // A chunk, or a decode with drafts possible.
            let decodes_left = *behind.get_or_insert_with(|| self.decodes_after(i));
            let n = if decoding {
                let drafts = self
                    .num_drafts(slot)
                    .min(budget.saturating_sub(1 + decodes_left));
                (1 + drafts).min(*budget)
            } else {
                remaining
                    .min(budget.saturating_sub(decodes_left))
                    .min(self.chunk_cap())
                    .min(self.fair.allowance(self.req(slot).client))
            };
            if n == 0 {
                i += 1;
                continue;
            }
            let (table_id, start, reported) = {
                let r = self.req(slot);
                (
                    r.table.as_ref().expect("running request has blocks").id(),
                    r.num_computed,
                    r.reported_blocks,
                )
            };
            // Blocks already reported are held: when they suffice the pool is not asked.
            let held = reported * self.config.block_size;
            if start + n > held
                && !self.reserve_preempting(pool, slot, table_id, start + n, &mut behind)
            {
                break 'requests;
            }
            let num_draft = if decoding { n - 1 } else { 0 };
            if !decoding {
                self.fair.spend(self.req(slot).client, n);
            }
            entries.push(self.scheduled(slot, n, num_draft));
            *budget -= n;
            i += 1;
        }
        self.num_preemptions != preemptions
    }

    /// Schedules the plain decode rows from the `i`-th running request on, up to the first row
    /// that is not one (a chunk, a ban, no budget left, a block the pool cannot give without
    /// preempting); returns how many. Each request is read once: the common step's rows all
    /// pass here, a row that starts a new block taking it from the pool. Not inlined: on its
    /// own the loop keeps its state in registers.
    #[inline(never)]
    fn schedule_plain_decodes(
        &mut self,
        pool: &mut PoolInner,
        i: usize,
        entries: &mut Vec<Scheduled>,
        budget: &mut usize,
    ) -> usize {
        let EngineCore {
            requests,
            running,
            block_size: bs,
            ..
        } = self;
        let block_size = bs.get();
        let mut left = *budget;
        for &slot in &running[i..] {
            let r = requests[slot as usize].as_mut().expect("live slot");
            let start = r.num_computed;
            if left == 0 || r.tokens.len() - start != 1 || !r.may_stop() {
                break;
            }
            let (cache_slot, reports) = match r.tail_slot(start, block_size) {
                Some(cache_slot) => (cache_slot, false),
                None => {
                    // Its position starts the block after its tail: the block is reserved and
                    // reported with the row (every block before it was).
                    match r.tail {
                        Some(tail) if start == tail.base + block_size => {}
                        _ => break,
                    }
                    let table_id = r.table.as_ref().expect("running request has blocks").id();
                    if pool.reserve(table_id, start + 1).is_err() {
                        break; // the general path preempts for it
                    }
                    let blocks = &pool.table(table_id).blocks;
                    r.reported_blocks = blocks.len();
                    r.tail = tail_of(blocks, *bs);
                    let cache_slot = r.tail_slot(start, block_size);
                    (cache_slot.expect("its position starts the new tail"), true)
                }
            };
            entries.push(Scheduled {
                slot,
                arrival: r.arrival,
                start,
                num_new: 1,
                num_draft: 0,
                samples: true,
                plain: Some(PlainRow {
                    token: r.tokens[start],
                    cache_slot: cache_slot as i32,
                    reports,
                }),
            });
            left -= 1;
        }
        let taken = *budget - left;
        *budget = left;
        taken
    }

    /// A decode row of running request `slot` at position `start` that is not a plain decode in
    /// its reported tail block: reserves its block if it is not held (None when `slot` itself
    /// was preempted for it), then the plain row when min_tokens are out and every block but
    /// the one holding its position is reported (that one is reported with the row).
    fn plain_or_reserve(
        &mut self,
        pool: &mut PoolInner,
        slot: u32,
        start: usize,
        behind: &mut Option<usize>,
    ) -> Option<Option<PlainRow>> {
        let bs = self.block_size;
        let r = self.req(slot);
        let table_id = r.table.as_ref().expect("running request has blocks").id();
        if start >= r.reported_blocks * bs.get()
            && !self.reserve_preempting(pool, slot, table_id, start + 1, behind)
        {
            return None;
        }
        let r = self.requests[slot as usize].as_mut().expect("live slot");
        let blocks = &pool.table(table_id).blocks;
        let (block, offset) = bs.split(start);
        let reports = match blocks.len() - r.reported_blocks {
            0 => false,
            1 if block + 1 == blocks.len() => true,
            _ => return Some(None),
        };
        if !r.may_stop() {
            return Some(None);
        }
        r.reported_blocks = blocks.len();
        r.tail = tail_of(blocks, bs);
        Some(Some(PlainRow {
            token: r.tokens[start],
            cache_slot: (blocks[block] as usize * bs.get() + offset) as i32,
            reports,
        }))
    }

    /// Reserves blocks for the first `len` tokens of running request `slot`, preempting
    /// from the back of `running` until they fit; false when `slot` itself was preempted.
    /// `behind` (decoding requests after `slot`, when counted) loses each one preempted.
    fn reserve_preempting(
        &mut self,
        pool: &mut PoolInner,
        slot: u32,
        table_id: u32,
        len: usize,
        behind: &mut Option<usize>,
    ) -> bool {
        while pool.reserve(table_id, len).is_err() {
            let victim = *self.running.last().expect("running is not empty");
            if self.remaining(victim) == 1 && victim != slot {
                *behind = behind.map(|d| d - 1);
            }
            self.preempt(pool, victim);
            if victim == slot {
                return false;
            }
        }
        true
    }

    /// Decoding requests after the `i`-th running one.
    fn decodes_after(&self, i: usize) -> usize {
        self.running[i + 1..]
            .iter()
            .filter(|&&s| self.remaining(s) == 1)
            .count()
    }

    fn scheduled(&self, slot: u32, num_new: usize, num_draft: usize) -> Scheduled {
        let r = self.req(slot);
        Scheduled {
            slot,
            arrival: r.arrival,
            start: r.num_computed,
            num_new,
            num_draft,
            samples: r.num_computed + num_new - num_draft == r.tokens.len(),
            plain: None,
        }
    }

    /// The draft tokens a decoding request may verify now: its drafts, no more than would
    /// take it past its length limit (max_tokens, max_model_len).
    fn num_drafts(&self, slot: u32) -> usize {
        let r = self.req(slot);
        r.draft
            .len()
            .min(r.stops.max_len.saturating_sub(r.tokens.len() + 1))
    }

    /// Sets the draft tokens that follow request `id`'s tokens now, replacing any it had;
    /// the next step that decodes it verifies them. A request with a grammar takes the
    /// draft's prefix its grammar allows (the step's masks follow the draft, row by row).
    pub fn set_draft(&mut self, id: &str, draft: &[u32]) -> Result<()> {
        let slot = *self
            .slot_of
            .get(id)
            .ok_or_else(|| CoreError::UnknownRequest(id.to_string()))?;
        if self.in_flight.is_some() {
            return Err(CoreError::State(
                "set_draft() was called while a step is in flight".into(),
            ));
        }
        let r = self.req_mut(slot);
        let had = !r.draft.is_empty();
        r.draft.clear();
        let valid = match &r.grammar {
            Some(grammar) => grammar.lock().valid_prefix(draft),
            None => draft.len(),
        };
        r.draft.extend_from_slice(&draft[..valid]);
        let has = !r.draft.is_empty();
        self.num_drafted = self.num_drafted + usize::from(has) - usize::from(had);
        Ok(())
    }

    fn schedule_waiting(
        &mut self,
        pool: &mut PoolInner,
        entries: &mut Vec<Scheduled>,
        budget: &mut usize,
    ) {
        while *budget > 0 {
            let Some(((priority, arrival, slot), allowance)) = self.next_waiting() else {
                break;
            };
            if self.running.len() >= self.config.max_num_seqs
                && !self.preempt_lower_priority(pool, entries, budget, priority)
            {
                break;
            }
            self.open_table(pool, slot);
            let n = self
                .remaining(slot)
                .min(*budget)
                .min(self.chunk_cap())
                .min(allowance);
            let (table_id, start) = {
                let r = self.req(slot);
                (r.table.as_ref().expect("opened").id(), r.num_computed)
            };
            let mut admitted = pool.reserve(table_id, start + n).is_ok();
            while !admitted && self.preempt_lower_priority(pool, entries, budget, priority) {
                admitted = pool.reserve(table_id, start + n).is_ok();
            }
            if !admitted {
                let r = self.req_mut(slot);
                r.table.take().expect("opened").release_in(pool);
                r.num_computed = 0;
                break;
            }
            // The budget may have grown by unscheduling a victim, never shrunk.
            let n = n.min(*budget);
            self.waiting.remove(&(priority, arrival, slot));
            self.req_mut(slot).status = Status::Running;
            let key = self.req(slot).order_key();
            let at = self
                .running
                .partition_point(|&s| self.req(s).order_key() < key);
            self.running.insert(at, slot);
            self.fair.spend(self.req(slot).client, n);
            entries.push(self.scheduled(slot, n, 0));
            *budget -= n;
        }
    }

    /// The budget of a step bounded in time (see `shared_step`): every decode, and the prefill
    /// tokens the cost model fits under the target, at least the floor; at most `full`. With
    /// clients starting that can start, at most their waiting tokens, given to them alone.
    fn bounded_budget(&mut self, pool: &PoolInner, full: usize) -> usize {
        let chunk_cap = self.chunk_cap();
        let (mut decodes, mut prefill) = (StepWork::default(), StepWork::default());
        let requests = &self.requests;
        let live = self.running.iter().chain(self.waiting.iter().map(|k| &k.2));
        let live = live.map(|&slot| requests[slot as usize].as_ref().expect("live slot"));
        // Each live request's pending tokens, None for a decode (one token of a running one).
        let pending = |r: &Request| {
            let tokens = r.tokens.len() - r.num_computed;
            (r.status != Status::Running || tokens != 1).then_some(tokens.min(chunk_cap))
        };
        for r in live.clone() {
            match pending(r) {
                None => decodes.add_row(r.num_computed, 1 + r.draft.len()),
                Some(tokens) => prefill.add_row(r.num_computed, tokens),
            }
        }
        if prefill.tokens == 0 {
            return full;
        }
        let context = prefill.key_reads as f64 / prefill.tokens as f64;
        let Some(tokens) = self.shared.prefill_tokens(decodes, context) else {
            return full;
        };
        let prefills = live
            .clone()
            .filter_map(|r| pending(r).map(|tokens| (r.client, tokens)));
        let whole_smallest = self.fair.whole_smallest_demand(prefills);
        let mut tokens = tokens.max(MIN_PREFILL).max(whole_smallest);
        let work = live.map(|r| {
            let running = r.status == Status::Running;
            (
                r.client,
                r.params.priority,
                pending(r).unwrap_or(0),
                running,
            )
        });
        let (starting, requests) = self.fair.find_starting(work);
        if starting > 0 && self.room_to_start(pool, starting, requests) {
            // A client's new request goes first, in a step no longer than it needs.
            self.fair.start_first();
            tokens = tokens.min(starting);
        }
        decodes.tokens.saturating_add(tokens).min(full)
    }

    /// Whether `requests` waiting requests of `tokens` prefill tokens in all can all start
    /// in the next step: free slots, and free blocks for them (no prefix cache hit counted).
    /// Else the clients starting do not go first: the others' prefill never waits for
    /// requests that cannot start (embeddings mid-prefill hold the blocks they need).
    fn room_to_start(&self, pool: &PoolInner, tokens: usize, requests: usize) -> bool {
        let block_size = self.config.block_size;
        let blocks = tokens.div_ceil(block_size) + requests;
        self.running.len() + requests <= self.config.max_num_seqs
            && pool.stats().num_free_blocks >= blocks
    }

    /// With several clients live, splits the step's prefill budget between them (see
    /// `fair_share`); with one, nothing is read.
    fn begin_fair_step(&mut self, budget: usize) {
        let requests = &self.requests;
        let work = self.running.iter().chain(self.waiting.iter().map(|k| &k.2));
        let work = work.map(|&slot| {
            let r = requests[slot as usize].as_ref().expect("live slot");
            let tokens = r.tokens.len() - r.num_computed;
            let decodes = r.status == Status::Running && tokens == 1;
            (r.client, r.params.priority, tokens, decodes)
        });
        self.fair.begin_step(budget, self.chunk_cap(), work);
    }

    /// Hands what the clients' shares left unspent (a waiting client that got no free slot,
    /// a prompt found in the prefix cache) to the prefill chunks the shares capped, in plan
    /// order, so a split step wastes no budget.
    fn top_up_prefills(
        &mut self,
        pool: &mut PoolInner,
        entries: &mut [Scheduled],
        budget: &mut usize,
    ) {
        if !self.fair.splitting() {
            return;
        }
        for e in entries.iter_mut().filter(|e| e.num_draft == 0) {
            let wanted = self.remaining(e.slot).min(self.chunk_cap());
            let more = wanted.saturating_sub(e.num_new).min(*budget);
            let table_id = self.req(e.slot).table.as_ref().expect("scheduled").id();
            if more > 0 && pool.reserve(table_id, e.start + e.num_new + more).is_ok() {
                *e = self.scheduled(e.slot, e.num_new + more, 0);
                *budget -= more;
            }
        }
    }

    /// The next waiting request to admit and the most tokens it may take: the first in
    /// (priority, arrival) order, or, while the step splits its budget, the fair pick
    /// within the best priority class waiting.
    fn next_waiting(&self) -> Option<((i32, u64, u32), usize)> {
        let first = *self.waiting.first()?;
        let requests = &self.requests;
        let class = self.waiting.iter().take_while(|k| k.0 == first.0);
        let fair = self.fair.pick(class.map(|&k| {
            let r = requests[k.2 as usize].as_ref().expect("live slot");
            (k, r.client)
        }));
        Some(fair.unwrap_or((first, usize::MAX)))
    }

    fn open_table(&mut self, pool: &mut PoolInner, slot: u32) {
        let table = {
            let r = self.req(slot);
            let id = pool.open_table(&r.tokens, r.stops.max_len, !r.params.skip_prefix_cache);
            self.pool.wrap(id)
        };
        let cached = pool.table(table.id()).num_cached_tokens;
        let r = self.req_mut(slot);
        r.num_computed = cached;
        r.num_cached_tokens.get_or_insert(cached);
        r.table = Some(table);
        r.reported_blocks = 0;
        r.tail = None;
    }

    /// Preempts the lowest-priority running request if it ranks strictly below
    /// `priority`, taking back its tokens scheduled in this step.
    fn preempt_lower_priority(
        &mut self,
        pool: &mut PoolInner,
        entries: &mut Vec<Scheduled>,
        budget: &mut usize,
        priority: i32,
    ) -> bool {
        let Some(&victim) = self.running.last() else {
            return false;
        };
        if self.req(victim).params.priority <= priority {
            return false;
        }
        if let Some(at) = entries.iter().position(|e| e.slot == victim) {
            let taken_back = entries.remove(at);
            *budget += taken_back.num_new;
            self.step_plain_rows -= usize::from(taken_back.plain.is_some());
        }
        self.preempt(pool, victim);
        true
    }

    fn preempt(&mut self, pool: &mut PoolInner, slot: u32) {
        self.running.retain(|&s| s != slot);
        self.num_preemptions += 1;
        let r = self.req_mut(slot);
        r.table
            .take()
            .expect("running request has blocks")
            .release_in(pool);
        r.num_computed = 0;
        r.tail = None;
        r.num_preemptions += 1;
        r.status = Status::Waiting;
        let key = (r.params.priority, r.arrival, slot);
        self.waiting.insert(key);
    }

    /// Fills `plan` (cleared, or readied by `clear_for_reuse`) with the step of `entries`
    /// (`num_tokens` tokens); marks every block of theirs as reported. The columns are sized
    /// once (written over whole, every entry); a run of plain decode rows
    /// (one token and one sample each, read whole when scheduled) is written column by column,
    /// any other row on its own. Returns the step's sampling rows.
    fn build_plan(
        &mut self,
        pool: &PoolInner,
        entries: &[Scheduled],
        num_tokens: usize,
        plan: &mut StepPlan,
    ) -> usize {
        let bs = self.block_size;
        let rows = entries.len();
        let StepPlan {
            input_ids,
            positions,
            slot_mapping,
            query_start_loc,
            num_computed_tokens,
            seq_lens,
            logits_indices,
            sample_request_rows,
            slots,
            new_block_slots,
            new_block_indices,
            new_block_ids,
            banned_rows,
            banned_ids,
            ..
        } = plan;
        slots.resize(rows, 0);
        num_computed_tokens.resize(rows, 0);
        seq_lens.resize(rows, 0);
        query_start_loc.resize(rows + 1, 0);
        query_start_loc[0] = 0;
        input_ids.resize(num_tokens, 0);
        positions.resize(num_tokens, 0);
        slot_mapping.resize(num_tokens, 0);
        // A step samples at most each of its tokens: cut to the samples at the end.
        logits_indices.resize(num_tokens, 0);
        sample_request_rows.resize(num_tokens, 0);
        let (slots, computed, lens, qsl) = (
            &mut slots[..],
            &mut num_computed_tokens[..],
            &mut seq_lens[..],
            &mut query_start_loc[1..],
        );
        let (ids, pos, mapping) = (
            &mut input_ids[..],
            &mut positions[..],
            &mut slot_mapping[..],
        );
        let (logits, sample_rows) = (&mut logits_indices[..], &mut sample_request_rows[..]);
        let slot_of = |blocks: &[u32], pos: usize| {
            let (block, offset) = bs.split(pos);
            (blocks[block] as usize * bs.get() + offset) as i32
        };
        let (mut first, mut sample, mut row, mut sampling_rows) = (0, 0, 0, 0);
        debug_assert_eq!(
            self.step_plain_rows,
            entries.iter().filter(|e| e.plain.is_some()).count()
        );
        // Every row plain (the common step): one run, not looked for.
        let all_plain = self.step_plain_rows == rows;
        while row < rows {
            let run = if all_plain {
                rows
            } else {
                entries[row..]
                    .iter()
                    .take_while(|e| e.plain.is_some())
                    .count()
            };
            if run > 0 {
                let plain = &entries[row..row + run];
                let (rows_out, tokens_out, samples_out) =
                    (row..row + run, first..first + run, sample..sample + run);
                for (out, e) in slots[rows_out.clone()].iter_mut().zip(plain) {
                    *out = e.slot as i32;
                }
                for (out, e) in computed[rows_out.clone()].iter_mut().zip(plain) {
                    *out = e.start as i32;
                }
                // One token a row: its position is its computed count, its length one more.
                let starts = &computed[rows_out.clone()];
                pos[tokens_out.clone()].copy_from_slice(starts);
                for (out, &start) in lens[rows_out.clone()].iter_mut().zip(starts) {
                    *out = start + 1;
                }
                for (out, end) in qsl[rows_out.clone()].iter_mut().zip(first + 1..) {
                    *out = end as i32;
                }
                let token_columns = ids[tokens_out.clone()]
                    .iter_mut()
                    .zip(&mut mapping[tokens_out.clone()]);
                for ((id, cache_slot), e) in token_columns.zip(plain) {
                    let Some(p) = e.plain else { continue };
                    (*id, *cache_slot) = (p.token as i32, p.cache_slot);
                    if p.reports {
                        new_block_slots.push(e.slot as i32);
                        new_block_indices.push(bs.split(e.start).0 as i32);
                        new_block_ids.push(bs.split(p.cache_slot as usize).0 as i32);
                    }
                }
                for (out, token) in logits[samples_out.clone()].iter_mut().zip(tokens_out) {
                    *out = token as i32;
                }
                for (out, plan_row) in sample_rows[samples_out].iter_mut().zip(rows_out) {
                    *out = plan_row as i32;
                }
                (row, first, sample) = (row + run, first + run, sample + run);
                sampling_rows += run;
                continue;
            }
            let e = &entries[row];
            slots[row] = e.slot as i32;
            computed[row] = e.start as i32;
            lens[row] = (e.start + e.num_new) as i32;
            qsl[row] = (first + e.num_new) as i32;
            let r = self.requests[e.slot as usize].as_mut().expect("live slot");
            let blocks = &pool.table(r.table.as_ref().expect("scheduled").id()).blocks;
            let (start, end) = (e.start, e.start + e.num_new);
            if e.num_new == 1 && e.num_draft == 0 {
                ids[first] = r.tokens[start] as i32;
                pos[first] = start as i32;
                mapping[first] = slot_of(blocks, start);
            } else {
                let own_end = end - e.num_draft;
                let tokens = r.tokens[start..own_end]
                    .iter()
                    .chain(&r.draft[..e.num_draft]);
                for (out, &t) in ids[first..first + e.num_new].iter_mut().zip(tokens) {
                    *out = t as i32;
                }
                for (out, p) in pos[first..first + e.num_new].iter_mut().zip(start..end) {
                    *out = p as i32;
                }
                let (mut p, mut at) = (start, first);
                while p < end {
                    let base = slot_of(blocks, p);
                    let run = (bs.get() - bs.offset(p)).min(end - p);
                    for (out, k) in mapping[at..at + run].iter_mut().zip(0..) {
                        *out = base + k;
                    }
                    p += run;
                    at += run;
                }
            }
            first += e.num_new;
            if e.samples {
                sampling_rows += 1;
                // Position j (0: the row's own next token, then one per draft) samples the
                // output token that follows j more; it may not end the request while
                // min_tokens are not out.
                let last = first - e.num_draft - 1;
                if e.num_draft == 0 && r.may_stop() {
                    // The common row: one sample, nothing banned.
                    logits[sample] = last as i32;
                    sample_rows[sample] = row as i32;
                    sample += 1;
                } else {
                    for j in 0..=e.num_draft {
                        if r.tokens.len() + j < r.stops.min_len {
                            for &id in r.stop_ids() {
                                banned_rows.push(sample as i32);
                                banned_ids.push(id as i32);
                            }
                        }
                        logits[sample] = (last + j) as i32;
                        sample_rows[sample] = row as i32;
                        sample += 1;
                    }
                }
            }
            if r.reported_blocks < blocks.len() {
                for (index, &block) in blocks.iter().enumerate().skip(r.reported_blocks) {
                    new_block_slots.push(e.slot as i32);
                    new_block_indices.push(index as i32);
                    new_block_ids.push(block as i32);
                }
                r.reported_blocks = blocks.len();
            }
            r.tail = tail_of(blocks, bs);
            row += 1;
        }
        logits_indices.truncate(sample);
        sample_request_rows.truncate(sample);
        sampling_rows
    }

    /// Applies the step in flight: `sampled[i]` is the token of the i-th sampling
    /// row of the last plan. Appends tokens, checks stops, frees finished requests.
    pub fn update(&mut self, sampled: &[i64]) -> Result<StepUpdate> {
        self.apply(sampled, None)
    }

    /// Applies the step in flight when a sampling row may take several tokens:
    /// the i-th sampling row takes the next `num_sampled[i]` (at least 1) of
    /// `sampled`. Each token goes through every stop check in turn; once a
    /// request stops, the rest of its tokens are dropped. Tokens past the first
    /// are not in the cache yet: the next step schedules them.
    pub fn update_with_counts(
        &mut self,
        sampled: &[i64],
        num_sampled: &[i64],
    ) -> Result<StepUpdate> {
        self.apply(sampled, Some(num_sampled))
    }

    fn apply(&mut self, sampled: &[i64], num_sampled: Option<&[i64]>) -> Result<StepUpdate> {
        let Some(entries) = self.in_flight.take() else {
            return Err(CoreError::State(
                "update() was called without a scheduled step".into(),
            ));
        };
        let sampling_rows = self.in_flight_sampling_rows;
        debug_assert_eq!(sampling_rows, entries.iter().filter(|e| e.samples).count());
        if let Some(message) = check_sampled(sampled, num_sampled, sampling_rows) {
            self.in_flight = Some(entries);
            return Err(CoreError::InvalidArgument(message));
        }
        if self.shared.learning() {
            self.shared.finish();
        }
        // At most every sampled token is appended: the columns are allocated once, filled
        // (the common step: a token per sampling row, every one written, nothing cleared
        // first) or sized and written in place, and cut to the tokens appended.
        let column = || Vec::with_capacity(sampled.len());
        let mut out = StepUpdate {
            rows: column(),
            slots: column(),
            token_ids: column(),
            texts: Vec::new(),
            finished: Vec::new(),
        };
        let mut appended = 0;
        if let Some(masks) = self.in_flight_masks.take() {
            masks.wait(); // its worker must not read a matcher this update advances
        }
        let mut finished_slots = Vec::new();
        let tokenizer = self.tokenizer.clone();
        let (drafted, grammars) = (self.num_drafted > 0, self.num_grammars > 0);
        let plain = tokenizer.is_none() && !grammars;
        let mut undrafted = 0;
        let bs = self.block_size;
        let pool = self.pool.clone();
        let mut guard = pool.lock();
        if plain && num_sampled.is_none() && !drafted {
            // The common step: each sampling row takes one token; no text, no grammar, no draft.
            // The columns name every sampling row, written column by column; a row whose
            // request was aborted in flight is cut from them after.
            if sampled.len() == entries.len() {
                // Every row samples (a step of decodes): the rows are 0, 1, 2...
                out.rows.extend(0..sampled.len() as u32);
                out.slots.extend(entries.iter().map(|e| e.slot));
            } else {
                for (row, e) in entries.iter().enumerate().filter(|(_, e)| e.samples) {
                    out.rows.push(row as u32);
                    out.slots.push(e.slot);
                }
            }
            out.token_ids.extend(sampled.iter().map(|&t| t as u32));
            appended = sampled.len();
            let aborted = Self::append_common(
                &mut self.requests,
                &entries,
                sampled,
                &mut guard,
                bs,
                &mut finished_slots,
            );
            if aborted {
                appended = Self::cut_aborted(&self.requests, &entries, &mut out);
            }
        } else {
            // Resized, not `vec![0; n]`: calloc clears memory it allocates more slowly than a
            // memset (measured).
            for column in [&mut out.rows, &mut out.slots, &mut out.token_ids] {
                column.resize(sampled.len(), 0);
            }
            let mut counts = num_sampled.map(|c| c.iter());
            let mut rest = sampled;
            for (row, e) in entries.iter().enumerate() {
                let mut tokens: &[i64] = &[];
                if e.samples {
                    let k = counts
                        .as_mut()
                        .map_or(1, |c| *c.next().expect("counted") as usize);
                    (tokens, rest) = rest.split_at(k);
                }
                let Some(r) = Self::live_entry(&mut self.requests, e) else {
                    continue; // aborted while in flight
                };
                // Drafts count as computed as far as the tokens taken confirm them.
                let confirmed = match e.num_draft {
                    0 => 0,
                    n => tokens
                        .iter()
                        .zip(&r.draft[..n])
                        .take_while(|(&t, &d)| t == d as i64)
                        .count()
                        .min(tokens.len().saturating_sub(1)),
                };
                r.num_computed += e.num_new - e.num_draft + confirmed;
                if drafted && !r.draft.is_empty() {
                    r.draft.clear();
                    undrafted += 1;
                }
                if let (true, &[token]) = (plain, tokens) {
                    // The common row: one token, no text to detokenize, no grammar.
                    let token = token as u32;
                    let stop = Self::append_plain(r, &mut out, &mut appended, row, e.slot, token);
                    if let Some(stop) = stop {
                        finished_slots.push((e.slot, stop));
                    }
                    tokens = &[];
                }
                for &token in tokens {
                    let token = token as u32;
                    r.tokens.push(token);
                    out.put(&mut appended, row, e.slot, token);
                    let mut stop = match tokenizer.as_deref() {
                        Some(tok) => {
                            let (text, stop) = Self::append_text(r, tok, token);
                            out.texts.push(text);
                            stop
                        }
                        None => r.check_stop(),
                    };
                    if stop.is_none() && grammars {
                        stop =
                            Self::advance_grammar(r, tokenizer.as_deref(), token, &mut out.texts);
                    }
                    if let Some(stop) = stop {
                        finished_slots.push((e.slot, stop));
                        break;
                    }
                }
                Self::commit_filled(&mut guard, r, e, bs);
                if confirmed < e.num_draft {
                    // Blocks that held only rejected positions go back to the pool.
                    let table_id = r.table.as_ref().expect("scheduled").id();
                    guard.release_tail(table_id, r.tokens.len());
                    let blocks = &guard.table(table_id).blocks;
                    r.reported_blocks = r.reported_blocks.min(blocks.len());
                    r.tail = (r.reported_blocks == blocks.len())
                        .then(|| tail_of(blocks, bs))
                        .flatten();
                }
            }
        }
        self.num_drafted -= undrafted;
        out.rows.truncate(appended);
        out.slots.truncate(appended);
        out.token_ids.truncate(appended);
        for (slot, (reason, stop_reason)) in finished_slots {
            self.running.retain(|&s| s != slot);
            let r = self.req_mut(slot);
            r.table
                .take()
                .expect("running request has blocks")
                .release_in(&mut guard);
            out.finished.push(self.retire(slot, reason, stop_reason));
        }
        drop(guard);
        self.spare_entries = entries;
        self.spare_entries.clear();
        self.num_steps += 1;
        self.debug_check();
        Ok(out)
    }

    /// The live request of an entry of the step in flight; None if it was aborted meanwhile
    /// (its slot empty, or taken by a later request).
    #[inline(always)]
    fn live_entry<'a>(
        requests: &'a mut [Option<Request>],
        e: &Scheduled,
    ) -> Option<&'a mut Request> {
        requests[e.slot as usize]
            .as_mut()
            .filter(|r| r.arrival == e.arrival)
    }

    /// Appends the common step's tokens to their requests (one per sampling row; no text, no
    /// grammar, no draft), noting those that stop in `finished`; returns whether a row's request
    /// was aborted in flight. Not inlined: on its own the loop keeps its state in registers.
    #[inline(never)]
    fn append_common(
        requests: &mut [Option<Request>],
        entries: &[Scheduled],
        sampled: &[i64],
        pool: &mut PoolInner,
        bs: BlockSize,
        finished: &mut Vec<(u32, (FinishReason, Option<StopReason>))>,
    ) -> bool {
        let mut live = true;
        if sampled.len() == entries.len() {
            // Every row samples (a step of decodes): row i takes token i.
            for (e, &token) in entries.iter().zip(sampled) {
                live &= Self::append_row(requests, e, Some(token as u32), pool, bs, finished);
            }
        } else {
            let mut tokens = sampled.iter();
            for e in entries {
                let token = e.samples.then(|| *tokens.next().expect("counted") as u32);
                live &= Self::append_row(requests, e, token, pool, bs, finished);
            }
        }
        !live
    }

    /// One row of the common step: its request takes its token, if it samples; false when
    /// the request was aborted in flight.
    #[inline(always)]
    fn append_row(
        requests: &mut [Option<Request>],
        e: &Scheduled,
        token: Option<u32>,
        pool: &mut PoolInner,
        bs: BlockSize,
        finished: &mut Vec<(u32, (FinishReason, Option<StopReason>))>,
    ) -> bool {
        let Some(r) = Self::live_entry(requests, e) else {
            return false;
        };
        r.num_computed += e.num_new;
        if let Some(token) = token {
            r.tokens.push(token);
            if let Some(stop) = r.check_stop() {
                finished.push((e.slot, stop));
            }
        }
        Self::commit_filled(pool, r, e, bs);
        true
    }

    /// Cuts from the common step's columns (one token per sampling row) the rows whose request
    /// was aborted while the step was in flight; returns how many tokens are left.
    fn cut_aborted(
        requests: &[Option<Request>],
        entries: &[Scheduled],
        out: &mut StepUpdate,
    ) -> usize {
        let mut kept = 0;
        for k in 0..out.rows.len() {
            let e = &entries[out.rows[k] as usize];
            let live = requests[e.slot as usize]
                .as_ref()
                .is_some_and(|r| r.arrival == e.arrival);
            if live {
                out.rows[kept] = out.rows[k];
                out.slots[kept] = out.slots[k];
                out.token_ids[kept] = out.token_ids[k];
                kept += 1;
            }
        }
        kept
    }

    /// Appends one token to a request without text or grammar; returns its stop, if it stops.
    #[inline(always)]
    fn append_plain(
        r: &mut Request,
        out: &mut StepUpdate,
        appended: &mut usize,
        row: usize,
        slot: u32,
        token: u32,
    ) -> Option<(FinishReason, Option<StopReason>)> {
        r.tokens.push(token);
        out.put(appended, row, slot, token);
        r.check_stop()
    }

    /// After a step that filled a block of the entry's request, the block becomes findable by
    /// later requests.
    #[inline(always)]
    fn commit_filled(pool: &mut PoolInner, r: &Request, e: &Scheduled, bs: BlockSize) {
        if bs.offset(e.start) + e.num_new >= bs.get() {
            let table_id = r.table.as_ref().expect("scheduled").id();
            pool.commit(table_id, &r.tokens, r.num_computed);
        }
    }

    /// Advances a request's grammar by a token that did not stop it: a complete grammar
    /// ends it (a stop, releasing its held-back text), a refused token is an error.
    fn advance_grammar(
        r: &mut Request,
        tokenizer: Option<&Tokenizer>,
        token: u32,
        texts: &mut [String],
    ) -> Option<(FinishReason, Option<StopReason>)> {
        let accepted = r.grammar.as_ref()?.lock().accept(token);
        let mut stop = match accepted {
            Ok(false) => return None,
            Ok(true) => (FinishReason::Stop, None),
            Err(why) => (FinishReason::Error, Some(StopReason::Text(why))),
        };
        if let (Some(tok), Some(text)) = (tokenizer, r.text.as_mut()) {
            let tail = text.finish(tok);
            if let Some(last) = texts.last_mut() {
                last.push_str(&tail.emit);
            }
            if let (FinishReason::Stop, Some(s)) = (stop.0, tail.stopped) {
                stop.1 = Some(StopReason::Text(s));
            }
        }
        Some(stop)
    }

    /// Detokenizes a new token and checks every stop condition: a stop string
    /// first, then EOS, stop ids and lengths. A finishing request's held-back
    /// text is released with its last token.
    fn append_text(
        r: &mut Request,
        tok: &Tokenizer,
        token: u32,
    ) -> (String, Option<(FinishReason, Option<StopReason>)>) {
        let may_stop = r.may_stop();
        let text = r
            .text
            .as_mut()
            .expect("a core with a tokenizer keeps text state");
        let step = text.push(tok, token, may_stop);
        if let Some(stop) = step.stopped {
            return (
                step.emit,
                Some((FinishReason::Stop, Some(StopReason::Text(stop)))),
            );
        }
        let mut emitted = step.emit;
        let Some(mut stop) = r.check_stop() else {
            return (emitted, None);
        };
        let tail = r.text.as_mut().expect("text state").finish(tok);
        emitted.push_str(&tail.emit);
        if let Some(s) = tail.stopped {
            stop = (FinishReason::Stop, Some(StopReason::Text(s)));
        }
        (emitted, Some(stop))
    }

    fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if let Err(e) = self.check_invariants() {
            panic!("scheduler invariant violated: {e}");
        }
    }

    /// The pool's invariants and the scheduler's own: waiting and running
    /// partition the live requests, running ones hold blocks, waiting ones none.
    pub fn check_invariants(&self) -> Result<()> {
        self.pool.check_invariants()?;
        let fail = |m: String| Err(CoreError::State(m));
        let live = self.requests.iter().flatten().count();
        if live != self.slot_of.len() || live != self.waiting.len() + self.running.len() {
            return fail(format!(
                "{live} live requests, {} ids, {} waiting + {} running",
                self.slot_of.len(),
                self.waiting.len(),
                self.running.len()
            ));
        }
        if self.running.len() > self.config.max_num_seqs {
            return fail("more running requests than max_num_seqs".into());
        }
        let live_requests = || self.requests.iter().flatten();
        let grammars = live_requests().filter(|r| r.grammar.is_some()).count();
        let drafted = live_requests().filter(|r| !r.draft.is_empty()).count();
        if (grammars, drafted) != (self.num_grammars, self.num_drafted) {
            return fail(format!(
                "{grammars} requests with a grammar and {drafted} with drafts, counted {} and {}",
                self.num_grammars, self.num_drafted
            ));
        }
        for r in live_requests() {
            if self.slot_ids.get(self.slot_of[&*r.id]) != Some(&*r.id) {
                return fail(format!("{:?} is not named in its slot", r.id));
            }
        }
        let pool = self.pool.lock();
        let mut last_key = None;
        for &slot in &self.running {
            let r = self.req(slot);
            if r.status != Status::Running || r.num_computed > r.tokens.len() {
                return fail(format!("running request {:?} is inconsistent", r.id));
            }
            let Some(table) = &r.table else {
                return fail(format!("{:?} holds no blocks", r.id));
            };
            if let Err(e) = pool.check_table(table.id(), &r.tokens) {
                return fail(format!("{:?}: {e}", r.id));
            }
            let blocks = &pool.table(table.id()).blocks;
            if r.reported_blocks > blocks.len() {
                return fail(format!("{:?}: more blocks reported than held", r.id));
            }
            if r.tail.is_some()
                && (r.reported_blocks != blocks.len() || r.tail != tail_of(blocks, self.block_size))
            {
                return fail(format!(
                    "{:?}: its tail block is not its last reported",
                    r.id
                ));
            }
            if last_key.is_some_and(|k| k > r.order_key()) {
                return fail("running requests are out of order".into());
            }
            last_key = Some(r.order_key());
        }
        for &(_, _, slot) in &self.waiting {
            let r = self.req(slot);
            if r.status != Status::Waiting || r.table.is_some() || r.num_computed != 0 {
                return fail(format!("waiting request {:?} is inconsistent", r.id));
            }
        }
        Ok(())
    }
}

/// The last block of a table whose blocks are all reported, and its first position.
fn tail_of(blocks: &[u32], bs: BlockSize) -> Option<TailBlock> {
    let (&block, before) = blocks.split_last()?;
    Some(TailBlock {
        base: before.len() * bs.get(),
        block,
    })
}

/// Why `sampled` (and `num_sampled`) cannot be the tokens of a step with
/// `sampling_rows` sampling rows, if they cannot.
fn check_sampled(
    sampled: &[i64],
    num_sampled: Option<&[i64]>,
    sampling_rows: usize,
) -> Option<String> {
    // One pass without a branch per token (it vectorizes): the bits above a u32's, ored.
    let high = sampled
        .iter()
        .fold(0u64, |bits, &t| bits | (t as u64 >> 32));
    if high != 0 {
        let t = sampled.iter().find(|&&t| u32::try_from(t).is_err())?;
        return Some(format!("sampled token id {t} is out of range"));
    }
    let Some(counts) = num_sampled else {
        return (sampled.len() != sampling_rows).then(|| {
            format!(
                "expected {sampling_rows} sampled tokens, got {}",
                sampled.len()
            )
        });
    };
    if counts.len() != sampling_rows {
        return Some(format!(
            "num_sampled has {} entries but the step has {sampling_rows} sampling rows",
            counts.len()
        ));
    }
    if let Some((i, n)) = counts.iter().enumerate().find(|(_, &n)| n < 1) {
        return Some(format!(
            "num_sampled[{i}] is {n}: every sampling row takes at least 1 token"
        ));
    }
    let total = counts.iter().map(|&n| n as i128).sum::<i128>();
    (total != sampled.len() as i128).then(|| {
        format!(
            "num_sampled adds up to {total} tokens but sampled has {}",
            sampled.len()
        )
    })
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "scheduler_spec_tests.rs"]
mod spec_tests;

#[cfg(test)]
#[path = "scheduler_fair_tests.rs"]
mod fair_tests;

#[cfg(test)]
#[path = "scheduler_shared_step_tests.rs"]
mod shared_step_tests;
