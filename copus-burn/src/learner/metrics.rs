//! Burn metrics that show the add-on's state in burn-train's loggers and dashboard.
//!
//! Each takes no input from the model output (`Input = ()`, which every output adapts to) and
//! reads the snapshot the strategy published for the same training iteration, so an event
//! processor that runs behind still reports the value of the step the item belongs to.

use std::sync::Arc;

use burn::tensor::TensorReadError;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Metric, MetricAttributes, MetricMetadata, MetricName, Numeric, NumericAttributes, NumericEntry, SerializedEntry,
};

use super::handle::CopusBatching;
use super::state::Snapshot;

macro_rules! snapshot_metric {
    ($(#[$doc:meta])* $name:ident, $label:expr, $unit:expr, $precision:expr, $higher:expr, $read:expr) => {
        $(#[$doc])*
        #[derive(Clone)]
        pub struct $name {
            copus: CopusBatching,
            name: MetricName,
            state: NumericMetricState,
        }

        impl $name {
            pub(crate) fn new(copus: CopusBatching) -> Self {
                Self { copus, name: Arc::new($label.to_string()), state: NumericMetricState::new() }
            }

            fn format(&self) -> FormatOptions {
                let f = FormatOptions::new(self.name.clone()).precision($precision);
                match $unit {
                    Some(unit) => f.unit(unit),
                    None => f,
                }
            }
        }

        impl Metric for $name {
            type Input = ();

            fn name(&self) -> MetricName {
                self.name.clone()
            }

            fn attributes(&self) -> MetricAttributes {
                NumericAttributes { unit: $unit.map(str::to_string), higher_is_better: $higher }.into()
            }

            fn update(&mut self, _item: &(), metadata: &MetricMetadata) -> Result<SerializedEntry, TensorReadError> {
                let read: fn(&Snapshot) -> Option<f64> = $read;
                match read(&self.copus.snapshot_at(metadata.iteration)) {
                    Some(value) => {
                        self.state.update(value, 1);
                        Ok(self.state.compute_update(self.format()))
                    }
                    None => Ok(SerializedEntry::not_available($unit)),
                }
            }

            fn compute(&mut self) -> Result<SerializedEntry, TensorReadError> {
                Ok(self.state.compute_final(self.format()))
            }

            fn clear(&mut self) {
                self.state.reset();
            }
        }

        impl Numeric for $name {
            fn value(&self) -> Option<NumericEntry> {
                Some(self.state.current_value())
            }

            fn running_value(&self) -> Option<NumericEntry> {
                Some(self.state.running_value())
            }

            fn final_value(&self) -> NumericEntry {
                self.state.final_value()
            }
        }
    };
}

snapshot_metric!(
    /// The smoothed gradient noise scale `B_simple = tr(Sigma) / |G|^2` in samples: the batch
    /// beyond which more samples per step buy little. "N/A" until measured.
    NoiseScaleMetric,
    "Noise Scale (B_simple)",
    None::<&str>,
    1,
    true,
    |s| s.b_simple
);

snapshot_metric!(
    /// Samples per optimizer step (micro-batch x accumulation) of the step in progress.
    BatchSizeMetric,
    "Batch Size",
    Some("samples"),
    0,
    true,
    |s| Some(s.plan.batch() as f64)
);

snapshot_metric!(
    /// Statistical efficiency of the current batch against `B0`: the share of a sample's progress
    /// at `B0` that a sample at this batch still makes. "N/A" until the noise scale is measured.
    EfficiencyMetric,
    "Statistical Efficiency",
    None::<&str>,
    3,
    true,
    |s| s.efficiency
);

impl CopusBatching {
    /// Burn metric: the smoothed noise scale `B_simple`.
    pub fn noise_scale_metric(&self) -> NoiseScaleMetric {
        NoiseScaleMetric::new(self.clone())
    }

    /// Burn metric: samples per optimizer step.
    pub fn batch_size_metric(&self) -> BatchSizeMetric {
        BatchSizeMetric::new(self.clone())
    }

    /// Burn metric: statistical efficiency of the current batch against `B0`.
    pub fn efficiency_metric(&self) -> EfficiencyMetric {
        EfficiencyMetric::new(self.clone())
    }
}
