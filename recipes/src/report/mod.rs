//! What a person sees of a run: PNG plots and progress (log lines, bars).

pub mod plot;
pub mod progress;
