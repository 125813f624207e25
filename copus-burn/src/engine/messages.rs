//! The engine's messages, a leaf of its module graph: what the engine asks of its ranks and
//! what they answer ([`Command`], [`Reply`], [`EngineStep`]), the messages of a live layout
//! change ([`LiveJob`], [`Sent`], [`Agreed`], [`Received`] and the pieces handed over between
//! threads), and, with feature `mpi`, the control header process 0 broadcasts before each
//! command's payload and its framing. It imports only the engine's configuration, error and
//! fault types, the training state's and the trainer's step metrics, so the rank side
//! (`cluster.rs`, `rank.rs`, `executor.rs`, `live.rs`, `processes.rs`), the driver side
//! (`mod.rs`, `crate::reconfig`) and `mpi.rs` all import it and not each other.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use burn::backend::flex::FlexTensor;
use burn::tensor::Tensor;
use burn_pack::Scalar;
use copus_core::gns::StepStats;
use copus_core::model::ParamSpec;
use copus_core::reshard::ReshardPlan;
use serde::{Deserialize, Serialize};

use super::config::EngineConfig;
use super::error::ReconfigPhase;
use super::fault::{Fault, StepFault};
use crate::state::{OptimScalars, RankExport};
use crate::traffic::HostTraffic;
use crate::trainer::StepMetrics;

/// What a step reports.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineStep {
    /// The usual trainer metrics.
    pub metrics: StepMetrics,
    /// What the probe measured this step (before smoothing).
    pub stats: StepStats,
    /// The loss or the gradient norm was not finite, so the update was skipped: no weight,
    /// optimizer moment, estimator or counter changed.
    pub skipped: bool,
    /// Bytes moved between host memory and the ranks' tensors since the previous step (the
    /// step's own, and any evaluation or state transfer between the two), by kind, summed over
    /// the ranks this process drives: every rank with in-process ranks, this process's under
    /// mpirun. See [`crate::traffic`].
    pub host: HostTraffic,
    /// The largest total of one rank among those in `host`.
    pub host_rank_max: u64,
}

/// One rank's parameters as `(global name, shape, values)`.
pub type RankParams = Vec<(String, Vec<usize>, Vec<f32>)>;

/// What the engine asks of every rank.
pub(crate) enum Command {
    /// The step's batch, and the faults planted in it (nothing without `fault-injection`).
    Step(Arc<Vec<i64>>, StepFault),
    Params,
    Export,
    SetBatch {
        global_batch: usize,
        micro_batch: usize,
    },
    /// A held-out evaluation: whole sequences of `seq + 1` ids, in micro-batches of at most
    /// `micro` sequences per replica.
    Evaluate(Arc<Vec<i64>>, usize),
    /// A live layout change, step 1: send this rank's pieces of the plan.
    LiveSend(Arc<LiveJob>),
    /// Step 2: receive and build the new state beside the current one.
    LiveBuild(Arc<LiveJob>, Arc<Agreed>),
    /// Step 3: switch to the state built in step 2.
    LiveCommit,
    /// Step 3 after a failure: drop whatever step 2 built, keep the current state.
    LiveAbort,
    Stop,
}

/// A rank's answer.
pub(crate) enum Reply {
    Step(Box<EngineStep>),
    /// The mean held-out loss per target token (the same on every rank).
    Evaluated(f64),
    Params(RankParams),
    Export(Box<RankExport>),
    Sent(Result<Sent, String>),
    Built(Result<Received, PhaseError>),
    Done,
}

/// Tags of reshard messages: above every tag the step uses, and inside MPI's signed tags.
pub(crate) const TAG_BASE: u32 = 1 << 30;

/// One layout change, shared by every rank.
pub(crate) struct LiveJob {
    pub(crate) plan: ReshardPlan,
    /// The configuration to switch to.
    pub(crate) cfg: EngineConfig,
    pub(crate) specs: Arc<Vec<ParamSpec>>,
    pub(crate) num_layers: usize,
    /// A planted failure (rollback tests), struck on world rank `fault_rank`.
    pub(crate) fault: Fault,
    pub(crate) fault_rank: usize,
    /// Between rank threads of this process: pieces handed over without a copy. `None` between
    /// processes, where every piece goes through the world communicator.
    pub(crate) handoff: Option<Handoff>,
}

/// Pieces handed from one rank thread to another without a copy. In host memory (Flex): a
/// shared handle to the sender's shard and where the piece lies in it; the receiver copies the
/// piece straight into its new shard. On a device: the piece as a tensor where it lies,
/// `[outer, len, inner]` around the split dim, which the receiver joins with the others there.
/// The sender's state is only read, so a rollback still finds it untouched.
#[derive(Default)]
pub(crate) struct Handoff {
    pub(super) pieces: Mutex<HashMap<u32, Shared>>,
    pub(super) tensors: Mutex<HashMap<u32, Tensor<3>>>,
}

impl Handoff {
    pub(super) fn put(&self, tag: u32, piece: Shared) {
        self.pieces.lock().unwrap_or_else(|e| e.into_inner()).insert(tag, piece);
    }

    pub(super) fn take(&self, tag: u32) -> Option<Shared> {
        self.pieces.lock().unwrap_or_else(|e| e.into_inner()).remove(&tag)
    }

    pub(super) fn put_tensor(&self, tag: u32, piece: Tensor<3>) {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner()).insert(tag, piece);
    }

    pub(super) fn take_tensor(&self, tag: u32) -> Option<Tensor<3>> {
        self.tensors.lock().unwrap_or_else(|e| e.into_inner()).remove(&tag)
    }

    /// Drops every piece not taken (a failed change); returns how many there were.
    pub(crate) fn clear(&self) -> usize {
        let mut pieces = self.pieces.lock().unwrap_or_else(|e| e.into_inner());
        let mut tensors = self.tensors.lock().unwrap_or_else(|e| e.into_inner());
        let left = pieces.len() + tensors.len();
        pieces.clear();
        tensors.clear();
        left
    }
}

/// A piece still in the sender's shard: `[offset, offset + len)` along `dim` of `values`
/// (contiguous f32, of the sender's local `shape`).
pub(crate) struct Shared {
    pub(super) values: FlexTensor,
    pub(super) shape: Vec<usize>,
    pub(super) dim: usize,
    pub(super) offset: usize,
    pub(super) len: usize,
}

/// What a rank sent: each piece's tag and checksum (`None` for a piece handed over between
/// threads, whose source checksum the receiver gives), the elements, and what the build step needs
/// from every rank.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Sent {
    pub(crate) sums: Vec<(u32, Option<u64>)>,
    pub(crate) elements: u64,
    /// Optimizer state scalars (step counts) of the parameters this rank holds.
    pub(crate) scalars: OptimScalars,
    /// The optimizer's tensor fields, sorted.
    pub(crate) fields: Vec<String>,
    pub(crate) has_previous: bool,
}

/// What every rank agrees on before building: the pieces per move and the step counts.
#[derive(Serialize, Deserialize)]
pub(crate) struct Agreed {
    pub(crate) fields: Vec<String>,
    pub(crate) has_previous: bool,
    pub(crate) scalars: HashMap<String, Vec<(String, Scalar)>>,
}

impl Agreed {
    /// Pieces per move: the weights, each optimizer field, and the previous gradient if kept.
    pub(crate) fn kinds(&self) -> usize {
        kinds(&self.fields, self.has_previous)
    }
}

pub(super) fn kinds(fields: &[String], has_previous: bool) -> usize {
    1 + fields.len() + usize::from(has_previous)
}

/// What a rank received: each piece's checksum where it landed, and of the pieces handed over
/// between threads, the checksum of the source (the landed one where the copy matched it bit for
/// bit).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Received {
    pub(crate) sums: Vec<(u32, u64)>,
    pub(crate) sources: Vec<(u32, u64)>,
    pub(crate) elements: u64,
}

/// The tag of piece `kind` of move `index`.
pub(crate) fn tag(index: usize, kind: usize, kinds: usize) -> u32 {
    TAG_BASE + (index * kinds + kind) as u32
}

/// Whether a plan's pieces fit the tag space (tags below 2^31, as MPI's are).
pub(super) fn tags_fit(moves: usize, kinds: usize) -> bool {
    moves.saturating_mul(kinds) < (i32::MAX as u32 - TAG_BASE) as usize
}

/// A failure at a phase, reported by a rank without aborting the world.
pub(crate) type PhaseError = (ReconfigPhase, String);

/// What process 0 tells the others; the payload follows the header.
#[cfg(feature = "mpi")]
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Header {
    /// Start the ranks of the configuration in the payload's training state (checkpoint bytes).
    Launch {
        model: String,
    },
    /// One step; the payload is the batch (i64, little-endian).
    Step {
        /// The faults planted in the step (nothing without `fault-injection`).
        fault: StepFault,
    },
    Params,
    Export,
    SetBatch {
        global_batch: usize,
        micro_batch: usize,
    },
    /// A held-out evaluation; the payload is the sequences (i64, little-endian).
    Evaluate {
        micro: usize,
    },
    /// A live layout change, step 1: send this rank's pieces of the plan in the payload
    /// ([`LiveOrder`], JSON).
    LiveSend,
    /// Step 2: receive and build; the payload is what the ranks agreed on (JSON).
    LiveBuild,
    /// Step 3: switch to what step 2 built.
    LiveCommit,
    /// Step 3 after a failure: drop it.
    LiveAbort,
    /// Stop the ranks of the current layout (the process keeps serving).
    Stop,
    /// The run is over.
    Exit,
}

/// A live layout change as process 0 sends it: the plan and the configuration to switch to
/// (each process derives the parameter specs from its own model).
#[cfg(feature = "mpi")]
#[derive(Serialize, Deserialize)]
pub(super) struct LiveOrder {
    pub(super) plan: copus_core::reshard::ReshardPlan,
    pub(super) cfg: EngineConfig,
    pub(super) num_layers: usize,
}

#[cfg(feature = "mpi")]
pub(super) fn encode(header: &Header, payload: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(header).expect("headers serialise");
    let mut out = Vec::with_capacity(4 + h.len() + payload.len());
    out.extend_from_slice(&(h.len() as u32).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    out
}

#[cfg(feature = "mpi")]
pub(super) fn decode(msg: &[u8]) -> Result<(Header, &[u8]), String> {
    let len = msg.get(..4).ok_or("a control message shorter than its header")?;
    let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
    let h = msg.get(4..4 + len).ok_or("a control message shorter than its header")?;
    let header = serde_json::from_slice(h).map_err(|e| format!("a control header that does not parse: {e}"))?;
    Ok((header, &msg[4 + len..]))
}

/// The message that ends a serving process's loop.
#[cfg(feature = "mpi")]
pub(crate) fn exit_message() -> Vec<u8> {
    encode(&Header::Exit, &[])
}
