//! What one engine step runs: flat arrays the model runner turns into tensors.

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
    /// Block ids of each request, row-major (R, block_table_width), padded with 0.
    pub block_tables: Vec<i32>,
    pub block_table_width: usize,
    /// Flat token rows whose logits are sampled. (S,)
    pub logits_indices: Vec<i32>,
    /// The request row each sample belongs to. (S,)
    pub sample_request_rows: Vec<i32>,
    /// Persistent per-request slots, stable while a request lives. (R,)
    pub slots: Vec<i32>,
    /// Request ids. (R,)
    pub request_ids: Vec<String>,
}

impl StepPlan {
    pub fn num_requests(&self) -> usize {
        self.seq_lens.len()
    }

    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.input_ids.is_empty()
    }
}
