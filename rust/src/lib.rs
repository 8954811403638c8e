//! The Rust core of aieng: the KV-cache block pool with prefix caching, the
//! continuous-batching scheduler that drives it, and the tokenizer glue.
//!
//! Everything here is plain Rust and tested with `cargo test`; the Python
//! bindings live in `py` behind the `python` cargo feature.

pub mod block_pool;
mod block_size;
pub mod body_scan;
pub mod cpu_decoder;
pub mod error;
pub mod fair_share;
mod free_list;
pub mod kernels;
mod prefix_hash;
pub mod request;
pub mod scheduler;
pub mod shared_step;
pub mod step_plan;
pub mod structured;
pub mod text;

#[cfg(feature = "python")]
mod py;

pub use block_pool::{BlockPool, BlockTable, PoolStats};
pub use error::{CoreError, Result};
pub use request::{FinishReason, RequestParams, StopReason};
pub use scheduler::{EngineCore, SchedulerConfig, StepUpdate};
pub use step_plan::StepPlan;
pub use structured::{Grammar, GrammarCompiler, GrammarSpec};
