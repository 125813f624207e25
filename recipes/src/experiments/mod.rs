//! Experiments that put policies side by side: `compare` (one comparison recipe), `suite` (many
//! synthetic scenarios over seeds) and `headline` (time to a held-out loss on this machine's
//! wall clock, the adaptive run against fixed batches); `args` holds `recipes compare`'s
//! arguments.

pub mod args;
pub mod compare;
pub mod headline;
pub mod stats;
pub mod suite;
