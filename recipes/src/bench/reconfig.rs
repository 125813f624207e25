//! `recipes bench reconfig`: an in-memory layout change of the engine against a real process
//! restart from a synced checkpoint, per model preset and layout change, with the switch, the
//! first step after it and the steady step each timed.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::Device;
use copus_burn::{Engine, EngineOptions, OptimConfig, ReconfigReport};
use copus_core::layout::ParallelDims;
use copus_core::model::ModelSpec;
use copus_models::{LlamaConfig, full_params};

use super::median;
use crate::profile::synthetic_batch;

/// Waits until every rank has finished its queued work (the backend may still be applying the
/// last update when `step` returns) by reading the weights back; returns the seconds it took.
fn settle(engine: &mut Engine<LlamaConfig>) -> f64 {
    let t = Instant::now();
    engine.rank_params().expect("read the weights");
    t.elapsed().as_secs_f64()
}

/// Seconds of `n` steady training steps of `engine` after a warm-up step, each from settled to
/// settled, less the cost of settling itself.
fn step_times(engine: &mut Engine<LlamaConfig>, spec: &ModelSpec, salt: usize, n: usize) -> Vec<f64> {
    let b = engine.config().global_batch;
    engine.step(synthetic_batch(b, spec.seq_len, spec.vocab_size, salt)).expect("step");
    settle(engine);
    (0..n)
        .map(|i| {
            let t = Instant::now();
            engine.step(synthetic_batch(b, spec.seq_len, spec.vocab_size, salt + 1 + i)).expect("step");
            settle(engine);
            t.elapsed().as_secs_f64() - settle(engine)
        })
        .collect()
}

/// Tries to drop the page cache (root with a writable `/proc/sys`), so a restart reads its
/// checkpoint from storage; returns whether it did.
fn drop_page_cache() -> Result<(), String> {
    // Written data first, then the clean pages.
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "1").map_err(|e| e.to_string())
}

/// The checkpoint-restart side of one layout change, as a real restart: the checkpoint is
/// written and synced, then a new process (this binary, `bench restart-child`) starts, loads it
/// into the target layout and runs one step. Returns the seconds from the decision to the end
/// of that step, and whether the page cache was dropped before the load.
fn process_restart(
    e: Engine<LlamaConfig>,
    path: &std::path::Path,
    preset: &str,
    seq: usize,
    to: ParallelDims,
    b_g: usize,
    b_m: usize,
) -> (f64, Result<(), String>) {
    use std::io::BufRead;
    let mut e = e;
    let t = Instant::now();
    e.save_checkpoint(path, &Default::default()).expect("save");
    drop(e);
    let dropped = drop_page_cache();
    let exe = std::env::current_exe().expect("this binary");
    let mut child = std::process::Command::new(exe)
        .args(["bench", "restart-child", "--quiet", "--checkpoint"])
        .arg(path)
        .args(["--preset", preset, "--seq", &seq.to_string(), "--layout", &format!("{},{},{}", to.dp, to.tp, to.pp)])
        .args(["--global-batch", &b_g.to_string(), "--micro-batch", &b_m.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the restart process");
    let out = std::io::BufReader::new(child.stdout.take().expect("piped"));
    let mut done = None;
    for line in out.lines().map_while(Result::ok) {
        if line.trim() == "first-step-done" {
            done = Some(t.elapsed().as_secs_f64());
            break;
        }
    }
    let status = child.wait().expect("the restart process");
    let secs = done.unwrap_or_else(|| panic!("the restart process ended ({status}) before its first step"));
    (secs, dropped)
}

/// `bench restart-child`: a fresh process loads a checkpoint into `layout` and runs one step.
pub fn restart_child(checkpoint: &std::path::Path, preset: &str, seq: usize, layout: &str, b_g: usize, b_m: usize) -> anyhow::Result<()> {
    let mut spec = ModelSpec::preset(preset)?;
    spec.seq_len = seq;
    let d: Vec<usize> = layout.split(',').map(str::parse).collect::<Result<_, _>>()?;
    let [dp, tp, pp] = d[..] else { anyhow::bail!("--layout dp,tp,pp") };
    let dims = ParallelDims::new(dp, tp, pp, dp * tp * pp)?;
    let cfg = LlamaConfig::from_spec(&spec);
    let optim = OptimConfig { warmup_steps: 0, ..OptimConfig::default() };
    let (mut e, _) =
        Engine::resume(Arc::new(cfg), checkpoint, Some(EngineOptions::default().engine_config_of(dims, (b_g, b_m), seq, optim)))?;
    e.step(synthetic_batch(b_g, seq, spec.vocab_size, 1))?;
    // Finished as the in-memory side counts it: every rank's update applied.
    e.rank_params()?;
    println!("first-step-done");
    Ok(())
}

/// A layout change, `(dp, tp, pp)` before and after.
pub type Change = ((usize, usize, usize), (usize, usize, usize));

/// The changes `bench reconfig` times by default: three of 8 ranks and one from 8 ranks to 4.
const CHANGES: [Change; 4] = [((2, 2, 2), (1, 4, 2)), ((1, 2, 4), (2, 4, 1)), ((2, 4, 1), (2, 1, 4)), ((2, 4, 1), (1, 2, 2))];

/// Parses `dp2,tp2,pp2->dp1,tp4,pp2` (the layouts as the table prints them).
pub fn parse_change(text: &str) -> Result<Change, ChangeError> {
    parse(text).map_err(ChangeError)
}

/// A `--change` that is not `FROM->TO` of two layouts, with what is wrong in it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ChangeError(pub String);

fn parse(text: &str) -> Result<Change, String> {
    let layout = |part: &str| -> Result<(usize, usize, usize), String> {
        let axes: Vec<&str> = part.trim().split(',').map(str::trim).collect();
        let value = |axis: &str, field: &str| -> Result<usize, String> {
            field
                .strip_prefix(axis)
                .and_then(|n| n.parse().ok())
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("`{field}` is not {axis}N with N a positive whole number"))
        };
        match axes[..] {
            [dp, tp, pp] => Ok((value("dp", dp)?, value("tp", tp)?, value("pp", pp)?)),
            _ => Err(format!("`{part}` is not a layout dpA,tpB,ppC")),
        }
    };
    let (from, to) = text.split_once("->").ok_or_else(|| format!("`{text}` is not FROM->TO, as in dp2,tp2,pp2->dp1,tp4,pp2"))?;
    Ok((layout(from)?, layout(to)?))
}

/// In-memory reconfiguration against a real checkpoint-restart (write and sync the checkpoint,
/// start a new process that loads it into the new layout), each timed from the decision to the
/// end of the first step at the target layout, and the steady step time there.
pub fn run_reconfig(presets: &[String], trials: usize, changes: &[Change]) {
    let dir = std::env::temp_dir().join(format!("copus-reconfig-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let pairs = if changes.is_empty() { &CHANGES[..] } else { changes };
    print_header(trials);
    let mut cache_note = None;
    for preset in ["tiny-20m", "small-100m"] {
        if !presets.is_empty() && !presets.iter().any(|p| p == preset) {
            continue;
        }
        let mut spec = ModelSpec::preset(preset).expect("preset");
        spec.seq_len = 64;
        let cfg = LlamaConfig::from_spec(&spec);
        let device = Device::flex().autodiff();
        device.seed(0);
        let full = full_params(&cfg.init(&device));
        let model = Model { preset, spec: &spec, cfg: &cfg, full: &full, dir: &dir };
        for pair in pairs {
            let Some((a, b)) = model.change(pair) else { continue };
            let t = model.trials(a, b, trials, &mut cache_note);
            model.print_row(a, b, t);
        }
    }
    match cache_note {
        Some(Ok(())) => println!("\nthe page cache was dropped between writing and loading each checkpoint"),
        Some(Err(e)) => println!("\nthe page cache could not be dropped here ({e}): restarts read the checkpoint from memory"),
        None => {}
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The table's explanation and header.
fn print_header(trials: usize) {
    println!("In-memory reconfiguration against a process restart, in-process ranks, this machine.");
    println!("switch: the layout change alone; first step: the step after it; in-memory and restart: from");
    println!("the decision to the end of the first step at the target layout; step: a steady step there;");
    println!("cost: that time less the trial's steady step, in steady steps (0 where it took no longer), the");
    println!("median over trials; ratio: restart cost / in-memory cost (a lower bound, \"> N\", where the");
    println!("in-memory cost is below 0.01 steps). Per-trial times go to standard error.");
    println!("Times are medians of {trials} trial(s), each on a fresh engine (steady steps: the median of three");
    println!("per trial, over all trials); each column is its own median, so switch and first step need not");
    println!("add up to in-memory. moved: bytes the plan copied (weights, both moments, previous");
    println!("gradient), of which rank-to-rank crossed between ranks. Every clock starts and stops with all");
    println!("ranks' queued work done (the weights read back, that read's own time taken off).");
    println!(
        "| model | params | from -> to | path | state MB | moved MB | rank-to-rank MB | switch s | first step s | in-memory s | restart s | step s | in-memory cost | restart cost | ratio |"
    );
    println!("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
}

/// The global batch and micro-batch every change runs at.
const BATCH: (usize, usize) = (8, 1);

/// One preset's model for the changes: its shape, starting weights and the checkpoint folder.
struct Model<'a> {
    preset: &'a str,
    spec: &'a ModelSpec,
    cfg: &'a LlamaConfig,
    full: &'a copus_burn::parallel::FullParams,
    dir: &'a std::path::Path,
}

/// One change's times over its trials, and the last trial's switch report and state size.
struct Trials {
    switch: Vec<f64>,
    first: Vec<f64>,
    in_memory: Vec<f64>,
    restart: Vec<f64>,
    steps: Vec<f64>,
    last: Option<(ReconfigReport, f64)>,
}

impl Model<'_> {
    /// The change's two layouts, or `None` (said on standard error) where the model or the batch
    /// does not fit one of them.
    fn change(&self, &((a_dp, a_tp, a_pp), (b_dp, b_tp, b_pp)): &Change) -> Option<(ParallelDims, ParallelDims)> {
        let preset = self.preset;
        let (a, b) =
            match (ParallelDims::new(a_dp, a_tp, a_pp, a_dp * a_tp * a_pp), ParallelDims::new(b_dp, b_tp, b_pp, b_dp * b_tp * b_pp)) {
                (Ok(a), Ok(b)) => (a, b),
                (Err(e), _) | (_, Err(e)) => {
                    eprintln!("{preset}: a change skipped: {e}");
                    return None;
                }
            };
        if let Some(e) = a.check_model(self.spec).err().or(b.check_model(self.spec).err()) {
            eprintln!("{preset}: {a} -> {b} skipped: {e}");
            return None;
        }
        let (b_g, b_m) = BATCH;
        if let Some(d) = [a, b].into_iter().find(|d| b_g % (d.dp * b_m) != 0) {
            eprintln!("{preset}: {a} -> {b} skipped: B_g {b_g} does not split into {} replicas of micro-batches of {b_m}", d.dp);
            return None;
        }
        Some((a, b))
    }

    /// The engine's configuration on layout `d`.
    fn config(&self, d: ParallelDims) -> copus_burn::EngineConfig {
        let optim = OptimConfig { warmup_steps: 0, ..OptimConfig::default() };
        EngineOptions::default().engine_config_of(d, BATCH, self.spec.seq_len, optim)
    }

    /// `trials` trials of `a -> b`, each in memory and by a restart, on fresh engines.
    fn trials(&self, a: ParallelDims, b: ParallelDims, trials: usize, cache_note: &mut Option<Result<(), String>>) -> Trials {
        let (spec, (b_g, b_m)) = (self.spec, BATCH);
        let mut t = Trials { switch: vec![], first: vec![], in_memory: vec![], restart: vec![], steps: vec![], last: None };
        for _ in 0..trials {
            // In memory: one step so AdamW state exists, then switch and take the first step.
            let mut e = Engine::new(Arc::new(self.cfg.clone()), self.full, self.config(a)).expect("engine");
            e.step(synthetic_batch(b_g, spec.seq_len, spec.vocab_size, 0)).expect("step");
            // The clock starts once the last step is wholly done, on both sides.
            settle(&mut e);
            let clock = Instant::now();
            let report = e.reconfigure(b, b_g, b_m).expect("reconfigure");
            e.step(synthetic_batch(b_g, spec.seq_len, spec.vocab_size, 1)).expect("step");
            settle(&mut e);
            let total = clock.elapsed().as_secs_f64() - settle(&mut e);
            t.in_memory.push(total);
            t.switch.push(report.total_secs);
            t.first.push(total - report.total_secs);
            t.steps.extend(step_times(&mut e, spec, 2, 3));
            let state_mb = e.stage_state().expect("stage").bytes() as f64 / 1e6;
            t.last = Some((report, state_mb));
            drop(e);
            // A real restart of the same state.
            let mut e = Engine::new(Arc::new(self.cfg.clone()), self.full, self.config(a)).expect("engine");
            e.step(synthetic_batch(b_g, spec.seq_len, spec.vocab_size, 0)).expect("step");
            settle(&mut e);
            let path = self.dir.join("state.bpk");
            let (secs, dropped) = process_restart(e, &path, self.preset, spec.seq_len, b, b_g, b_m);
            t.restart.push(secs);
            let k = t.restart.len() - 1;
            eprintln!(
                "{} {a} -> {b}, trial {}: switch {:.2} s, first step {:.2} s, steady steps {:.2?} s, restart {secs:.2} s",
                self.preset,
                k + 1,
                t.switch[k],
                t.first[k],
                &t.steps[3 * k..]
            );
            cache_note.get_or_insert(dropped);
            let _ = std::fs::remove_file(&path);
        }
        t
    }

    /// The table's row of `a -> b`: medians, and costs against each trial's own steady step.
    fn print_row(&self, a: ParallelDims, b: ParallelDims, t: Trials) {
        let Some((report, state_mb)) = t.last else { return };
        // Each trial's costs against its own steady step (the machine drifts between trials),
        // then the median over trials.
        let steady: Vec<f64> = t.steps.chunks(3).map(|c| median(c.to_vec())).collect();
        let per_trial = |x: &[f64]| median(x.iter().zip(&steady).map(|(t, s)| (t - s).max(0.0) / s).collect());
        let (cost, restart_cost) = (per_trial(&t.in_memory), per_trial(&t.restart));
        let (switch, first, in_memory, restart, step) =
            (median(t.switch), median(t.first), median(t.in_memory), median(t.restart), median(t.steps));
        // Below the table's resolution (0.01 steps) the ratio is only a lower bound.
        let ratio = if cost >= 0.01 {
            format!("{:.1}x", restart_cost / cost)
        } else if restart_cost > 0.0 {
            format!("> {:.0}x", (restart_cost / 0.01).floor())
        } else {
            "-".to_string()
        };
        println!(
            "| {} | {:.1}M | {a} -> {b} | {} | {state_mb:.0} | {:.0} | {:.0} | {switch:.2} | {first:.2} | {in_memory:.2} | {restart:.2} | {step:.2} | {cost:.2} | {restart_cost:.2} | {ratio} |",
            self.preset,
            self.spec.num_params() as f64 / 1e6,
            if report.live { "live" } else { "staged" },
            report.bytes as f64 / 1e6,
            report.remote_bytes as f64 / 1e6,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_parses_as_the_table_prints_it_and_a_bad_one_names_its_part() {
        let a = ParallelDims::new(2, 2, 2, 8).unwrap();
        let b = ParallelDims::new(1, 4, 2, 8).unwrap();
        assert_eq!(parse_change(&format!("{a}->{b}")), Ok(((2, 2, 2), (1, 4, 2))));
        assert_eq!(parse_change(" dp2, tp4, pp1 -> dp1,tp2,pp2 "), Ok(((2, 4, 1), (1, 2, 2))));
        assert!(parse_change("dp2,tp2,pp2").unwrap_err().0.contains("FROM->TO"));
        assert!(parse_change("dp2,tp2->dp1,tp4,pp2").unwrap_err().0.contains("`dp2,tp2` is not a layout"));
        assert!(parse_change("dp2,tp0,pp2->dp1,tp4,pp2").unwrap_err().0.contains("`tp0`"));
        assert!(parse_change("dp2,pp2,tp2->dp1,tp4,pp2").unwrap_err().0.contains("`pp2` is not tpN"));
    }
}
