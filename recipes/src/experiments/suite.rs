//! `recipes compare --suite recipes/suite-NAME.ron`: many synthetic scenarios, each over
//! several seeds of the estimator-driven simulation, in one table: Copus's time against the
//! fastest baseline and against Goodput batch adaptation on the best fixed layout (the layout
//! with the smallest mean time over the scenario's seeds), its regret
//! against the hindsight oracle, and its layout and batch switch counts against the oracle's,
//! as mean and spread over seeds; with the suite's goals checked and a plot of the regret
//! distribution.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, anyhow};
use copus_core::goodput::ObjectiveKind;
use copus_core::policy::{SwitchCosts, SwitchRule, hindsight_oracle, schedule_time};
use serde::{Deserialize, Serialize};

use crate::experiments::compare::schema::{Synthetic, default_rule, read_ron};
use crate::experiments::compare::synthetic::simulate_lineup;
use crate::report::plot::{Series, line_plot};
use crate::report::progress::Progress;

/// A suite file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Suite {
    /// Run folder name.
    pub name: String,
    /// Where run folders go.
    #[serde(default = "default_output_dir")]
    pub output_dir: String,
    /// Seeds of the simulated estimator; every scenario runs each.
    #[serde(default = "default_seeds")]
    pub seeds: Vec<u64>,
    /// Copus's and the Goodput baselines' rule (default: thresholds 2% / 5%, a 30 s prior on
    /// the layout cost, horizon 3600 s).
    #[serde(default)]
    pub rule: Option<SwitchRule>,
    /// The objective the Goodput policies maximise.
    #[serde(default = "default_objective")]
    pub objective: ObjectiveKind,
    /// CBS's constant.
    #[serde(default = "default_c")]
    pub cbs_c: f64,
    /// The scenarios.
    pub scenarios: Vec<SuiteScenario>,
}

/// One scenario of a suite.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SuiteScenario {
    /// Its row label.
    pub name: String,
    /// Seconds the clock charges for a batch-only and a layout change.
    pub costs: SwitchCosts,
    /// Model, cluster, candidate lists, trajectory, noise and the progress model (`truth`).
    pub scenario: Synthetic,
    /// The objective the Goodput policies maximise here (default: the suite's), e.g.
    /// `LrAware` against an `LrAware` truth.
    #[serde(default)]
    pub objective: Option<ObjectiveKind>,
}

fn default_output_dir() -> String {
    "runs".into()
}
fn default_seeds() -> Vec<u64> {
    vec![0, 1, 2, 3, 4]
}
fn default_objective() -> ObjectiveKind {
    ObjectiveKind::Plain
}
fn default_c() -> f64 {
    1.0
}

impl Suite {
    /// Reads and checks a suite file.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let s: Self = read_ron(path)?;
        s.validate().map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(s)
    }

    fn validate(&self) -> anyhow::Result<()> {
        if self.name.is_empty() || self.name.contains(['/', '\\']) {
            return Err(anyhow!("suite field `name` = {:?}: a non-empty folder name without slashes", self.name));
        }
        if self.seeds.is_empty() {
            return Err(anyhow!("suite field `seeds`: at least one seed"));
        }
        if self.scenarios.is_empty() {
            return Err(anyhow!("suite field `scenarios`: at least one scenario"));
        }
        self.rule.unwrap_or(default_rule()).validate().map_err(|e| anyhow!("suite field `rule`: {e}"))?;
        for (i, sc) in self.scenarios.iter().enumerate() {
            if !(sc.costs.batch >= 0.0 && sc.costs.layout >= 0.0) {
                return Err(anyhow!("suite field `scenarios[{i}].costs` ({}): batch and layout must be >= 0 seconds", sc.name));
            }
            sc.scenario.validate(&format!("scenarios[{i}].scenario"))?;
        }
        Ok(())
    }
}

/// One scenario on one seed.
#[derive(Clone, Debug, Serialize)]
pub struct SeedResult {
    /// The seed.
    pub seed: u64,
    /// Copus's simulated seconds to the target.
    pub copus: f64,
    /// The fastest baseline's seconds and name.
    pub fastest: (f64, String),
    /// Goodput batch adaptation on the hindsight-best layout, seconds.
    pub best_layout: f64,
    /// The oracle's seconds.
    pub oracle: f64,
    /// Seconds, on the truth, of the schedule the oracle would pick if it trusted the prior's
    /// throughput (it knows the trajectory and the true progress model, not the seed's
    /// throughput errors): what the throughput errors alone cost a planner that does not
    /// measure.
    pub prior_oracle: f64,
    /// Seconds, on the truth, of the schedule the oracle would pick if it knew the true
    /// throughput but planned with the policies' objective: about what that objective costs a
    /// policy optimising it (a reference, not a strict bound; the oracle's time when the
    /// objective is the truth's).
    pub objective_oracle: f64,
    /// Seconds Copus spent in switches.
    pub switching: f64,
    /// Seconds Copus lost against running, at every step, the truly best candidate for the
    /// step's noise scale: (on a global batch other than the best's, on another layout or
    /// micro-batch than the best of its global batch); see [`lost_time`].
    pub lost: (f64, f64),
    /// Copus's layout and batch-only switches.
    pub switches: (usize, usize),
    /// The oracle's layout switches.
    pub oracle_layout_switches: usize,
}

impl SeedResult {
    /// Copus's regret against the oracle.
    pub fn regret(&self) -> f64 {
        self.copus / self.oracle - 1.0
    }
    /// Copus's time over the fastest baseline's, minus one (negative: faster).
    pub fn vs_fastest(&self) -> f64 {
        self.copus / self.fastest.0 - 1.0
    }
    /// Copus's time over the best-layout Goodput baseline's, minus one.
    pub fn vs_best_layout(&self) -> f64 {
        self.copus / self.best_layout - 1.0
    }
    /// The share of the oracle's gain over the fastest baseline that Copus captures.
    pub fn captured(&self) -> Option<f64> {
        let gain = self.fastest.0 - self.oracle;
        (gain > 0.0).then(|| (self.fastest.0 - self.copus) / gain)
    }
}

/// Runs every scenario on every seed; writes `suite.md`, `suite.json` and `regret.png` into a
/// new run folder; returns the folder and the table.
pub fn run(suite: &Suite) -> anyhow::Result<(std::path::PathBuf, String)> {
    let folder = crate::prepare::run_folder(Path::new(&suite.output_dir), &suite.name)?;
    let rule = suite.rule.unwrap_or(default_rule());
    let bar = Progress::new(&suite.name, (suite.scenarios.len() * suite.seeds.len()) as u64);
    let mut results: Vec<(String, Vec<SeedResult>)> = Vec::new();
    for sc in &suite.scenarios {
        bar.set_message(sc.name.clone());
        results.push((sc.name.clone(), scenario_rows(suite, sc, rule, &bar)?));
    }
    bar.finish();
    let table = table(suite, &results);
    write_suite(&folder, &table, &results)?;
    Ok((folder, table))
}

/// What the table needs of one scenario on one seed (whole runs are large), before the
/// scenario's best layout is known.
struct SeedRun {
    /// The seed.
    seed: u64,
    /// Copus's seconds to the target.
    copus: f64,
    /// Copus's layout and batch-only switches.
    switches: (usize, usize),
    /// Every baseline's seconds and name.
    baselines: Vec<(f64, String)>,
    /// Goodput batch adaptation on each fixed layout: seconds and name.
    per_layout: Vec<(f64, String)>,
    /// The oracle's seconds.
    oracle: f64,
    /// See [`SeedResult::prior_oracle`].
    prior_oracle: f64,
    /// See [`SeedResult::objective_oracle`].
    objective_oracle: f64,
    /// Seconds Copus spent in switches.
    switching: f64,
    /// See [`SeedResult::lost`].
    lost: (f64, f64),
    /// The oracle's layout switches.
    oracle_layout_switches: usize,
}

/// A run's seconds to the target (infinite when not reached).
fn time_to_target(r: &copus_core::sim::SimRun) -> f64 {
    r.time_to_target.unwrap_or(f64::INFINITY)
}

/// One scenario on every seed of the suite, each seed's row against the layout that is best in
/// hindsight over the seeds.
fn scenario_rows(suite: &Suite, sc: &SuiteScenario, rule: SwitchRule, bar: &Progress) -> anyhow::Result<Vec<SeedResult>> {
    let objective = sc.objective.unwrap_or(suite.objective);
    // Per seed, only what the table needs (whole runs are large).
    let mut light = Vec::new();
    for &seed in &suite.seeds {
        light.push(seed_run(suite, sc, objective, rule, seed)?);
        bar.inc(1);
    }
    // Goodput on the layout that is best in hindsight for the scenario: the smallest mean
    // time over the seeds.
    let layouts = light.first().map_or(0, |s| s.per_layout.len());
    let mean_of = |i: usize| light.iter().map(|s| s.per_layout[i].0).sum::<f64>() / light.len() as f64;
    let best = (0..layouts).min_by(|a, b| mean_of(*a).total_cmp(&mean_of(*b))).context("a layout")?;
    light.into_iter().map(|s| seed_result(s, best)).collect()
}

/// Simulates the line-up of one scenario on one seed and plans the hindsight oracle, on the
/// truth and on the prior and the policies' objective.
fn seed_run(suite: &Suite, sc: &SuiteScenario, objective: ObjectiveKind, rule: SwitchRule, seed: u64) -> anyhow::Result<SeedRun> {
    let sim = simulate_lineup(&sc.scenario, objective, sc.costs, rule, suite.cbs_c, seed, false)?;
    let copus = sim.runs.iter().find(|r| !r.1).context("Copus is in the line-up")?;
    let layout = copus.0.switches.iter().filter(|w| w.from.dims != w.to.dims).count();
    let baselines: Vec<(f64, String)> = sim.runs.iter().filter(|r| r.1).map(|r| (time_to_target(&r.0), r.0.policy.clone())).collect();
    let per_layout: Vec<(f64, String)> = sim.per_layout.iter().map(|r| (time_to_target(r), r.policy.clone())).collect();
    let oracle = hindsight_oracle(&sim.trajectory, &sim.truth, sc.costs, Some(sim.start));
    // The oracle's schedule planned on another scorer, timed on the truth.
    let planned_on = |belief: &copus_core::policy::Scorer, what: &str| {
        let plan = hindsight_oracle(&sim.trajectory, belief, sc.costs, Some(sim.start));
        schedule_time(&sim.trajectory, &plan.per_segment, &sim.truth, sc.costs, Some(sim.start))
            .with_context(|| format!("the schedule planned on {what} runs on the truth"))
    };
    let prior_oracle = planned_on(&sim.prior, "the prior")?;
    let objective_oracle = planned_on(&sim.truth_under_objective, "the policies' objective")?;
    let switching: f64 = copus.0.switches.iter().map(|w| w.cost).sum();
    let lost = lost_time(&copus.0, &sim.truth);
    let oracle_layout_switches = std::iter::once(sim.start)
        .chain(oracle.per_segment.iter().copied())
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0].dims != w[1].dims)
        .count();
    let switches = (layout, copus.0.switches.len() - layout);
    Ok(SeedRun {
        seed,
        copus: time_to_target(&copus.0),
        switches,
        baselines,
        per_layout,
        oracle: oracle.time,
        prior_oracle,
        objective_oracle,
        switching,
        lost,
        oracle_layout_switches,
    })
}

/// A seed's row, with Goodput batch adaptation on the scenario's best layout (`best`) among
/// the baselines.
fn seed_result(s: SeedRun, best: usize) -> anyhow::Result<SeedResult> {
    let best_layout = s.per_layout[best].clone();
    let fastest =
        s.baselines.into_iter().chain(std::iter::once(best_layout.clone())).min_by(|a, b| a.0.total_cmp(&b.0)).context("baselines")?;
    Ok(SeedResult {
        seed: s.seed,
        copus: s.copus,
        fastest,
        best_layout: best_layout.0,
        oracle: s.oracle,
        prior_oracle: s.prior_oracle,
        objective_oracle: s.objective_oracle,
        switching: s.switching,
        lost: s.lost,
        switches: s.switches,
        oracle_layout_switches: s.oracle_layout_switches,
    })
}

/// Writes `suite.md`, `suite.json` and the regret distribution `regret.png` (a plot that cannot
/// be drawn is a warning).
fn write_suite(folder: &Path, table: &str, results: &[(String, Vec<SeedResult>)]) -> anyhow::Result<()> {
    std::fs::write(folder.join("suite.md"), table).with_context(|| format!("cannot write {}", folder.join("suite.md").display()))?;
    std::fs::write(folder.join("suite.json"), serde_json::to_string_pretty(results)?)?;
    let mut regrets: Vec<f64> = results.iter().flat_map(|(_, r)| r.iter().map(|x| 100.0 * x.regret())).filter(|r| r.is_finite()).collect();
    regrets.sort_by(f64::total_cmp);
    let n = regrets.len().max(1) as f64;
    let cdf: Vec<(f64, f64)> = regrets.iter().enumerate().map(|(i, r)| (*r, (i + 1) as f64 / n)).collect();
    if let Err(e) = line_plot(
        &folder.join("regret.png"),
        "Copus's regret against the hindsight oracle over scenarios and seeds (cumulative share)",
        "regret (%)",
        "share of runs",
        &[Series { label: "Copus", points: cdf }],
        false,
    ) {
        tracing::warn!("plot not written: {e:#}");
    }
    Ok(())
}

/// Where a run's time went against the truth: for each step, the share of its seconds it would
/// have saved on the candidate with the highest true Goodput at the step's noise scale, split
/// into the part a better global batch would have saved (`1 - G_b / G_best`, `G_b` the best
/// true Goodput at the step's global batch) and the part a better layout or micro-batch at
/// that global batch would have (`(G_b - G) / G_best`); summed over steps, seconds. Needs the
/// run's recorded steps.
pub fn lost_time(run: &copus_core::sim::SimRun, truth: &copus_core::policy::Scorer) -> (f64, f64) {
    use std::collections::HashMap;
    // Best true Goodput overall and per global batch, per noise scale (piecewise constant).
    let mut best: HashMap<u64, (f64, HashMap<usize, f64>)> = HashMap::new();
    let (mut on_batch, mut on_layout) = (0.0, 0.0);
    let mut previous = 0.0;
    let mut switches = run.switches.iter().peekable();
    for s in &run.steps {
        // The step's own seconds: its end minus the previous end, less a switch before it.
        let mut secs = s.time - previous;
        while let Some(w) = switches.next_if(|w| w.step < s.step) {
            secs -= w.cost;
        }
        previous = s.time;
        let (overall, per_batch) = best.entry(s.b_simple.to_bits()).or_insert_with(|| {
            let mut per_batch: HashMap<usize, f64> = HashMap::new();
            for (c, t) in truth.candidates() {
                let g = truth.goodput(*t, c.global_batch, s.b_simple);
                let e = per_batch.entry(c.global_batch).or_insert(0.0);
                *e = e.max(g);
            }
            (per_batch.values().copied().fold(0.0, f64::max), per_batch)
        });
        let Some(t) = truth.throughput(&s.candidate) else { continue };
        let g = truth.goodput(t, s.candidate.global_batch, s.b_simple);
        let g_b = per_batch.get(&s.candidate.global_batch).copied().unwrap_or(g);
        if *overall > 0.0 && secs > 0.0 {
            on_batch += secs * (1.0 - g_b / *overall);
            on_layout += secs * (g_b - g) / *overall;
        }
    }
    (on_batch, on_layout)
}

fn stats(x: impl Iterator<Item = f64>) -> (f64, f64, f64) {
    let v: Vec<f64> = x.collect();
    let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
    (mean, v.iter().copied().fold(f64::INFINITY, f64::min), v.iter().copied().fold(f64::NEG_INFINITY, f64::max))
}

fn pct((mean, lo, hi): (f64, f64, f64)) -> String {
    format!("{:+.1}% [{:+.1}, {:+.1}]", 100.0 * mean, 100.0 * lo, 100.0 * hi)
}

/// The suite's table and its goals, scenario by scenario.
fn table(suite: &Suite, results: &[(String, Vec<SeedResult>)]) -> String {
    let mut md = table_intro(suite);
    md.push_str("| scenario | vs fastest baseline | vs goodput on best layout | regret vs oracle | oracle trusting the prior: regret | oracle planning with the policies' objective: regret | Copus's time: switching / on a worse B_g / on a worse layout at its B_g | captured of oracle's gain | layout switches (oracle) | batch switches | goals |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    let mut missed = Vec::new();
    for (name, rows) in results {
        if let Some(m) = scenario_row(&mut md, name, rows) {
            missed.push(m);
        }
    }
    md.push_str("\nGoals: mean regret at most 5%; never more than 2% slower than the fastest baseline; at least 70% of the oracle's gain where it beats the fastest baseline by 5% or more; at most twice the oracle's layout switches.\n\n");
    if missed.is_empty() {
        md.push_str("Every goal is met on every scenario.\n");
    } else {
        md.push_str("Missed:\n");
        md.push_str(&missed.join("\n"));
        md.push('\n');
    }
    md
}

/// The table's title and the paragraph on what its columns mean.
fn table_intro(suite: &Suite) -> String {
    format!(
        "# {}\n\nSimulated clock (analytic cluster models); the policies see the real estimator's output on simulated gradient \
         statistics. {} seeds per scenario; mean [min, max] over seeds. Time columns: Copus's time relative to the other's \
         (negative: Copus sooner). The oracle trusting the prior knows the trajectory and the true progress model but plans \
         with the analytic throughput, not the seed's errors; its regret is what those errors cost a planner that does not \
         measure. The oracle planning with the policies' objective knows the true throughput but plans with the \
         objective the policies optimise; its regret (0 where the objective is the truth's) is about what that objective costs any policy \
         optimising that objective. Copus's time is split into switches, steps on a global batch worse than the best \
         for the step's noise scale, and steps on a layout or micro-batch worse than the best at its global batch \
         (each step's seconds times its shortfall of true Goodput against the best).\n\n",
        suite.name,
        suite.seeds.len()
    )
}

/// One scenario's row of the table; returns its line of the missed goals, if it missed any.
fn scenario_row(md: &mut String, name: &str, rows: &[SeedResult]) -> Option<String> {
    let regret = stats(rows.iter().map(SeedResult::regret));
    let prior_regret = stats(rows.iter().map(|r| r.prior_oracle / r.oracle - 1.0));
    let objective_regret = stats(rows.iter().map(|r| r.objective_oracle / r.oracle - 1.0));
    let switching = stats(rows.iter().map(|r| r.switching / r.copus));
    let lost_batch = stats(rows.iter().map(|r| r.lost.0 / r.copus));
    let lost_layout = stats(rows.iter().map(|r| r.lost.1 / r.copus));
    let fastest = stats(rows.iter().map(SeedResult::vs_fastest));
    let best_layout = stats(rows.iter().map(SeedResult::vs_best_layout));
    let oracle_gain = stats(rows.iter().map(|r| r.fastest.0 / r.oracle - 1.0)).0;
    let captured: Vec<f64> = rows.iter().filter_map(SeedResult::captured).collect();
    let captured_mean = (!captured.is_empty()).then(|| captured.iter().sum::<f64>() / captured.len() as f64);
    let layout = stats(rows.iter().map(|r| r.switches.0 as f64));
    let oracle_layout = stats(rows.iter().map(|r| r.oracle_layout_switches as f64)).0;
    let batch = stats(rows.iter().map(|r| r.switches.1 as f64));
    let goals = missed_goals(regret, fastest, (oracle_gain, captured_mean), (layout, oracle_layout));
    let verdict = if goals.is_empty() { "met".to_string() } else { goals.join("; ") };
    let _ = writeln!(
        md,
        "| {name} | {} | {} | {} | {} | {} | {:.1}% / {:.1}% / {:.1}% | {} | {:.1} [{:.0}, {:.0}] ({oracle_layout:.0}) | {:.1} [{:.0}, {:.0}] | {verdict} |",
        pct(fastest),
        pct(best_layout),
        pct(regret),
        pct(prior_regret),
        pct(objective_regret),
        100.0 * switching.0,
        100.0 * lost_batch.0,
        100.0 * lost_layout.0,
        captured_mean.map_or(format!("- (oracle +{:.1}%)", 100.0 * oracle_gain), |c| format!(
            "{:.0}% (oracle +{:.1}%)",
            100.0 * c,
            100.0 * oracle_gain
        )),
        layout.0,
        layout.1,
        layout.2,
        batch.0,
        batch.1,
        batch.2,
    );
    (!goals.is_empty()).then(|| format!("- {name}: {verdict}"))
}

/// The suite's goals a scenario missed, from its regret and its time against the fastest
/// baseline (mean, min, max), the oracle's gain with the mean share Copus captured of it, and
/// its layout switches (mean, min, max) with the oracle's mean.
fn missed_goals(
    regret: (f64, f64, f64),
    fastest: (f64, f64, f64),
    (oracle_gain, captured_mean): (f64, Option<f64>),
    (layout, oracle_layout): ((f64, f64, f64), f64),
) -> Vec<String> {
    let mut goals = Vec::new();
    if regret.0 > 0.05 {
        goals.push(format!("regret {:.1}% > 5%", 100.0 * regret.0));
    }
    if fastest.2 > 0.02 {
        goals.push(format!("up to {:.1}% slower than the fastest baseline", 100.0 * fastest.2));
    }
    if oracle_gain >= 0.05 && captured_mean.is_some_and(|c| c < 0.7) {
        goals.push(format!("captures {:.0}% < 70% of the oracle's gain", 100.0 * captured_mean.unwrap_or(0.0)));
    }
    if layout.0 > 2.0 * oracle_layout.max(0.5) {
        goals.push(format!("{:.1} layout switches > twice the oracle's {oracle_layout:.0}", layout.0));
    }
    goals
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_suite(dir: &Path) -> String {
        format!(
            r#"(
                name: "suite-test",
                output_dir: "{}",
                seeds: [0, 1],
                scenarios: [
                    (
                        name: "3b rising",
                        costs: (batch: 0.5, layout: 20.0),
                        scenario: (
                            model: "llama-3.2-3b",
                            cluster: (preset: "h100", nodes: 1),
                            global_batches: [1, 4, 16, 64],
                            micro_batches: [1, 4],
                            b0: 8.0,
                            trajectory: [(0.0, 2.0), (1.0e4, 16.0), (2.0e4, 128.0)],
                            end: 3.0e4,
                            loss: (l_inf: 2.0, a: 8.0, p0: 2.0e4, alpha: 0.3),
                        ),
                    ),
                    (
                        name: "3b flat, LR-aware truth",
                        costs: (batch: 0.5, layout: 60.0),
                        scenario: (
                            model: "llama-3.2-3b",
                            cluster: (preset: "h100", nodes: 1),
                            global_batches: [1, 4, 16, 64],
                            micro_batches: [1, 4],
                            b0: 8.0,
                            trajectory: [(0.0, 16.0)],
                            end: 2.0e4,
                            loss: (l_inf: 2.0, a: 8.0, p0: 2.0e4, alpha: 0.3),
                            truth: LrAware(x0: 0.5, rule: Sqrt),
                            p_eff: 6.0,
                        ),
                        objective: LrAware(x0: 0.5, rule: Sqrt),
                    ),
                ],
            )"#,
            dir.display()
        )
    }

    #[test]
    fn a_suite_writes_one_table_over_scenarios_and_seeds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("suite.ron");
        std::fs::write(&path, small_suite(dir.path())).unwrap();
        let suite = Suite::load(&path).unwrap();
        let (folder, table) = run(&suite).unwrap();
        for f in ["suite.md", "suite.json"] {
            assert!(folder.join(f).exists(), "{f}");
        }
        assert!(table.contains("| 3b rising |") && table.contains("| 3b flat, LR-aware truth |"), "{table}");
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(folder.join("suite.json")).unwrap()).unwrap();
        let rows = json.as_array().unwrap();
        assert_eq!(rows.len(), 2);
        for r in rows {
            let seeds = r[1].as_array().unwrap();
            assert_eq!(seeds.len(), 2);
            for s in seeds {
                // The oracle bounds every run from below (within the step discretisation).
                let (copus, oracle) = (s["copus"].as_f64().unwrap(), s["oracle"].as_f64().unwrap());
                assert!(oracle <= copus * 1.001, "oracle {oracle} vs copus {copus}");
                // Any schedule timed on the truth takes at least the oracle's time; planning with
                // the truth's own objective is the oracle.
                let (prior, objective) = (s["prior_oracle"].as_f64().unwrap(), s["objective_oracle"].as_f64().unwrap());
                assert!(prior >= oracle * (1.0 - 1e-12) && objective >= oracle * (1.0 - 1e-12), "{prior} {objective} {oracle}");
                if r[0].as_str() == Some("3b flat, LR-aware truth") {
                    assert!((objective / oracle - 1.0).abs() < 1e-12, "matched objective: {objective} vs {oracle}");
                }
                // The time lost on worse candidates and in switches is part of Copus's time.
                let lost = s["lost"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).sum::<f64>();
                assert!(lost >= 0.0 && lost + s["switching"].as_f64().unwrap() <= copus, "{lost} of {copus}");
                assert!(s["best_layout"].as_f64().unwrap().is_finite());
            }
        }
    }

    /// The breakdown of a run's time against hand-computed values: three candidates (true
    /// Goodput 40 and 80 at B_g 4, 133.3 at B_g 8, plain efficiency with B0 = B_simple = 4),
    /// one step on each, switches between them.
    #[test]
    fn lost_time_splits_a_runs_shortfall_by_batch_and_layout() {
        use copus_core::candidates::Candidate;
        use copus_core::layout::ParallelDims;
        use copus_core::policy::Scorer;
        use copus_core::sim::{SimRun, SimStep, SimSwitch};
        use copus_core::throughput::ThroughputModel;
        struct Table(Vec<(Candidate, f64)>);
        impl ThroughputModel for Table {
            fn samples_per_sec(&self, c: &Candidate) -> Option<f64> {
                self.0.iter().find(|(k, _)| k == c).map(|(_, t)| *t)
            }
        }
        let cand = |dp, tp, b| Candidate::new(ParallelDims::new(dp, tp, 1, 2).unwrap(), b, 1).unwrap();
        let (a, b, c) = (cand(2, 1, 4), cand(1, 2, 4), cand(2, 1, 8));
        let table = Table(vec![(a, 40.0), (b, 80.0), (c, 200.0)]);
        let truth = Scorer::plain(&[a, b, c], &table, 4.0).unwrap();
        let step = |step, time, candidate: Candidate, throughput| SimStep {
            step,
            time,
            progress: 0.0,
            candidate,
            throughput,
            efficiency: 1.0,
            b_simple: 4.0,
        };
        // Step seconds 0.1 (4 / 40), 0.05 (4 / 80), 0.04 (8 / 200); switches of 2 s and 0.5 s.
        let run = SimRun {
            policy: "hand".into(),
            steps: vec![step(1, 0.1, a, 40.0), step(2, 2.15, b, 80.0), step(3, 2.69, c, 200.0)],
            switches: vec![
                SimSwitch { step: 1, time: 0.1, from: a, to: b, cost: 2.0 },
                SimSwitch { step: 2, time: 2.15, from: b, to: c, cost: 0.5 },
            ],
            time_to_target: Some(2.69),
            refused: 0,
        };
        // Best 200 x 8 / 12 = 133.3. Step 1: 0.1 x (1 - 80 / 133.3) = 0.04 on the batch,
        // 0.1 x (80 - 40) / 133.3 = 0.03 on the layout; step 2: 0.05 x 0.4 = 0.02 on the batch.
        let (on_batch, on_layout) = lost_time(&run, &truth);
        assert!((on_batch - 0.06).abs() < 1e-9, "{on_batch}");
        assert!((on_layout - 0.03).abs() < 1e-9, "{on_layout}");
    }

    #[test]
    fn the_shipped_suites_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("suite-")) {
                let s = Suite::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                assert!(s.scenarios.len() >= 12, "{}: {} scenarios", p.display(), s.scenarios.len());
                n += 1;
            }
        }
        assert!(n >= 1);
    }

    #[test]
    fn bad_suites_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let good = small_suite(dir.path());
        for (from, to, field) in [
            ("seeds: [0, 1]", "seeds: []", "seeds"),
            ("p_eff: 6.0", "p_eff: 0.5", "scenarios[1].scenario.p_eff"),
            ("costs: (batch: 0.5, layout: 60.0)", "costs: (batch: 0.5, layout: -1.0)", "scenarios[1].costs"),
        ] {
            let path = dir.path().join("bad.ron");
            std::fs::write(&path, good.replace(from, to)).unwrap();
            let err = Suite::load(&path).unwrap_err().to_string();
            assert!(err.contains(field), "{field}: {err}");
        }
    }
}
