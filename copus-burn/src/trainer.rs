//! The single-rank trainer: one optimizer step is `a` micro-batches of `B_m` sequences, the loss
//! normalised by the step's total number of target tokens (so it does not depend on how B_g is
//! split), gradients accumulated, AdamW with explicit PyTorch-like settings, warmup + cosine
//! schedule scaled by the batch-size LR rule, global-norm clipping, and the gradient-noise-scale
//! probe: each micro-batch's squared gradient norm and the squared norm of the step's mean
//! gradient feed copus-core's estimator, measured before clipping.

use std::time::Instant;

use burn::module::Module;
use burn::optim::GradientsParams;
use burn::tensor::{Int, Tensor};
use copus_core::gns::{GnsEstimator, StepStats};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::closing::StepCloser;
use crate::grads;
use crate::optim::{AdamW, OptimConfig, SettingError};

/// A causal language model copus can train.
pub trait CausalLm: Module + Clone + Send + std::fmt::Debug + 'static {
    /// Summed next-token cross entropy over every position of `inputs` `[b, s]`, shape `[1]`.
    fn loss_sum(&self, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1>;
    /// Path fragments of parameters that take no weight decay (norms, embeddings).
    fn no_decay_predicates(&self) -> Vec<String> {
        Vec::new()
    }
}

/// Bad trainer settings or inputs.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum TrainError {
    /// An optimizer setting out of range.
    #[error(transparent)]
    Setting(#[from] SettingError),
    /// A step with no micro-batch, or micro-batches of different shapes.
    #[error("a step needs one or more micro-batches of equal shape [B_m, seq]; {0}")]
    Batch(String),
    /// The gradient-noise estimator refused the measurement.
    #[error("gradient noise scale: {0}")]
    Gns(#[from] copus_core::gns::GnsError),
    /// The loss is not finite.
    #[error("the loss became {0} at step {1}; lower the learning rate or enable clipping")]
    NonFinite(f64, u64),
}

/// One micro-batch: inputs and next-token targets, both `[B_m, seq]`.
#[derive(Clone, Debug)]
pub struct MicroBatch {
    /// Token ids.
    pub inputs: Tensor<2, Int>,
    /// The token after each input position.
    pub targets: Tensor<2, Int>,
}

impl MicroBatch {
    /// A micro-batch from token windows of `seq + 1` tokens each: inputs are the first `seq`,
    /// targets the last `seq` (the next token at every position). Windows must be equally long.
    pub fn from_windows<T: Copy + Into<i64>>(windows: &[&[T]], device: &burn::tensor::Device) -> Self {
        let seq = windows.first().map_or(0, |w| w.len().saturating_sub(1));
        assert!(windows.iter().all(|w| w.len() == seq + 1), "token windows of unequal length");
        let inputs: Vec<i64> = windows.iter().flat_map(|w| w[..seq].iter().map(|&t| t.into())).collect();
        let targets: Vec<i64> = windows.iter().flat_map(|w| w[1..].iter().map(|&t| t.into())).collect();
        let shape = [windows.len(), seq];
        Self {
            inputs: crate::traffic::upload(burn::tensor::TensorData::new(inputs, shape), device, crate::traffic::Kind::Batch),
            targets: crate::traffic::upload(burn::tensor::TensorData::new(targets, shape), device, crate::traffic::Kind::Batch),
        }
    }
}

/// What one step measured; one JSONL line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// Optimizer steps done after this one.
    pub step: u64,
    /// Mean loss per target token.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global batch B_g, sequences.
    pub global_batch: usize,
    /// Micro-batch B_m, sequences.
    pub micro_batch: usize,
    /// Micro-batches in the step.
    pub num_micro: usize,
    /// Target tokens seen so far.
    pub tokens_seen: u64,
    /// Wall seconds of the step.
    pub step_time: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Smoothed |G|^2.
    pub grad_sq: Option<f64>,
    /// Smoothed tr(Sigma).
    pub trace: Option<f64>,
    /// Smoothed B_simple (sequences).
    pub b_simple: Option<f64>,
    /// Whether the estimate comes from differencing steps (n == 1).
    pub gns_biased: bool,
}

/// A step's accumulated gradient and the probe's numbers.
pub struct Accumulated {
    /// Mean gradient of the step (the loss is normalised by all target tokens).
    pub grads: GradientsParams,
    /// Mean loss per target token.
    pub loss: f64,
    /// L: mean over micro-batches of |g_k|^2, g_k the mean gradient of micro-batch k.
    pub mean_micro_sq_norm: f64,
    /// T: |g|^2 of the step's mean gradient.
    pub grad_sq_norm: f64,
}

/// Computes the step's gradient over micro-batches without updating anything.
pub fn accumulate<M: CausalLm>(model: &M, micro: &[MicroBatch]) -> Result<Accumulated, TrainError> {
    accumulate_with(model, micro, true)
}

/// [`accumulate`], with the probe's per-micro-batch norms only if `probe` (else
/// `mean_micro_sq_norm` is NaN).
pub fn accumulate_with<M: CausalLm>(model: &M, micro: &[MicroBatch], probe: bool) -> Result<Accumulated, TrainError> {
    let Some(first) = micro.first() else { return Err(TrainError::Batch("got none".into())) };
    let shape = first.inputs.dims();
    for (k, m) in micro.iter().enumerate() {
        if m.inputs.dims() != shape || m.targets.dims() != shape {
            return Err(TrainError::Batch(format!(
                "micro-batch {k} has inputs {:?} and targets {:?}, the first has {shape:?}",
                m.inputs.dims(),
                m.targets.dims()
            )));
        }
    }
    let n = micro.len();
    let tokens_per_micro = (shape[0] * shape[1]) as f64;
    let total_tokens = tokens_per_micro * n as f64;
    let mut acc: Option<GradientsParams> = None;
    let mut loss = 0.0;
    let mut sum_micro_sq = 0.0;
    for m in micro {
        let loss_k = model.loss_sum(m.inputs.clone(), m.targets.clone()).div_scalar(total_tokens);
        let g = GradientsParams::from_grads(loss_k.backward(), model);
        loss += f64::from(loss_k.into_scalar::<f32>());
        // g is this micro-batch's share of the step mean; its own mean gradient is n times it.
        // Its norm is summed while it is added in.
        let (sum, sq) = grads::add_measured(model, acc, g, probe);
        sum_micro_sq += sq * (n * n) as f64;
        acc = Some(sum);
    }
    let grads = acc.expect("at least one micro-batch");
    // With one micro-batch its norm is the step's: read the gradients once.
    let grad_sq_norm = if n == 1 && probe { sum_micro_sq } else { grads::sq_norm(model, &grads) };
    let mean_micro_sq_norm = if probe { sum_micro_sq / n as f64 } else { f64::NAN };
    Ok(Accumulated { grads, loss, mean_micro_sq_norm, grad_sq_norm })
}

/// Trains a model on one rank.
pub struct Trainer<M: CausalLm> {
    model: Option<M>,
    optim: AdamW,
    cfg: OptimConfig,
    closer: StepCloser,
    step: u64,
    tokens_seen: u64,
    last_stats: Option<StepStats>,
    probe: bool,
}

impl<M: CausalLm> Trainer<M> {
    /// A trainer for `model` (built on an autodiff device).
    pub fn new(model: M, cfg: OptimConfig) -> Result<Self, TrainError> {
        cfg.validate()?;
        let optim = cfg.adamw(&model.no_decay_predicates());
        let closer = StepCloser::with_estimator(cfg.gns_estimator()?);
        Ok(Self { model: Some(model), optim, cfg, closer, step: 0, tokens_seen: 0, last_stats: None, probe: true })
    }

    /// The same trainer with the noise-scale probe off: no per-micro-batch norms, no
    /// difference against the previous step, no estimate. Only to measure what the probe costs
    /// (`recipes bench` runs the same split both ways).
    pub fn without_probe(mut self) -> Self {
        self.probe = false;
        self
    }

    /// The model.
    pub fn model(&self) -> &M {
        self.model.as_ref().expect("model present between steps")
    }

    /// Steps done.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// What the probe measured in the last step (before smoothing).
    pub fn last_stats(&self) -> Option<&StepStats> {
        self.last_stats.as_ref()
    }

    /// The noise-scale estimator.
    pub fn gns(&self) -> &GnsEstimator {
        self.closer.gns()
    }

    /// The settings.
    pub fn config(&self) -> &OptimConfig {
        &self.cfg
    }

    /// One optimizer step over `micro` (all `[B_m, seq]`).
    pub fn step(&mut self, micro: &[MicroBatch]) -> Result<StepMetrics, TrainError> {
        let start = Instant::now();
        // Everything that can fail only borrows the model; it is moved out just for the update.
        let model = self.model.as_ref().expect("model present between steps");
        let acc = accumulate_with(model, micro, self.probe)?;
        if !acc.loss.is_finite() {
            return Err(TrainError::NonFinite(acc.loss, self.step));
        }
        let [b_m, seq] = micro[0].inputs.dims();
        let n = micro.len();
        let global_batch = b_m * n;
        let samples = self.tokens_seen / seq.max(1) as u64;
        let closed = if self.probe {
            let diff = self.closer.memory().previous(n).map(|p| grads::diff_sq_norm(model, &acc.grads, p));
            let stats = StepStats {
                micro_batch: b_m,
                num_micro: n,
                mean_micro_sq_norm: acc.mean_micro_sq_norm,
                grad_sq_norm: acc.grad_sq_norm,
                diff_sq_norm: diff,
            };
            let closed = self.closer.close(model, &self.cfg, self.step, samples, global_batch, &stats, acc.grads)?;
            self.last_stats = Some(stats);
            closed
        } else {
            self.closer.close_unprobed(model, &self.cfg, self.step, samples, global_batch, acc.grad_sq_norm, acc.grads)
        };
        let model = self.model.take().expect("model present between steps");
        self.model = Some(self.optim.step(closed.lr, model, closed.grads));
        self.step += 1;
        self.tokens_seen += (global_batch * seq) as u64;
        let est = closed.estimate;
        Ok(StepMetrics {
            step: self.step,
            loss: acc.loss,
            lr: closed.lr,
            global_batch,
            micro_batch: b_m,
            num_micro: n,
            tokens_seen: self.tokens_seen,
            step_time: start.elapsed().as_secs_f64(),
            grad_norm: closed.grad_norm,
            grad_sq: est.map(|e| e.grad_sq),
            trace: est.map(|e| e.trace),
            b_simple: est.and_then(|e| e.b_simple()),
            gns_biased: est.is_some_and(|e| e.biased),
        })
    }
}
