//! `recipes`: the command line over the `recipes` library: the top level's parsing and the
//! dispatch to each subcommand's module (which holds its arguments and runs it), the exit codes,
//! the allocator, and the serving loop of MPI processes 1.. . Subcommands: run (the default),
//! bench, compare, learner, orchestrator, export, eval, generate, profile, prepare.
//!
//! ```text
//! cargo run --release -p recipes -- recipes/shakespeare-tiny.ron
//! cargo run --release -p recipes -- run recipes/shakespeare-tiny.ron --resume runs/shakespeare-tiny
//! cargo run --release -p recipes -- bench
//! cargo run --release -p recipes -- bench engine
//! cargo run --release -p recipes -- bench reconfig
//! cargo run --release -p recipes -- profile recipes/parallel-tiny.ron
//! cargo run --release -p recipes -- compare recipes/compare-synthetic-3b.ron
//! cargo run --release -p recipes -- compare --suite recipes/suite-paper.ron
//! cargo run --release -p recipes -- learner recipes/shakespeare-tiny.ron --compare
//! ```
//!
//! Logs go to stderr through `tracing` (`COPUS_LOG=debug` for more, `--quiet` for warnings
//! only); results go to stdout.

#![deny(unsafe_code)]

/// Training frees and allocates the same large buffers every step, and a layout change frees
/// one layout's state as the next one's is built. mimalloc keeps freed memory for reuse where
/// the system allocator unmaps every large block on free, so each step and each first step
/// after a change page-faulted its buffers in afresh (`recipes bench reconfig`, docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (its place in mimalloc 3's option list; `libmimalloc-sys`
/// names no constant for it): milliseconds a freed span waits before it goes back to the OS.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Whether the environment sets mimalloc's purge delay (under its name or its older one).
fn purge_delay_set_by_user() -> bool {
    ["MIMALLOC_PURGE_DELAY", "MIMALLOC_RESET_DELAY"].iter().any(|v| std::env::var_os(v).is_some())
}

/// Keeps freed memory for reuse for the whole run (purge delay -1) unless `MIMALLOC_PURGE_DELAY`
/// (or `MIMALLOC_RESET_DELAY`) says otherwise. With mimalloc's default of one second, a step of a second or more found its
/// buffers of the step before handed back and faulted them in again: about 1.6 million page
/// faults and 19 s of system time in one `recipes bench step`, against under 2,000 faults.
/// Memory stays at the run's peak, as with a caching allocator.
#[allow(unsafe_code)]
fn keep_freed_memory() {
    if !purge_delay_set_by_user() {
        // SAFETY: called first thing in `main`, before any other thread exists (mimalloc's option
        // setter is not thread-safe); the option is an index into mimalloc's option table.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use recipes::report::progress;
use recipes::{Usage, bench, experiments, interop, learner, orchestrator, prepare, profile, run};

#[derive(Parser)]
#[command(name = "recipes", about = "copus recipes: train on real text and report", args_conflicts_with_subcommands = true)]
struct Cli {
    /// A recipe file (RON), e.g. recipes/shakespeare-tiny.ron.
    recipe: Option<PathBuf>,
    /// Stop after this many steps (overrides the recipe; for smoke runs).
    #[arg(long)]
    max_steps: Option<u64>,
    /// Continue the run in this run folder from its last checkpoint.
    #[arg(long, value_name = "RUN_DIR")]
    resume: Option<PathBuf>,
    /// Warnings and errors only, no progress bars (COPUS_LOG, when set, wins).
    #[arg(long, global = true)]
    quiet: bool,
    #[command(subcommand)]
    command: Option<Cmd>,
}

/// The subcommands; each one's arguments, help text and execution live with its module.
#[derive(Subcommand)]
enum Cmd {
    Run(run::RunArgs),
    Bench(bench::args::BenchArgs),
    Compare(experiments::args::CompareArgs),
    Learner(learner::LearnerArgs),
    Orchestrator(orchestrator::OrchestratorArgs),
    Export(interop::ExportArgs),
    Eval(interop::EvalArgs),
    Generate(interop::GenerateArgs),
    Profile(profile::ProfileArgs),
    Prepare(prepare::PrepareArgs),
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match (cli.command, cli.recipe) {
        (Some(Cmd::Run(args)), _) => args.exec(),
        (Some(Cmd::Bench(args)), _) => args.exec(),
        (Some(Cmd::Compare(args)), _) => args.exec(),
        (Some(Cmd::Learner(args)), _) => args.exec(),
        (Some(Cmd::Orchestrator(args)), _) => args.exec(),
        (Some(Cmd::Export(args)), _) => args.exec(),
        (Some(Cmd::Eval(args)), _) => args.exec(),
        (Some(Cmd::Generate(args)), _) => args.exec(),
        (Some(Cmd::Profile(args)), _) => args.exec(),
        (Some(Cmd::Prepare(args)), _) => args.exec(),
        (None, Some(recipe)) => run::run_file(&recipe, cli.max_steps, cli.resume.as_deref(), false),
        (None, None) => Err(Usage("give a recipe file (e.g. recipes/shakespeare-tiny.ron) or a subcommand; see --help".into()).into()),
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    // Under `mpirun -np N` (feature `mpi`), processes 1.. serve their ranks; process 0 runs the
    // command and drives them.
    #[cfg(feature = "mpi")]
    match copus_burn::comm::mpi::init() {
        Ok(copus_burn::comm::mpi::Role::Worker { .. }) => return serve_ranks(),
        Ok(_) => {}
        Err(e) => {
            eprintln!("error: MPI: {e}");
            return ExitCode::FAILURE;
        }
    }
    let code = match Cli::try_parse() {
        Ok(cli) => run_cli(cli),
        Err(e) => {
            // Help, version and usage errors; clap's exit codes (0 for help, 2 for mistakes).
            let _ = e.print();
            ExitCode::from(e.exit_code().clamp(0, 255) as u8)
        }
    };
    #[cfg(feature = "mpi")]
    copus_burn::engine::finish();
    code
}

fn run_cli(cli: Cli) -> ExitCode {
    progress::init(cli.quiet);
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The whole chain of causes, outermost first; printed even when logs are off.
            eprintln!("error: {e:#}");
            if e.is::<Usage>() { ExitCode::from(2) } else { ExitCode::FAILURE }
        }
    }
}

/// A serving process of an MPI run: its rank of every layout process 0 starts, until the end.
#[cfg(feature = "mpi")]
fn serve_ranks() -> ExitCode {
    use burn::config::Config;
    progress::init(true);
    // Ctrl-C, SIGTERM, SIGHUP and SIGUSR1 (which mpirun passes on to every process) reach every
    // process; process 0 decides when to stop, the others follow it.
    let _ = ctrlc::set_handler(|| {});
    let _ = signal_hook::flag::register(signal_hook::consts::SIGUSR1, std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false)));
    let served = copus_burn::engine::serve(|text| copus_models::LlamaConfig::load_binary(text.as_bytes()));
    if let Err(e) = served {
        // Process 0 would wait for this one forever: end the whole job.
        copus_burn::comm::mpi::abort_job(&e.to_string());
    }
    copus_burn::engine::finish();
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(unsafe_code)]
    fn the_purge_delay_option_is_the_one_set() {
        // mimalloc 3's default purge delay is 1000 ms and its neighbours' defaults differ (1 and
        // 0), so a shifted option table shows here. The test harness never calls `main`.
        if !purge_delay_set_by_user() {
            // SAFETY: reading an option is thread-safe.
            assert_eq!(unsafe { libmimalloc_sys::mi_option_get(MI_OPTION_PURGE_DELAY) }, 1000);
        }
    }
}
