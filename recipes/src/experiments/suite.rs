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
use copus_core::policy::{SwitchCosts, SwitchRule, hindsight_oracle};
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
        let objective = sc.objective.unwrap_or(suite.objective);
        let time = |r: &copus_core::sim::SimRun| r.time_to_target.unwrap_or(f64::INFINITY);
        // Per seed, only what the table needs (whole runs are large).
        let mut light = Vec::new();
        for &seed in &suite.seeds {
            let sim = simulate_lineup(&sc.scenario, objective, sc.costs, rule, suite.cbs_c, seed, false)?;
            let copus = sim.runs.iter().find(|r| !r.1).context("Copus is in the line-up")?;
            let layout = copus.0.switches.iter().filter(|w| w.from.dims != w.to.dims).count();
            let baselines: Vec<(f64, String)> = sim.runs.iter().filter(|r| r.1).map(|r| (time(&r.0), r.0.policy.clone())).collect();
            let per_layout: Vec<(f64, String)> = sim.per_layout.iter().map(|r| (time(r), r.policy.clone())).collect();
            let oracle = hindsight_oracle(&sim.trajectory, &sim.truth, sc.costs, Some(sim.start));
            let oracle_layout_switches = std::iter::once(sim.start)
                .chain(oracle.per_segment.iter().copied())
                .collect::<Vec<_>>()
                .windows(2)
                .filter(|w| w[0].dims != w[1].dims)
                .count();
            let switches = (layout, copus.0.switches.len() - layout);
            light.push((seed, time(&copus.0), switches, baselines, per_layout, oracle.time, oracle_layout_switches));
            bar.inc(1);
        }
        // Goodput on the layout that is best in hindsight for the scenario: the smallest mean
        // time over the seeds.
        let layouts = light.first().map_or(0, |s| s.4.len());
        let mean_of = |i: usize| light.iter().map(|s| s.4[i].0).sum::<f64>() / light.len() as f64;
        let best = (0..layouts).min_by(|a, b| mean_of(*a).total_cmp(&mean_of(*b))).context("a layout")?;
        let mut rows = Vec::new();
        for (seed, copus, switches, baselines, per_layout, oracle, oracle_layout_switches) in light {
            let best_layout = per_layout[best].clone();
            let fastest = baselines
                .into_iter()
                .chain(std::iter::once(best_layout.clone()))
                .min_by(|a, b| a.0.total_cmp(&b.0))
                .context("baselines")?;
            rows.push(SeedResult { seed, copus, fastest, best_layout: best_layout.0, oracle, switches, oracle_layout_switches });
        }
        results.push((sc.name.clone(), rows));
    }
    bar.finish();
    let table = table(suite, &results);
    std::fs::write(folder.join("suite.md"), &table).with_context(|| format!("cannot write {}", folder.join("suite.md").display()))?;
    std::fs::write(folder.join("suite.json"), serde_json::to_string_pretty(&results)?)?;
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
    Ok((folder, table))
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
    let mut md = format!(
        "# {}\n\nSimulated clock (analytic cluster models); the policies see the real estimator's output on simulated gradient \
         statistics. {} seeds per scenario; mean [min, max] over seeds. Time columns: Copus's time relative to the other's \
         (negative: Copus sooner).\n\n",
        suite.name,
        suite.seeds.len()
    );
    md.push_str("| scenario | vs fastest baseline | vs goodput on best layout | regret vs oracle | captured of oracle's gain | layout switches (oracle) | batch switches | goals |\n|---|---:|---:|---:|---:|---:|---:|---|\n");
    let mut missed = Vec::new();
    for (name, rows) in results {
        let regret = stats(rows.iter().map(SeedResult::regret));
        let fastest = stats(rows.iter().map(SeedResult::vs_fastest));
        let best_layout = stats(rows.iter().map(SeedResult::vs_best_layout));
        let oracle_gain = stats(rows.iter().map(|r| r.fastest.0 / r.oracle - 1.0)).0;
        let captured: Vec<f64> = rows.iter().filter_map(SeedResult::captured).collect();
        let captured_mean = (!captured.is_empty()).then(|| captured.iter().sum::<f64>() / captured.len() as f64);
        let layout = stats(rows.iter().map(|r| r.switches.0 as f64));
        let oracle_layout = stats(rows.iter().map(|r| r.oracle_layout_switches as f64)).0;
        let batch = stats(rows.iter().map(|r| r.switches.1 as f64));
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
        let verdict = if goals.is_empty() { "met".to_string() } else { goals.join("; ") };
        if !goals.is_empty() {
            missed.push(format!("- {name}: {verdict}"));
        }
        let _ = writeln!(
            md,
            "| {name} | {} | {} | {} | {} | {:.1} [{:.0}, {:.0}] ({oracle_layout:.0}) | {:.1} [{:.0}, {:.0}] | {verdict} |",
            pct(fastest),
            pct(best_layout),
            pct(regret),
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
                assert!(s["best_layout"].as_f64().unwrap().is_finite());
            }
        }
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
