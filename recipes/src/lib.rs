//! recipes: copus's recipe files run end to end, as a library under the `recipes` binary.
//!
//! A recipe (RON) names a model, the Shakespeare data, a training schedule and, with a
//! `parallel` section, the candidate space Copus adapts over. Modules, by what they hold:
//!
//! - [`recipe`]: the recipe schema and its checks;
//! - [`data`]: the corpus, the tokenizer and packed sequences;
//! - [`prepare`]: what every run starts from (data, model shape, run folder, seeding);
//! - [`adaptive`], [`run`]: a recipe's run on the engine, fixed (one rank at the recipe's batch)
//!   or under Copus, through one loop and one run-folder writer (stopped by signals through
//!   `stop`, with checkpoints and resume, the run folder written by `run_folder`), and the
//!   entry points that start or continue it;
//! - [`eval`], [`summary`]: held-out loss and the run's summary;
//! - [`interop`]: export to the Hugging Face layout, `init_from`, `recipes eval` and `generate`;
//! - [`learner`]: the Burn `Learner` add-on on the recipe's data;
//! - [`profile`]: measured throughput of a recipe's candidates;
//! - [`orchestrator`]: a recipe's candidate space served to training runs over TCP;
//! - [`experiments`]: comparisons of policies, suites of scenarios and the headline measurement;
//! - [`bench`](mod@bench): the benchmarks, each printing a table;
//! - [`report`]: plots and progress.

#![deny(unsafe_code)]

pub mod adaptive;
pub mod bench;
pub mod data;
pub mod eval;
pub mod experiments;
pub mod interop;
pub mod learner;
pub mod orchestrator;
pub mod prepare;
pub mod profile;
pub mod recipe;
pub mod report;
pub mod run;
mod run_folder;
mod stop;
pub mod summary;

use std::path::Path;

/// A user mistake in what was asked (the binary exits with code 2), as opposed to a failure
/// while doing it.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// Loads and checks a recipe file; a bad recipe is a [`Usage`] error naming the field.
pub fn load_recipe(path: &Path) -> anyhow::Result<recipe::Recipe> {
    recipe::Recipe::load(path).map_err(|e| Usage(e.to_string()).into())
}
