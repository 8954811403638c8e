//! A request as the scheduler sees it: its tokens, its limits, and why it ended.

use std::sync::Arc;

use crate::error::{CoreError, Result};
use crate::structured::SharedMatcher;
use crate::text::{IncrementalDetokenizer, StopStep, StopStrings, Tokenizer};

/// Per-request limits and stop conditions (text-level stops come with the tokenizer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestParams {
    pub max_tokens: usize,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub eos_token_ids: Vec<u32>,
    pub stop_token_ids: Vec<u32>,
    /// Lower values are served first; FCFS within a value.
    pub priority: i32,
    /// Stop strings, matched on the detokenized output (needs a tokenizer).
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Never read the prefix cache (the request computes every prompt token, e.g. to score
    /// them); its own blocks are still cached for others.
    pub skip_prefix_cache: bool,
    /// Who sent it, for fair shares of the prefill budget (None: the one anonymous client).
    pub client: Option<String>,
}

impl Default for RequestParams {
    fn default() -> Self {
        RequestParams {
            max_tokens: 16,
            min_tokens: 0,
            ignore_eos: false,
            eos_token_ids: Vec::new(),
            stop_token_ids: Vec::new(),
            priority: 0,
            stop: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            skip_prefix_cache: false,
            client: None,
        }
    }
}

impl RequestParams {
    pub fn validate(&self) -> Result<()> {
        if self.max_tokens < 1 {
            return Err(CoreError::InvalidArgument(format!(
                "max_tokens must be at least 1, got {}",
                self.max_tokens
            )));
        }
        if self.min_tokens > self.max_tokens {
            return Err(CoreError::InvalidArgument(format!(
                "min_tokens ({}) must not exceed max_tokens ({})",
                self.min_tokens, self.max_tokens
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// max_tokens or max_model_len reached.
    Length,
    /// Aborted by the caller.
    Abort,
    /// The request's grammar refused a token it had allowed (an internal failure).
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// What made a request stop, when it was a token or a string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopReason {
    Token(u32),
    Text(String),
}

/// A request's place in the scheduler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Waiting,
    Running,
}

/// The scheduler's record of a live request. `repr(C)` keeps the fields a step of decodes
/// reads together at the front (up to `stops`, 120 bytes): a plain decode touches the first
/// two cache lines of its request, in schedule() and update() alike.
#[repr(C)]
pub(crate) struct Request {
    /// Prefix-cache hits at the first admission. First because `Option<Request>`
    /// keeps its tag in this field's, so telling a live slot reads the front line.
    pub(crate) num_cached_tokens: Option<usize>,
    /// Prompt followed by the generated tokens.
    pub(crate) tokens: Vec<u32>,
    /// Tokens whose KV is in the cache.
    pub(crate) num_computed: usize,
    pub(crate) arrival: u64,
    /// The last block of `table` while every block of it is reported: a decode whose position
    /// lies in it needs neither the pool nor a report (see [`Request::tail_slot`]).
    pub(crate) tail: Option<TailBlock>,
    pub(crate) stops: Stops,
    pub(crate) table: Option<crate::block_pool::TableLease>,
    /// Leading blocks of `table` already handed to the runner in a plan.
    pub(crate) reported_blocks: usize,
    pub(crate) prompt_len: usize,
    /// Shared with the core's id index and its [`SlotIds`]: never copied per step.
    pub(crate) id: Arc<str>,
    pub(crate) params: RequestParams,
    pub(crate) num_preemptions: u32,
    pub(crate) status: Status,
    /// Streaming text state, when the core has a tokenizer.
    pub(crate) text: Option<Box<TextState>>,
    /// The matcher of its structured-output grammar, advanced with every token it takes
    /// (generated tokens are kept across preemption, so the matcher never rolls back).
    pub(crate) grammar: Option<SharedMatcher>,
    /// Speculative tokens proposed to follow `tokens`, verified by the next step that
    /// decodes it (then cleared); never set for a request with a grammar.
    pub(crate) draft: Vec<u32>,
    /// Its client's id in the core's `FairShare`.
    pub(crate) client: crate::fair_share::ClientId,
}

/// A request's last reported block, and the position its first token has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TailBlock {
    pub(crate) base: usize,
    pub(crate) block: u32,
}

/// The id of the request in each slot, as a plan names its rows' requests. A plan holds
/// the table as it was when planned: one reference per step, no copy per row. A slot's
/// entry changes only when a new request takes the slot (the table is copied then only
/// if a plan still holds it); a retired request's entry stays until then, read by no
/// later plan.
///
/// The empty table is None: a plan cleared for reuse allocates nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SlotIds(Option<Arc<Vec<Arc<str>>>>);

impl SlotIds {
    /// The id of the request in `slot` when the table was taken; None for a slot never used.
    pub fn get(&self, slot: u32) -> Option<&str> {
        self.0.as_ref()?.get(slot as usize).map(|id| &**id)
    }

    /// Names `slot`'s new request.
    pub(crate) fn set(&mut self, slot: u32, id: Arc<str>) {
        let ids = Arc::make_mut(self.0.get_or_insert_with(Default::default));
        let slot = slot as usize;
        if slot >= ids.len() {
            ids.resize(slot + 1, Arc::from(""));
        }
        ids[slot] = id;
    }
}

/// When a request ends, as lengths of its whole sequence, from its params.
pub(crate) struct Stops {
    /// From this length on (min_tokens out), a stop id ends it.
    pub(crate) min_len: usize,
    /// At this length it ends: max_tokens out, or max_model_len reached.
    pub(crate) max_len: usize,
    /// The EOS ids (unless ignore_eos), then the stop ids.
    pub(crate) ids: Vec<u32>,
}

impl Stops {
    fn new(params: &RequestParams, prompt_len: usize, max_model_len: usize) -> Self {
        let eos = (!params.ignore_eos).then_some(&params.eos_token_ids);
        Stops {
            min_len: prompt_len + params.min_tokens,
            max_len: (prompt_len + params.max_tokens).min(max_model_len),
            ids: eos
                .into_iter()
                .flatten()
                .chain(&params.stop_token_ids)
                .copied()
                .collect(),
        }
    }
}

/// A request's incremental detokenizer and stop-string matcher.
pub(crate) struct TextState {
    pub(crate) detokenizer: IncrementalDetokenizer,
    pub(crate) stops: StopStrings,
}

impl TextState {
    pub(crate) fn new(params: &RequestParams) -> Result<Self> {
        Ok(TextState {
            detokenizer: IncrementalDetokenizer::new(params.skip_special_tokens),
            stops: StopStrings::new(params.stop.clone(), params.include_stop_str_in_output)?,
        })
    }

    /// The text `token` adds, and the stop string it completed (only when `may_stop`:
    /// before `min_tokens` a stop string does not end the request).
    pub(crate) fn push(&mut self, tok: &Tokenizer, token: u32, may_stop: bool) -> StopStep {
        let delta = self.detokenizer.push(tok, token);
        if may_stop {
            self.stops.push(&delta)
        } else {
            StopStep {
                emit: self.stops.pass_through(&delta),
                stopped: None,
            }
        }
    }

    /// What is still held back when the request ends for a reason other than a stop string.
    pub(crate) fn finish(&mut self, tok: &Tokenizer) -> StopStep {
        let tail = self.detokenizer.flush(tok);
        let mut step = self.stops.push(&tail);
        if step.stopped.is_none() {
            step.emit.push_str(&self.stops.finish());
        }
        step
    }
}

impl Request {
    /// A waiting request; `text` when the core has a tokenizer.
    pub(crate) fn new(
        id: Arc<str>,
        arrival: u64,
        prompt: &[u32],
        params: RequestParams,
        max_model_len: usize,
        text: Option<Box<TextState>>,
    ) -> Self {
        let stops = Stops::new(&params, prompt.len(), max_model_len);
        // Room for every token it may reach, so appending never reallocates.
        let mut tokens = Vec::with_capacity(stops.max_len);
        tokens.extend_from_slice(prompt);
        Request {
            num_cached_tokens: None,
            tokens,
            num_computed: 0,
            arrival,
            table: None,
            reported_blocks: 0,
            tail: None,
            prompt_len: prompt.len(),
            stops,
            id,
            params,
            num_preemptions: 0,
            status: Status::Waiting,
            text,
            grammar: None,
            draft: Vec::new(),
            client: crate::fair_share::ANONYMOUS,
        }
    }

    pub(crate) fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The key that orders requests: priority class, then arrival.
    pub(crate) fn order_key(&self) -> (i32, u64) {
        (self.params.priority, self.arrival)
    }

    /// The cache slot of position `pos` when it lies in the last block of the table and every
    /// block is reported; None otherwise (the pool is asked).
    #[inline(always)]
    pub(crate) fn tail_slot(&self, pos: usize, block_size: usize) -> Option<usize> {
        let tail = self.tail?;
        let offset = pos.wrapping_sub(tail.base);
        (offset < block_size).then(|| tail.block as usize * block_size + offset)
    }

    /// Whether min_tokens are out, so a stop id or string may end it.
    pub(crate) fn may_stop(&self) -> bool {
        self.tokens.len() >= self.stops.min_len
    }

    /// The ids that may end it: EOS (unless ignore_eos), then the stop ids.
    pub(crate) fn stop_ids(&self) -> &[u32] {
        &self.stops.ids
    }

    /// Checks the stop conditions after a token was appended: the stop ids, then
    /// the lengths.
    #[inline(always)]
    pub(crate) fn check_stop(&self) -> Option<(FinishReason, Option<StopReason>)> {
        let len = self.tokens.len();
        if !self.stops.ids.is_empty() && len >= self.stops.min_len {
            let token = self.tokens[len - 1];
            if self.stops.ids.contains(&token) {
                return Some((FinishReason::Stop, Some(StopReason::Token(token))));
            }
        }
        (len >= self.stops.max_len).then_some((FinishReason::Length, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_reads_the_first_two_cache_lines_of_its_request() {
        let end = std::mem::offset_of!(Request, stops) + std::mem::size_of::<Stops>();
        assert!(end <= 128, "the fields a decode reads end at byte {end}");
    }

    #[test]
    fn a_held_slot_table_keeps_the_ids_it_was_taken_with() {
        let mut ids = SlotIds::default();
        ids.set(2, Arc::from("a"));
        assert_eq!(
            (ids.get(0), ids.get(2), ids.get(3)),
            (Some(""), Some("a"), None)
        );
        let held = ids.clone();
        ids.set(2, Arc::from("b"));
        ids.set(0, Arc::from("c"));
        assert_eq!((held.get(2), held.get(0)), (Some("a"), Some("")));
        assert_eq!((ids.get(2), ids.get(0)), (Some("b"), Some("c")));
    }

    #[test]
    fn an_unshared_table_is_updated_in_place() {
        let mut ids = SlotIds::default();
        ids.set(0, Arc::from("a"));
        let before = Arc::as_ptr(ids.0.as_ref().unwrap());
        ids.set(0, Arc::from("b"));
        assert_eq!(Arc::as_ptr(ids.0.as_ref().unwrap()), before);
        assert_eq!(ids.get(0), Some("b"));
    }
}
