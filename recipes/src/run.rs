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
    /// Supervise the run: it trains in a child process, and when that ends abnormally (killed
    /// by a signal, the kernel's out-of-memory killer, a crash, an error) it is started again
    /// from the run folder's newest checkpoint, after 1, 2, 4, ... s (at most 60), up to this
    /// many times. A bad recipe (exit code 2) is not retried; a stop by a signal is not either.
    #[arg(long, default_value_t = 0, value_name = "N")]
    max_restarts: u32,
}

impl RunArgs {
    /// `recipes run`: runs or resumes the recipe and prints its summary line and run folder.
    pub fn exec(self) -> anyhow::Result<()> {
        if self.max_restarts > 0 {
            return supervise(&self);
        }
        copus_burn::checkpoint::allow_unverified(self.allow_unverified);
        run_file(&self.recipe, self.max_steps, self.resume.as_deref(), self.allow_precision_change)
    }

    /// The child's command line: the same run without the supervision, resuming `resume`.
    fn child_command(&self, resume: Option<&Path>) -> std::process::Command {
        let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("recipes"));
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("run").arg(&self.recipe);
        if let Some(n) = self.max_steps {
            cmd.arg("--max-steps").arg(n.to_string());
        }
        if let Some(dir) = resume {
            cmd.arg("--resume").arg(dir);
            if self.allow_unverified {
                cmd.arg("--allow-unverified");
            }
            if self.allow_precision_change {
                cmd.arg("--allow-precision-change");
            }
        }
        cmd
    }
}

pub use crate::prepare::RUN_FOLDER_FILE_ENV;

/// Runs `args`'s run in a child process and starts it again from its newest checkpoint when it
/// ends abnormally, up to `args.max_restarts` times, with backoff, saying so each time. A stop
/// asked of the supervisor (SIGTERM, SIGINT, SIGHUP, SIGUSR1) is passed on to the child, which
/// checkpoints and exits, and ends the supervision.
fn supervise(args: &RunArgs) -> anyhow::Result<()> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT, signal_hook::consts::SIGHUP, signal_hook::consts::SIGUSR1] {
        signal_hook::flag::register(sig, stop.clone())?;
    }
    let folder_file = tempfile::NamedTempFile::new()?;
    let mut resume = args.resume.clone();
    let (mut restarts, mut backoff) = (0u32, std::time::Duration::from_secs(1));
    loop {
        let mut child = args.child_command(resume.as_deref()).env(RUN_FOLDER_FILE_ENV, folder_file.path()).spawn()?;
        let mut forwarded = false;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if stop.load(Ordering::Relaxed) && !forwarded {
                forwarded = true;
                crate::stop::terminate(child.id());
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        };
        if status.success() {
            return Ok(());
        }
        if stop.load(Ordering::Relaxed) {
            return Err(anyhow::anyhow!("the run was stopped ({status}); not restarted"));
        }
        if status.code() == Some(2) {
            return Err(crate::Usage(format!("the run was refused ({status}); a usage error is not retried")).into());
        }
        if restarts == args.max_restarts {
            return Err(anyhow::anyhow!(
                "the run ended abnormally ({status}) after {restarts} restarts; giving up (--max-restarts {})",
                args.max_restarts
            ));
        }
        restarts += 1;
        let folder =
            std::fs::read_to_string(folder_file.path()).ok().map(|s| PathBuf::from(s.trim())).filter(|p| !p.as_os_str().is_empty());
        resume = folder.filter(|f| !copus_burn::run_dir::RunDir::new(f).checkpoints().is_empty()).or(resume.take());
        let from = resume.as_ref().map_or("from the start (no checkpoint yet)".to_string(), |f| format!("from {}", f.display()));
        tracing::warn!("restart {restarts} of {} after the run ended abnormally ({status}); in {backoff:?}, {from}", args.max_restarts);
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(std::time::Duration::from_secs(60));
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
