//! Experiments that put policies side by side: `compare` (one comparison recipe), `suite` (many
//! synthetic scenarios over seeds), `evidence` (a pre-registered comparison on the suite's
//! scenarios: structured truth, information arms, baselines chosen on development seeds) and
//! `headline` (time to a held-out loss on this machine's
//! wall clock, the adaptive run against fixed batches); `args` holds `recipes compare`'s
//! arguments.

pub mod args;
pub mod compare;
pub mod evidence;
pub mod headline;
pub mod stats;
pub mod suite;
