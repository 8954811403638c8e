//! What one engine step runs: flat arrays the model runner turns into tensors.
//!
//! Block tables are handed over as changes: a runner keeps one persistent table
//! per request slot, (max slots, ceil(max_model_len / block_size)), and applies
//! `table[new_block_slots, new_block_indices] = new_block_ids` each step. Every
//! block of a freshly opened table (admission, readmission after preemption,
//! prefix-cache hits included) is reported from index 0; a block added as a
//! request grows is reported once. Row r's first ceil(seq_lens[r] / block_size)
//! entries of `table[slots[r]]` are then its block ids. The runner's tables are
//! the one copy: the core keeps only the block lists it reports from.
//!
//! End-of-sequence rules are decided here too, once: a sampling row whose request
//! has not produced `min_tokens` yet may not draw its EOS (unless `ignore_eos`) or
//! stop ids, and the plan lists those bans for the sampler (`banned_rows`,
//! `banned_ids`) instead of the sampler tracking output counts of its own.

use crate::request::SlotIds;
use crate::structured::PendingMasks;

/// The work of one step. Rows are requests, in the order the arrays list them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Tokens to run, request after request. (T,)
    pub input_ids: Vec<i32>,
    /// Their positions in their sequences. (T,)
    pub positions: Vec<i32>,
    /// Cache slot of each token's K/V: block id * block_size + offset. (T,)
    pub slot_mapping: Vec<i32>,
    /// Request r's tokens are `input_ids[query_start_loc[r]..query_start_loc[r + 1]]`. (R + 1,)
    pub query_start_loc: Vec<i32>,
    /// Tokens of each request already in the cache before this step. (R,)
    pub num_computed_tokens: Vec<i32>,
    /// Context length of each request after this step. (R,)
    pub seq_lens: Vec<i32>,
    /// Flat token rows whose logits are sampled. (S,)
    pub logits_indices: Vec<i32>,
    /// The request row each sample belongs to. (S,)
    pub sample_request_rows: Vec<i32>,
    /// Persistent per-request slots, stable while a request lives; a finished
    /// request's slot is reused by a later one. (R,)
    pub slots: Vec<i32>,
    /// Slot of each block new to that slot's table since it was last reported. (N,)
    pub new_block_slots: Vec<i32>,
    /// Its position in that slot's block table. (N,)
    pub new_block_indices: Vec<i32>,
    /// Its block id. (N,)
    pub new_block_ids: Vec<i32>,
    /// Token bans of this step's sampling rows: sampling row `banned_rows[i]` (an
    /// index into `logits_indices`) may not draw `banned_ids[i]` — the EOS and stop
    /// ids of a request that has not produced `min_tokens` yet. (K,)
    pub banned_rows: Vec<i32>,
    /// (K,)
    pub banned_ids: Vec<i32>,
    /// The request id of each slot as of this plan: row r's is `request_ids.get(slots[r])`.
    pub request_ids: SlotIds,
    /// The token masks of the sampling rows with a structured-output grammar, computed
    /// while the model runs; None when no row has one.
    pub grammar_masks: Option<PendingMasks>,
}

impl StepPlan {
    /// Empties every array, keeping their buffers.
    pub fn clear(&mut self) {
        for column in [
            &mut self.input_ids,
            &mut self.positions,
            &mut self.slot_mapping,
            &mut self.query_start_loc,
            &mut self.num_computed_tokens,
            &mut self.seq_lens,
            &mut self.logits_indices,
            &mut self.sample_request_rows,
            &mut self.slots,
        ] {
            column.clear();
        }
        self.clear_for_reuse();
    }

    /// Readies a plan handed back for the next step's: empties the columns a plan pushes to
    /// and drops its ids and masks; the columns a plan writes by index whole (every entry up
    /// to the lengths it sets) keep their lengths and stale entries, so that sizing them
    /// again clears no memory that is written over anyway.
    pub fn clear_for_reuse(&mut self) {
        for column in [
            &mut self.new_block_slots,
            &mut self.new_block_indices,
            &mut self.new_block_ids,
            &mut self.banned_rows,
            &mut self.banned_ids,
        ] {
            column.clear();
        }
        self.request_ids = SlotIds::default();
        self.grammar_masks = None;
    }

    pub fn num_requests(&self) -> usize {
        self.seq_lens.len()
    }

    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }

    /// The id of row `row`'s request.
    pub fn request_id(&self, row: usize) -> &str {
        self.request_ids
            .get(self.slots[row] as u32)
            .expect("a planned slot is named")
    }
}
