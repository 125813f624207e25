//! What can go wrong in the engine, and where a reconfiguration can fail.

use thiserror::Error;

use crate::comm::placement::DeviceError;
use crate::parallel::ShardError;
use crate::trainer::TrainError;

/// Why the engine could not train.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum EngineError {
    /// The layout does not fit the model or the world.
    #[error("layout {dims}: {reason}")]
    Layout {
        /// The layout asked for.
        dims: String,
        /// What does not fit.
        reason: String,
    },
    /// Batch arithmetic or batch data.
    #[error("batch: {0}")]
    Batch(String),
    /// A rank's device cannot be used by this build.
    #[error("device: {0}")]
    Device(String),
    /// Building shards, or a model whose parallel plan disagrees with its parameter specs.
    #[error("sharding: {0}")]
    Shard(#[from] ShardError),
    /// Optimizer settings or a non-finite loss.
    #[error(transparent)]
    Train(TrainError),
    /// A rank failed (panicked or reported an error); the step did not happen.
    #[error("rank {rank} failed: {message}")]
    Rank {
        /// The first failing rank.
        rank: usize,
        /// Its message.
        message: String,
    },
    /// A rank's loaded state does not match the staged state.
    #[error("verification failed: {0}")]
    Verify(String),
    /// A reconfiguration failed at `phase` and the engine went back to its old configuration.
    #[error("reconfiguration to {target} failed at {phase:?} ({message}); rolled back to {restored}, nothing lost")]
    RolledBack {
        /// Where it failed.
        phase: ReconfigPhase,
        /// The error.
        message: String,
        /// The configuration asked for.
        target: String,
        /// The configuration running again.
        restored: String,
    },
    /// Reading or writing a checkpoint.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// File.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// A checkpoint whose bytes are damaged: truncated, a hash or the manifest not matching,
    /// unreadable metadata. A resume falls back past such a file; any other error stops it.
    #[error("checkpoint {path}: {message}")]
    Damaged {
        /// File.
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// The engine failed earlier and must be rebuilt.
    #[error("the engine stopped after an earlier failure: {0}")]
    Dead(String),
}

impl From<crate::state::StateError> for EngineError {
    /// The state's errors as the engine reported them before the state had its own type.
    fn from(e: crate::state::StateError) -> Self {
        use crate::state::StateError;
        match e {
            StateError::Shard(e) => Self::Shard(e),
            StateError::Gns(e) => Self::Train(TrainError::Gns(e)),
            StateError::Incomplete(message) => Self::Checkpoint { path: "(training state)".into(), message },
            StateError::NoRanks(m) => Self::Dead(m),
        }
    }
}

/// Where a reconfiguration can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReconfigPhase {
    /// While or right after the state leaves the old layout: staged in host memory (the old
    /// ranks then stop), or cut and sent by every rank (a live change).
    AfterStaging,
    /// While the new ranks build their process groups.
    GroupRebuild,
    /// While the new ranks load their shards and optimizer state.
    Load,
    /// When the loaded state is checked against the staged or the sent one.
    Verify,
}

impl From<DeviceError> for EngineError {
    fn from(e: DeviceError) -> Self {
        EngineError::Device(e.0)
    }
}
