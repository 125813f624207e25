//! The learning-rate scheduler wrapper: the inner schedule times the batch rule's factor,
//! advanced by samples or steps, with the add-on's state inside the scheduler's record.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use burn::optim::LearningRate;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::lr_scheduler::{LrScheduler, LrSchedulerRecord};

use super::config::ScheduleClock;
use super::state::{Shared, from_saved_json, saved_json};

/// A scheduler whose rate is the inner scheduler's times the batch rule's factor.
#[derive(Clone)]
pub struct BatchScaledLr {
    pub(super) inner: ModuleLrScheduler,
    pub(super) shared: Arc<Shared>,
    /// Schedule steps owed (the samples clock advances by fractions).
    pub(super) debt: f64,
    /// The inner scheduler's latest rate.
    pub(super) last: Option<LearningRate>,
}

const RECORD_PREFIX: &str = "copus";

/// The group of a one-group `ModuleLrScheduler` whose record is the schedule's own.
const BASE_GROUP: &str = "0";

impl LrScheduler for BatchScaledLr {
    fn step(&mut self) -> LearningRate {
        self.shared.scheduler_steps.fetch_add(1, Ordering::Relaxed);
        let (factor, advance) = {
            let s = self.shared.lock();
            (s.lr_factor, s.schedule_advance)
        };
        let rate = match self.shared.config.schedule_clock {
            ScheduleClock::Steps => self.inner.step().base(),
            ScheduleClock::Samples => {
                self.debt += advance;
                while self.debt >= 1.0 - 1e-9 || self.last.is_none() {
                    self.last = Some(self.inner.step().base());
                    self.debt -= 1.0;
                }
                self.last.expect("stepped above")
            }
        };
        rate * factor
    }

    fn to_record(&self) -> LrSchedulerRecord {
        let s = self.shared.lock();
        let json = saved_json(&s.kept, self.debt);
        // Records hold numbers only: the state's JSON as little-endian u64 words.
        let mut copus = LrSchedulerRecord::new().with_scalar("len", json.len() as u64);
        for (i, chunk) in json.chunks(8).enumerate() {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            copus = copus.with_scalar(&i.to_string(), u64::from_le_bytes(word));
        }
        // The schedule's own keys, without the group level the wrapper's inner scheduler adds
        // (the Learner adds its own, as it does for a schedule given without copus).
        let mut record = self.inner.to_record().record(BASE_GROUP).with_record(RECORD_PREFIX, copus);
        if let Some(rate) = self.last {
            record = record.with_scalar("copus_last_rate", rate);
        }
        record
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        self.inner = self.inner.clone().load_record(LrSchedulerRecord::new().with_record(BASE_GROUP, record.clone()));
        self.last = record.scalar::<f64>("copus_last_rate");
        let copus = record.record(RECORD_PREFIX);
        let Some(len) = copus.scalar::<u64>("len") else {
            // A plain burn-train checkpoint: the schedule continues, copus starts afresh.
            return;
        };
        let mut json = Vec::with_capacity(len as usize + 8);
        for i in 0..len.div_ceil(8) {
            let Some(word) = copus.scalar::<u64>(&i.to_string()) else { return };
            json.extend_from_slice(&word.to_le_bytes());
        }
        json.truncate(len as usize);
        let Some((kept, debt)) = from_saved_json(&json) else {
            tracing::warn!("copus: the checkpoint's batching state does not parse; continuing from the current state");
            return;
        };
        self.debt = debt;
        let micro_batch = kept.plan.micro_batch;
        self.shared.lock().kept = kept;
        self.shared.micro_batch.store(micro_batch, Ordering::Relaxed);
    }
}
