//! `recipes compare recipes/compare-NAME.ron`: every policy on the same data, seed and model,
//! side by side, with the clock each report names:
//! - `Synthetic`: a known noise-scale trajectory and McCandlish's progress model on the
//!   simulated clock of an analytic cluster model; seconds for a whole comparison, and sweeps of
//!   the switch threshold, the CBS constant c and the objective;
//! - `Real`: a tiny model trained for real on the Shakespeare text on in-process ranks, with
//!   the noise scale measured online. The clock is the wall clock (a throughput profile
//!   measured here tells the policies what each configuration costs), or the simulated clock of
//!   an analytic cluster model.
//!
//! Output: a time-to-target table with each policy's speedup over the fastest baseline and its
//! regret against the hindsight oracle, loss against time with Copus's layout regions shaded,
//! the B_g schedules, Copus's Goodput split into throughput and efficiency, and the list of
//! reconfigurations with their costs (PNG, CSV, JSONL, Markdown).

pub mod real;
pub mod records;
pub mod report;
pub mod schema;
pub mod synthetic;

use std::path::{Path, PathBuf};

use real::real;
use report::report;
pub use schema::{CompareRecipe, Scenario};
use synthetic::synthetic;

/// What a comparison produced.
pub struct Outcome {
    /// Folder written.
    pub folder: PathBuf,
    /// The summary (Markdown).
    pub summary: String,
}

/// Runs a comparison recipe and writes its report.
pub fn run(recipe: &CompareRecipe) -> anyhow::Result<Outcome> {
    let folder = crate::prepare::run_folder(Path::new(&recipe.output_dir), &recipe.name)?;
    if let Scenario::Headline(h) = &recipe.scenario {
        let summary = crate::experiments::headline::run(&recipe.name, h, &folder)?;
        return Ok(Outcome { folder, summary });
    }
    let (runs, oracle, clock, target, sweeps) = match &recipe.scenario {
        Scenario::Synthetic(s) => synthetic(recipe, s)?,
        Scenario::Real(r) => real(recipe, r)?,
        Scenario::Headline(_) => unreachable!("handled above"),
    };
    let summary = report(recipe, &folder, &runs, oracle, &clock, &target, sweeps.as_deref())?;
    Ok(Outcome { folder, summary })
}

#[cfg(test)]
mod tests {
    use super::synthetic::{fastest_run, goodput_per_layout, synthetic_setup};
    use super::*;
    use copus_core::goodput::ObjectiveKind;
    use copus_core::layout::ParallelDims;
    use copus_core::policy::{DpOnlyGoodput, smallest_on};
    use copus_core::sim::simulate;

    #[test]
    fn the_shipped_comparison_recipes_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.file_name().is_some_and(|f| f.to_string_lossy().starts_with("compare-")) {
                CompareRecipe::load(&p).unwrap_or_else(|e| panic!("{e}"));
                n += 1;
            }
        }
        assert!(n >= 2);
    }

    #[test]
    fn a_synthetic_comparison_writes_its_report_and_copus_beats_the_fixed_layouts() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = CompareRecipe::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("compare-synthetic-13b.ron")).unwrap();
        r.output_dir = dir.path().display().to_string();
        let out = run(&r).unwrap();
        for f in ["summary.md", "results.csv", "reconfigurations.csv", "steps.jsonl", "recipe.ron"] {
            assert!(out.folder.join(f).exists(), "{f}");
        }
        let rows: Vec<csv::StringRecord> =
            csv::Reader::from_path(out.folder.join("results.csv")).unwrap().records().map(|r| r.unwrap()).collect();
        let time =
            // A policy that never reaches the target has an empty time: infinitely slow.
            |prefix: &str| -> Vec<f64> {
                rows.iter().filter(|r| r[0].starts_with(prefix)).map(|r| r[2].parse::<f64>().unwrap_or(f64::INFINITY)).collect()
            };
        let copus = time("copus")[0];
        let oracle = time("hindsight oracle")[0];
        // Every baseline here keeps one layout; Copus changes layout and is faster than all,
        // under the estimator-driven noise at the calibrated level, with the policies' own model
        // as the truth (the recipe says so; the suite grades against a truth they do not know).
        for prefix in ["static", "cbs", "merrill", "dp-only", "goodput on the best layout"] {
            assert!(!time(prefix).is_empty(), "{prefix} ran");
            for t in time(prefix) {
                assert!(copus < t, "copus {copus} vs {prefix} {t}");
            }
        }
        assert!(copus.is_finite() && oracle <= copus * 1.001);
        assert!(out.summary.contains("Clock: simulated"), "the report names its clock");
        let switches: Vec<csv::StringRecord> =
            csv::Reader::from_path(out.folder.join("reconfigurations.csv")).unwrap().records().map(|r| r.unwrap()).collect();
        assert!(switches.iter().any(|r| &r[0] == "copus" && &r[6] == "true"), "Copus changed layout at least once");
    }

    /// The best-layout Goodput baseline is AdaptDL's batch adaptation on the layout that is
    /// fastest in hindsight: checked against each layout run on its own.
    #[test]
    fn the_best_layout_baseline_picks_the_hindsight_best_layout() {
        let r = CompareRecipe::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("compare-synthetic-3b.ron")).unwrap();
        let Scenario::Synthetic(mut s) = r.scenario.clone() else { panic!("synthetic") };
        // A shorter run of the same shape, so the test stays quick.
        s.trajectory = vec![(0.0, 2.0), (1.0e4, 16.0), (2.0e4, 128.0)];
        s.end = 3.0e4;
        let (scorer, _, truth, traj, _) = synthetic_setup(&s, ObjectiveKind::Plain, 3).unwrap();
        let cfg = s.sim_config(r.costs, 3);
        let rule = r.rule();
        let per_layout = goodput_per_layout(&scorer, &truth, &traj, &cfg, rule).unwrap();
        let picked = fastest_run(&per_layout).unwrap();
        let mut layouts: Vec<ParallelDims> = scorer.candidates().map(|(c, _)| c.dims).collect();
        layouts.dedup();
        layouts.sort_by_key(|d| (d.dp, d.tp, d.pp));
        layouts.dedup();
        let mut each: Vec<(f64, ParallelDims)> = Vec::new();
        for l in layouts {
            let start = smallest_on(&scorer, l).unwrap();
            let mut p = DpOnlyGoodput::new(scorer.clone(), rule).unwrap();
            let run = simulate(&mut p, &truth, &traj, start, &cfg).unwrap();
            each.push((run.time_to_target.unwrap(), l));
        }
        let best = each.iter().min_by(|a, b| a.0.total_cmp(&b.0)).unwrap();
        assert!(each.len() > 1);
        assert_eq!(picked.time_to_target, Some(best.0));
        assert!(picked.policy.contains(&best.1.to_string()), "{} vs {}", picked.policy, best.1);
        // The run never leaves its layout.
        assert!(picked.switches.iter().all(|w| w.from.dims == w.to.dims));
    }

    #[test]
    fn bad_comparison_recipes_name_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let base = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("compare-synthetic-13b.ron")).unwrap();
        let check = |text: String, field: &str| {
            let p = dir.path().join("c.ron");
            std::fs::write(&p, text).unwrap();
            let e = CompareRecipe::load(&p).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        };
        check(base.replace("\"h100\"", "\"tpu\""), "cluster.preset");
        check(base.replace("llama-2-13b", "llama-9"), "scenario.model");
        check(base.replace("b0: 16.0", "b0: -1.0"), "scenario.b0");
        check(base.replace("(0.0, 4.0)", "(5.0, 4.0)"), "scenario.trajectory");
        check(base.replace("objective: Plain", "objective: Fast"), "Fast");
    }
}
