//! A request as the scheduler sees it: its tokens, its limits, and why it ended.

use crate::error::{CoreError, Result};
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
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
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

/// The scheduler's record of a live request.
pub(crate) struct Request {
    pub(crate) id: String,
    pub(crate) arrival: u64,
    pub(crate) params: RequestParams,
    /// Prompt followed by the generated tokens.
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Tokens whose KV is in the cache.
    pub(crate) num_computed: usize,
    /// Prefix-cache hits at the first admission.
    pub(crate) num_cached_tokens: Option<usize>,
    pub(crate) num_preemptions: u32,
    pub(crate) status: Status,
    pub(crate) table: Option<crate::block_pool::TableLease>,
    /// Leading blocks of `table` already handed to the runner in a plan.
    pub(crate) reported_blocks: usize,
    /// Streaming text state, when the core has a tokenizer.
    pub(crate) text: Option<TextState>,
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
    pub(crate) fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The key that orders requests: priority class, then arrival.
    pub(crate) fn order_key(&self) -> (i32, u64) {
        (self.params.priority, self.arrival)
    }

    /// Checks the stop conditions after `token` was appended.
    pub(crate) fn check_stop(
        &self,
        max_model_len: usize,
    ) -> Option<(FinishReason, Option<StopReason>)> {
        let token = *self.tokens.last().expect("a generated token");
        let produced = self.num_output_tokens();
        if produced >= self.params.min_tokens {
            if !self.params.ignore_eos && self.params.eos_token_ids.contains(&token) {
                return Some((FinishReason::Stop, Some(StopReason::Token(token))));
            }
            if self.params.stop_token_ids.contains(&token) {
                return Some((FinishReason::Stop, Some(StopReason::Token(token))));
            }
        }
        if produced >= self.params.max_tokens || self.tokens.len() >= max_model_len {
            return Some((FinishReason::Length, None));
        }
        None
    }
}
