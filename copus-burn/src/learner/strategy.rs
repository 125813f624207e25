//! The training loop: micro-batches, the noise probe, accumulation by the current plan.

use std::sync::Arc;
use std::time::Instant;

use burn::data::dataloader::Progress;
use burn::data::dataloader::split::split_dataloader;
use burn::optim::GradientsParams;
use burn::tensor::Device;
use burn::train::train::{MultiDevicesTrainStep, MultiTrainOutput, WorkerFailure};
use burn::train::{
    EventProcessorTraining, InferenceStep, Interrupter, Learner, LearnerEvent, LearnerModel, SupervisedLearningStrategy,
    SupervisedTrainingEventProcessor, TrainLoader, TrainingComponents, TrainingError, TrainingItem, TrainingStrategy, ValidLoader,
};

use copus_core::accumulation::Plan;

use super::config::{CopusLearnerError, bad};
use super::handle::CopusBatching;
use super::state::StepMeasure;
use crate::closing::ProbeMemory;
use crate::grads;

/// burn-train's custom strategy that runs copus's adaptive batching on one device or several.
pub struct CopusStrategy {
    copus: CopusBatching,
    /// Autodiff devices; the first holds the model and the optimizer.
    devices: Vec<Device>,
}

impl CopusStrategy {
    /// The strategy for `copus` on `devices` (each made an autodiff device if it is not one;
    /// at least one).
    pub(crate) fn new(copus: CopusBatching, devices: Vec<Device>) -> Self {
        let checkpointing = copus.config().gradient_checkpointing;
        let devices = devices
            .into_iter()
            .map(|d| {
                let d = if d.is_autodiff() { d } else { d.autodiff() };
                if checkpointing { d.gradient_checkpointing() } else { d }
            })
            .collect();
        Self { copus, devices }
    }

    /// The strategy's autodiff devices.
    #[cfg(test)]
    pub(crate) fn devices(&self) -> &[Device] {
        &self.devices
    }

    fn main(&self) -> &Device {
        &self.devices[0]
    }
}

/// The accumulation of the optimizer step in progress.
#[derive(Default)]
struct Open {
    sum: Option<GradientsParams>,
    sizes: Vec<usize>,
    sq_norms: Vec<f64>,
    started: Option<Instant>,
}

impl<M: LearnerModel> SupervisedLearningStrategy<M> for CopusStrategy {
    fn fit(
        &self,
        components: TrainingComponents<M>,
        mut learner: Learner<M>,
        dataloader_train: TrainLoader<M>,
        dataloader_valid: ValidLoader<M>,
        starting_epoch: usize,
    ) -> (M, SupervisedTrainingEventProcessor<M>) {
        let interrupter = components.interrupter.clone();
        let mut processor = components.event_processor;
        if let Err(message) = self.copus.check_scheduler(&learner) {
            interrupter.fail(refusal(message));
            return (learner.model(), processor);
        }
        if components.grad_accumulation.is_some() {
            interrupter
                .fail(refusal("copus chooses the gradient accumulation; remove `grads_accumulation(..)` from SupervisedTraining".into()));
            return (learner.model(), processor);
        }
        let train_items = dataloader_train.num_items();
        let multi = self.devices.len() > 1;
        let trains = if multi { split_dataloader(dataloader_train, &self.devices) } else { vec![dataloader_train.to_device(self.main())] };
        let valid = dataloader_valid.to_device(&self.main().clone().inner());
        let valid_items = valid.num_items();
        learner.fork(self.main());
        let workers = multi.then(|| MultiDevicesTrainStep::<M>::new(&self.devices));
        let mut checkpointer = components.checkpointer;
        let mut early_stopping = components.early_stopping;
        // The previous step's mean gradient, kept only while steps have one micro-batch (the
        // estimator's differencing fallback needs it).
        let mut previous = ProbeMemory::new();

        for epoch in starting_epoch..=components.num_epochs {
            interrupter.fail_on_error(processor.process_train(LearnerEvent::StartSplit { epoch_number: epoch, total_items: train_items }));
            match &workers {
                Some(w) => self.train_epoch_multi(&mut learner, &trains, w, &mut processor, &interrupter, &mut previous),
                None => self.train_epoch(&mut learner, &trains[0], &mut processor, &interrupter, &mut previous),
            }
            interrupter.fail_on_error(processor.process_train(LearnerEvent::EndSplit(epoch)));
            if interrupter.should_stop() {
                break;
            }

            interrupter.fail_on_error(processor.process_valid(LearnerEvent::StartSplit { epoch_number: epoch, total_items: valid_items }));
            valid_epoch(&learner, &valid, &mut processor, &interrupter);
            interrupter.fail_on_error(processor.process_valid(LearnerEvent::EndSplit(epoch)));
            interrupter.fail_on_error(processor.process_train(LearnerEvent::EndEpoch(epoch)));
            if checkpointer.is_some() || early_stopping.is_some() {
                interrupter.fail_on_error(processor.flush());
            }
            if interrupter.should_stop() {
                break;
            }
            if let Some(c) = &mut checkpointer {
                c.checkpoint(&learner, epoch, &components.event_store);
            }
            if let Some(e) = &mut early_stopping
                && e.should_stop(epoch, &components.event_store)
            {
                break;
            }
        }
        (learner.model(), processor)
    }
}

impl CopusStrategy {
    fn train_epoch<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        loader: &TrainLoader<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
        previous: &mut ProbeMemory,
    ) {
        let mut iterator = loader.iter();
        let mut iteration = 0;
        let mut open = Open::default();
        let mut seen = 0usize;
        loop {
            let started = Instant::now();
            let Some(item) = iterator.next() else { break };
            let item = match item {
                Ok(item) => item,
                Err(err) => {
                    interrupter.fail(err);
                    break;
                }
            };
            iteration += 1;
            let progress: Progress = iterator.progress();
            let planned = self.copus.plan();
            // The loader's progress tells how many samples the batch held.
            let size = match progress.items_processed.checked_sub(seen) {
                Some(d) if d > 0 => d,
                _ => planned.micro_batch,
            };
            seen = progress.items_processed;

            let model = learner.model();
            let out = learner.train_step(item);
            absorb(&model, &mut open, out.grads, size, planned.micro_batch, started);
            self.copus.publish_micro_batch(iteration, size, started.elapsed().as_secs_f64());

            let last = progress.items_processed >= progress.items_total;
            if !self.close_if_due(learner, &model, &mut open, planned, last, previous, interrupter) {
                break;
            }
            let lr = learner.lr_current();
            let item = TrainingItem::new(out.item, progress, Some(iteration), Some(lr));
            interrupter.fail_on_error(processor.process_train(LearnerEvent::ProcessedItem(item)));
            if interrupter.should_stop() {
                break;
            }
        }
        self.close_rest(learner, &mut open, previous, interrupter);
    }

    /// One epoch on several devices: each round runs one micro-batch per device on the same
    /// weights; a step closes only on a round boundary (accumulation counts are multiples of the
    /// device count), so no gradient is ever computed on stale weights.
    fn train_epoch_multi<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        loaders: &[TrainLoader<M>],
        workers: &MultiDevicesTrainStep<M>,
        processor: &mut SupervisedTrainingEventProcessor<M>,
        interrupter: &Interrupter,
        previous: &mut ProbeMemory,
    ) {
        let mut iterators: Vec<_> = loaders.iter().map(|l| l.iter()).collect();
        let mut iteration = 0;
        let mut open = Open::default();
        let mut seen = 0usize;
        loop {
            let started = Instant::now();
            let model = learner.model();
            let before: Vec<usize> = iterators.iter().map(|it| it.progress().items_processed).collect();
            let (outputs, progress) = match workers.step(&mut iterators, &model) {
                Ok(r) => r,
                Err(e) => {
                    interrupter.fail(TrainingError::from(e));
                    break;
                }
            };
            if outputs.is_empty() {
                break;
            }
            let planned = self.copus.plan();
            let round = outputs.len();
            let processed = iterators.iter().map(|it| it.progress().items_processed);
            let (sizes, weight_size) = round_sizes(processed, &before, &progress, seen, round, planned.micro_batch);
            seen = progress.items_processed;
            let (items, measured) = self.measure_round(&model, outputs);
            // The round's time includes the per-device norms and the moves to the main device,
            // which grow with the number of micro-batches like the forward and backward do.
            let seconds = started.elapsed().as_secs_f64();
            let items: Vec<_> = items
                .into_iter()
                .zip(measured)
                .zip(sizes)
                .map(|((item, (g, sq)), size)| {
                    iteration += 1;
                    absorb_weighted(&model, &mut open, g, sq, weight_size, size, planned.micro_batch, started);
                    self.copus.publish_micro_batch(iteration, size, seconds);
                    (iteration, item)
                })
                .collect();
            let last = progress.items_processed >= progress.items_total;
            if !self.close_if_due(learner, &model, &mut open, planned, last, previous, interrupter) {
                break;
            }
            let lr = learner.lr_current();
            for (iteration, item) in items {
                let item = TrainingItem::new(item, progress.clone(), Some(iteration), Some(lr.clone()));
                interrupter.fail_on_error(processor.process_train(LearnerEvent::ProcessedItem(item)));
            }
            if interrupter.should_stop() {
                break;
            }
        }
        self.close_rest(learner, &mut open, previous, interrupter);
    }

    /// Multi-device round, measure: each output's gradient's squared norm where it was computed,
    /// and the gradient moved to the main device; the outputs' items apart, in the same order.
    fn measure_round<M: LearnerModel, TO>(&self, model: &M, outputs: Vec<MultiTrainOutput<TO>>) -> (Vec<TO>, Vec<(GradientsParams, f64)>) {
        let round = outputs.len();
        let mut items = Vec::with_capacity(round);
        let mut measured = Vec::with_capacity(round);
        for out in outputs {
            let g = out.output.grads;
            let sq = grads::sq_norm_on_device(model, &g);
            measured.push((g.to_device(self.main(), model), sq));
            items.push(out.output.item);
        }
        (items, measured)
    }

    /// Takes the optimizer step once the plan's micro-batches are in, or the epoch's data ends.
    /// False when the step was refused (the interrupter then holds the error).
    #[allow(clippy::too_many_arguments)]
    fn close_if_due<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        model: &M,
        open: &mut Open,
        planned: Plan,
        last: bool,
        previous: &mut ProbeMemory,
        interrupter: &Interrupter,
    ) -> bool {
        // By samples: batches of an older size still queued in a prefetching loader make up the
        // planned batch as well as batches of the new size do.
        let samples: usize = open.sizes.iter().sum();
        let full = samples >= planned.batch();
        if !(full || last) {
            return true;
        }
        match self.optimizer_step(learner, model, open, planned.micro_batch, previous, full) {
            Ok(()) => true,
            Err(message) => {
                interrupter.fail(refusal(message));
                false
            }
        }
    }

    /// A loader that ended early (interrupted or failed) leaves no half step behind.
    fn close_rest<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        open: &mut Open,
        previous: &mut ProbeMemory,
        interrupter: &Interrupter,
    ) {
        if !open.sizes.is_empty() && !interrupter.should_stop() {
            let model = learner.model();
            let m = self.copus.plan().micro_batch;
            if let Err(message) = self.optimizer_step(learner, &model, open, m, previous, false) {
                interrupter.fail(refusal(message));
            }
        }
    }

    fn optimizer_step<M: LearnerModel>(
        &self,
        learner: &mut Learner<M>,
        model: &M,
        open: &mut Open,
        micro_batch: usize,
        previous: &mut ProbeMemory,
        full: bool,
    ) -> Result<(), String> {
        let overhead = Instant::now();
        self.copus.check_loader(&open.sizes, full)?;
        let Some(sum) = open.sum.take() else { return Ok(()) };
        let samples: usize = open.sizes.iter().sum();
        // sum holds sum_k (n_k / m) g_k; the mean gradient is sum_k n_k g_k / sum_k n_k.
        let mean = grads::scaled(model, &sum, micro_batch as f64 / samples as f64);
        // One micro-batch: the mean is that micro-batch's gradient, whose norm is measured.
        let grad_sq_norm = match open.sq_norms.as_slice() {
            [only] => *only,
            _ => grads::sq_norm_on_device(model, &mean),
        };
        let num_micro = open.sizes.len();
        let diff_sq_norm = previous.previous(num_micro).map(|prev| grads::diff_sq_norm_on_device(model, &mean, prev));
        previous.remember(model, num_micro, &mean);
        self.copus.set_step_samples(samples);
        learner.lr_step();
        learner.optimizer_step(mean);
        let step_seconds = open.started.take().map_or(0.0, |t| t.elapsed().as_secs_f64());
        self.copus.finish_step(StepMeasure {
            micro_sizes: std::mem::take(&mut open.sizes),
            micro_sq_norms: std::mem::take(&mut open.sq_norms),
            grad_sq_norm,
            diff_sq_norm,
            step_seconds,
            overhead_seconds: overhead.elapsed().as_secs_f64(),
        });
        Ok(())
    }
}

/// Multi-device round, size: each device's batch from its loader's items `processed`, against
/// those `before` the round; where that does not match the round's `round` outputs, the samples
/// since `seen` split evenly. Also the size each gradient is weighted as.
fn round_sizes(
    processed: impl Iterator<Item = usize>,
    before: &[usize],
    progress: &Progress,
    seen: usize,
    round: usize,
    micro_batch: usize,
) -> (Vec<usize>, usize) {
    // Each device's batch, from its loader's progress. At an epoch's end they may differ
    // (a split's last batch is short, or a loader is done); such a step is not fed to the
    // estimator, which needs equal micro-batches.
    let mut sizes: Vec<usize> = processed.zip(before).map(|(p, b)| p.saturating_sub(*b)).filter(|&d| d > 0).collect();
    if sizes.len() != round {
        // Progress that does not match the outputs: split the round's samples evenly.
        let d = progress.items_processed.saturating_sub(seen);
        sizes = vec![if d >= round { d / round } else { micro_batch }; round];
    }
    // burn-train hands the outputs back in the order they finished, without their
    // device, so uneven sizes cannot be paired with their gradients: weight each by the
    // round's mean (the round's samples still count in full) and record the real sizes,
    // which keep the step out of the estimator.
    let weight_size = if sizes.iter().all(|&x| x == sizes[0]) { sizes[0] } else { sizes.iter().sum::<usize>() / round };
    (sizes, weight_size)
}

/// A setting copus refuses, as burn-train's error (it has no variant of its own for this).
fn refusal(message: String) -> TrainingError {
    TrainingError::Workers(vec![WorkerFailure { device_id: 0, message }])
}

/// Adds a micro-batch's gradient to the open step, weighted by its samples (so a short last
/// batch counts for what it holds), and records its squared norm.
fn absorb<M: LearnerModel>(model: &M, open: &mut Open, g: GradientsParams, size: usize, micro_batch: usize, started: Instant) {
    let sq = grads::sq_norm_on_device(model, &g);
    absorb_measured(model, open, g, sq, size, micro_batch, started);
}

fn absorb_measured<M: LearnerModel>(
    model: &M,
    open: &mut Open,
    g: GradientsParams,
    sq: f64,
    size: usize,
    micro_batch: usize,
    started: Instant,
) {
    absorb_weighted(model, open, g, sq, size, size, micro_batch, started);
}

/// [`absorb_measured`] with the gradient weighted as `weight_size` samples and recorded as
/// `size`.
#[allow(clippy::too_many_arguments)]
fn absorb_weighted<M: LearnerModel>(
    model: &M,
    open: &mut Open,
    g: GradientsParams,
    sq: f64,
    weight_size: usize,
    size: usize,
    micro_batch: usize,
    started: Instant,
) {
    let weight = weight_size as f64 / micro_batch as f64;
    let g = if weight == 1.0 { g } else { grads::scaled(model, &g, weight) };
    open.sum = Some(grads::add(model, open.sum.take(), g));
    open.sizes.push(size);
    open.sq_norms.push(sq);
    open.started.get_or_insert(started);
}

fn valid_epoch<M: LearnerModel>(
    learner: &Learner<M>,
    loader: &ValidLoader<M>,
    processor: &mut SupervisedTrainingEventProcessor<M>,
    interrupter: &Interrupter,
) {
    let model = learner.model().valid();
    let mut iterator = loader.iter();
    let mut iteration = 0;
    while let Some(item) = iterator.next() {
        let item = match item {
            Ok(item) => item,
            Err(err) => {
                interrupter.fail(err);
                break;
            }
        };
        iteration += 1;
        let progress = iterator.progress();
        let out = InferenceStep::step(&model, item);
        let item = TrainingItem::new(out, progress, Some(iteration), None);
        interrupter.fail_on_error(processor.process_valid(LearnerEvent::ProcessedItem(item)));
        if interrupter.should_stop() {
            break;
        }
    }
}

impl CopusBatching {
    /// The burn-train training strategy on `device` (an autodiff device is made from it).
    pub fn training_strategy<M: LearnerModel>(&self, device: Device) -> TrainingStrategy<M> {
        self.shared.lock().devices = 1;
        TrainingStrategy::Custom(Arc::new(CopusStrategy::new(self.clone(), vec![device])))
    }

    /// The strategy on several devices through burn-train's multi-device step: each round runs
    /// one micro-batch per device (the loader split across them, as Burn's own multi-device
    /// strategy does), gradients are gathered on the first device, and accumulation counts are
    /// multiples of the device count, so a bigger batch costs more rounds only every
    /// `devices` micro-batches.
    pub fn training_strategy_multi<M: LearnerModel>(&self, devices: Vec<Device>) -> Result<TrainingStrategy<M>, CopusLearnerError> {
        let n = devices.len();
        let cfg = &self.shared.config;
        if n == 0 {
            return Err(bad("devices", "one or more", n));
        }
        if !cfg.initial_accumulation.is_multiple_of(n) {
            return Err(bad("initial_accumulation", format!("a multiple of the {n} devices"), cfg.initial_accumulation));
        }
        if cfg.max_accumulation < n {
            return Err(bad("max_accumulation", format!("at least the {n} devices"), cfg.max_accumulation));
        }
        self.shared.lock().devices = n;
        Ok(TrainingStrategy::Custom(Arc::new(CopusStrategy::new(self.clone(), devices))))
    }
}
