//! The loader's batch strategy that cuts batches of copus's current micro-batch.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use burn::data::dataloader::BatchStrategy;

use super::state::Shared;

/// A loader batch strategy whose size is copus's current micro-batch.
pub struct AdaptiveBatchSize<I> {
    pub(super) items: Vec<I>,
    pub(super) shared: Arc<Shared>,
}

impl<I: Send + Sync + 'static> BatchStrategy<I> for AdaptiveBatchSize<I> {
    fn add(&mut self, item: I) {
        self.items.push(item);
    }

    fn batch(&mut self, force: bool) -> Option<Vec<I>> {
        self.shared.follows.store(true, Ordering::Relaxed);
        let size = self.shared.micro_batch.load(Ordering::Relaxed).max(1);
        if self.items.is_empty() || (self.items.len() < size && !force) {
            return None;
        }
        let rest = self.items.split_off(size.min(self.items.len()));
        Some(std::mem::replace(&mut self.items, rest))
    }

    fn clone_dyn(&self) -> Box<dyn BatchStrategy<I>> {
        Box::new(AdaptiveBatchSize::<I> { items: Vec::new(), shared: self.shared.clone() })
    }

    fn batch_size(&self) -> Option<usize> {
        Some(self.shared.micro_batch.load(Ordering::Relaxed).max(1))
    }
}
