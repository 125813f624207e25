//! The host-traffic meter: the bytes a rank's code moves between host buffers and its backend's
//! tensors, by kind, counted where the engine reads a tensor back ([`read`]) or builds one from
//! host values ([`upload`]).
//!
//! The count is of the engine's code path, not of the bus: on Flex the backend's memory is host
//! memory and a read is a copy (or, for the probe's in-place reads, none), while on a GPU
//! backend every counted byte crosses PCIe. Where the code is the same on both, so is the
//! figure, and the CPU build measures what a GPU rank would move; the one difference today is
//! the probe, which reads each gradient in place on Flex and only per-parameter sums on a
//! device. Counts are per thread (a rank runs its commands on its own thread); [`take`] returns
//! this thread's counts and starts them again. Token ids count as the host buffer's 8 bytes
//! each, whatever integer width the device keeps.
//!
//! A leaf module: it imports only Burn and serde.

use std::cell::Cell;

use burn::tensor::kind::Basic;
use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// Bytes moved between host and a rank's tensors, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostTraffic {
    /// Token ids uploaded (inputs and targets).
    pub batch: u64,
    /// Activations and their gradients at tensor-parallel region and pipeline stage
    /// boundaries: the residual stream read back and uploaded again, the logits read back for
    /// the cross entropy, backward seeds uploaded, input gradients read back; without tensor
    /// parallelism only the pipeline's boundaries and each micro-batch's loss scalar.
    pub activations: u64,
    /// Gradients staged on the host for a collective (tp-replicated and tied parameters, the
    /// data-parallel reduction) and written back.
    pub collective: u64,
    /// Gradient values the noise probe reads for its squared norms (or the few sums it reads
    /// where the norms are reduced on the device).
    pub probe: u64,
    /// Tensors built on the host and uploaded: a stage's context (a Llama's rotary tables),
    /// once per rank and sequence length, with the first step and the first after a layout
    /// change; the index ranges of the causal mask and the cross entropy's one-hot, once per
    /// rank thread and length.
    pub constants: u64,
    /// Parameters and optimizer state read or written for a checkpoint, an export, a layout
    /// change or loading a state.
    pub state: u64,
    /// What a held-out evaluation on the ranks moves (its token ids, boundaries and loss
    /// scalars), and parameters read for a report (the engine's `rank_params`; an export for a
    /// checkpoint or a layout change counts as `state`). Reported with the next step.
    pub evaluation: u64,
    /// Uploads of token ids (each a transfer and, on a device, a wait): one a step on each rank
    /// of the first or last stage where the stage runs as graphs (on a device, or in host
    /// memory without tensor parallelism or checkpointing), whatever its number of
    /// micro-batches; elsewhere one or two per micro-batch. A count, not bytes: it is in no sum
    /// of bytes.
    #[serde(default)]
    pub batch_uploads: u64,
}

/// One kind of [`HostTraffic`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// [`HostTraffic::batch`].
    Batch,
    /// [`HostTraffic::activations`].
    Activations,
    /// [`HostTraffic::collective`].
    Collective,
    /// [`HostTraffic::probe`].
    Probe,
    /// [`HostTraffic::constants`].
    Constants,
    /// [`HostTraffic::state`].
    State,
    /// [`HostTraffic::evaluation`].
    Evaluation,
}

impl HostTraffic {
    /// Every kind's bytes together.
    pub fn total(&self) -> u64 {
        self.batch + self.activations + self.collective + self.probe + self.constants + self.state + self.evaluation
    }

    /// Bytes of a training step other than its token ids (what a device-resident step keeps
    /// to a few scalars).
    pub fn beyond_batch(&self) -> u64 {
        self.total() - self.batch
    }

    fn slot(&mut self, kind: Kind) -> &mut u64 {
        match kind {
            Kind::Batch => &mut self.batch,
            Kind::Activations => &mut self.activations,
            Kind::Collective => &mut self.collective,
            Kind::Probe => &mut self.probe,
            Kind::Constants => &mut self.constants,
            Kind::State => &mut self.state,
            Kind::Evaluation => &mut self.evaluation,
        }
    }

    /// The kind's bytes.
    pub fn get(&self, kind: Kind) -> u64 {
        let mut c = *self;
        *c.slot(kind)
    }

    /// Adds `other`'s bytes, kind by kind.
    pub fn add(&mut self, other: &HostTraffic) {
        for k in [Kind::Batch, Kind::Activations, Kind::Collective, Kind::Probe, Kind::Constants, Kind::State, Kind::Evaluation] {
            *self.slot(k) += other.get(k);
        }
        self.batch_uploads += other.batch_uploads;
    }
}

thread_local! {
    static COUNTS: Cell<HostTraffic> = Cell::new(HostTraffic::default());
}

/// Counts `bytes` of `kind` on this thread.
pub fn count(kind: Kind, bytes: usize) {
    COUNTS.with(|c| {
        let mut t = c.get();
        *t.slot(kind) += bytes as u64;
        c.set(t);
    });
}

/// This thread's counts since the last call, which start again from zero.
pub fn take() -> HostTraffic {
    COUNTS.with(|c| c.replace(HostTraffic::default()))
}

/// Runs `f`, counting every byte it moves on this thread as `kind` (an evaluation's token
/// uploads and activations, say); what was counted before stays as it was.
pub fn counted_as<T>(kind: Kind, f: impl FnOnce() -> T) -> T {
    let before = take();
    let out = f();
    let during = take();
    COUNTS.with(|c| c.set(before));
    count(kind, during.total() as usize);
    out
}

/// Reads `t` back to the host, counting its bytes as `kind`.
pub fn read<const D: usize, K: Basic>(t: Tensor<D, K>, kind: Kind) -> TensorData {
    let data = t.into_data();
    count(kind, data.bytes().len());
    data
}

/// A tensor on `device` from host `data`, counting its bytes as `kind`.
pub fn upload<const D: usize, K: Basic>(data: TensorData, device: &Device, kind: Kind) -> Tensor<D, K> {
    count(kind, data.bytes().len());
    if kind == Kind::Batch {
        COUNTS.with(|c| c.set(HostTraffic { batch_uploads: c.get().batch_uploads + 1, ..c.get() }));
    }
    Tensor::from_data(data, device)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts follow the bytes of the data (4 per f32, 8 per i64 host id), per kind, per thread,
    /// and start again after `take`.
    #[test]
    fn the_meter_counts_bytes_by_kind_and_thread() {
        let _ = take();
        let device = Device::flex();
        let t: Tensor<2> = upload(TensorData::new(vec![1f32; 12], [3, 4]), &device, Kind::Activations);
        let ids: Tensor<2, burn::tensor::Int> = upload(TensorData::new(vec![3i64; 10], [2, 5]), &device, Kind::Batch);
        let _ = read(t, Kind::Probe);
        drop(ids);
        // Another thread's counts are its own.
        std::thread::spawn(|| count(Kind::State, 1000)).join().unwrap();
        let got = take();
        assert_eq!(got, HostTraffic { batch: 80, activations: 48, probe: 48, batch_uploads: 1, ..HostTraffic::default() });
        assert_eq!((got.total(), got.beyond_batch()), (176, 96));
        assert_eq!(take(), HostTraffic::default());
        let mut sum = got;
        sum.add(&got);
        assert_eq!((sum.get(Kind::Batch), sum.batch_uploads), (160, 2));
        // Counted as one kind: what the closure moves lands there, what came before stays.
        count(Kind::Probe, 4);
        let ids =
            counted_as(Kind::Evaluation, || upload::<1, burn::tensor::Int>(TensorData::new(vec![1i64; 3], [3]), &device, Kind::Batch));
        drop(ids);
        assert_eq!(take(), HostTraffic { probe: 4, evaluation: 24, ..HostTraffic::default() });
    }
}
