//! The synthetic comparison: a known noise-scale trajectory and McCandlish's progress model
//! on the simulated clock of an analytic cluster model, with the sweeps of the switch
//! threshold, the CBS constant and the objective; and one seed of a suite scenario.

use std::fmt::Write as _;
use std::sync::Arc;

use anyhow::anyhow;
use copus_core::candidates::{Candidate, CandidateSpace};
use copus_core::goodput::{Objective, ObjectiveKind};
use copus_core::layout::ParallelDims;
use copus_core::memory::MemoryModel;
use copus_core::model::ModelSpec;
use copus_core::policy::{Copus, DpOnlyGoodput, Policy, Scorer, StepObservation, SwitchCosts, SwitchRule, Trajectory, hindsight_oracle};
use copus_core::schedule::ScheduleKind;
use copus_core::sim::{SimConfig, SimRun, perturbed, simulate};
use copus_core::throughput::ClusterModel;

use super::records::{Compared, PolicyRun, StepRecord, SwitchRecord, describe};
use super::schema::Sweeps;
use super::schema::{CompareRecipe, Synthetic};
use copus_core::policy::{Entry, Named, lineup, smallest_on};

/// The policies' scorer of a synthetic scenario under `objective` (the analytic model's
/// throughput) and the cluster's ranks.
pub(crate) fn synthetic_scorer(s: &Synthetic, objective: ObjectiveKind) -> anyhow::Result<(Scorer, usize)> {
    let spec = ModelSpec::preset(&s.model)?;
    let cluster = s.cluster.spec()?;
    let world = cluster.gpus_per_node * cluster.num_nodes;
    let space = CandidateSpace::new(
        world,
        s.global_batches.clone(),
        s.micro_batches.clone(),
        ScheduleKind::OneFOneB,
        MemoryModel::mixed_bf16(),
        cluster.memory_bytes,
    )
    .map_err(|e| anyhow!("recipe field `scenario`: {e}"))?;
    let feasible = space.enumerate(&spec).feasible;
    if feasible.is_empty() {
        return Err(anyhow!("no feasible candidate in the scenario's space"));
    }
    let model = ClusterModel::new(cluster, spec);
    let objective: Arc<dyn Objective> = Arc::from(objective.build());
    Ok((Scorer::new(&feasible, &model, s.b0, objective)?, world))
}

/// AdaptDL's Goodput batch adaptation on each layout, from its smallest B_g: one run per
/// layout, in layout order, each named `goodput on the best layout (L)` (the name it carries
/// when it is the one picked).
pub(crate) fn goodput_per_layout(
    scorer: &Scorer,
    truth: &Scorer,
    trajectory: &Trajectory,
    cfg: &SimConfig,
    rule: SwitchRule,
) -> anyhow::Result<Vec<SimRun>> {
    let mut layouts: Vec<ParallelDims> = scorer.candidates().map(|(c, _)| c.dims).collect();
    layouts.sort_by_key(|d| (d.dp, d.tp, d.pp));
    layouts.dedup();
    let mut out = Vec::new();
    for l in layouts {
        let Some(start) = smallest_on(scorer, l) else { continue };
        let mut p = Named::new(format!("goodput on the best layout ({l})"), Box::new(DpOnlyGoodput::new(scorer.clone(), rule)?));
        out.push(simulate(&mut p, truth, trajectory, start, cfg)?);
    }
    Ok(out)
}

/// The fastest of `runs` (the layout best in hindsight).
pub(crate) fn fastest_run(runs: &[SimRun]) -> Option<&SimRun> {
    runs.iter()
        .filter(|r| r.time_to_target.is_some())
        .min_by(|a, b| a.time_to_target.unwrap_or(f64::INFINITY).total_cmp(&b.time_to_target.unwrap_or(f64::INFINITY)))
}

/// A synthetic scenario's scorer for the policies; the prior under the truth's progress model
/// (the analytic throughput without the seed's error: what an oracle that knows the progress
/// model but not the throughput errors would plan with); the truth of seed `seed` (the
/// analytic throughput times the seed's per-candidate error, and the scenario's progress
/// model); the trajectory; the cluster's ranks.
pub(crate) fn synthetic_setup(
    s: &Synthetic,
    objective: ObjectiveKind,
    seed: u64,
) -> anyhow::Result<(Scorer, Scorer, Scorer, Trajectory, usize)> {
    let (scorer, world) = synthetic_scorer(s, objective)?;
    let (model, _) = synthetic_scorer(s, s.truth)?;
    let truth = perturbed(&model, s.throughput_error, seed)?;
    Ok((scorer, model, truth, Trajectory::new(s.trajectory.clone(), s.end)?, world))
}

/// One seed of a synthetic scenario: every policy of the line-up as (run, whether a
/// baseline), Goodput batch adaptation on each layout, and Copus's starting configuration.
pub(crate) struct Simulated {
    pub(crate) runs: Vec<(SimRun, bool)>,
    pub(crate) per_layout: Vec<SimRun>,
    pub(crate) start: Candidate,
    /// The seed's truth and the trajectory the runs were timed on (for the oracle).
    pub(crate) truth: Scorer,
    /// The analytic throughput without the seed's error, under the truth's progress model.
    pub(crate) prior: Scorer,
    /// The seed's true throughput under the policies' objective (what an oracle that measured
    /// every candidate but believes the policies' progress model would plan with).
    pub(crate) truth_under_objective: Scorer,
    pub(crate) trajectory: Trajectory,
    /// Ranks of the scenario's cluster.
    pub(crate) world: usize,
}

pub(crate) fn simulate_lineup(
    s: &Synthetic,
    objective: ObjectiveKind,
    costs: SwitchCosts,
    rule: SwitchRule,
    cbs_c: f64,
    seed: u64,
    record_steps: bool,
) -> anyhow::Result<Simulated> {
    let (scorer, prior, truth, trajectory, world) = synthetic_setup(s, objective, seed)?;
    let cfg = SimConfig { record_steps, ..s.sim_config(costs, seed) };
    let truth_under_objective = perturbed(&scorer, s.throughput_error, seed)?;
    let lineup = lineup(&scorer, rule, cbs_c)?;
    let mut runs = Vec::new();
    for Entry { mut policy, start, baseline } in lineup.entries {
        // Copus's steps are always kept (the suite's breakdown of its time reads them).
        let cfg = SimConfig { record_steps: record_steps || !baseline, ..cfg.clone() };
        runs.push((simulate(policy.as_mut(), &truth, &trajectory, start, &cfg)?, baseline));
    }
    let per_layout = goodput_per_layout(&scorer, &truth, &trajectory, &cfg, rule)?;
    Ok(Simulated { runs, per_layout, start: lineup.copus_start, truth, prior, truth_under_objective, trajectory, world })
}

pub(super) fn synthetic(recipe: &CompareRecipe, s: &Synthetic) -> anyhow::Result<Compared> {
    let cfg = s.sim_config(recipe.costs, s.seed);
    let Simulated { runs: mut sims, per_layout, start: copus_start, truth, trajectory, world, .. } =
        simulate_lineup(s, recipe.objective, recipe.costs, recipe.rule(), recipe.cbs_c, s.seed, true)?;
    if let Some(best) = fastest_run(&per_layout) {
        // Next to the other baselines, before Copus.
        sims.insert(sims.len() - 1, (best.clone(), true));
    }
    let mut runs = Vec::new();
    for (sim, baseline) in sims {
        // Keep plots light: at most ~2000 points per run.
        let every = (sim.steps.len() / 2000).max(1);
        let steps = sim
            .steps
            .iter()
            .enumerate()
            .filter(|(i, _)| i % every == 0 || *i + 1 == sim.steps.len())
            .map(|(_, x)| StepRecord {
                step: x.step,
                time: x.time,
                loss: s.loss.loss(x.progress),
                global_batch: x.candidate.global_batch,
                micro_batch: x.candidate.micro_batch,
                layout: x.candidate.dims.to_string(),
                throughput: x.throughput,
                efficiency: x.efficiency,
                b_simple: Some(x.b_simple),
            })
            .collect();
        let switches = sim
            .switches
            .iter()
            .map(|w| SwitchRecord {
                step: w.step,
                time: w.time,
                from: describe(&w.from),
                to: describe(&w.to),
                cost: w.cost,
                layout: w.from.dims != w.to.dims,
            })
            .collect();
        tracing::info!("{}: {}", sim.policy, sim.time_to_target.map_or("did not reach the target".into(), |t| format!("{t:.0} s")));
        runs.push(PolicyRun { name: sim.policy, baseline, steps, switches, time_to_target: sim.time_to_target });
    }
    let oracle = hindsight_oracle(&trajectory, &truth, recipe.costs, Some(copus_start)).time;
    let clock = format!(
        "simulated: analytic model of {} x{} GPUs ({}), switch costs {} s (batch) / {} s (layout)",
        s.cluster.preset, world, s.model, recipe.costs.batch, recipe.costs.layout
    );
    let target = format!("progress {:.3e} reference samples (loss {:.3})", s.end, s.loss.loss(s.end));
    let sweeps = recipe.sweeps.as_ref().map(|sw| sweep_table(recipe, s, sw, &truth, &trajectory, &cfg)).transpose()?;
    Ok((runs, Some(oracle), clock, target, sweeps))
}

/// Copus's time under each setting, against the fastest baseline of the main comparison.
fn sweep_table(
    recipe: &CompareRecipe,
    s: &Synthetic,
    sw: &Sweeps,
    truth: &Scorer,
    traj: &Trajectory,
    cfg: &SimConfig,
) -> anyhow::Result<String> {
    let (scorer, _) = synthetic_scorer(s, recipe.objective)?;
    let base = lineup(&scorer, recipe.rule(), recipe.cbs_c)?;
    let mut fastest = f64::INFINITY;
    for Entry { policy: mut p, start, baseline } in base.entries {
        if baseline && let Some(t) = simulate(p.as_mut(), truth, traj, start, cfg)?.time_to_target {
            fastest = fastest.min(t);
        }
    }
    let oracle = hindsight_oracle(traj, truth, recipe.costs, Some(base.copus_start)).time;
    let mut out = String::from("| setting | value | Copus s | vs fastest baseline | regret vs oracle |\n|---|---|---:|---:|---:|\n");
    let mut row = |setting: &str, value: String, t: Option<f64>| {
        let t = t.unwrap_or(f64::INFINITY);
        let _ =
            writeln!(out, "| {setting} | {value} | {t:.0} | {:+.1}% | {:+.1}% |", 100.0 * (fastest / t - 1.0), 100.0 * (t / oracle - 1.0));
    };
    for &th in &sw.layout_thresholds {
        let rule = SwitchRule { layout_threshold: th, ..recipe.rule() };
        let mut p = Copus::new(scorer.clone(), rule)?;
        row("layout threshold", format!("{th}"), simulate(&mut p, truth, traj, base.copus_start, cfg)?.time_to_target);
    }
    for &c in &sw.cbs_c {
        // c scales Copus's noise estimate the way it scales CBS's target batch.
        let rule = recipe.rule();
        let mut p = Scaled(c, Copus::new(scorer.clone(), rule)?);
        row("calibration c (B_simple x c)", format!("{c}"), simulate(&mut p, truth, traj, base.copus_start, cfg)?.time_to_target);
    }
    for &o in &sw.objectives {
        let (sc, _) = synthetic_scorer(s, o)?;
        let mut p = Copus::new(sc, recipe.rule())?;
        row("objective", format!("{o:?}"), simulate(&mut p, truth, traj, base.copus_start, cfg)?.time_to_target);
    }
    Ok(out)
}

/// Copus seeing `c` times the measured noise scale.
struct Scaled(f64, Copus);

impl Policy for Scaled {
    fn name(&self) -> String {
        format!("copus(c={})", self.0)
    }
    fn decide(&mut self, obs: &StepObservation) -> copus_core::policy::Decision {
        let mut o = *obs;
        if let Some(n) = o.noise.as_mut() {
            n.trace *= self.0;
        }
        self.1.decide(&o)
    }
    fn observe_reconfiguration(&mut self, s: f64, l: bool) {
        self.1.observe_reconfiguration(s, l);
    }
    fn observe_throughput(&mut self, c: &Candidate, samples_per_sec: f64) {
        self.1.observe_throughput(c, samples_per_sec);
    }
}
