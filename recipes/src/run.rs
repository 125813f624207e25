//! A recipe run from start to end: the fixed single-rank run or, when the recipe is adaptive,
//! the run on the engine under Copus; and continuing a run from its run folder.

use std::path::{Path, PathBuf};

pub use crate::prepare::RunOptions;
use crate::recipe::Recipe;
use crate::summary::Summary;

/// Runs a recipe to the end, under Copus when it is adaptive; returns the run folder and its
/// summary.
pub fn run_any(recipe: &Recipe, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    #[cfg(feature = "mpi")]
    if let copus_burn::mpi::Role::Driver { size } = copus_burn::mpi::role()
        && !recipe.is_adaptive()
    {
        return Err(anyhow::anyhow!(
            "recipe `{}` trains a fixed batch on one rank; run it without mpirun (the {size} processes would idle)",
            recipe.name
        ));
    }
    if recipe.is_adaptive() { crate::adaptive::run(recipe, opts) } else { Ok(crate::fixed::run(recipe, opts)?) }
}

/// Continues the run in `run_dir` (a run folder of `recipe` with checkpoints) to the recipe's
/// end. Only runs on the engine (adaptive recipes) write checkpoints.
pub fn resume_any(recipe: &Recipe, run_dir: &Path, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    if !recipe.is_adaptive() {
        return Err(anyhow::anyhow!(
            "recipe `{}` trains a fixed batch on one rank, which writes no checkpoints; resume needs a run on the engine (a `parallel` section, `adaptive` not false)",
            recipe.name
        ));
    }
    crate::adaptive::resume(recipe, run_dir, opts)
}
