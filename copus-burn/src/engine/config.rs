//! How the engine runs: layout, batch split, pipeline schedule, optimizer and the device of
//! every rank.

use burn::config::Config;
use copus_core::layout::ParallelDims;
pub use copus_core::memory::{Checkpointing, Precision};
use copus_core::schedule::ScheduleKind;

use super::error::EngineError;
pub use crate::comm::placement::RankDevice;
use crate::optim::OptimConfig;

/// How the engine runs. Build with [`EngineConfig::new`] and the `with_*` setters; start the
/// ranks with [`EngineConfig::init`].
#[derive(Config, Debug, PartialEq)]
pub struct EngineConfig {
    /// The layout.
    pub dims: ParallelDims,
    /// Sequences per optimizer step, B_g.
    pub global_batch: usize,
    /// Sequences per micro-batch, B_m.
    pub micro_batch: usize,
    /// Tokens per sequence (inputs; each sequence in a batch has `seq_len + 1` tokens).
    pub seq_len: usize,
    /// Optimizer, LR schedule and probe settings.
    pub optim: OptimConfig,
    /// Pipeline schedule.
    #[config(default = "ScheduleKind::OneFOneB")]
    pub schedule: ScheduleKind,
    /// Elements per dp all-reduce bucket.
    #[config(default = 1048576)]
    pub bucket_elems: usize,
    /// The device of each rank, in rank order; empty means Flex for every rank.
    #[config(default = "Vec::new()")]
    pub devices: Vec<RankDevice>,
    /// Under mpirun, how many of a node's GPU ranks share one of its devices (see
    /// [`device_index`](crate::comm::placement::device_index)); `None` spreads them evenly over the devices the node shows. In one
    /// process, [`RankDevice::for_ranks`] lays out `devices` the same way.
    #[config(default = "None")]
    pub ranks_per_device: Option<usize>,
    /// Under mpirun, reductions over MPI gather every rank's buffer and add them in rank order,
    /// bit-equal to in-process ranks (`true`, for parity tests), or run as MPI's own
    /// all-reduce (`false`, the default: a ring or tree, equal to rounding). GPU ranks take
    /// NCCL or RCCL only with `false` (the libraries sum in their own order); with `true` they
    /// reduce over MPI too.
    #[config(default = false)]
    pub exact_reductions: bool,
    /// Activation checkpointing: what a micro-batch keeps between its forward and backward
    /// passes (the residual stream at each layer or each residual branch, recomputing the rest).
    #[config(default = "Checkpointing::None")]
    pub checkpointing: Checkpointing,
    /// The arithmetic: f32, or bf16 products with f32 master weights ([`Precision`]). Every
    /// rank's device must compute in bf16 for `Bf16Mixed` (Flex and CUDA do; wgpu does not).
    #[config(default = "Precision::F32")]
    pub precision: Precision,
    /// ZeRO stage 1: each dp replica keeps the AdamW moments of its 1/dp of the stage's
    /// parameters; gradients are reduce-scattered over dp and the updated weights
    /// all-gathered. The same arithmetic as the unsharded optimizer; no effect at dp = 1.
    #[config(default = false)]
    pub zero1: bool,
    /// The longest any wait may last, seconds: a collective or receive waiting for another rank,
    /// and the engine waiting for a rank's reply. A rank that hangs then fails the step with
    /// [`CommError::Timeout`](crate::comm::CommError::Timeout) naming the ranks that did not arrive, instead of freezing
    /// training. It bounds one step's slowest rank, so the default is generous.
    #[config(default = 1800.0)]
    pub timeout_secs: f64,
}

/// The largest global batch, sequences (with [`copus_core::model::MAX_SIZE`] it keeps every
/// batch's token count inside 64 bits).
pub const MAX_BATCH: usize = 1 << 24;

impl EngineConfig {
    /// The longest any wait lasts ([`EngineConfig::timeout_secs`]).
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.timeout_secs.clamp(1e-3, 1e9))
    }

    /// Micro-batches per dp replica per step, `a = B_g / (dp * B_m)`.
    pub fn num_micro_per_replica(&self) -> usize {
        self.global_batch / (self.dims.dp * self.micro_batch)
    }

    /// Checks the batch arithmetic, the device list and the optimizer settings.
    pub(crate) fn validate(&self) -> Result<(), EngineError> {
        let (b, m, dp) = (self.global_batch, self.micro_batch, self.dims.dp);
        if m == 0 || b == 0 || self.seq_len == 0 {
            return Err(EngineError::Batch(format!(
                "global batch ({b}), micro-batch ({m}) and sequence length ({}) must be at least 1",
                self.seq_len
            )));
        }
        if b > MAX_BATCH || self.seq_len > copus_core::model::MAX_SIZE {
            return Err(EngineError::Batch(format!(
                "global batch ({b}) must be at most {MAX_BATCH} and sequence length ({}) at most {}",
                self.seq_len,
                copus_core::model::MAX_SIZE
            )));
        }
        if m > b {
            return Err(EngineError::Batch(format!("micro-batch {m} is larger than the global batch {b}")));
        }
        if !b.is_multiple_of(dp * m) {
            return Err(EngineError::Batch(format!("global batch {b} is not a multiple of dp x micro-batch = {dp} x {m} = {}", dp * m)));
        }
        if !(self.timeout_secs.is_finite() && self.timeout_secs > 0.0) {
            return Err(EngineError::Batch(format!("timeout_secs ({}) must be a positive number of seconds", self.timeout_secs)));
        }
        if self.ranks_per_device == Some(0) {
            return Err(EngineError::Device("ranks_per_device must be at least 1".into()));
        }
        if self.bucket_elems == 0 {
            return Err(EngineError::Batch("bucket_elems must be at least 1".into()));
        }
        let world = self.dims.world_size();
        if !self.devices.is_empty() && self.devices.len() != world {
            return Err(EngineError::Device(format!(
                "`devices` lists {} devices for {world} ranks; give one per rank, or none for Flex on every rank",
                self.devices.len()
            )));
        }
        self.optim.validate().map_err(|e| EngineError::Train(e.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No rank can share a device with zero others.
    #[test]
    fn zero_ranks_per_device_is_refused() {
        let cfg = EngineConfig::new(ParallelDims::new(1, 1, 1, 1).unwrap(), 2, 1, 8, OptimConfig::default()).with_ranks_per_device(Some(0));
        assert!(cfg.validate().unwrap_err().to_string().contains("ranks_per_device"));
    }
}
