//! The Llama as a burn-train `Learner` model (feature `learner`): token batches made from
//! windows of `seq_len + 1` ids, the batcher that makes them, and the model whose train and
//! validation steps give the next-token loss averaged over tokens. What a Burn user writes to
//! train a Llama with `SupervisedTraining`, with or without copus's adaptive batching.

use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use burn::train::{InferenceStep, SequenceOutput, TrainOutput, TrainStep};
use copus_burn::{MicroBatch, cross_entropy_sum};

use crate::Llama;

/// A batch of next-token pairs, both `[batch, seq]`.
#[derive(Clone, Debug)]
pub struct TokenBatch {
    /// Token ids the model reads.
    pub inputs: Tensor<2, Int>,
    /// The next token at each place.
    pub targets: Tensor<2, Int>,
}

/// Makes a [`TokenBatch`] from windows of `seq + 1` token ids.
#[derive(Clone, Copy, Debug, Default)]
pub struct TokenBatcher;

impl Batcher<Vec<u32>, TokenBatch> for TokenBatcher {
    fn batch(&self, items: Vec<Vec<u32>>, device: &Device) -> TokenBatch {
        let windows: Vec<&[u32]> = items.iter().map(Vec::as_slice).collect();
        let b = MicroBatch::from_windows(&windows, device);
        TokenBatch { inputs: b.inputs, targets: b.targets }
    }
}

/// A Llama as a Learner model: its loss is the next-token cross entropy averaged over tokens.
#[derive(Module, Debug)]
pub struct LanguageModel {
    /// The model.
    pub llama: Llama,
}

impl LanguageModel {
    /// The loss and logits of a batch.
    pub fn forward(&self, b: TokenBatch) -> SequenceOutput {
        let logits = self.llama.forward(b.inputs);
        let tokens = b.targets.dims().iter().product::<usize>() as f64;
        let loss = cross_entropy_sum(logits.clone(), b.targets.clone()).div_scalar(tokens);
        SequenceOutput::new(loss, logits, None, b.targets)
    }
}

impl TrainStep for LanguageModel {
    type Input = TokenBatch;
    type Output = SequenceOutput;
    fn step(&self, b: TokenBatch) -> TrainOutput<SequenceOutput> {
        let out = self.forward(b);
        TrainOutput::new(self, out.loss.backward(), out)
    }
}

impl InferenceStep for LanguageModel {
    type Input = TokenBatch;
    type Output = SequenceOutput;
    fn step(&self, b: TokenBatch) -> SequenceOutput {
        self.forward(b)
    }
}
