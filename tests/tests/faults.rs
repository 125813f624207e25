//! Fault injection: damaged checkpoints, a rank that hangs, a reconfiguration whose rollback
//! fails too, and the process killed (SIGKILL, as a child process) while it writes a checkpoint
//! or changes layout. Each fault must end in a clear error or a clean resume, with nothing lost.
//!
//! The child processes are this test binary run again on one `#[ignore]`d test, with
//! `COPUS_FAULT_CHILD` naming the folder to work in; without it those tests do nothing.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use copus_burn::{Engine, EngineConfig, EngineError, OptimConfig, ReconfigPhase, TrainingState};
use copus_core::layout::ParallelDims;
use copus_models::LlamaConfig;
use copus_tests::{SEQ, config, dims, initial_full, structured_batch};

fn optim() -> OptimConfig {
    OptimConfig { lr: 1e-3, warmup_steps: 2, total_steps: 50, b0: 4, ..OptimConfig::default() }
}

fn engine_with(d: ParallelDims, cfg: impl FnOnce(EngineConfig) -> EngineConfig) -> Engine<LlamaConfig> {
    Engine::new(Arc::new(config()), initial_full(), cfg(EngineConfig::new(d, 4, 1, SEQ, optim()))).unwrap()
}

fn engine(d: ParallelDims) -> Engine<LlamaConfig> {
    engine_with(d, |c| c)
}

fn batch(step: usize) -> Vec<i64> {
    structured_batch(step, config().shape.vocab_size, 4)
}

/// Trains steps `from..to`; returns the losses.
fn train(e: &mut Engine<LlamaConfig>, from: usize, to: usize) -> Vec<f64> {
    (from..to).map(|s| e.step(batch(s)).unwrap().metrics.loss).collect()
}

fn resume(path: &Path) -> Result<Engine<LlamaConfig>, EngineError> {
    Engine::resume(Arc::new(config()), path, None).map(|(e, _)| e)
}

/// A checkpoint after two steps, and the loss of the third step from it.
fn saved(dir: &Path) -> (PathBuf, f64) {
    let path = dir.join("state.bpk");
    let mut e = engine(dims(2, 1, 1));
    train(&mut e, 0, 2);
    e.save_checkpoint(&path, &BTreeMap::new()).unwrap();
    let next = train(&mut e, 2, 3)[0];
    (path, next)
}

/// Rewrites a checkpoint file without the tensor `key` (its header kept), as a damaged copy
/// might be.
fn without_tensor(path: &Path, key: &str) -> Vec<u8> {
    let bytes = std::fs::read(path).unwrap();
    let reader = burn_pack::Reader::from_bytes(burn_pack::Bytes::from_bytes_vec(bytes)).unwrap();
    let metadata = reader.metadata().clone();
    let tensors: Vec<burn_pack::Tensor> = reader
        .into_tensors()
        .unwrap()
        .into_iter()
        .filter_map(|t| {
            let (name, dtype, shape, id, bytes) = t.into_parts().unwrap();
            (name != key).then(|| burn_pack::Tensor::new(name, dtype, shape, id, bytes))
        })
        .collect();
    let mut w = burn_pack::Writer::new(tensors);
    for (k, v) in &metadata {
        w = w.with_metadata(k, v);
    }
    w.into_bytes().unwrap().to_vec()
}

#[test]
fn a_damaged_checkpoint_is_an_error_naming_the_damage_and_loads_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (path, next) = saved(dir.path());
    let good = std::fs::read(&path).unwrap();
    let state = TrainingState::load(&path).unwrap().0;
    let (param, fields) = state.optim.iter().next().unwrap();
    let field = fields.keys().next().unwrap();
    let damaged = dir.path().join("damaged.bpk");
    let mut cases: Vec<(&str, Vec<u8>, String)> = Vec::new();
    // One flipped bit in tensor data (the tensors fill the file's second half).
    let mut flipped = good.clone();
    let at = good.len() - good.len() / 4;
    flipped[at] ^= 0x10;
    cases.push(("a flipped bit", flipped, "corrupt".into()));
    // One optimizer tensor gone (the header says it was written).
    cases.push((
        "a missing optimizer tensor",
        without_tensor(&path, &format!("optim/{param}/{field}")),
        format!("tensor `optim/{param}/{field}` is missing"),
    ));
    // The file cut short.
    cases.push(("a truncated file", good[..good.len() / 2].to_vec(), "not a readable checkpoint".into()));
    for (what, bytes, want) in cases {
        std::fs::write(&damaged, bytes).unwrap();
        let err = resume(&damaged).err().unwrap_or_else(|| panic!("{what}: loaded")).to_string();
        assert!(err.contains(&want) && err.contains("damaged.bpk"), "{what}: {err}");
    }
    // The intact file still resumes exactly.
    let mut e = resume(&path).unwrap();
    assert_eq!(train(&mut e, 2, 3)[0].to_bits(), next.to_bits());
}

#[test]
fn a_partial_or_foreign_state_is_refused_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    let (path, _) = saved(dir.path());
    let (state, cfg, _) = TrainingState::load(&path).unwrap();
    let model = Arc::new(config());
    let (param, fields) = state.optim.iter().next().map(|(p, f)| (p.clone(), f.clone())).unwrap();
    let field = fields.keys().next().unwrap().clone();

    let mut partial = state.clone();
    partial.optim.get_mut(&param).unwrap().remove(&field);
    let e = Engine::from_state(model.clone(), &partial, cfg.clone()).err().unwrap().to_string();
    assert!(e.contains(&format!("`{param}#{field}` is missing")), "{e}");
    // Nor can it be saved: a checkpoint is never written partial.
    let e = partial
        .save(&dir.path().join("p.bpk"), &copus_burn::ParallelLm::spec(&config()).param_specs(), &cfg, &BTreeMap::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("is missing"), "{e}");
    assert!(!dir.path().join("p.bpk").exists());

    let mut no_moments = state.clone();
    no_moments.optim.clear();
    let e = Engine::from_state(model.clone(), &no_moments, cfg.clone()).err().unwrap().to_string();
    assert!(e.contains("optimizer state is missing although 2 steps"), "{e}");

    let mut extra = state.clone();
    extra.params.insert("layers.9.unknown".into(), vec![0.0; 4]);
    let e = Engine::from_state(model.clone(), &extra, cfg.clone()).err().unwrap().to_string();
    assert!(e.contains("layers.9.unknown") && e.contains("extra"), "{e}");

    let mut short = state.clone();
    short.params.get_mut(&param).unwrap().pop();
    let e = Engine::from_state(model, &short, cfg).err().unwrap().to_string();
    assert!(e.contains(&param) && e.contains("elements"), "{e}");
}

#[test]
fn a_hung_rank_fails_the_step_in_time_and_the_engine_drops_promptly() {
    let mut e = engine_with(dims(2, 1, 1), |c| c.with_timeout_secs(1.0));
    train(&mut e, 0, 1);
    e.inject_stall(1);
    let t = Instant::now();
    let err = e.step(batch(1)).unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(15), "the step took {:?}", t.elapsed());
    assert!(err.contains("timed out") && err.contains("[1]"), "{err}");
    // Dead, not hanging: the next step is refused at once.
    let t = Instant::now();
    assert!(matches!(e.step(batch(1)), Err(EngineError::Dead(_))));
    assert!(t.elapsed() < Duration::from_secs(1));
    let t = Instant::now();
    drop(e);
    assert!(t.elapsed() < Duration::from_secs(10), "dropping took {:?}", t.elapsed());
}

/// Also with ZeRO-1, whose replicas hand back their pieces of the optimizer state without a
/// collective (the ranks can no longer reduce together).
#[test]
fn a_failed_rollback_leaves_an_emergency_checkpoint_that_resumes_exactly() {
    for zero1 in [false, true] {
        a_failed_rollback_leaves_an_emergency_checkpoint(zero1);
    }
}

fn a_failed_rollback_leaves_an_emergency_checkpoint(zero1: bool) {
    let dir = tempfile::tempdir().unwrap();
    let mut reference = engine_with(dims(2, 1, 1), |c| c.with_zero1(zero1));
    let want = train(&mut reference, 0, 3);
    let mut e = engine_with(dims(2, 1, 1), |c| c.with_zero1(zero1));
    train(&mut e, 0, 2);
    e.set_emergency_dir(dir.path());
    e.inject_fault_with_failed_rollback(ReconfigPhase::Load);
    let err = e.reconfigure(dims(1, 2, 1), 4, 1).unwrap_err().to_string();
    assert!(err.contains("rollback failed too") && err.contains("emergency checkpoint"), "{err}");
    let path = std::fs::read_dir(dir.path()).unwrap().flatten().map(|d| d.path()).find(|p| p.extension().is_some_and(|x| x == "bpk"));
    let path = path.expect("an emergency checkpoint");
    assert!(err.contains(&path.display().to_string()), "{err}");
    assert!(matches!(e.step(batch(2)), Err(EngineError::Dead(_))));
    drop(e);
    let mut back = resume(&path).unwrap();
    assert_eq!(back.steps_done(), 2);
    assert_eq!(back.config().zero1, zero1);
    assert_eq!(train(&mut back, 2, 3)[0].to_bits(), want[2].to_bits(), "zero1 {zero1}");
}

// ---- The process killed -------------------------------------------------------------------

const CHILD_ENV: &str = "COPUS_FAULT_CHILD";

/// A child process, killed when dropped (also when the test fails).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs this binary's test `name` as a child working in `dir`, its stdout piped.
fn child(name: &str, dir: &Path) -> Killed {
    Killed(
        Command::new(std::env::current_exe().unwrap())
            .args(["--exact", name, "--ignored", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// How long a child works before it stops by itself (should its parent be gone).
const CHILD_LIFETIME: Duration = Duration::from_secs(300);

/// Reads the child's lines until one ends with `line` (the test harness may print the test's
/// name before it on the same line).
fn wait_for_line(lines: &mut impl Iterator<Item = std::io::Result<String>>, line: &str) {
    for l in lines.by_ref() {
        if l.unwrap().trim_end().ends_with(line) {
            return;
        }
    }
    panic!("the child ended before printing {line:?}");
}

fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Child: trains and checkpoints after every step, forever (until killed).
#[test]
#[ignore = "a child process of the kill tests"]
fn child_checkpoints_forever() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    let path = PathBuf::from(dir).join("state.bpk");
    let mut e = engine(dims(2, 1, 1));
    let started = Instant::now();
    for s in (0..).take_while(|_| started.elapsed() < CHILD_LIFETIME) {
        train(&mut e, s, s + 1);
        e.save_checkpoint(&path, &BTreeMap::from([("step".to_string(), (s + 1).to_string())])).unwrap();
        say(&format!("saved {}", s + 1));
    }
}

/// Child: trains and checkpoints, then forever: changes layout (back and forth), trains a step
/// and checkpoints.
#[test]
#[ignore = "a child process of the kill tests"]
fn child_reconfigures_forever() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else { return };
    let path = PathBuf::from(dir).join("state.bpk");
    let mut e = engine(dims(2, 1, 1));
    train(&mut e, 0, 2);
    e.save_checkpoint(&path, &BTreeMap::new()).unwrap();
    say("checkpointed");
    let started = Instant::now();
    for i in (0..).take_while(|_| started.elapsed() < CHILD_LIFETIME) {
        say("reconfiguring");
        let to = if i % 2 == 0 { dims(1, 2, 1) } else { dims(2, 1, 1) };
        e.reconfigure(to, 4, 1).unwrap();
        train(&mut e, 2 + i, 3 + i);
        e.save_checkpoint(&path, &BTreeMap::new()).unwrap();
    }
}

/// SIGKILL while a checkpoint is being written (its temporary file exists): the previous
/// checkpoint is whole and resumes.
#[test]
fn killed_while_writing_a_checkpoint_the_previous_one_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = child("child_checkpoints_forever", dir.path());
    let mut lines = BufReader::new(c.0.stdout.take().unwrap()).lines();
    wait_for_line(&mut lines, "saved 1");
    // Keep reading its output on another thread (a full pipe would stall the child).
    std::thread::spawn(move || lines.for_each(drop));
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut caught = false;
    while Instant::now() < deadline && !caught {
        caught = std::fs::read_dir(dir.path()).unwrap().flatten().any(|d| d.file_name().to_string_lossy().ends_with(".tmp"));
        if !caught {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    c.0.kill().unwrap();
    c.0.wait().unwrap();
    assert!(caught, "never saw a checkpoint being written");
    let (state, _, extra) = TrainingState::load(&dir.path().join("state.bpk")).unwrap();
    let step: u64 = extra["step"].parse().unwrap();
    assert_eq!(state.step, step, "the file is one whole checkpoint");
    // It resumes, bit-exactly as the uninterrupted run goes on.
    let mut reference = engine(dims(2, 1, 1));
    let want = train(&mut reference, 0, step as usize + 1);
    let mut e = resume(&dir.path().join("state.bpk")).unwrap();
    assert_eq!(train(&mut e, step as usize, step as usize + 1)[0].to_bits(), want[step as usize].to_bits());
    // The next save removes the killed process's temporary file.
    e.save_checkpoint(&dir.path().join("state.bpk"), &BTreeMap::new()).unwrap();
    let left: Vec<String> =
        std::fs::read_dir(dir.path()).unwrap().flatten().map(|d| d.file_name().to_string_lossy().into_owned()).collect();
    assert_eq!(left, vec!["state.bpk".to_string()]);
}

/// SIGKILL in the middle of a layout change: the last checkpoint resumes exactly.
#[test]
fn killed_during_a_reconfiguration_the_last_checkpoint_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = child("child_reconfigures_forever", dir.path());
    let mut lines = BufReader::new(c.0.stdout.take().unwrap()).lines();
    wait_for_line(&mut lines, "checkpointed");
    for _ in 0..3 {
        wait_for_line(&mut lines, "reconfiguring");
    }
    // Somewhere inside the third change (staging, stopping ranks, loading, verifying).
    std::thread::sleep(Duration::from_millis(15));
    c.0.kill().unwrap();
    c.0.wait().unwrap();
    // The newest checkpoint is whole: it resumes (in the layout it was saved in) and trains on
    // as the uninterrupted run does (other layouts agree to float rounding).
    let mut e = resume(&dir.path().join("state.bpk")).unwrap();
    let step = e.steps_done() as usize;
    assert!(step >= 2 + 2, "checkpoints after two changes exist: {step}");
    let mut reference = engine(dims(2, 1, 1));
    let want = train(&mut reference, 0, step + 1)[step];
    let got = train(&mut e, step, step + 1)[0];
    assert!((got - want).abs() <= 1e-5 * want.abs(), "step {step}: {got} vs {want}");
}

/// The emergency checkpoint of a driven run carries the driver's position, so `RunDir::resume`
/// (what `recipes run --resume` uses) continues from it: it becomes the run's newest checkpoint
/// and the run goes on exactly as one whose layout change was never asked for.
#[test]
fn a_driven_runs_emergency_checkpoint_resumes_through_the_run_folder() {
    use copus_burn::driver::Clock;
    use copus_burn::{Driver, RunDir};
    use copus_core::candidates::{Candidate, CandidateSpace};
    use copus_core::decision::Scripted;
    use copus_core::memory::{GIB, MemoryModel};
    use copus_core::schedule::ScheduleKind;

    let space = CandidateSpace::new(2, vec![4, 8], vec![1, 2], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB)
        .unwrap()
        .enumerate(&copus_burn::ParallelLm::spec(&config()));
    let start = Candidate::new(dims(2, 1, 1), 4, 2).unwrap();
    let data = copus_tests::IndexedSequences { vocab: config().shape.vocab_size };
    let driver = || {
        let ec = EngineConfig::new(start.dims, start.global_batch, start.micro_batch, SEQ, optim());
        Driver::new(Engine::new(Arc::new(config()), initial_full(), ec).unwrap(), space.clone(), Clock::Wall).unwrap()
    };
    let mut reference = driver();
    let want: Vec<f64> = (0..4).map(|_| reference.step(&data, &mut Scripted::default()).unwrap().step.metrics.loss).collect();

    let dir = tempfile::tempdir().unwrap();
    let mut d = driver();
    d.engine_mut().set_emergency_dir(dir.path());
    let mut source = Scripted::new([(2, Candidate::new(dims(1, 2, 1), 4, 2).unwrap())]);
    d.step(&data, &mut source).unwrap();
    d.engine_mut().inject_fault_with_failed_rollback(ReconfigPhase::Load);
    assert!(d.step(&data, &mut source).is_err(), "the change and its rollback failed");
    drop(d);

    let run = RunDir::new(dir.path());
    assert_eq!(run.emergency_checkpoints().len(), 1);
    let (mut back, from) = run.resume(Arc::new(config()), &space, || Clock::Wall, &mut Scripted::default()).unwrap();
    assert_eq!(from, run.checkpoint_path(2));
    assert!(run.emergency_checkpoints().is_empty(), "moved into checkpoints/");
    assert_eq!((back.engine().steps_done(), back.position().next_sample), (2, 8));
    let rest: Vec<f64> = (0..2).map(|_| back.step(&data, &mut Scripted::default()).unwrap().step.metrics.loss).collect();
    assert_eq!(rest.iter().map(|l| l.to_bits()).collect::<Vec<_>>(), want[2..].iter().map(|l| l.to_bits()).collect::<Vec<_>>());
}
