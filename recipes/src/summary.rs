//! What a run reports at the end: `summary.json` and `summary.md`.

use serde::Serialize;

use crate::recipe::Recipe;

/// What a run reports at the end (summary.json).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Recipe name.
    pub name: String,
    /// The clock the times are on.
    pub clock: &'static str,
    /// Model preset and parameter count.
    pub model: String,
    /// Parameters.
    pub num_params: u64,
    /// sha256 over the corpus (play names and texts).
    pub corpus_sha256: String,
    /// Steps done.
    pub steps: u64,
    /// Target tokens trained on.
    pub tokens: u64,
    /// Wall seconds of training (evaluations excluded).
    pub train_secs: f64,
    /// Training tokens per second.
    pub tokens_per_sec: f64,
    /// Mean training loss of the first and last 10 steps.
    pub first_loss: f64,
    /// See `first_loss`.
    pub last_loss: f64,
    /// Held-out loss before training.
    pub initial_eval_loss: f64,
    /// Held-out loss at the end.
    pub final_eval_loss: f64,
    /// Smoothed B_simple at the end (sequences).
    pub final_b_simple: Option<f64>,
    /// Why training stopped.
    pub stopped: String,
    /// The batch row of summary.md when it is not the recipe's fixed B_g (adaptive runs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch: Option<String>,
    /// Stopped by Ctrl-C; the run folder's last checkpoint continues it.
    pub interrupted: bool,
    /// Adaptive runs: every change made, with its step and why (`decisions.jsonl`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<String>,
}

/// The Markdown summary (`summary.md`) of a run of `r`.
pub fn summary_markdown(s: &Summary, r: &Recipe) -> String {
    let mut md = format!(
        "# {name}\n\nClock: {clock}.\n\n| | |\n|---|---|\n| model | {model}, {params:.2}M parameters |\n\
         | batch | {batch}; sequences of {seq} tokens |\n| steps | {steps} ({stopped}) |\n\
         | tokens | {tokens} |\n| training time | {secs:.1} s |\n| throughput | {tps:.0} tokens/s |\n\
         | training loss | {fl:.3} (first 10 steps) -> {ll:.3} (last 10) |\n\
         | held-out loss | {il:.3} -> {el:.3} |\n| B_simple at the end | {bs} sequences |\n\
         | corpus sha256 | {sha} |\n",
        name = s.name,
        clock = s.clock,
        model = s.model,
        params = s.num_params as f64 / 1e6,
        batch = s.batch.clone().unwrap_or_else(|| format!("B_g {} sequences, B_m {}", r.train.global_batch, r.train.micro_batch)),
        seq = r.model_spec().map(|m| m.seq_len).unwrap_or(0),
        steps = s.steps,
        stopped = s.stopped,
        tokens = s.tokens,
        secs = s.train_secs,
        tps = s.tokens_per_sec,
        fl = s.first_loss,
        ll = s.last_loss,
        il = s.initial_eval_loss,
        el = s.final_eval_loss,
        bs = s.final_b_simple.map_or("not measured".into(), |b| format!("{b:.1}")),
        sha = s.corpus_sha256,
    );
    if !s.changes.is_empty() {
        md.push_str(&format!("\n## What Copus changed, and why ({} changes)\n\n", s.changes.len()));
        for c in &s.changes {
            md.push_str(&format!("- {c}\n"));
        }
    }
    md
}
