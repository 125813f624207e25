//! Held-out loss: the mean next-token loss per token over the first held-out sequences, for a
//! whole model or through any summed-loss function (the engine's ranks).

use burn::module::Module;
use burn::tensor::Device;
use copus_burn::MicroBatch;
use copus_models::Llama;

use crate::data::PackedDataset;

/// Mean held-out loss per token over the first `count` held-out sequences (in stream order).
pub fn evaluate(model: &Llama, heldout: &PackedDataset, count: usize, micro: usize) -> f64 {
    let eval = model.valid();
    let device = eval.embed_tokens.weight.device();
    heldout_loss(heldout, count, micro, &device, |b| f64::from(eval.loss_sum(b.inputs, b.targets).into_scalar::<f32>()))
}

/// The first `count` held-out sequences (`seq_len + 1` ids each), row-major: what
/// [`copus_burn::Engine::evaluate`] takes.
pub fn windows(heldout: &PackedDataset, count: usize) -> Vec<i64> {
    (0..count.min(heldout.num_seqs())).flat_map(|i| heldout.sequence(i).iter().map(|&t| i64::from(t)).collect::<Vec<_>>()).collect()
}

/// Mean loss per token over the first `count` held-out sequences in micro-batches of `micro`,
/// `loss_sum` giving a micro-batch's summed loss.
pub fn heldout_loss(heldout: &PackedDataset, count: usize, micro: usize, device: &Device, loss_sum: impl Fn(MicroBatch) -> f64) -> f64 {
    let count = count.min(heldout.num_seqs());
    let (mut sum, mut tokens) = (0.0, 0usize);
    let idx: Vec<usize> = (0..count).collect();
    for chunk in idx.chunks(micro.max(1)) {
        let seqs: Vec<_> = chunk.iter().map(|&i| heldout.sequence(i)).collect();
        let seqs: Vec<&[u32]> = seqs.iter().map(|s| s.as_ref()).collect();
        sum += loss_sum(MicroBatch::from_windows(&seqs, device));
        tokens += chunk.len() * heldout.seq_len();
    }
    sum / tokens.max(1) as f64
}
