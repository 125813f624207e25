//! `recipes`: the command line over the `recipes` library: argument parsing and dispatch, the
//! allocator, and the serving loop of MPI processes 1.. . Subcommands: run (the default), bench,
//! compare, learner, orchestrator, export, eval, generate, profile.
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
/// after a change page-faulted its buffers in afresh (`recipes bench reconfig`, README).
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

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::builder::TypedValueParser as _;
use clap::{Parser, Subcommand};

use copus_service::PolicyName;
use recipes::bench::reconfig::{Change, parse_change};
use recipes::recipe::Backend;
use recipes::report::progress;
use recipes::{Usage, bench, experiments, interop, learner, load_recipe, profile, run};

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

#[derive(Subcommand)]
enum Cmd {
    /// Run a recipe file.
    Run {
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
    },
    /// Benchmarks, each printing a table (`step` when none is named).
    Bench {
        #[command(subcommand)]
        mode: Option<BenchMode>,
    },
    /// Run every policy of a comparison recipe side by side and write the report; with
    /// `--suite`, every scenario of a suite file over its seeds, in one table.
    Compare {
        /// The comparison recipe (RON), e.g. recipes/compare-synthetic-3b.ron.
        #[arg(required_unless_present = "suite", conflicts_with = "suite")]
        recipe: Option<PathBuf>,
        /// A suite file (RON), e.g. recipes/suite-paper.ron.
        #[arg(long)]
        suite: Option<PathBuf>,
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
    },
    /// Serve decisions over TCP to training runs (token from COPUS_ORCHESTRATOR_TOKEN).
    Orchestrator {
        /// A training recipe with a `parallel` section (the candidate space).
        recipe: PathBuf,
        /// Throughput profile of the candidates (from `recipes profile`).
        #[arg(long)]
        profile: PathBuf,
        /// The decision policy.
        #[arg(long, default_value_t = PolicyName::Copus, value_parser = policy_name())]
        policy: PolicyName,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:7450")]
        listen: std::net::SocketAddr,
    },
    /// Write a run's model as a Hugging Face Llama directory (config.json, model.safetensors,
    /// tokenizer.json) that transformers' LlamaForCausalLM loads.
    Export {
        /// The run folder.
        run_dir: PathBuf,
        /// The directory to write.
        #[arg(long)]
        to: PathBuf,
    },
    /// Mean next-token loss and perplexity of a run's model on any UTF-8 text.
    Eval {
        /// The run folder.
        run_dir: PathBuf,
        /// The text file.
        #[arg(long)]
        text: PathBuf,
        /// Window length in tokens (default: the run's sequence length).
        #[arg(long)]
        seq: Option<usize>,
        /// Evaluate at most this many windows.
        #[arg(long)]
        max_windows: Option<usize>,
    },
    /// Continue a prompt with a run's model (KV cache; greedy at temperature 0).
    Generate {
        /// The run folder.
        run_dir: PathBuf,
        /// The text to continue.
        #[arg(long)]
        prompt: String,
        /// Tokens to generate at most.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Softmax temperature (0: greedy).
        #[arg(long, default_value_t = 0.8)]
        temperature: f64,
        /// Nucleus sampling: the smallest set of tokens holding this much probability.
        #[arg(long, default_value_t = 0.95)]
        top_p: f64,
        /// Seed of the sampler.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Measure samples/s of every feasible candidate of a recipe's `parallel` section and write
    /// a throughput profile.
    Profile {
        /// The recipe (RON) with a `parallel` section.
        recipe: PathBuf,
        /// Output file (default `<output_dir>/<name>-profile.ron`; a CSV is written next to it).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum BenchMode {
    /// Training-step time per phase on the reference shape and tiny-20m, against PyTorch when it
    /// is installed, and the noise-scale probe's cost.
    Step {
        /// Timed steps.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// Untimed warm-up steps.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Skip the PyTorch comparison.
        #[arg(long)]
        no_torch: bool,
        /// Threads on both sides (rayon's pool for copus, torch.set_num_threads for PyTorch).
        #[arg(long, default_value_t = 2)]
        threads: usize,
    },
    /// A device backend against Flex (losses and gradient norms of six layouts over three
    /// steps; fails on a difference above 1e-4 or a NaN), then its samples/s, model-FLOPs utilisation and host
    /// bytes per step on one and several ranks, in f32 and bf16 (scripts/gpu-check.sh).
    Device {
        /// The backend under test (the build needs its feature).
        #[arg(long, value_parser = backend_name())]
        backend: Backend,
        /// Presets of the throughput table (repeatable); tiny-20m and small-100m by default.
        #[arg(long = "preset", value_parser = ["tiny-1m", "tiny-5m", "tiny-20m", "small-100m"])]
        presets: Vec<String>,
        /// Ranks sharing the device in each preset's second row.
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
        ranks: u64,
        /// Sequences per step of the throughput rows (a multiple of `--ranks` x `--micro-batch`).
        #[arg(long, default_value_t = 32)]
        global_batch: usize,
        /// Sequences per micro-batch of the throughput rows.
        #[arg(long, default_value_t = 4)]
        micro_batch: usize,
        /// Sequence length of the throughput rows (default: the preset's).
        #[arg(long)]
        seq: Option<usize>,
        /// Timed steps per throughput row, after one warm-up step.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// The device's peak dense TFLOP/s as `F32,BF16` (an H200: `67,989`), for utilisation.
        #[arg(long, value_parser = parse_peaks)]
        peak_tflops: Option<(f64, f64)>,
        /// Only the parity table.
        #[arg(long)]
        parity_only: bool,
    },
    /// The parallel engine: all-reduce bandwidth and the step time of every layout.
    Engine {
        /// Timed steps per layout.
        #[arg(long, default_value_t = 5)]
        steps: usize,
    },
    /// In-memory reconfiguration against a real process restart from a checkpoint.
    Reconfig {
        /// Only these model presets (repeatable); tiny-5m, tiny-20m and small-100m by default.
        #[arg(long = "preset", value_parser = ["tiny-5m", "tiny-20m", "small-100m"])]
        presets: Vec<String>,
        /// Trials per layout change, each on a fresh engine; the table shows medians.
        #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=50))]
        trials: u64,
        /// Only these layout changes (repeatable), as `'dp2,tp2,pp2->dp1,tp4,pp2'` (quoted: `>`
        /// is the shell's); by default
        /// three changes of 8 ranks and one from 8 to 4.
        #[arg(long = "change", value_parser = parse_change)]
        changes: Vec<Change>,
    },
    /// The restart side of `reconfig`: load a checkpoint into a layout, run one step.
    #[command(hide = true)]
    RestartChild {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        preset: String,
        #[arg(long)]
        seq: usize,
        #[arg(long)]
        layout: String,
        #[arg(long)]
        global_batch: usize,
        #[arg(long)]
        micro_batch: usize,
    },
    /// The learner add-on's noise probe against the same step without it.
    Probe {
        /// Timed steps.
        #[arg(long, default_value_t = 10)]
        steps: usize,
    },
    /// Peak memory of the engine's ranks per configuration (each in a child process) against
    /// the memory model's prediction.
    Memory {
        /// Only these model presets (repeatable); tiny-5m, tiny-20m and small-100m by default.
        #[arg(long = "preset", value_parser = ["tiny-5m", "tiny-20m", "small-100m"])]
        presets: Vec<String>,
        /// Only the ZeRO-1 rows and their unsharded twins.
        #[arg(long, conflicts_with = "bf16")]
        zero1: bool,
        /// Only the `Bf16Mixed` rows.
        #[arg(long)]
        bf16: bool,
        /// Where the ranks train: on a GPU backend the rows of a GPU (tiny-20m and small-100m,
        /// f32 and bf16), measured on the device.
        #[arg(long, value_parser = backend_name(), default_value = "Flex")]
        backend: Backend,
        /// Also write the model's terms beside each measurement to this CSV file (what a refit
        /// of the coefficients reads; `scripts/fit-memory.py`).
        #[arg(long)]
        csv: Option<PathBuf>,
    },
    /// The measuring side of `memory`: one configuration, its peak bytes.
    #[command(hide = true)]
    MemoryChild {
        #[arg(long)]
        preset: String,
        #[arg(long)]
        seq: usize,
        #[arg(long)]
        layout: String,
        #[arg(long)]
        micro_batch: usize,
        #[arg(long, value_parser = ["OneFOneB", "GPipe"])]
        schedule: String,
        #[arg(long, value_parser = ["None", "Layers", "Regions"])]
        checkpointing: String,
        #[arg(long, value_parser = ["F32", "Bf16Mixed"], default_value = "F32")]
        precision: String,
        #[arg(long)]
        zero1: bool,
        #[arg(long, value_parser = backend_name(), default_value = "Flex")]
        backend: Backend,
    },
}

/// `--backend`: a recipe's backend name, as the recipe spells it.
fn backend_name() -> impl clap::builder::TypedValueParser<Value = Backend> {
    clap::builder::PossibleValuesParser::new(["Flex", "Wgpu", "Cuda", "Rocm", "Tch", "TchCpu"])
        .map(|s| ron::from_str::<Backend>(&s).expect("one of the listed names"))
}

/// `--peak-tflops F32,BF16`: two positive numbers.
fn parse_peaks(s: &str) -> Result<(f64, f64), String> {
    let bad = || format!("`{s}`: expected two positive TFLOP/s figures as F32,BF16 (an H200: 67,989)");
    let (a, b) = s.split_once(',').ok_or_else(bad)?;
    let (a, b) = (a.trim().parse::<f64>().map_err(|_| bad())?, b.trim().parse::<f64>().map_err(|_| bad())?);
    if a > 0.0 && b > 0.0 && a.is_finite() && b.is_finite() { Ok((a, b)) } else { Err(bad()) }
}

/// `--policy`: one of the service's policy names, listed in `--help` and in the error.
fn policy_name() -> impl clap::builder::TypedValueParser<Value = PolicyName> {
    clap::builder::PossibleValuesParser::new(PolicyName::ALL.map(PolicyName::as_str))
        .map(|s| s.parse::<PolicyName>().expect("one of the listed names"))
}

fn run_profile(path: &Path, out: Option<PathBuf>) -> anyhow::Result<()> {
    let recipe = load_recipe(path)?;
    let (p, file) = profile::profile(&recipe, &profile::ProfileOptions { out })?;
    print!("{}", profile::table(&p));
    println!("\nthroughput-optimal B_m per B_g:\n{}", profile::best_table(&p));
    println!("profile: {} (and .csv)", file.display());
    Ok(())
}

fn run_recipe(path: &Path, max_steps: Option<u64>, resume: Option<&Path>, allow_precision_change: bool) -> anyhow::Result<()> {
    let recipe = load_recipe(path)?;
    let opts = run::RunOptions { max_steps, allow_precision_change };
    let (folder, s) = match resume {
        Some(dir) => run::resume_any(&recipe, dir, &opts)?,
        None => run::run_any(&recipe, &opts)?,
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

fn run_compare(path: &Path) -> anyhow::Result<()> {
    let r = experiments::compare::CompareRecipe::load(path).map_err(|e| Usage(e.to_string()))?;
    let out = experiments::compare::run(&r)?;
    println!("{}", out.summary);
    println!("report: {}", out.folder.display());
    Ok(())
}

fn run_suite(path: &Path) -> anyhow::Result<()> {
    let s = experiments::suite::Suite::load(path).map_err(|e| Usage(e.to_string()))?;
    let (folder, table) = experiments::suite::run(&s)?;
    println!("{table}");
    println!("report: {}", folder.display());
    Ok(())
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match (cli.command, cli.recipe) {
        (Some(Cmd::Run { recipe, max_steps, resume, allow_unverified, allow_precision_change }), _) => {
            copus_burn::checkpoint::allow_unverified(allow_unverified);
            run_recipe(&recipe, max_steps, resume.as_deref(), allow_precision_change)
        }
        (Some(Cmd::Bench { mode }), _) => {
            match mode.unwrap_or(BenchMode::Step { steps: 5, warmup: 2, no_torch: false, threads: 2 }) {
                BenchMode::Step { steps, warmup, no_torch, threads } => bench::step::run(steps.max(1), warmup, !no_torch, threads.max(1)),
                BenchMode::Engine { steps } => bench::engine::run(steps.max(1)),
                BenchMode::Device { backend, presets, ranks, global_batch, micro_batch, seq, steps, peak_tflops, parity_only } => {
                    let ranks = ranks as usize;
                    if global_batch == 0 || micro_batch == 0 || !global_batch.is_multiple_of(ranks * micro_batch) {
                        return Err(Usage(format!(
                            "--global-batch {global_batch} must be a positive multiple of --ranks {ranks} x --micro-batch {micro_batch}"
                        ))
                        .into());
                    }
                    if let Some(n) = seq
                        && !(1..=copus_core::model::MAX_SIZE).contains(&n)
                    {
                        return Err(Usage(format!("--seq {n}: 1..={} tokens", copus_core::model::MAX_SIZE)).into());
                    }
                    let presets = if presets.is_empty() { vec!["tiny-20m".to_string(), "small-100m".to_string()] } else { presets };
                    let opts = bench::device::Options { presets, ranks, global_batch, micro_batch, seq, steps: steps.max(1), peak_tflops };
                    if parity_only { bench::device::parity(backend)? } else { bench::device::run(backend, &opts)? }
                }
                BenchMode::Reconfig { presets, trials, changes } => bench::reconfig::run_reconfig(&presets, trials as usize, &changes),
                BenchMode::RestartChild { checkpoint, preset, seq, layout, global_batch, micro_batch } => {
                    bench::reconfig::restart_child(&checkpoint, &preset, seq, &layout, global_batch, micro_batch)?
                }
                BenchMode::Probe { steps } => bench::probe::run(steps.max(1)),
                BenchMode::Memory { presets, zero1, bf16, backend, csv } => {
                    let group = match (zero1, bf16) {
                        (true, _) => bench::memory::Group::Zero1,
                        (_, true) => bench::memory::Group::Bf16,
                        _ if bench::memory::on_gpu(backend) => bench::memory::Group::Gpu,
                        _ => bench::memory::Group::All,
                    };
                    bench::memory::run(backend, &presets, group, csv.as_deref())?
                }
                BenchMode::MemoryChild { preset, seq, layout, micro_batch, schedule, checkpointing, precision, zero1, backend } => {
                    let row = bench::memory::Row {
                        preset,
                        seq,
                        dims: bench::memory::parse_layout(&layout)?,
                        micro_batch,
                        schedule: ron::from_str(&schedule)?,
                        checkpointing: ron::from_str(&checkpointing)?,
                        zero1,
                        precision: ron::from_str(&precision)?,
                        held_out: false,
                        backend,
                    };
                    bench::memory::child(&row)?
                }
            }
            Ok(())
        }
        (Some(Cmd::Profile { recipe, out }), _) => run_profile(&recipe, out),
        (Some(Cmd::Export { run_dir, to }), _) => {
            interop::export(&run_dir, &to)?;
            println!("wrote {} (config.json, model.safetensors, tokenizer.json)", to.display());
            Ok(())
        }
        (Some(Cmd::Eval { run_dir, text, seq, max_windows }), _) => {
            let r = interop::eval_command(&run_dir, &text, seq, max_windows)?;
            println!(
                "{}: {} tokens, {} windows; mean loss {:.4} nats/token, perplexity {:.2}",
                text.display(),
                r.tokens,
                r.windows,
                r.loss,
                r.perplexity()
            );
            Ok(())
        }
        (Some(Cmd::Generate { run_dir, prompt, max_tokens, temperature, top_p, seed }), _) => {
            let sampling = copus_models::generate::Sampling { temperature, top_p, seed };
            let text = interop::generate_command(&run_dir, &prompt, max_tokens, sampling)?;
            println!("{prompt}{text}");
            Ok(())
        }
        (Some(Cmd::Learner { recipe, fixed, compare, max_samples }), _) => {
            println!("{}", learner::run(&recipe, fixed, compare, max_samples)?);
            Ok(())
        }
        (Some(Cmd::Orchestrator { recipe, profile, policy, listen }), _) => recipes::orchestrator::serve(&recipe, &profile, policy, listen),
        (Some(Cmd::Compare { suite: Some(suite), .. }), _) => run_suite(&suite),
        (Some(Cmd::Compare { recipe: Some(recipe), .. }), _) => run_compare(&recipe),
        (Some(Cmd::Compare { .. }), _) => Err(Usage("give a comparison recipe or --suite FILE".into()).into()),
        (None, Some(recipe)) => run_recipe(&recipe, cli.max_steps, cli.resume.as_deref(), false),
        (None, None) => Err(Usage("give a recipe file (e.g. recipes/shakespeare-tiny.ron) or a subcommand; see --help".into()).into()),
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    // Under `mpirun -np N` (feature `mpi`), processes 1.. serve their ranks; process 0 runs the
    // command and drives them.
    #[cfg(feature = "mpi")]
    match copus_burn::mpi::init() {
        Ok(copus_burn::mpi::Role::Worker { .. }) => return serve_ranks(),
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
    copus_burn::mpi::finish();
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
        copus_burn::mpi::abort_job(&e.to_string());
    }
    copus_burn::mpi::finish();
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
