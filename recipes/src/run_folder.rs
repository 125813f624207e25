//! A run's folder, written as the run goes: its logs (`metrics.jsonl`, `eval.jsonl`,
//! `decisions.jsonl`, `reconfigurations.csv`), its checkpoints, what a resumed run reads back,
//! and the outputs at its end (weights and plots). The run loop (`adaptive`) writes through it,
//! fixed or adaptive alike.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{Device, TensorData};
use copus_burn::Driver;
use copus_burn::ParallelLm;
use copus_burn::parallel::{ShardPlan, ShardSource};
use copus_burn::run_dir::RunDir;
use copus_core::candidates::Candidate;
use copus_core::decision::DecisionSource;
use copus_core::layout::ParallelDims;
use copus_models::{LlamaConfig, LlamaStage};
use serde::{Deserialize, Serialize};

use crate::report::plot::{self, Series};
use crate::stop;

/// One step as the plots need it (kept in `metrics.jsonl` so a resumed run plots it all).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Point {
    pub(crate) secs: f64,
    pub(crate) loss: f64,
    pub(crate) candidate: Candidate,
    pub(crate) b_simple: Option<f64>,
    pub(crate) throughput: f64,
    pub(crate) efficiency: f64,
    /// The step (1-based); 0 in runs written before it was kept.
    #[serde(default)]
    pub(crate) step: u64,
    /// Tokens trained on after the step; 0 in runs written before it was kept.
    #[serde(default)]
    pub(crate) tokens: u64,
}

/// The applied decisions of `decisions.jsonl` (the whole run's, resumes included), one line
/// each: step, from, to and why.
pub(crate) fn applied_changes(folder: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(folder.join("decisions.jsonl")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["record"]["applied"].as_bool() == Some(true))
        .filter_map(|v| {
            let r = serde_json::from_value::<copus_burn::driver::DecisionRecord>(v["record"].clone()).ok()?;
            Some(format!("step {}: {} -> {} ({})", r.step, r.current, r.proposed, v["why"].as_str().unwrap_or("-")))
        })
        .collect()
}

/// The run's output files, open for appending.
pub(crate) struct Logs {
    pub(crate) metrics: BufWriter<File>,
    pub(crate) evals: BufWriter<File>,
    pub(crate) decisions: BufWriter<File>,
    pub(crate) switches: BufWriter<File>,
}

pub(crate) const LOG_FILES: [&str; 4] = ["metrics.jsonl", "eval.jsonl", "decisions.jsonl", "reconfigurations.csv"];

impl Logs {
    pub(crate) fn open(folder: &Path, fresh: bool) -> anyhow::Result<Self> {
        let open = |name: &str| -> anyhow::Result<BufWriter<File>> {
            let p = folder.join(name);
            let f = std::fs::OpenOptions::new().create(true).append(true).truncate(false).open(&p);
            Ok(BufWriter::new(f.with_context(|| format!("cannot write {}", p.display()))?))
        };
        let [m, e, d, s] = LOG_FILES;
        let mut logs = Self { metrics: open(m)?, evals: open(e)?, decisions: open(d)?, switches: open(s)? };
        if fresh {
            writeln!(logs.switches, "step,train_secs,from,to,layout_changed,measured_secs,bytes,live")?;
        }
        Ok(logs)
    }

    pub(crate) fn flush(&mut self) -> std::io::Result<()> {
        for w in [&mut self.metrics, &mut self.evals, &mut self.decisions, &mut self.switches] {
            w.flush()?;
        }
        Ok(())
    }

    /// Flushes every log and syncs it to the disk.
    pub(crate) fn sync(&mut self) -> std::io::Result<()> {
        self.flush()?;
        for w in [&mut self.metrics, &mut self.evals, &mut self.decisions, &mut self.switches] {
            w.get_ref().sync_data()?;
        }
        Ok(())
    }
}

/// What the loop carries from a fresh start or a resume: the plotted points and the evaluations.
pub(crate) struct History {
    pub(crate) points: Vec<Point>,
    pub(crate) initial_eval: f64,
    pub(crate) last_eval: (u64, f64),
}

/// Writes a checkpoint of the run at its current step (the logs flushed and synced first, so a
/// power loss cannot leave them behind the checkpoint) and keeps the newest two. A signal that
/// arrives meanwhile waits for it; a second one quits once it is written.
pub(crate) fn checkpoint(
    driver: &mut Driver<LlamaConfig>,
    source: &dyn DecisionSource,
    folder: &Path,
    logs: &mut Logs,
) -> anyhow::Result<PathBuf> {
    stop::saving(|| {
        #[cfg(feature = "fault-injection")]
        if let Some(ms) = std::env::var("COPUS_TEST_SAVE_PAUSE_MS").ok().and_then(|v| v.parse::<u64>().ok()) {
            eprintln!("copus-test: writing a checkpoint");
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
        logs.sync().map_err(anyhow::Error::from).and_then(|()| Ok(RunDir::new(folder).save(driver, source, &BTreeMap::new())?))
    })
}

/// The plotted points and evaluations of a run folder up to `step`.
pub(crate) fn history_of(folder: &Path, step: u64) -> anyhow::Result<History> {
    let read = |name: &str| -> anyhow::Result<Vec<serde_json::Value>> {
        let p = folder.join(name);
        let text = std::fs::read_to_string(&p).with_context(|| format!("cannot read {}", p.display()))?;
        Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
    };
    let mut points: Vec<Point> = Vec::new();
    for v in read("metrics.jsonl")? {
        if let Ok(p) = serde_json::from_value::<Point>(v["point"].clone()) {
            // Steps trained again after a recovery: the later ones count.
            while points.last().is_some_and(|q| q.step >= p.step) {
                points.pop();
            }
            points.push(p);
        }
    }
    let evals: Vec<(u64, f64)> =
        read("eval.jsonl")?.iter().filter_map(|v| Some((v["step"].as_u64()?, v["eval_loss"].as_f64()?))).filter(|e| e.0 <= step).collect();
    let initial_eval = evals.first().filter(|e| e.0 == 0).map(|e| e.1).context("eval.jsonl has no evaluation at step 0")?;
    let last_eval = *evals.last().expect("one evaluation at least");
    Ok(History { points, initial_eval, last_eval })
}

/// The whole model as one stage (dp1,tp1,pp1) from gathered parameters, on Flex without autodiff.
pub(crate) fn whole_model(cfg: &LlamaConfig, params: HashMap<String, Vec<f32>>) -> anyhow::Result<LlamaStage> {
    let spec = ParallelLm::spec(cfg);
    let mut shards = HashMap::new();
    for p in spec.param_specs() {
        let v = params.get(&p.name).with_context(|| format!("parameter {} missing from the gathered state", p.name))?;
        shards.insert(p.name.clone(), TensorData::new(v.clone(), p.shape.clone()));
    }
    let plan = ShardPlan::new(ParallelDims { dp: 1, tp: 1, pp: 1 }, 0, 0, spec.num_layers);
    Ok(cfg.build_stage(&plan, &mut ShardSource::new(shards), &Device::flex())?)
}

/// Writes the final weights under the model's global names.
pub(crate) fn save_weights(cfg: &LlamaConfig, params: HashMap<String, Vec<f32>>, path: &Path) -> anyhow::Result<()> {
    let stage = whole_model(cfg, params)?;
    let mut store = SafetensorsStore::from_file(path).overwrite(true);
    stage.save_into(&mut store).map_err(|e| anyhow!("{}: {e}", path.display()))
}

/// A fixed run's plots: loss against time and tokens (training and held-out), and the noise
/// scale against the step.
pub(crate) fn fixed_plots(folder: &Path, points: &[Point]) -> anyhow::Result<()> {
    let evals: Vec<serde_json::Value> =
        std::fs::read_to_string(folder.join("eval.jsonl"))?.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let eval_pts = |x: &str| -> Vec<(f64, f64)> { evals.iter().filter_map(|v| Some((v[x].as_f64()?, v["eval_loss"].as_f64()?))).collect() };
    let train_by = |f: &dyn Fn(&Point) -> f64| points.iter().map(|p| (f(p), p.loss)).collect::<Vec<_>>();
    plot::line_plot(
        &folder.join("loss_time.png"),
        "Loss against training time (wall clock)",
        "seconds",
        "loss (nats/token)",
        &[Series { label: "training", points: train_by(&|p| p.secs) }, Series { label: "held-out", points: eval_pts("train_secs") }],
        false,
    )?;
    plot::line_plot(
        &folder.join("loss_tokens.png"),
        "Loss against tokens",
        "tokens",
        "loss (nats/token)",
        &[Series { label: "training", points: train_by(&|p| p.tokens as f64) }, Series { label: "held-out", points: eval_pts("tokens") }],
        false,
    )?;
    let b: Vec<(f64, f64)> = points.iter().filter_map(|p| Some((p.step as f64, p.b_simple?))).collect();
    let bg: Vec<(f64, f64)> = points.iter().map(|p| (p.step as f64, p.candidate.global_batch as f64)).collect();
    plot::line_plot(
        &folder.join("b_simple.png"),
        "Gradient noise scale B_simple (smoothed)",
        "step",
        "sequences",
        &[Series { label: "B_simple", points: b }, Series { label: "B_g", points: bg }],
        true,
    )
}

/// An adaptive run's plots: loss against time with layouts shaded and batch changes
/// marked, the batch schedule against the noise scale, and Goodput's two factors.
pub(crate) fn plots(folder: &Path, points: &[Point], b0: f64) -> anyhow::Result<()> {
    // Layout regions, and a marker series at every batch change.
    let mut regions: Vec<(f64, f64, String)> = Vec::new();
    for p in points {
        let label = p.candidate.dims.to_string();
        match regions.last_mut() {
            Some(r) if r.2 == label => r.1 = p.secs,
            _ => regions.push((regions.last().map_or(0.0, |r| r.1), p.secs, label)),
        }
    }
    let losses: Vec<(f64, f64)> = points.iter().map(|p| (p.secs, p.loss)).collect();
    let changes: Vec<f64> = points
        .windows(2)
        .filter(|w| w[0].candidate.global_batch != w[1].candidate.global_batch || w[0].candidate.micro_batch != w[1].candidate.micro_batch)
        .map(|w| w[1].secs)
        .collect();
    plot::region_plot(
        &folder.join("loss_time.png"),
        "Loss against time under Copus (layouts shaded, batch changes marked)",
        "seconds",
        "loss (nats/token)",
        &[Series { label: "training loss", points: losses }],
        &regions,
        &changes,
    )?;
    let bg: Vec<(f64, f64)> = points.iter().map(|p| (p.secs, p.candidate.global_batch as f64)).collect();
    let bs: Vec<(f64, f64)> = points.iter().filter_map(|p| Some((p.secs, p.b_simple?))).collect();
    plot::line_plot(
        &folder.join("batch_schedule.png"),
        "Global batch B_g against the noise scale B_simple",
        "seconds",
        "sequences",
        &[Series { label: "B_g", points: bg }, Series { label: "B_simple", points: bs }],
        true,
    )?;
    let max_t = points.iter().map(|p| p.throughput).fold(0.0, f64::max).max(1e-12);
    plot::line_plot(
        &folder.join("goodput.png"),
        &format!("Throughput (relative to its peak {max_t:.1} samples/s) and statistical efficiency (B0 = {b0})"),
        "seconds",
        "fraction",
        &[
            Series { label: "throughput / peak", points: points.iter().map(|p| (p.secs, p.throughput / max_t)).collect() },
            Series { label: "statistical efficiency", points: points.iter().map(|p| (p.secs, p.efficiency)).collect() },
            Series { label: "goodput / peak", points: points.iter().map(|p| (p.secs, p.throughput * p.efficiency / max_t)).collect() },
        ],
        false,
    )
}
