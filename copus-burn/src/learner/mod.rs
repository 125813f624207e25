//! Adaptive batching for burn-train's `SupervisedTraining` (feature `learner`).
//!
//! Enabling it on an existing Learner takes two calls on one [`CopusBatching`] handle:
//!
//! ```ignore
//! use copus_burn::learner::{CopusBatchingConfig, CopusTrainingExt};
//! let copus = CopusBatchingConfig::new(16).init()?;            // loader batches of 16, B0 = 16
//! let learner = copus.learner(model, optim, scheduler);        // the scheduler, batch-scaled
//! SupervisedTraining::new(dir, train_loader, valid_loader)
//!     .with_copus(&copus, device)                              // strategy and the three metrics
//!     .launch(learner);
//! ```
//!
//! A Learner built without the scaled scheduler is refused when training starts (unless the LR
//! rule is `Constant`), so forgetting it cannot silently leave the learning rate unscaled.
//!
//! The training strategy runs the loader's batches as micro-batches and accumulates `k` of them
//! per optimizer step (the mean gradient, weighted by each micro-batch's samples). Per step it
//! measures every micro-batch's squared gradient norm and that of the mean, feeds copus-core's
//! noise-scale estimator, and every `adapt_every` steps picks the accumulation count (and, with a
//! loader built on [`CopusBatching::batch_strategy`], the micro-batch size) with the highest
//! Goodput under the measured step costs ([`copus_core::accumulation`]). The optimizer, its state
//! and the model are never rebuilt: a batch change only changes how many gradients go into the
//! next step and the learning-rate factor the scheduler wrapper applies.
//!
//! Files: `config` (settings), `state` (the shared state and what a checkpoint keeps), `lr` (the
//! scheduler wrapper), `loader` (the batch strategy), `handle` (the shared handle and its
//! decisions), `strategy` (the training strategy, on one device or several), `metrics` (what
//! burn-train's dashboard shows). Each imports only files listed before it.

mod config;
mod handle;
mod loader;
mod lr;
mod metrics;
mod state;
mod strategy;

use burn::tensor::Device;
use burn::train::{LearnerModel, SupervisedTraining};

pub use config::{CopusBatchingConfig, CopusLearnerError, ScheduleClock};
pub use handle::CopusBatching;
pub use loader::AdaptiveBatchSize;
pub use lr::BatchScaledLr;
pub use metrics::{BatchSizeMetric, EfficiencyMetric, NoiseScaleMetric};
pub use state::{Snapshot, StepRecord};
pub use strategy::CopusStrategy;

/// Wires copus into burn-train's `SupervisedTraining` in one call.
pub trait CopusTrainingExt {
    /// The copus training strategy on `device`, and its three metrics (noise scale, batch
    /// size, efficiency). Build the Learner with [`CopusBatching::learner`].
    fn with_copus(self, copus: &CopusBatching, device: Device) -> Self;
}

impl<M: LearnerModel> CopusTrainingExt for SupervisedTraining<M> {
    fn with_copus(self, copus: &CopusBatching, device: Device) -> Self {
        self.with_training_strategy(copus.training_strategy(device))
            .metric_train_numeric(copus.noise_scale_metric())
            .metric_train_numeric(copus.batch_size_metric())
            .metric_train_numeric(copus.efficiency_metric())
    }
}

#[cfg(test)]
mod tests {
    use burn::optim::lr_scheduler::LrScheduler;
    use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
    use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
    use copus_core::goodput::LrRule;

    use super::*;

    /// Rates of a linear schedule from 1.0 down by 0.01 per schedule step, scaled by copus, as
    /// steps of `samples` samples go by (B0 = 4).
    fn rates(clock: ScheduleClock, samples: &[usize]) -> Vec<f64> {
        let copus = CopusBatchingConfig::new(4).with_schedule_clock(clock).with_lr_rule(LrRule::Constant).init().unwrap();
        let mut lr = copus.lr_scheduler(LinearLrSchedulerConfig::new(1.0, 0.0, 100).init().unwrap());
        samples
            .iter()
            .map(|&n| {
                copus.set_step_samples(n);
                lr.step()
            })
            .collect()
    }

    #[test]
    fn gradient_checkpointing_reaches_the_strategys_devices() {
        let strategy = |on: bool| {
            let copus = CopusBatchingConfig::new(4).with_gradient_checkpointing(on).init().unwrap();
            CopusStrategy::new(copus, vec![Device::flex()])
        };
        let want = format!("{:?}", Device::flex().autodiff().gradient_checkpointing().gradient_checkpointing_strategy());
        let off = format!("{:?}", Device::flex().autodiff().gradient_checkpointing_strategy());
        assert_ne!(want, off);
        assert_eq!(format!("{:?}", strategy(true).devices()[0].gradient_checkpointing_strategy()), want);
        assert_eq!(format!("{:?}", strategy(false).devices()[0].gradient_checkpointing_strategy()), off);
    }

    /// Parameter groups keep their own schedules when each is wrapped: every group's rate is
    /// its own schedule's times the batch factor.
    #[test]
    fn each_wrapped_group_keeps_its_schedule() {
        use burn::module::{ParamGroup, ParamId};
        use burn::optim::lr_scheduler::constant::ConstantLr;
        let copus = CopusBatchingConfig::new(4).with_lr_rule(LrRule::Linear).init().unwrap();
        copus.shared.lock().lr_factor = 2.0;
        let head = ParamId::new();
        let mut lr = ModuleLrScheduler::new(copus.lr_scheduler(ConstantLr::from(0.1)))
            .with_group(ParamGroup::from_ids(vec![head]), copus.lr_scheduler(ConstantLr::from(0.01)));
        let rates = lr.step();
        assert!((rates.base() - 0.2).abs() < 1e-12, "{}", rates.base());
        assert!((rates.lr_from_param(head, None) - 0.02).abs() < 1e-12);
        assert!((rates.lr_from_param(ParamId::new(), None) - 0.2).abs() < 1e-12);
    }

    #[test]
    fn the_schedule_advances_by_samples_or_by_steps() {
        let close = |a: &[f64], b: &[f64]| a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12);
        // At B0 both clocks take one schedule step per optimizer step.
        let at_b0 = rates(ScheduleClock::Samples, &[4, 4, 4]);
        assert!(close(&at_b0, &rates(ScheduleClock::Steps, &[4, 4, 4])), "{at_b0:?}");
        assert!(close(&at_b0, &[1.0, 0.99, 0.98]), "{at_b0:?}");
        // Twice B0 takes two schedule steps a step; half of it one every other step.
        let by_samples = rates(ScheduleClock::Samples, &[4, 8, 8, 2, 2]);
        assert!(close(&by_samples, &[1.0, 0.98, 0.96, 0.96, 0.95]), "{by_samples:?}");
        let by_steps = rates(ScheduleClock::Steps, &[4, 8, 8, 2, 2]);
        assert!(close(&by_steps, &[1.0, 0.99, 0.98, 0.97, 0.96]), "{by_steps:?}");
    }
}
