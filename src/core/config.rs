//! `SchedulerConfig`: the knobs of one scheduler, validated once at construction.
//!
//! Names follow vLLM (`max_num_batched_tokens`, `max_num_seqs`, ...). The three cost-model
//! fields feed `preemption_mode = "auto"`; Python calibrates them on the loaded model.

use crate::error::{CoreError, CoreResult};

/// How a victim's KV is handled when it is preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Drop the KV; the request is prefilled again later.
    Recompute,
    /// Copy the KV to host blocks; copy it back later.
    Swap,
}

/// The configured preemption mode: a fixed mode, or a per-victim choice by cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionModeConfig {
    Recompute,
    Swap,
    Auto,
}

/// Which running request is preempted first, and which waiting request is admitted first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// Latest arrival is preempted first; earliest is admitted first.
    Fcfs,
    /// Largest `priority` value (least important) first, then latest arrival.
    Priority,
}

impl PreemptionModeConfig {
    /// Parses "recompute" | "swap" | "auto".
    pub fn parse(s: &str) -> CoreResult<Self> {
        match s {
            "recompute" => Ok(Self::Recompute),
            "swap" => Ok(Self::Swap),
            "auto" => Ok(Self::Auto),
            _ => Err(CoreError::InvalidConfig(format!(
                "preemption_mode must be \"recompute\", \"swap\" or \"auto\", got {s:?}"
            ))),
        }
    }
    /// The config string of this mode.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Swap => "swap",
            Self::Auto => "auto",
        }
    }
}

impl Policy {
    /// Parses "fcfs" | "priority".
    pub fn parse(s: &str) -> CoreResult<Self> {
        match s {
            "fcfs" => Ok(Self::Fcfs),
            "priority" => Ok(Self::Priority),
            _ => Err(CoreError::InvalidConfig(format!("policy must be \"fcfs\" or \"priority\", got {s:?}"))),
        }
    }
    /// The config string of this policy.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fcfs => "fcfs",
            Self::Priority => "priority",
        }
    }
}

impl PreemptionMode {
    /// "recompute" | "swap", as events report it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Swap => "swap",
        }
    }
}

/// The most sequences a scheduler runs at once.
pub const MAX_NUM_SEQS: usize = 1 << 20;

/// Every knob of the scheduler. Build with `SchedulerConfig::default()` and field updates, then
/// call `validate()` (the `Scheduler` constructor does).
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Tokens per KV block (FlashInfer's `page_size`).
    pub block_size: usize,
    /// Usable device blocks; the null block 0 is extra.
    pub num_device_blocks: usize,
    /// Host (swap space) blocks; 0 disables swapping (swap falls back to recompute).
    pub num_host_blocks: usize,
    /// The token budget of one step.
    pub max_num_batched_tokens: usize,
    /// At most this many sequences run at once.
    pub max_num_seqs: usize,
    /// Prompt plus output of one request may not exceed this.
    pub max_model_len: usize,
    /// Split long prefills across steps and mix them with decodes.
    pub enable_chunked_prefill: bool,
    /// Reuse full blocks by content hash.
    pub enable_prefix_caching: bool,
    /// recompute | swap | auto.
    pub preemption_mode: PreemptionModeConfig,
    /// fcfs | priority.
    pub policy: Policy,
    /// Fraction of device blocks kept free when admitting (vLLM's 0.01).
    pub watermark: f64,
    /// Bytes of one block across all layers, K and V (cost model).
    pub bytes_per_block: f64,
    /// Host link bandwidth in bytes per second, one direction (cost model).
    pub host_link_bytes_per_s: f64,
    /// Prefill throughput in tokens per second (cost model).
    pub prefill_tokens_per_s: f64,
    /// Allow `schedule()` while one step still awaits `update()`, so the host plans step N+1
    /// during step N's forward (decode inputs then name step N's samples).
    pub async_scheduling: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_device_blocks: 4096,
            num_host_blocks: 0,
            max_num_batched_tokens: 8192,
            max_num_seqs: 256,
            max_model_len: 8192,
            enable_chunked_prefill: true,
            enable_prefix_caching: true,
            preemption_mode: PreemptionModeConfig::Auto,
            policy: Policy::Fcfs,
            watermark: 0.01,
            // A Llama-3-8B block of 16 tokens in bf16: 32 layers x 2 x 8 heads x 128 x 2 bytes x 16.
            bytes_per_block: 2.0 * 1024.0 * 1024.0,
            // PCIe 5.0 x16, one direction, as measured copies usually reach.
            host_link_bytes_per_s: 50e9,
            // A mid-size GPU prefilling an 8B model.
            prefill_tokens_per_s: 20_000.0,
            async_scheduling: false,
        }
    }
}

impl SchedulerConfig {
    /// Checks every field and their relations; names the offending field.
    pub fn validate(&self) -> CoreResult<()> {
        let bad = |m: String| Err(CoreError::InvalidConfig(m));
        if !self.block_size.is_power_of_two() || self.block_size > 4096 {
            return bad(format!("block_size must be a power of two up to 4096, got {}", self.block_size));
        }
        if self.num_device_blocks == 0 || self.num_device_blocks >= i32::MAX as usize {
            let most = i32::MAX - 1;
            return bad(format!("num_device_blocks must be in 1..={most}, got {}", self.num_device_blocks));
        }
        if self.num_host_blocks >= i32::MAX as usize {
            return bad(format!("num_host_blocks too large: {}", self.num_host_blocks));
        }
        if (self.num_device_blocks + 1).saturating_mul(self.block_size) >= i64::MAX as usize {
            return bad("num_device_blocks * block_size overflows a slot index".into());
        }
        if self.max_num_batched_tokens == 0 || self.max_num_batched_tokens >= i32::MAX as usize {
            // a step's tokens cross as int32 (and the simulator sizes arrays by the budget)
            let most = i32::MAX - 1;
            return bad(format!("max_num_batched_tokens must be in 1..={most}, got {}", self.max_num_batched_tokens));
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be >= 1".into());
        }
        if self.max_num_seqs > MAX_NUM_SEQS {
            // the batch's rows are allocated up front and cross as int32 (2**40 aborted on memory)
            return bad(format!("max_num_seqs must be at most {MAX_NUM_SEQS}, got {}", self.max_num_seqs));
        }
        if self.max_model_len == 0 || self.max_model_len >= i32::MAX as usize {
            let most = i32::MAX - 1;
            return bad(format!("max_model_len must be in 1..={most}, got {}", self.max_model_len));
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return bad(format!(
                "without chunked prefill max_num_batched_tokens ({}) must be >= max_model_len ({}), \
                 or a long request could never be scheduled",
                self.max_num_batched_tokens, self.max_model_len
            ));
        }
        if !(0.0..1.0).contains(&self.watermark) {
            return bad(format!("watermark must be in [0, 1), got {}", self.watermark));
        }
        for (name, v) in [
            ("bytes_per_block", self.bytes_per_block),
            ("host_link_bytes_per_s", self.host_link_bytes_per_s),
            ("prefill_tokens_per_s", self.prefill_tokens_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(format!("{name} must be a positive finite number, got {v}"));
            }
        }
        Ok(())
    }

    /// Blocks needed to hold `num_tokens` tokens of this config's `block_size`.
    #[inline]
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        crate::kv_cache_manager::blocks_for(num_tokens, self.block_size)
    }

    /// Steps that may await `update()` at once: 2 with `async_scheduling`, else 1.
    #[inline]
    pub fn max_steps_in_flight(&self) -> usize {
        if self.async_scheduling {
            2
        } else {
            1
        }
    }

    /// Free device blocks that admission leaves untouched while others run.
    pub fn watermark_blocks(&self) -> usize {
        (self.watermark * self.num_device_blocks as f64) as usize
    }
}
