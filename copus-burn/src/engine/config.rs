//! How the engine runs: layout, batch split, pipeline schedule, optimizer and the device of
//! every rank.

use burn::config::Config;
use burn::tensor::Device;
use copus_core::layout::ParallelDims;
use copus_core::schedule::ScheduleKind;
use serde::{Deserialize, Serialize};

use super::error::EngineError;
use crate::optim::OptimConfig;

/// The device a rank trains on. Only Flex (Burn's pure-Rust CPU backend) is built by default;
/// the others need the crate feature of the same name.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankDevice {
    /// Burn's Flex CPU backend (several ranks share the machine's cores).
    #[default]
    Flex,
    /// The default wgpu adapter (feature `wgpu`).
    Wgpu,
    /// CUDA device `i` (feature `cuda`).
    Cuda(usize),
    /// ROCm device `i` (feature `rocm`).
    Rocm(usize),
}

impl RankDevice {
    /// The Burn device, or an error naming the feature this build lacks.
    pub fn device(self) -> Result<Device, EngineError> {
        let missing = |feature: &str| EngineError::Device(format!("{self:?} needs copus-burn built with feature `{feature}`"));
        match self {
            RankDevice::Flex => Ok(Device::flex()),
            #[cfg(feature = "wgpu")]
            RankDevice::Wgpu => Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(not(feature = "wgpu"))]
            RankDevice::Wgpu => Err(missing("wgpu")),
            #[cfg(feature = "cuda")]
            RankDevice::Cuda(i) => Ok(Device::cuda(i)),
            #[cfg(not(feature = "cuda"))]
            RankDevice::Cuda(_) => Err(missing("cuda")),
            #[cfg(feature = "rocm")]
            RankDevice::Rocm(i) => Ok(Device::rocm(i)),
            #[cfg(not(feature = "rocm"))]
            RankDevice::Rocm(_) => Err(missing("rocm")),
        }
    }
}

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
    /// The longest any wait may last, seconds: a collective or receive waiting for another rank,
    /// and the engine waiting for a rank's reply. A rank that hangs then fails the step with
    /// [`CommError::Timeout`](crate::collective::CommError::Timeout) naming the ranks that did not arrive, instead of freezing
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
