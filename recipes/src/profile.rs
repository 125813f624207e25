//! `recipes profile RECIPE`: measures samples/s of every feasible (layout, B_g, B_m) candidate
//! of a recipe's `parallel` section on this machine, with the 3D-parallel engine on in-process
//! ranks, and writes a copus-core `ThroughputProfile` (RON, plus CSV next to it).
//!
//! Step time does not depend on token values, so the profile uses synthetic tokens and needs no
//! corpus.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::report::progress::Progress;
use anyhow::anyhow;
use burn::tensor::Device;
use copus_burn::{Engine, EngineConfig, EngineOptions, OptimConfig};
use copus_core::candidates::Candidate;
use copus_core::throughput::{ProfileEntry, ThroughputProfile};
use copus_models::{LlamaConfig, full_params};

use crate::recipe::Recipe;

/// Measure samples/s of every feasible candidate of a recipe's `parallel` section and write
/// a throughput profile.
#[derive(clap::Args)]
pub struct ProfileArgs {
    /// The recipe (RON) with a `parallel` section.
    recipe: PathBuf,
    /// Output file (default `<output_dir>/<name>-profile.ron`; a CSV is written next to it).
    #[arg(long)]
    out: Option<PathBuf>,
}

impl ProfileArgs {
    /// `recipes profile`: [`profile`], then the table, the throughput-optimal B_m per B_g and
    /// the file written.
    pub fn exec(self) -> anyhow::Result<()> {
        let recipe = crate::load_recipe(&self.recipe)?;
        let (p, file) = profile(&recipe, &ProfileOptions { out: self.out })?;
        print!("{}", table(&p));
        println!("\nthroughput-optimal B_m per B_g:\n{}", best_table(&p));
        println!("profile: {} (and .csv)", file.display());
        Ok(())
    }
}

/// Options of a profiling run.
pub struct ProfileOptions {
    /// Where to write the profile (default `<output_dir>/<name>-profile.ron`).
    pub out: Option<PathBuf>,
}

/// Synthetic batch of `b` sequences of `seq + 1` tokens below `vocab`.
pub fn synthetic_batch(b: usize, seq: usize, vocab: usize, salt: usize) -> Vec<i64> {
    (0..b * (seq + 1)).map(|j| ((j * 2_654_435_761 + salt * 97) % vocab) as i64).collect()
}

/// The engine configuration a profile times candidate `c` in: the run's options, the
/// optimizer without warmup.
pub fn candidate_config(options: &EngineOptions, c: &Candidate, seq: usize) -> EngineConfig {
    options.engine_config(c, seq, OptimConfig { warmup_steps: 0, ..OptimConfig::default() })
}

/// Seconds per step of one candidate: one untimed step, then `steps` timed ones.
pub fn time_candidate(
    cfg: &LlamaConfig,
    full: &copus_burn::parallel::FullParams,
    c: &Candidate,
    seq: usize,
    steps: usize,
    options: &EngineOptions,
) -> anyhow::Result<f64> {
    let mut engine = Engine::new(Arc::new(cfg.clone()), full, candidate_config(options, c, seq))?;
    let vocab = cfg.shape.vocab_size;
    engine.step(synthetic_batch(c.global_batch, seq, vocab, 0))?;
    let t = Instant::now();
    for i in 0..steps {
        engine.step(synthetic_batch(c.global_batch, seq, vocab, i + 1))?;
    }
    Ok(t.elapsed().as_secs_f64() / steps as f64)
}

/// Samples/s of each candidate, with a progress bar, the engines run as `options` say.
pub fn measure(
    cfg: &LlamaConfig,
    full: &copus_burn::parallel::FullParams,
    candidates: &[Candidate],
    seq: usize,
    steps: usize,
    options: &EngineOptions,
) -> anyhow::Result<Vec<ProfileEntry>> {
    let bar = Progress::new("profile", candidates.len() as u64);
    let mut entries = Vec::with_capacity(candidates.len());
    for c in candidates {
        bar.set_message(format!("{} B_g={} B_m={}", c.dims, c.global_batch, c.micro_batch));
        let secs = time_candidate(cfg, full, c, seq, steps, options)?;
        entries.push(ProfileEntry {
            dp: c.dims.dp,
            tp: c.dims.tp,
            pp: c.dims.pp,
            global_batch: c.global_batch,
            micro_batch: c.micro_batch,
            samples_per_sec: c.global_batch as f64 / secs,
        });
        bar.inc(1);
    }
    bar.finish();
    Ok(entries)
}

/// Profiles the recipe's candidate space; returns the profile and where it was written.
pub fn profile(recipe: &Recipe, opts: &ProfileOptions) -> anyhow::Result<(ThroughputProfile, PathBuf)> {
    let par = recipe.parallel.as_ref().ok_or_else(|| {
        anyhow!(
            "recipe `{}` has no `parallel` section; add one, e.g. parallel: (world_size: 8, global_batches: [8, 16], micro_batches: [1, 2])",
            recipe.name
        )
    })?;
    let spec = recipe.model_spec()?;
    let space = par.space()?;
    let enumeration = space.enumerate(&spec);
    if enumeration.feasible.is_empty() {
        let reasons: Vec<String> = enumeration
            .rejected
            .iter()
            .take(5)
            .map(|r| format!("{} B_g={} B_m={}: {}", r.dims, r.global_batch, r.micro_batch, r.reason))
            .collect();
        return Err(anyhow!("no feasible candidate in the recipe's space; for example {}", reasons.join("; ")));
    }
    let cfg = LlamaConfig::from_spec(&spec);
    let device = Device::flex().autodiff();
    let full = crate::prepare::seeded(&device, recipe.train.seed, || full_params(&cfg.init(&device)));
    let entries = measure(&cfg, &full, &enumeration.feasible, spec.seq_len, par.profile_steps, &recipe.engine_options())?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let hardware = format!("this machine: {cores} CPU cores, {} ranks on {:?}", par.world_size, recipe.backend);
    let profile = ThroughputProfile::new(hardware, spec.name.clone(), entries)?;
    let out = opts.out.clone().unwrap_or_else(|| Path::new(&recipe.output_dir).join(format!("{}-profile.ron", recipe.name)));
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| anyhow!("cannot create {}: {e}", dir.display()))?;
    }
    write_atomic(&out, &profile.to_ron())?;
    write_atomic(&out.with_extension("csv"), &profile.to_csv())?;
    Ok((profile, out))
}

fn write_atomic(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(|e| anyhow!("cannot write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| anyhow!("cannot write {}: {e}", path.display()))
}

/// The profile as a Markdown table, best layout per B_g marked.
pub fn table(profile: &ThroughputProfile) -> String {
    let mut rows: Vec<&ProfileEntry> = profile.entries().iter().collect();
    rows.sort_by_key(|a| (a.global_batch, a.micro_batch, a.dp, a.tp, a.pp));
    let mut out = String::from("| B_g | B_m | layout | samples/s | best for B_g |\n|---:|---:|---|---:|:---:|\n");
    for e in rows {
        let best =
            profile.best_layout(e.global_batch).is_some_and(|(d, m, _)| d.dp == e.dp && d.tp == e.tp && d.pp == e.pp && m == e.micro_batch);
        out.push_str(&format!(
            "| {} | {} | dp{},tp{},pp{} | {:.2} | {} |\n",
            e.global_batch,
            e.micro_batch,
            e.dp,
            e.tp,
            e.pp,
            e.samples_per_sec,
            if best { "*" } else { "" }
        ));
    }
    out
}

/// The throughput-optimal (layout, B_m) of each B_g, as a Markdown table.
pub fn best_table(profile: &ThroughputProfile) -> String {
    let mut batches: Vec<usize> = profile.entries().iter().map(|e| e.global_batch).collect();
    batches.sort_unstable();
    batches.dedup();
    let mut out = String::from("| B_g | best B_m | layout | samples/s |\n|---:|---:|---|---:|\n");
    for b in batches {
        if let Some((d, m, rate)) = profile.best_layout(b) {
            out.push_str(&format!("| {b} | {m} | dp{},tp{},pp{} | {rate:.2} |\n", d.dp, d.tp, d.pp));
        }
    }
    out
}

/// Measures the throughput of `feasible` on this machine, the engines run as the training
/// recipe's `options` say, and writes the profile to `out`.
pub fn measure_profile(
    cfg: &LlamaConfig,
    full: &copus_burn::parallel::FullParams,
    feasible: &[Candidate],
    (seq, steps): (usize, usize),
    options: &EngineOptions,
    out: Option<&Path>,
) -> anyhow::Result<ThroughputProfile> {
    let entries = crate::profile::measure(cfg, full, feasible, seq, steps, options)?;
    let p = ThroughputProfile::new("this machine (in-process ranks)".into(), "compare".into(), entries)?;
    if let Some(path) = out {
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(|e| anyhow!("{}: {e}", d.display()))?;
        }
        std::fs::write(path, p.to_ron()).map_err(|e| anyhow!("{}: {e}", path.display()))?;
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_a_small_space_and_writes_a_profile_that_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            r#"(
                name: "p",
                output_dir: "{}",
                model: (preset: "tiny-1m", seq_len: Some(16)),
                train: (global_batch: 4, micro_batch: 1, max_steps: 1),
                parallel: (world_size: 2, global_batches: [2, 4], micro_batches: [1, 2], profile_steps: 1),
            )"#,
            dir.path().display()
        );
        let recipe = Recipe::parse(&text, "p").unwrap();
        let (profile, path) = profile(&recipe, &ProfileOptions { out: None }).unwrap();
        // Layouts of 2 ranks: dp2, tp2, pp2. B_g=2 with dp2 needs B_m=1; everything else fits.
        let expected = recipe.parallel.as_ref().unwrap().space().unwrap().enumerate(&recipe.model_spec().unwrap()).feasible.len();
        assert_eq!(profile.entries().len(), expected);
        assert!(expected >= 9, "{expected}");
        assert!(profile.entries().iter().all(|e| e.samples_per_sec > 0.0 && e.samples_per_sec.is_finite()));
        let back = ThroughputProfile::from_ron(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back.entries().len(), expected);
        assert!(path.with_extension("csv").exists());
        assert!(table(&back).contains("| 4 | 2 |"));
        // The best B_m of each B_g is the fastest entry of that B_g.
        let best = best_table(&back);
        for b in [2, 4] {
            let fastest = back
                .entries()
                .iter()
                .filter(|e| e.global_batch == b)
                .max_by(|x, y| x.samples_per_sec.total_cmp(&y.samples_per_sec))
                .unwrap();
            assert!(
                best.contains(&format!("| {b} | {} | dp{},tp{},pp{} |", fastest.micro_batch, fastest.dp, fastest.tp, fastest.pp)),
                "{best}"
            );
        }
    }

    #[test]
    fn a_recipe_without_a_parallel_section_is_an_error_that_says_what_to_add() {
        let recipe =
            Recipe::parse(r#"(name: "p", model: (preset: "tiny-1m"), train: (global_batch: 4, micro_batch: 1, max_steps: 1))"#, "p")
                .unwrap();
        let e = profile(&recipe, &ProfileOptions { out: None }).unwrap_err().to_string();
        assert!(e.contains("parallel") && e.contains("world_size"), "{e}");
    }
}
