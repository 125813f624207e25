//! `recipes`: run a recipe file, or benchmark a training step.
//!
//! ```text
//! cargo run --release -p recipes -- recipes/shakespeare-tiny.ron
//! cargo run --release -p recipes -- bench
//! cargo run --release -p recipes -- bench --engine
//! cargo run --release -p recipes -- bench --reconfig
//! cargo run --release -p recipes -- profile recipes/parallel-tiny.ron
//! cargo run --release -p recipes -- compare recipes/compare-synthetic-3b.ron
//! cargo run --release -p recipes -- learner recipes/shakespeare-tiny.ron --compare
//! ```

mod bench;
mod compare;
mod data;
mod engine_bench;
mod learner;
mod plot;
mod profile;
mod recipe;
mod run;
mod service;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "recipes", about = "copus recipes: train on real text and report", args_conflicts_with_subcommands = true)]
struct Cli {
    /// A recipe file (RON), e.g. recipes/shakespeare-tiny.ron.
    recipe: Option<PathBuf>,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
    /// Stop after this many steps (overrides the recipe; for smoke runs).
    #[arg(long)]
    max_steps: Option<u64>,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run a recipe file.
    Run {
        /// The recipe (RON).
        recipe: PathBuf,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
        /// Stop after this many steps (overrides the recipe).
        #[arg(long)]
        max_steps: Option<u64>,
    },
    /// Training-step throughput of the reference shape, against PyTorch when it is installed.
    Bench {
        /// Timed steps.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Untimed warm-up steps.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Skip the PyTorch comparison.
        #[arg(long)]
        no_torch: bool,
        /// Instead: the parallel engine (all-reduce bandwidth, step time of every layout).
        #[arg(long)]
        engine: bool,
        /// Instead: in-memory reconfiguration against checkpoint-restart.
        #[arg(long)]
        reconfig: bool,
    },
    /// Run every policy of a comparison recipe side by side and write the report.
    Compare {
        /// The comparison recipe (RON), e.g. recipes/compare-synthetic-3b.ron.
        recipe: PathBuf,
        /// No progress output.
        #[arg(long)]
        quiet: bool,
    },
    /// Train the recipe's model and data with Burn's `SupervisedTraining` and copus's adaptive
    /// batching (the Learner add-on); `--fixed` for the plain Learner, `--compare` for both.
    Learner {
        /// The recipe (RON), e.g. recipes/shakespeare-tiny.ron.
        recipe: PathBuf,
        /// The plain Learner at the recipe's global batch.
        #[arg(long, conflicts_with = "compare")]
        fixed: bool,
        /// Both runs, then a table.
        #[arg(long)]
        compare: bool,
        /// Training sequences (default: the recipe's max_steps x global_batch).
        #[arg(long)]
        max_samples: Option<usize>,
        /// No data-preparation messages.
        #[arg(long)]
        quiet: bool,
    },
    /// Serve decisions over TCP to training runs (token from COPUS_ORCHESTRATOR_TOKEN).
    Orchestrator {
        /// A training recipe with a `parallel` section (the candidate space).
        recipe: PathBuf,
        /// Throughput profile of the candidates (from `recipes profile`).
        #[arg(long)]
        profile: PathBuf,
        /// copus, dp-only, merrill or static.
        #[arg(long, default_value = "copus")]
        policy: String,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:7450")]
        listen: std::net::SocketAddr,
    },
    /// Measure samples/s of every feasible candidate of a recipe's `parallel` section and write
    /// a throughput profile.
    Profile {
        /// The recipe (RON) with a `parallel` section.
        recipe: PathBuf,
        /// Output file (default `<output_dir>/<name>-profile.ron`; a CSV is written next to it).
        #[arg(long)]
        out: Option<PathBuf>,
        /// No progress bar.
        #[arg(long)]
        quiet: bool,
    },
}

fn run_service(recipe: &std::path::Path, profile: &std::path::Path, policy: &str, listen: std::net::SocketAddr) -> Result<(), String> {
    let token = std::env::var("COPUS_ORCHESTRATOR_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .ok_or("set COPUS_ORCHESTRATOR_TOKEN to the shared token the training runs will present")?;
    let recipe = recipe::Recipe::load(recipe).map_err(|e| e.to_string())?;
    let par = recipe.parallel.clone().ok_or("the recipe needs a `parallel` section (the candidate space)")?;
    let text = std::fs::read_to_string(profile).map_err(|e| format!("{}: {e}", profile.display()))?;
    let profile = copus_core::throughput::ThroughputProfile::from_ron(&text).map_err(|e| e.to_string())?;
    let spec = recipe.model_spec().map_err(|e| e.to_string())?;
    let feasible = par.space().map_err(|e| e.to_string())?.enumerate(&spec).feasible;
    let scorer = copus_core::policy::Scorer::plain(&feasible, &profile, recipe.optim.b0 as f64).map_err(|e| e.to_string())?;
    let rule = copus_core::policy::SwitchRule::default();
    service::policy_by_name(policy, &scorer, rule)?;
    let policy = policy.to_string();
    let make: std::sync::Arc<dyn Fn() -> copus_core::orchestrator::Orchestrator + Send + Sync> = std::sync::Arc::new(move || {
        let p = service::policy_by_name(&policy, &scorer, rule).expect("checked above");
        copus_core::orchestrator::Orchestrator::new(p, scorer.clone())
    });
    let (addr, handle) = service::spawn(listen, token, make)?;
    println!("orchestrator listening on {addr}");
    handle.join().map_err(|_| "the service thread panicked".to_string())
}

fn run_profile(path: &std::path::Path, out: Option<PathBuf>, quiet: bool) -> ExitCode {
    let recipe = match recipe::Recipe::load(path) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match profile::profile(&recipe, &profile::ProfileOptions { out, quiet }) {
        Ok((p, file)) => {
            print!("{}", profile::table(&p));
            println!("profile: {} (and .csv)", file.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_recipe(path: &std::path::Path, quiet: bool, max_steps: Option<u64>) -> ExitCode {
    let recipe = match recipe::Recipe::load(path) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run::run(&recipe, &run::RunOptions { quiet, max_steps }) {
        Ok((folder, s)) => {
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
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match (cli.command, cli.recipe) {
        (Some(Cmd::Run { recipe, quiet, max_steps }), _) => run_recipe(&recipe, quiet, max_steps),
        (Some(Cmd::Bench { reconfig: true, .. }), _) => {
            engine_bench::run_reconfig();
            ExitCode::SUCCESS
        }
        (Some(Cmd::Bench { steps, engine: true, .. }), _) => {
            engine_bench::run(steps.max(1));
            ExitCode::SUCCESS
        }
        (Some(Cmd::Bench { steps, warmup, no_torch, .. }), _) => {
            bench::run(steps.max(1), warmup, !no_torch);
            ExitCode::SUCCESS
        }
        (Some(Cmd::Profile { recipe, out, quiet }), _) => run_profile(&recipe, out, quiet),
        (Some(Cmd::Learner { recipe, fixed, compare, max_samples, quiet }), _) => {
            match learner::run(&recipe, fixed, compare, max_samples, quiet) {
                Ok(report) => {
                    println!("{report}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        (Some(Cmd::Orchestrator { recipe, profile, policy, listen }), _) => match run_service(&recipe, &profile, &policy, listen) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        (Some(Cmd::Compare { recipe, quiet }), _) => {
            let r = match compare::CompareRecipe::load(&recipe) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            match compare::run(&r, quiet) {
                Ok(out) => {
                    println!("{}", out.summary);
                    println!("report: {}", out.folder.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        (None, Some(recipe)) => run_recipe(&recipe, cli.quiet, cli.max_steps),
        (None, None) => {
            eprintln!("error: give a recipe file (e.g. recipes/shakespeare-tiny.ron) or a subcommand; see --help");
            ExitCode::from(2)
        }
    }
}
