//! A recipe run from start to end, fixed (one rank at the recipe's batch) or, when the recipe is
//! adaptive, under Copus, both on the engine through one loop; and continuing a run from its
//! run folder.

use std::path::{Path, PathBuf};

pub use crate::prepare::RunOptions;
use crate::recipe::Recipe;
use crate::summary::Summary;

/// Runs a recipe to the end, under Copus when it is adaptive; returns the run folder and its
/// summary.
pub fn run_any(recipe: &Recipe, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    fixed_needs_no_mpirun(recipe)?;
    crate::adaptive::run(recipe, opts)
}

/// Continues the run in `run_dir` (a run folder of `recipe` with checkpoints) to the recipe's
/// end.
pub fn resume_any(recipe: &Recipe, run_dir: &Path, opts: &RunOptions) -> anyhow::Result<(PathBuf, Summary)> {
    fixed_needs_no_mpirun(recipe)?;
    crate::adaptive::resume(recipe, run_dir, opts)
}

/// A fixed recipe trains on one rank: under `mpirun` with several processes it is refused, not
/// left to fail once the data is prepared.
fn fixed_needs_no_mpirun(recipe: &Recipe) -> anyhow::Result<()> {
    #[cfg(feature = "mpi")]
    if let copus_burn::comm::mpi::Role::Driver { size } = copus_burn::comm::mpi::role()
        && !recipe.is_adaptive()
    {
        return Err(anyhow::anyhow!(
            "recipe `{}` trains a fixed batch on one rank; run it without mpirun (the {size} processes would idle)",
            recipe.name
        ));
    }
    #[cfg(not(feature = "mpi"))]
    let _ = recipe;
    Ok(())
}

/// Run a recipe file.
#[derive(clap::Args)]
pub struct RunArgs {
    /// The recipe (RON).
    recipe: PathBuf,
    /// Stop after this many steps (overrides the recipe).
    #[arg(long)]
    max_steps: Option<u64>,
    /// Continue the run in this run folder from its last checkpoint (written every
    /// `train.checkpoint_every` steps, at the end and on Ctrl-C).
    #[arg(long, value_name = "RUN_DIR")]
    resume: Option<PathBuf>,
    /// Resume also from checkpoints of formats 1 and 2, which cannot be verified (no content
    /// hashes of the current kind): damage in them goes unnoticed.
    #[arg(long, requires = "resume")]
    allow_unverified: bool,
    /// Resume with another `parallel.precision` than the run trained in (F32 <-> Bf16Mixed;
    /// the checkpoint's master weights and moments are f32 either way).
    #[arg(long, requires = "resume")]
    allow_precision_change: bool,
}

impl RunArgs {
    /// `recipes run`: runs or resumes the recipe and prints its summary line and run folder.
    pub fn exec(self) -> anyhow::Result<()> {
        copus_burn::checkpoint::allow_unverified(self.allow_unverified);
        run_file(&self.recipe, self.max_steps, self.resume.as_deref(), self.allow_precision_change)
    }
}

/// Runs the recipe file at `path` (or resumes it from `resume`), printing the summary line, the
/// run folder and, when interrupted, the command that continues it; `recipes RECIPE` and
/// `recipes run`.
pub fn run_file(path: &Path, max_steps: Option<u64>, resume: Option<&Path>, allow_precision_change: bool) -> anyhow::Result<()> {
    let recipe = crate::load_recipe(path)?;
    let opts = RunOptions { max_steps, allow_precision_change };
    let (folder, s) = match resume {
        Some(dir) => resume_any(&recipe, dir, &opts)?,
        None => run_any(&recipe, &opts)?,
    };
    println!(
        "{}: {} steps, {} tokens in {:.1} s ({:.0} tokens/s); loss {:.3} -> {:.3}; held-out {:.3} -> {:.3}; B_simple {}",
        s.name,
        s.steps,
        s.tokens,
        s.train_secs,
        s.tokens_per_sec,
        s.first_loss,
        s.last_loss,
        s.initial_eval_loss,
        s.final_eval_loss,
        s.final_b_simple.map_or("-".into(), |b| format!("{b:.1}"))
    );
    println!("run folder: {}", folder.display());
    if s.interrupted {
        println!("resume with: cargo run --release -p recipes -- run {} --resume {}", path.display(), folder.display());
    }
    Ok(())
}
