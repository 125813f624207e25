//! The comparison's report: the time-to-target table with speedups and regret, loss against
//! time with Copus's layout regions, and the switch records (PNG, CSV, JSONL, Markdown).

use std::fmt::Write as _;
use std::path::Path;

use anyhow::anyhow;

use super::records::StepRecord;
use super::records::{PolicyRun, secs};
use super::schema::CompareRecipe;
use crate::report::plot::{Series, line_plot, region_plot};

/// A CSV file being written in memory.
type Csv = csv::Writer<Vec<u8>>;

/// Writes the report into `folder` (results.csv, reconfigurations.csv, steps.jsonl, the plots,
/// summary.md, recipe.ron); returns the summary (Markdown).
pub(super) fn report(
    recipe: &CompareRecipe,
    folder: &Path,
    runs: &[PolicyRun],
    oracle: Option<f64>,
    clock: &str,
    target: &str,
    sweeps: Option<&str>,
) -> anyhow::Result<String> {
    let write =
        |name: &str, text: &str| std::fs::write(folder.join(name), text).map_err(|e| anyhow!("{}: {e}", folder.join(name).display()));
    let fastest = fastest_baseline(runs);
    let mut md = format!("# {}\n\nClock: {clock}.\nTarget: {target}.\n\n", recipe.name);
    let results = results_table(&mut md, runs, fastest.as_ref(), oracle)?;
    let reconfigurations = reconfigurations_table(&mut md, runs)?;
    if let Some(sw) = sweeps {
        md.push_str("\n## Sweeps (Copus, synthetic statistics)\n\n");
        md.push_str(sw);
    }
    write("results.csv", &results)?;
    write("reconfigurations.csv", &reconfigurations)?;
    write("steps.jsonl", &steps_jsonl(runs)?)?;
    // Plots; a missing font is reported, the data files are written anyway.
    let notes = plots(folder, runs, fastest.as_ref());
    if !notes.is_empty() {
        md.push_str("\nPlots not written: ");
        md.push_str(&notes.iter().map(|e: &anyhow::Error| e.to_string()).collect::<Vec<_>>().join("; "));
        md.push('\n');
    }
    write("summary.md", &md)?;
    let recipe_text = ron::ser::to_string_pretty(recipe, ron::ser::PrettyConfig::default())?;
    write("recipe.ron", &recipe_text)?;
    Ok(md)
}

/// The baseline that reached the target first: its time and name.
fn fastest_baseline(runs: &[PolicyRun]) -> Option<(f64, String)> {
    runs.iter().filter(|r| r.baseline).filter_map(|r| r.time_to_target.map(|t| (t, r.name.clone()))).min_by(|a, b| a.0.total_cmp(&b.0))
}

/// Appends one record.
fn row(csv: &mut Csv, fields: &[String]) -> anyhow::Result<()> {
    csv.write_record(fields).map_err(anyhow::Error::from)
}

/// The text of a finished CSV.
fn csv_text(w: Csv) -> anyhow::Result<String> {
    w.into_inner().map_err(|e| anyhow!("{e}")).map(|b| String::from_utf8_lossy(&b).into_owned())
}

/// The time-to-target table: a Markdown row and a CSV record per policy, then the hindsight
/// oracle and the fastest baseline; returns results.csv.
fn results_table(md: &mut String, runs: &[PolicyRun], fastest: Option<&(f64, String)>, oracle: Option<f64>) -> anyhow::Result<String> {
    md.push_str("| policy | time to target (s) | speedup vs fastest baseline | regret vs oracle | steps | layout switches | batch switches |\n|---|---:|---:|---:|---:|---:|---:|\n");
    let mut csv = Csv::from_writer(Vec::new());
    row(
        &mut csv,
        &[
            "policy",
            "baseline",
            "time_to_target_s",
            "speedup_vs_fastest_baseline",
            "regret_vs_oracle",
            "steps",
            "layout_switches",
            "batch_switches",
        ]
        .map(String::from),
    )?;
    for r in runs {
        policy_row(md, &mut csv, r, fastest, oracle)?;
    }
    if let Some(o) = oracle {
        let _ = writeln!(
            md,
            "| hindsight oracle | {} | {} | 0.0% | | | |",
            secs(o),
            fastest.map_or("-".into(), |(f, _)| format!("{:+.1}%", 100.0 * (f / o - 1.0)))
        );
        row(
            &mut csv,
            &[
                "hindsight oracle".into(),
                "false".into(),
                format!("{o}"),
                String::new(),
                "0".into(),
                String::new(),
                String::new(),
                String::new(),
            ],
        )?;
    }
    if let Some((f, n)) = fastest {
        let _ = writeln!(md, "\nFastest baseline: {n} ({} s).", secs(*f));
    }
    csv_text(csv)
}

/// One policy's row of the time-to-target table, in Markdown and in the CSV.
fn policy_row(md: &mut String, csv: &mut Csv, r: &PolicyRun, fastest: Option<&(f64, String)>, oracle: Option<f64>) -> anyhow::Result<()> {
    let t = r.time_to_target;
    let speed = match (t, fastest) {
        (Some(t), Some((f, _))) => Some(f / t - 1.0),
        _ => None,
    };
    let regret = match (t, oracle) {
        (Some(t), Some(o)) if o > 0.0 => Some(t / o - 1.0),
        _ => None,
    };
    let (ls, bs) = (r.switches.iter().filter(|s| s.layout).count(), r.switches.iter().filter(|s| !s.layout).count());
    let steps = r.steps.last().map_or(0, |s| s.step);
    let pct = |x: Option<f64>| x.map_or("-".into(), |v| format!("{:+.1}%", 100.0 * v));
    let _ = writeln!(
        md,
        "| {} | {} | {} | {} | {steps} | {ls} | {bs} |",
        r.name,
        t.map_or("not reached".into(), secs),
        pct(speed),
        pct(regret)
    );
    row(
        csv,
        &[
            r.name.clone(),
            r.baseline.to_string(),
            t.map_or(String::new(), |t| format!("{t}")),
            speed.map_or(String::new(), |v| format!("{v}")),
            regret.map_or(String::new(), |v| format!("{v}")),
            steps.to_string(),
            ls.to_string(),
            bs.to_string(),
        ],
    )
}

/// The reconfigurations of every policy, in Markdown and as reconfigurations.csv (returned).
fn reconfigurations_table(md: &mut String, runs: &[PolicyRun]) -> anyhow::Result<String> {
    md.push_str("\n## Reconfigurations\n\n| policy | after step | at (s) | from | to | cost (s) |\n|---|---:|---:|---|---|---:|\n");
    let mut rcsv = Csv::from_writer(Vec::new());
    row(&mut rcsv, &["policy", "step", "time_s", "from", "to", "cost_s", "layout"].map(String::from))?;
    for r in runs {
        for s in &r.switches {
            let _ = writeln!(md, "| {} | {} | {:.1} | {} | {} | {:.2} |", r.name, s.step, s.time, s.from, s.to, s.cost);
            row(
                &mut rcsv,
                &[
                    r.name.clone(),
                    s.step.to_string(),
                    s.time.to_string(),
                    s.from.clone(),
                    s.to.clone(),
                    s.cost.to_string(),
                    s.layout.to_string(),
                ],
            )?;
        }
    }
    csv_text(rcsv)
}

/// Every step of every policy as a JSON line, with the policy's name.
fn steps_jsonl(runs: &[PolicyRun]) -> anyhow::Result<String> {
    let mut jsonl = String::new();
    for r in runs {
        for s in &r.steps {
            let mut v = serde_json::to_value(s)?;
            v["policy"] = serde_json::Value::String(r.name.clone());
            jsonl.push_str(&v.to_string());
            jsonl.push('\n');
        }
    }
    Ok(jsonl)
}

/// Draws loss against time (Copus's layouts shaded), the B_g schedules and Copus's Goodput
/// split; returns why any plot was not written.
fn plots(folder: &Path, runs: &[PolicyRun], fastest: Option<&(f64, String)>) -> Vec<anyhow::Error> {
    let mut notes = Vec::new();
    let copus = runs.iter().find(|r| !r.baseline);
    let shown = shown_runs(runs, fastest);
    let series = |f: &dyn Fn(&StepRecord) -> f64| -> Vec<Series<'_>> {
        shown.iter().map(|r| Series { label: &r.name, points: r.steps.iter().map(|s| (s.time, f(s))).collect() }).collect()
    };
    let regions = copus.map_or(Vec::new(), layout_regions);
    let mut plot = |r: anyhow::Result<()>| {
        if let Err(e) = r {
            notes.push(e);
        }
    };
    plot(region_plot(
        &folder.join("loss_time.png"),
        "Loss against time (shaded: Copus's layout)",
        "seconds",
        "loss",
        &series(&|s| s.loss),
        &regions,
        &[],
    ));
    plot(line_plot(
        &folder.join("batch_schedule.png"),
        "Global batch size B_g",
        "seconds",
        "B_g (sequences)",
        &series(&|s| s.global_batch as f64),
        true,
    ));
    if let Some(c) = copus {
        plot(goodput_split_plot(folder, c));
    }
    notes
}

/// The runs the plots show: Copus, the fastest baseline, the data-parallel-only and the
/// optimistic CBS baselines.
fn shown_runs<'a>(runs: &'a [PolicyRun], fastest: Option<&(f64, String)>) -> Vec<&'a PolicyRun> {
    let mut shown: Vec<&PolicyRun> = runs.iter().filter(|r| !r.baseline).collect();
    if let Some((_, n)) = fastest {
        shown.extend(runs.iter().filter(|r| &r.name == n));
    }
    shown.extend(runs.iter().filter(|r| r.baseline && r.name.starts_with("dp-only")));
    shown.extend(runs.iter().filter(|r| r.baseline && r.name.starts_with("cbs optimistic")));
    shown.dedup_by(|a, b| a.name == b.name);
    shown
}

/// Copus's stretches on one layout: (start, end, layout) in clock seconds.
fn layout_regions(c: &PolicyRun) -> Vec<(f64, f64, String)> {
    let mut out: Vec<(f64, f64, String)> = Vec::new();
    let mut prev = 0.0;
    for s in &c.steps {
        match out.last_mut() {
            Some(last) if last.2 == s.layout => last.1 = s.time,
            _ => out.push((prev, s.time, s.layout.clone())),
        }
        prev = s.time;
    }
    out
}

/// Copus's Goodput split into throughput and statistical efficiency, each relative to its
/// maximum.
fn goodput_split_plot(folder: &Path, c: &PolicyRun) -> anyhow::Result<()> {
    let tmax = c.steps.iter().map(|s| s.throughput).fold(0.0, f64::max).max(1e-12);
    let gmax = c.steps.iter().map(|s| s.throughput * s.efficiency).fold(0.0, f64::max).max(1e-12);
    let split = vec![
        Series { label: "throughput / max", points: c.steps.iter().map(|s| (s.time, s.throughput / tmax)).collect() },
        Series { label: "statistical efficiency", points: c.steps.iter().map(|s| (s.time, s.efficiency)).collect() },
        Series { label: "goodput / max", points: c.steps.iter().map(|s| (s.time, s.throughput * s.efficiency / gmax)).collect() },
    ];
    line_plot(&folder.join("goodput_split.png"), "Copus: Goodput = throughput x efficiency", "seconds", "relative", &split, false)
}
