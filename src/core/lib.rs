//! ferryman-core: the scheduler and KV block manager of the ferryman serving engine. Pure Rust;
//! the PyO3 binding lives in the parent crate.
//!
//! Glossary (docs/design.md §2): a **request** (`req_id`) is a unit of work, stored in the
//! `RequestArena` at its `ReqIdx` (also the index of its block tables); a **block** holds the KV
//! of `block_size` tokens (FlashInfer's "page"); block 0 is `NULL_BLOCK`; a request's blocks are
//! its `block_table`; a token's flat KV position is its **slot** = block * block_size + offset;
//! `ref_cnt` counts the tables holding a block; queues are `waiting`, `running`, `swapped`;
//! plans are `blocks_to_swap_out`, `blocks_to_swap_in`, `blocks_to_copy`.
//!
//! Layering: `Scheduler` (step policy, budgets, preemption) → `KvCacheManager` (tokens → blocks,
//! tables, swap, prefix cache) → `BlockPool` (blocks, ref counts, free list). Beside them, the
//! `Batch` gives each running sequence a persistent row of the runner's tensors, `text`
//! turns tokens into text, and `grammar` constrains them (structured outputs).

pub mod arena;
pub mod batch;
pub mod block_pool;
pub mod config;
pub mod error;
pub mod grammar;
pub mod greedy;
pub mod kv_cache_manager;
pub mod outputs;
pub mod prefix_cache;
pub mod queues;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod text;

pub use config::{Policy, PreemptionMode, PreemptionModeConfig, SchedulerConfig};
pub use error::{CoreError, CoreResult};
pub use grammar::GrammarSpec;
pub use greedy::argmax_rows;
pub use outputs::{Counters, PreemptionEvent, PreemptionReason, SchedulerOutput, StepOutputs, StepStats};
pub use request::{FinishReason, RequestParams, RequestStatus, TextParams};
pub use sampling::{sample_rows, sample_step, RowParams};
pub use scheduler::Scheduler;
pub use text::Tokenizer;
