//! The RON recipe schema. Unknown fields are errors; every value is checked, and an error names
//! the field, the value and what is allowed.

use std::path::Path;

use copus_burn::{OptimConfig, RankDevice};
use copus_core::candidates::{Candidate, CandidateSpace};
use copus_core::goodput::ObjectiveKind;
use copus_core::layout::ParallelDims;
use copus_core::memory::{Checkpointing, GIB, MemoryModel, Precision};
use copus_core::model::ModelSpec;
use copus_core::policy::CopusRule;
use copus_core::schedule::ScheduleKind;
use serde::{Deserialize, Serialize};

use crate::data::corpus::DataSpec;
pub use crate::data::spec::{Heldout, Source, TextSplit, TokenDtype, TokenizerRecipe};
use thiserror::Error;

/// A recipe that cannot be used.
#[derive(Debug, Error)]
pub enum RecipeError {
    /// The file could not be read.
    #[error("cannot read recipe {path}: {err}")]
    Read {
        /// File.
        path: String,
        /// Error.
        err: std::io::Error,
    },
    /// RON syntax, an unknown field or a wrong type.
    #[error("recipe {path}: {message}")]
    Parse {
        /// File.
        path: String,
        /// What the parser said (it names the field and the expected ones).
        message: String,
    },
    /// A value out of range inside a section another crate checks (the switch rule, the
    /// optimizer): its error names the field within the section and the allowed values.
    #[error("recipe section `{section}`: {message}")]
    Section {
        /// Dotted section name.
        section: &'static str,
        /// What the section's own check said.
        message: String,
    },
    /// A value out of range.
    #[error("recipe field `{field}` = {value}: {allowed}")]
    Field {
        /// Dotted field name.
        field: &'static str,
        /// The value given.
        value: String,
        /// What is allowed.
        allowed: String,
    },
}

/// Which model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelRecipe {
    /// A copus-core preset: tiny-1m, tiny-5m, tiny-20m, small-100m, llama-3.2-3b, ...
    pub preset: String,
    /// Sequence length (default: the preset's).
    #[serde(default)]
    pub seq_len: Option<usize>,
}

/// The data: where the corpus is, what is held out, the tokenizer. Every field has a default:
/// `source: Shakespeare`, `heldout` two plays for Shakespeare and `Fraction(0.01)` otherwise,
/// `tokenizer: Bpe(vocab_size: 4096)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataRecipe {
    /// The corpus: `Shakespeare`, `Sotu`, `Text(paths: [..])`, `Jsonl(paths: [..], field: ..)`,
    /// `Parquet(paths: [..], column: ..)`, `Tokens(paths: [..], dtype: U16 | U32 | Megatron)`.
    pub source: Source,
    /// What is kept out of training for the held-out loss: `Documents([..])`, `Files([..])`,
    /// `Fraction(f)` (default: the source's, [`Source::default_heldout`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout: Option<Heldout>,
    /// Whole plays kept out (the field before `heldout`; the same as `heldout: Documents([..])`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heldout_plays: Option<Vec<String>>,
    /// Tokenizer.
    pub tokenizer: TokenizerRecipe,
    /// Skip files (and JSON lines) that are not UTF-8, counted in the log, instead of stopping
    /// with the file and byte offset.
    pub skip_invalid_utf8: bool,
}

impl Default for DataRecipe {
    fn default() -> Self {
        Self {
            source: Source::Shakespeare,
            heldout: None,
            heldout_plays: None,
            tokenizer: TokenizerRecipe::Bpe { vocab_size: 4096 },
            skip_invalid_utf8: false,
        }
    }
}

impl DataRecipe {
    /// The held-out rule and the field it came from.
    pub fn heldout_rule(&self) -> (Heldout, &'static str) {
        match (&self.heldout, &self.heldout_plays) {
            (Some(h), _) => (h.clone(), "data.heldout"),
            (None, Some(plays)) => (Heldout::Documents(plays.clone()), "data.heldout_plays"),
            (None, None) => (self.source.default_heldout(), "data.heldout"),
        }
    }

    /// What decides the data a run reads: the source, the held-out rule (however written), the
    /// tokenizer and the UTF-8 handling. Two recipes with the same value read the same data.
    pub fn resolved(&self) -> (Source, Heldout, TokenizerRecipe, bool) {
        (self.source.clone(), self.heldout_rule().0, self.tokenizer.clone(), self.skip_invalid_utf8)
    }

    /// The data section resolved for [`crate::data::corpus::open`].
    pub fn spec(&self) -> DataSpec {
        let (heldout, heldout_field) = self.heldout_rule();
        DataSpec {
            source: self.source.clone(),
            heldout,
            heldout_field,
            tokenizer: self.tokenizer.clone(),
            skip_invalid_utf8: self.skip_invalid_utf8,
        }
    }

    /// The section's own checks (files are checked when the data is read).
    fn validate(&self) -> Result<(), RecipeError> {
        if self.heldout.is_some() && self.heldout_plays.is_some() {
            return Err(field(
                "data.heldout_plays",
                "given with `data.heldout`",
                "one of the two (`heldout_plays: [..]` is `heldout: Documents([..])`)",
            ));
        }
        if self.heldout_plays.is_some() && self.source != Source::Shakespeare {
            return Err(field("data.heldout_plays", "given", "only with `source: Shakespeare`; use `heldout: Documents([..])`"));
        }
        match self.heldout_rule().0 {
            Heldout::Fraction(f) if !(f > 0.0 && f < 1.0) => {
                return Err(field("data.heldout", format!("Fraction({f})"), "Fraction(f) with 0 < f < 1"));
            }
            Heldout::Documents(d) if d.is_empty() => return Err(field("data.heldout", "Documents([])", "at least one document name")),
            Heldout::Files(f) if f.is_empty() => return Err(field("data.heldout", "Files([])", "at least one file")),
            _ => {}
        }
        if let Some(paths) = self.source.paths()
            && paths.is_empty()
        {
            return Err(field("data.source.paths", "[]", "files, folders or globs of the corpus"));
        }
        match &self.source {
            Source::Jsonl { field: f, .. } if f.is_empty() => {
                Err(field("data.source.field", "\"\"", "the JSON field holding the text (default \"text\")"))
            }
            Source::Parquet { column, .. } if column.is_empty() => {
                Err(field("data.source.column", "\"\"", "the column holding the text (default \"text\")"))
            }
            Source::Tokens { .. } if !matches!(self.tokenizer, TokenizerRecipe::File(_)) => {
                Err(field("data.tokenizer", "Bpe", "File(\"path/to/tokenizer.json\"): token shards need the tokenizer that made them"))
            }
            _ => Ok(()),
        }
    }
}

/// The training loop.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainRecipe {
    /// Global batch B_g, sequences per optimizer step.
    pub global_batch: usize,
    /// Micro-batch B_m, sequences per forward/backward.
    pub micro_batch: usize,
    /// Stop after this many steps.
    pub max_steps: u64,
    /// Also stop after this many seconds of training.
    #[serde(default)]
    pub time_budget_secs: Option<f64>,
    /// Seed of initialisation and data order.
    #[serde(default)]
    pub seed: u64,
    /// Evaluate the held-out loss every this many steps (0: only at the end).
    #[serde(default = "default_eval_every")]
    pub eval_every: u64,
    /// Held-out sequences per evaluation.
    #[serde(default = "default_eval_sequences")]
    pub eval_sequences: usize,
    /// Runs on the engine (adaptive recipes) write a whole-run checkpoint every this many steps,
    /// at the end and on Ctrl-C, keeping the newest two (0: only at the end and on Ctrl-C).
    #[serde(default = "default_checkpoint_every")]
    pub checkpoint_every: u64,
    /// Runs on the engine: how many times a failed rank (a panic, a collective timeout) or
    /// training that diverges past its restores is recovered in the process, from the last
    /// in-memory snapshot (at most 50 steps back, or the last checkpoint), before the run stops
    /// with the error (0: never).
    #[serde(default = "default_max_recoveries")]
    pub max_recoveries: u32,
}

fn default_max_recoveries() -> u32 {
    3
}

fn default_checkpoint_every() -> u64 {
    100
}

fn default_eval_every() -> u64 {
    50
}

fn default_eval_sequences() -> usize {
    32
}

/// A whole recipe.
/// A layout written in a recipe.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayoutRecipe {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel ranks.
    pub tp: usize,
    /// Pipeline stages.
    pub pp: usize,
}

/// Training on several in-process ranks, and the candidate space copus searches.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParallelRecipe {
    /// Ranks (threads on this machine).
    pub world_size: usize,
    /// The layout to start in.
    #[serde(default)]
    pub layout: Option<LayoutRecipe>,
    /// Pipeline schedule: `OneFOneB` or `GPipe`.
    #[serde(default = "default_schedule")]
    pub schedule: ScheduleKind,
    /// Global batch sizes (sequences) copus may use.
    pub global_batches: Vec<usize>,
    /// Micro-batch sizes (sequences) copus may use.
    pub micro_batches: Vec<usize>,
    /// Memory per rank for the feasibility check, GiB.
    #[serde(default = "default_device_memory_gib")]
    pub device_memory_gib: f64,
    /// Timed steps per candidate in `recipes profile`.
    #[serde(default = "default_profile_steps")]
    pub profile_steps: usize,
    /// Decisions fixed in advance, replacing the policy: after step `after_step`, switch to the
    /// given configuration (replays, reproducible comparisons). Empty: Copus decides.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub script: Vec<ScriptedSwitch>,
    /// The objective Copus ranks candidates by. Default: the one consistent with
    /// `optim.lr_rule` ([`ObjectiveKind::for_rule`]: `LrTuned(rule: Sqrt)` under the default
    /// sqrt rule).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub objective: Option<ObjectiveKind>,
    /// Copus's rule, fixed before the run: `Learning(rule: (...), belief: (...))`, the rule on
    /// the structured belief (six settings, copus-core `policy::Rule`; `belief` optional), or
    /// `Switch((...))`, the switch rule of earlier waves. Default: `Learning` with the default
    /// settings, a payback horizon of a quarter of the time budget (replaced by the seconds
    /// left once the run runs) and a 1 s first guess of a layout change's cost.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<CopusRule>,
    /// Under mpirun: reductions over MPI bit-equal to in-process ranks (gathered and added in
    /// rank order; `true`), or MPI's own all-reduce (`false`, the default: faster, equal to
    /// rounding).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exact_reductions: bool,
    /// Activation checkpointing on the ranks: `None` (the default), `Layers` (keep the residual
    /// stream at each layer, recompute the layer in the backward pass) or `Regions` (at each
    /// residual branch). The memory model counts it.
    #[serde(default, skip_serializing_if = "is_default")]
    pub checkpointing: Checkpointing,
    /// The arithmetic: `F32` (the default) or `Bf16Mixed` (bf16 products, f32 master weights,
    /// moments, gradients and reductions). `Bf16Mixed` needs bf16 arithmetic on the backend:
    /// Flex and CUDA have it, wgpu does not (refused when the recipe loads).
    #[serde(default, skip_serializing_if = "is_default")]
    pub precision: Precision,
    /// ZeRO stage 1 (`true`): each data-parallel replica keeps the AdamW moments of 1/dp of
    /// the parameters; gradients are reduce-scattered and the updated weights all-gathered.
    /// Trains as without it; the memory model counts the moments divided over dp. Default
    /// `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub zero1: bool,
    /// The recipe's `backend` (not written in this section: [`Recipe::parse`] copies it here),
    /// which picks the memory model: measured on a GPU for GPU backends.
    #[serde(skip)]
    pub backend: Backend,
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

/// One switch of [`ParallelRecipe::script`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedSwitch {
    /// The step after which the switch happens (1-based).
    pub after_step: u64,
    /// The layout to switch to (the same as before for a batch-only change).
    pub layout: LayoutRecipe,
    /// The new B_g.
    pub global_batch: usize,
    /// The new B_m.
    pub micro_batch: usize,
}

fn default_schedule() -> ScheduleKind {
    ScheduleKind::OneFOneB
}

fn default_device_memory_gib() -> f64 {
    16.0
}

fn default_profile_steps() -> usize {
    2
}

impl ParallelRecipe {
    /// This section with the default precision (to compare two recipes but for it).
    pub fn without_precision(&self) -> Self {
        Self { precision: Precision::default(), ..self.clone() }
    }

    /// The objective Copus ranks by: the recipe's, else the one `optim.lr_rule` implies.
    pub fn objective(&self, optim: &OptimConfig) -> ObjectiveKind {
        self.objective.unwrap_or(ObjectiveKind::for_rule(optim.lr_rule))
    }

    /// Copus's rule: the recipe's, else [`CopusRule::for_run`] with a payback horizon of a
    /// quarter of the time budget (10 s to 10 min; 2 min without a budget) and a 1 s first
    /// guess of a layout change's cost (in-process ranks reshard in a fraction of a step).
    pub fn copus_rule(&self, time_budget_secs: Option<f64>) -> CopusRule {
        self.rule.unwrap_or_else(|| CopusRule::for_run(time_budget_secs.map_or(120.0, |b| (b / 4.0).clamp(10.0, 600.0)), 1.0))
    }

    /// The memory model of this recipe's ranks: the engine's as measured in its precision, on
    /// Flex ([`MemoryModel::engine`]) or, for a GPU backend, on a GPU
    /// ([`MemoryModel::engine_gpu`]), with its checkpointing and ZeRO-1.
    pub fn memory_model(&self) -> MemoryModel {
        MemoryModel::measured(self.precision, self.backend.is_gpu(), self.checkpointing, self.zero1)
    }

    /// The candidate space of this recipe.
    pub fn space(&self) -> Result<CandidateSpace, RecipeError> {
        CandidateSpace::new(
            self.world_size,
            self.global_batches.clone(),
            self.micro_batches.clone(),
            self.schedule,
            self.memory_model(),
            self.device_memory_gib * GIB,
        )
        .map_err(|e| field("parallel", "(..)", e.to_string()))
    }

    /// The scripted switches as candidates, each checked to be feasible in the candidate space.
    pub fn scripted(&self, spec: &ModelSpec) -> Result<Vec<(u64, Candidate)>, RecipeError> {
        let feasible = self.space()?.enumerate(spec).feasible;
        let mut out = Vec::with_capacity(self.script.len());
        for (i, s) in self.script.iter().enumerate() {
            let l = s.layout;
            let value = format!(
                "[{i}]: (after_step: {}, layout: (dp: {}, tp: {}, pp: {}), global_batch: {}, micro_batch: {})",
                s.after_step, l.dp, l.tp, l.pp, s.global_batch, s.micro_batch
            );
            let dims = ParallelDims::new(l.dp, l.tp, l.pp, self.world_size).map_err(|e| field("parallel.script", &value, e.to_string()))?;
            let c = Candidate::new(dims, s.global_batch, s.micro_batch).ok();
            let Some(c) = c.filter(|c| feasible.contains(c)) else {
                return Err(field(
                    "parallel.script",
                    value,
                    "a feasible candidate of the recipe's space: a layout the model splits into, global_batch in parallel.global_batches, micro_batch in parallel.micro_batches, global_batch a multiple of dp x micro_batch, within device_memory_gib",
                ));
            };
            if s.after_step == 0 || out.last().is_some_and(|(step, _)| *step >= s.after_step) {
                return Err(field("parallel.script", value, "after_step at least 1 and increasing from one switch to the next"));
            }
            out.push((s.after_step, c));
        }
        Ok(out)
    }

    /// The starting layout, checked against the model.
    pub fn initial_dims(&self, spec: &ModelSpec) -> Result<Option<ParallelDims>, RecipeError> {
        let Some(l) = self.layout else { return Ok(None) };
        let dims = ParallelDims::new(l.dp, l.tp, l.pp, self.world_size)
            .map_err(|e| field("parallel.layout", format!("(dp: {}, tp: {}, pp: {})", l.dp, l.tp, l.pp), e.to_string()))?;
        dims.check_model(spec).map_err(|e| field("parallel.layout", dims, e.to_string()))?;
        Ok(Some(dims))
    }
}

/// A recipe file: the model, the data, the training schedule and the optimizer, and, with a
/// `parallel` section, the candidate space Copus adapts over.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Run name; the run folder is `output_dir/name` (with a suffix if it exists).
    pub name: String,
    /// Folder for runs (default `runs`).
    #[serde(default = "default_output_dir")]
    pub output_dir: String,
    /// Model.
    pub model: ModelRecipe,
    /// Data.
    #[serde(default)]
    pub data: DataRecipe,
    /// Training loop.
    pub train: TrainRecipe,
    /// Optimizer, schedule, clipping, noise-scale smoothing: any of `OptimConfig`'s fields.
    #[serde(default, deserialize_with = "optim_section")]
    pub optim: OptimConfig,
    /// Several ranks and the candidate space (for `recipes profile`, layouts and policies).
    #[serde(default)]
    pub parallel: Option<ParallelRecipe>,
    /// Train under Copus on the engine's ranks (needs `parallel`), or the fixed single-rank
    /// run (`false`). Default: adaptive exactly when `parallel` is given.
    #[serde(default)]
    pub adaptive: Option<bool>,
    /// Start from the weights of a Hugging Face Llama directory (`config.json`,
    /// `model.safetensors`, as `recipes export` writes) instead of a seeded initialisation. Its
    /// shape must be the recipe's model with the run's tokenizer.
    #[serde(default)]
    pub init_from: Option<String>,
    /// Where the ranks train: `Flex` (CPU, the default), `Wgpu`, `Cuda`, `Rocm`, `Tch` (LibTorch
    /// on NVIDIA GPUs) or `TchCpu` (LibTorch on the CPU). All but Flex need `recipes` built with
    /// the backend's feature (`--features wgpu`; `tch` for both LibTorch backends).
    #[serde(default)]
    pub backend: Backend,
    /// `Cuda`, `Rocm` and `Tch`: how many ranks share one GPU (8 ranks on one H200: 8). Default: the
    /// ranks spread evenly over the GPUs the process may use (`CUDA_VISIBLE_DEVICES`, or the
    /// driver's count), one per GPU where nothing says how many there are.
    #[serde(default)]
    pub ranks_per_device: Option<usize>,
}

/// Burn's backend the ranks train on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Backend {
    /// Burn's pure-Rust CPU backend.
    #[default]
    Flex,
    /// The default wgpu adapter (Vulkan, Metal, DX12; lavapipe on a CPU).
    Wgpu,
    /// NVIDIA GPUs, shared by the ranks as `ranks_per_device` says.
    Cuda,
    /// AMD GPUs, shared by the ranks as `ranks_per_device` says.
    Rocm,
    /// NVIDIA GPUs through LibTorch (Burn's `tch` backend, linked against a PyTorch
    /// installation's libtorch), shared by the ranks as `ranks_per_device` says.
    Tch,
    /// LibTorch on the CPU: the `Tch` build's path, checked without a GPU.
    TchCpu,
}

impl Backend {
    /// The device of a single-rank run (the first GPU it may use).
    pub fn rank_device(self) -> RankDevice {
        match self {
            Backend::Flex => RankDevice::Flex,
            Backend::Wgpu => RankDevice::Wgpu,
            Backend::Cuda => RankDevice::Cuda(0),
            Backend::Rocm => RankDevice::Rocm(0),
            Backend::Tch => RankDevice::TchCuda(0),
            Backend::TchCpu => RankDevice::TchCpu,
        }
    }

    /// Whether the ranks' memory is a GPU's (wgpu counted so: its devices are GPUs but for
    /// lavapipe).
    pub fn is_gpu(self) -> bool {
        matches!(self, Backend::Wgpu | Backend::Cuda | Backend::Rocm | Backend::Tch)
    }

    /// The cargo feature of `recipes` that builds this backend.
    pub fn feature(self) -> &'static str {
        match self {
            Backend::Flex => "",
            Backend::Wgpu => "wgpu",
            Backend::Cuda => "cuda",
            Backend::Rocm => "rocm",
            Backend::Tch | Backend::TchCpu => "tch",
        }
    }

    /// Every rank's device, for the engine (empty for Flex: its default): `world` ranks spread
    /// over the GPUs this process may use, `ranks_per_device` each when given
    /// ([`RankDevice::for_ranks`]). Under mpirun each process then takes its own node's GPU.
    pub fn rank_devices(self, world: usize, ranks_per_device: Option<usize>) -> Vec<RankDevice> {
        if self == Backend::Flex { Vec::new() } else { self.rank_device().for_ranks(world, ranks_per_device) }
    }
}

/// A value of the wrong type or out of range (`max_recoveries: -1`) is named by its field: RON
/// gives the position, and the field is the last `name:` before it on that line.
fn parse_message(text: &str, e: &ron::error::SpannedError) -> String {
    use ron::Error::{DuplicateStructField, MissingStructField, NoSuchEnumVariant, NoSuchStructField};
    // These name the field or variant themselves.
    if matches!(e.code, NoSuchStructField { .. } | MissingStructField { .. } | DuplicateStructField { .. } | NoSuchEnumVariant { .. }) {
        return e.to_string();
    }
    let start = e.span.start;
    let before: String = text.lines().nth(start.line.saturating_sub(1)).unwrap_or("").chars().take(start.col.saturating_sub(1)).collect();
    let field = before.rfind(':').and_then(|i| {
        let name = before[..i].trim_end();
        let from = name.char_indices().rev().find(|(_, c)| !(c.is_alphanumeric() || *c == '_')).map_or(0, |(j, c)| j + c.len_utf8());
        Some(&name[from..]).filter(|n| !n.is_empty())
    });
    match field {
        // Only the old form `rule: Some((...))`: an objective's `rule:` also ends in `rule`.
        Some("rule") if matches!(e.code, ron::Error::ExpectedIdentifier) && old_rule_form(&before) => format!(
            "{e} (the value of `rule`: `Learning(rule: (...))`, the rule on the structured belief, or \
             `Switch((...))`, the switch rule recipes wrote as `rule: Some((...))` before 2026-12-07)"
        ),
        Some(f) => format!("{e} (the value of `{f}`)"),
        None => e.to_string(),
    }
}

/// Whether the text before a parse error ends in `rule: Some(`: where a recipe wrote the switch
/// rule before the Copus rule became a choice (`rule: Some((...))`).
fn old_rule_form(before: &str) -> bool {
    let squeezed: String = before.chars().filter(|c| !c.is_whitespace()).collect();
    squeezed.ends_with("rule:Some(")
}

/// The recipe's `optim` section: any subset of [`OptimConfig`]'s fields, the others at their
/// defaults; an unknown field is an error that lists the allowed ones.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct OptimSection {
    lr: Option<f64>,
    b0: Option<usize>,
    lr_rule: Option<copus_core::goodput::LrRule>,
    warmup_steps: Option<u64>,
    total_steps: Option<u64>,
    schedule_clock: Option<copus_burn::optim::ScheduleClock>,
    min_lr_ratio: Option<f64>,
    beta1: Option<f64>,
    beta2: Option<f64>,
    eps: Option<f64>,
    weight_decay: Option<f64>,
    decay_norms_and_embeddings: Option<bool>,
    /// Absent: the default; `None`: no clipping.
    #[serde(default, deserialize_with = "present")]
    clip_norm: Option<Option<f64>>,
    gns_theta: Option<f64>,
    /// Absent: the EMA alone; a number: the adaptive memory's longest, in steps.
    gns_memory: Option<f64>,
}

/// A field that is present, whatever its value (`None` included).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<f64>>, D::Error> {
    Option::<f64>::deserialize(d).map(Some)
}

fn optim_section<'de, D: serde::Deserializer<'de>>(d: D) -> Result<OptimConfig, D::Error> {
    let s = OptimSection::deserialize(d)?;
    let mut c = OptimConfig::new();
    macro_rules! given {
        ($($field:ident),*) => {
            $(if let Some(v) = s.$field {
                c.$field = v;
            })*
        };
    }
    given!(
        lr,
        b0,
        lr_rule,
        warmup_steps,
        total_steps,
        schedule_clock,
        min_lr_ratio,
        beta1,
        beta2,
        eps,
        weight_decay,
        decay_norms_and_embeddings,
        clip_norm,
        gns_theta
    );
    if s.gns_memory.is_some() {
        c.gns_memory = s.gns_memory;
    }
    Ok(c)
}

fn default_output_dir() -> String {
    "runs".into()
}

/// The largest batch size a recipe may name (the engine's limit).
const MAX_BATCH: usize = copus_burn::engine::config::MAX_BATCH;
/// The most steps a recipe may ask for: far beyond any run, small enough that sample and token
/// counters cannot overflow.
const MAX_STEPS: u64 = 1 << 32;

fn field(field: &'static str, value: impl ToString, allowed: impl Into<String>) -> RecipeError {
    RecipeError::Field { field, value: value.to_string(), allowed: allowed.into() }
}

impl Recipe {
    /// Reads and validates a recipe file.
    pub fn load(path: &Path) -> Result<Self, RecipeError> {
        let text = std::fs::read_to_string(path).map_err(|err| RecipeError::Read { path: path.display().to_string(), err })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates recipe text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, RecipeError> {
        let mut r: Recipe = ron::Options::default()
            .with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME)
            .from_str(text)
            .map_err(|e| RecipeError::Parse { path: origin.into(), message: parse_message(text, &e) })?;
        if let Some(par) = r.parallel.as_mut() {
            par.backend = r.backend;
        }
        r.validate()?;
        Ok(r)
    }

    /// The model shape: the preset with the recipe's sequence length.
    pub fn model_spec(&self) -> Result<ModelSpec, RecipeError> {
        let mut spec = ModelSpec::preset(&self.model.preset)
            .map_err(|_| field("model.preset", format!("{:?}", self.model.preset), format!("one of {}", ModelSpec::PRESETS.join(", "))))?;
        if let Some(s) = self.model.seq_len {
            spec.seq_len = s;
        }
        Ok(spec)
    }

    /// How the engine runs for this recipe: its backend and `ranks_per_device`, and the
    /// `parallel` section's schedule, exact reductions, checkpointing, precision and ZeRO-1
    /// (their defaults without one). Every run of the recipe on the engine takes its options
    /// from here, through [`EngineOptions::engine_config`](copus_burn::EngineOptions::engine_config);
    /// a fixed run (`adaptive: Some(false)`) with a `parallel` section takes its precision and
    /// checkpointing too (the rest has no effect on one rank).
    pub fn engine_options(&self) -> copus_burn::EngineOptions {
        let mut o = copus_burn::EngineOptions {
            device: self.backend.rank_device(),
            ranks_per_device: self.ranks_per_device,
            ..copus_burn::EngineOptions::default()
        };
        if let Some(p) = &self.parallel {
            o.schedule = p.schedule;
            o.exact_reductions = p.exact_reductions;
            o.checkpointing = p.checkpointing;
            o.precision = p.precision;
            o.zero1 = p.zero1;
        }
        o
    }

    /// Whether `recipes run` trains under Copus.
    pub fn is_adaptive(&self) -> bool {
        self.adaptive.unwrap_or(self.parallel.is_some())
    }

    /// Checks every value.
    pub fn validate(&self) -> Result<(), RecipeError> {
        self.validate_backend()?;
        self.validate_model()?;
        self.validate_train()?;
        self.data.validate()?;
        if let Some(p) = &self.parallel {
            self.validate_parallel(p)?;
        }
        self.optim.validate().map_err(|e| RecipeError::Section { section: "optim", message: e.to_string() })
    }

    /// `adaptive` against the `parallel` section, and the backend: built, able to run the
    /// precision, and `ranks_per_device` where it applies.
    fn validate_backend(&self) -> Result<(), RecipeError> {
        if self.adaptive == Some(true) && self.parallel.is_none() {
            return Err(field("adaptive", true, "false, unless the recipe has a `parallel` section (the candidate space Copus searches)"));
        }
        if self.backend == Backend::Wgpu && self.parallel.as_ref().is_some_and(|p| p.precision == Precision::Bf16Mixed) {
            return Err(field(
                "parallel.precision",
                "Bf16Mixed",
                "F32 on the Wgpu backend (its shaders have no bf16 arithmetic); Bf16Mixed runs on Flex, Cuda, Tch and TchCpu",
            ));
        }
        if !self.backend.rank_device().built() {
            let feature = self.backend.feature();
            return Err(field(
                "backend",
                format!("{:?}", self.backend),
                format!("Flex, or a backend this build has: build with `cargo run --release -p recipes --features {feature} -- ...`"),
            ));
        }
        match (self.ranks_per_device, self.backend) {
            (Some(0), _) => Err(field("ranks_per_device", 0, "at least 1, or absent (the ranks spread over the visible GPUs)")),
            (Some(k), Backend::Flex | Backend::Wgpu | Backend::TchCpu) => {
                Err(field("ranks_per_device", k, "absent: it applies to the `Cuda`, `Rocm` and `Tch` backends only"))
            }
            _ => Ok(()),
        }
    }

    /// The run's name, the model's shape and sequence length, and the tokenizer's vocabulary.
    fn validate_model(&self) -> Result<(), RecipeError> {
        if self.name.is_empty() || self.name.contains(['/', '\\']) || self.name.starts_with('.') {
            return Err(field("name", format!("{:?}", self.name), "a non-empty folder name without slashes"));
        }
        self.model_spec()?;
        if let Some(n) = self.model.seq_len
            && !(1..=copus_core::model::MAX_SIZE).contains(&n)
        {
            return Err(field("model.seq_len", n, format!("1..={} (larger sizes could overflow)", copus_core::model::MAX_SIZE)));
        }
        if let TokenizerRecipe::Bpe { vocab_size } = self.data.tokenizer
            && !(260..=1 << 20).contains(&vocab_size)
        {
            return Err(field("data.tokenizer.vocab_size", vocab_size, "260..=1048576 (256 bytes plus merges)"));
        }
        Ok(())
    }

    /// The `train` section: batches, steps, time budget, held-out sequences.
    fn validate_train(&self) -> Result<(), RecipeError> {
        let t = &self.train;
        if t.micro_batch == 0 {
            return Err(field("train.micro_batch", 0, "at least 1"));
        }
        if t.global_batch == 0 || !t.global_batch.is_multiple_of(t.micro_batch) {
            return Err(field(
                "train.global_batch",
                t.global_batch,
                format!("a positive multiple of train.micro_batch ({})", t.micro_batch),
            ));
        }
        if t.global_batch > MAX_BATCH {
            return Err(field("train.global_batch", t.global_batch, format!("at most {MAX_BATCH}")));
        }
        if t.max_steps == 0 || t.max_steps > MAX_STEPS {
            return Err(field("train.max_steps", t.max_steps, format!("1..={MAX_STEPS}")));
        }
        if let Some(b) = t.time_budget_secs
            && !(b.is_finite() && b > 0.0)
        {
            return Err(field("train.time_budget_secs", b, "a positive number of seconds (or None)"));
        }
        if t.eval_sequences == 0 {
            return Err(field("train.eval_sequences", 0, "at least 1"));
        }
        Ok(())
    }

    /// The `parallel` section: ranks, candidate sizes, profiling, objective and rule, and its
    /// candidate space, initial layout and scripted switches against the model.
    fn validate_parallel(&self, p: &ParallelRecipe) -> Result<(), RecipeError> {
        if !(1..=64).contains(&p.world_size) {
            return Err(field("parallel.world_size", p.world_size, "1..=64 in-process ranks"));
        }
        for (name, list) in [("parallel.global_batches", &p.global_batches), ("parallel.micro_batches", &p.micro_batches)] {
            if let Some(b) = list.iter().find(|&&b| b == 0 || b > MAX_BATCH) {
                return Err(field(name, b, format!("sizes in 1..={MAX_BATCH}")));
            }
        }
        if p.profile_steps == 0 {
            return Err(field("parallel.profile_steps", 0, "at least 1"));
        }
        if let Some(ObjectiveKind::LrAware { x0, .. }) = p.objective
            && !(x0 > 0.0 && x0 <= 1.0)
        {
            return Err(field("parallel.objective.x0", x0, "in (0, 1]"));
        }
        if let Some(r) = &p.rule {
            r.validate().map_err(|e| RecipeError::Section { section: "parallel.rule", message: e.to_string() })?;
        }
        p.space()?;
        p.initial_dims(&self.model_spec()?)?;
        p.scripted(&self.model_spec()?)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"(
        name: "t",
        model: (preset: "tiny-1m", seq_len: Some(64)),
        train: (global_batch: 8, micro_batch: 2, max_steps: 3),
    )"#;

    /// The shipped GPU recipe is `parallel-tiny` on `Tch` and nothing else; a build without
    /// LibTorch refuses it naming the feature.
    #[test]
    fn the_gpu_recipe_is_parallel_tiny_on_libtorch() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let cpu = Recipe::load(&dir.join("parallel-tiny.ron")).unwrap();
        let text = std::fs::read_to_string(dir.join("parallel-tiny-gpu.ron")).unwrap();
        let gpu: Recipe =
            ron::Options::default().with_default_extension(ron::extensions::Extensions::IMPLICIT_SOME).from_str(&text).unwrap();
        assert_eq!((gpu.name.as_str(), gpu.backend), ("parallel-tiny-gpu", Backend::Tch));
        let mut as_cpu = Recipe { name: cpu.name.clone(), backend: Backend::Flex, ..gpu };
        as_cpu.parallel.as_mut().unwrap().backend = Backend::Flex;
        assert_eq!(as_cpu, cpu);
        match Recipe::parse(&text, "gpu") {
            Ok(r) => assert_eq!(r.parallel.unwrap().backend, Backend::Tch),
            Err(e) => assert!(!Backend::Tch.rank_device().built() && e.to_string().contains("--features tch"), "{e}"),
        }
    }

    /// A scripted switch outside the candidate space, or out of order, names `parallel.script`
    /// and the entry; a backend this build lacks names `backend` and the feature to build with.
    #[test]
    fn scripts_and_backends_are_checked() {
        let with = |script: &str| {
            GOOD.replace(
                "max_steps: 3),",
                &format!("max_steps: 3), parallel: (world_size: 2, global_batches: [8, 16], micro_batches: [2, 4], script: [{script}]),"),
            )
        };
        let ok = with("(after_step: 2, layout: (dp: 1, tp: 2, pp: 1), global_batch: 16, micro_batch: 4)");
        let r = Recipe::parse(&ok, "ok").unwrap();
        let plan = r.parallel.as_ref().unwrap().scripted(&r.model_spec().unwrap()).unwrap();
        assert_eq!(plan.len(), 1);
        assert_eq!((plan[0].0, plan[0].1.dims.tp, plan[0].1.global_batch, plan[0].1.micro_batch), (2, 2, 16, 4));
        let bad = with("(after_step: 2, layout: (dp: 1, tp: 2, pp: 1), global_batch: 32, micro_batch: 4)");
        let e = Recipe::parse(&bad, "bad").unwrap_err().to_string();
        assert!(e.contains("parallel.script") && e.contains("[0]") && e.contains("global_batch in parallel.global_batches"), "{e}");
        let order = with(
            "(after_step: 5, layout: (dp: 2, tp: 1, pp: 1), global_batch: 8, micro_batch: 2), \
             (after_step: 5, layout: (dp: 1, tp: 2, pp: 1), global_batch: 8, micro_batch: 2)",
        );
        let e = Recipe::parse(&order, "order").unwrap_err().to_string();
        assert!(e.contains("parallel.script") && e.contains("[1]") && e.contains("increasing"), "{e}");
        let world = with("(after_step: 2, layout: (dp: 4, tp: 1, pp: 1), global_batch: 8, micro_batch: 2)");
        let e = Recipe::parse(&world, "world").unwrap_err().to_string();
        assert!(e.contains("parallel.script"), "{e}");
        // This build has Flex only (the default features).
        let e = Recipe::parse(&GOOD.replace("name: \"t\",", "name: \"t\", backend: Cuda,"), "cuda").unwrap_err().to_string();
        assert!(e.contains("backend") && e.contains("--features cuda"), "{e}");
        // Both LibTorch backends come with feature `tch`.
        let e = Recipe::parse(&GOOD.replace("name: \"t\",", "name: \"t\", backend: TchCpu,"), "tch").unwrap_err().to_string();
        assert!(e.contains("backend") && e.contains("TchCpu") && e.contains("--features tch "), "{e}");
        assert!(Recipe::parse(&GOOD.replace("name: \"t\",", "name: \"t\", backend: Flex,"), "flex").is_ok());
        // Ranks per GPU: at least 1, and only where there are GPUs.
        let e = Recipe::parse(&GOOD.replace("name: \"t\",", "name: \"t\", ranks_per_device: Some(2),"), "rpd").unwrap_err().to_string();
        assert!(e.contains("ranks_per_device") && e.contains("`Cuda`, `Rocm` and `Tch`"), "{e}");
        let e = Recipe::parse(&GOOD.replace("name: \"t\",", "name: \"t\", ranks_per_device: Some(0),"), "rpd").unwrap_err().to_string();
        assert!(e.contains("ranks_per_device") && e.contains("at least 1"), "{e}");
        // bf16 mixed precision where the backend has bf16 arithmetic only.
        let bf16 = GOOD.replace(
            "max_steps: 3),",
            "max_steps: 3), parallel: (world_size: 1, global_batches: [8], micro_batches: [2], precision: Bf16Mixed),",
        );
        let par = Recipe::parse(&bf16, "bf16").unwrap().parallel.unwrap();
        assert_eq!(par.precision, Precision::Bf16Mixed);
        // Its memory model counts the larger activations of bf16 runs (4.85 bytes, not 4; the
        // fit to measured bf16 peaks) and the weights' bf16 copies.
        let (m, d) = (copus_core::model::ModelSpec::tiny_5m(), copus_core::layout::ParallelDims::serial());
        let want = |p: &ParallelRecipe| p.memory_model().estimate(&m, d, 8, 1, ScheduleKind::OneFOneB).activations;
        let f32_par = ParallelRecipe { precision: Precision::F32, ..par.clone() };
        assert_eq!((par.memory_model().activation_bytes, par.memory_model().weight_bytes), (4.85, 5.6));
        assert_eq!((f32_par.memory_model().activation_bytes, f32_par.memory_model().weight_bytes), (4.0, 4.0));
        let logits = 8.0 * m.seq_len as f64 * 3.0 * m.vocab_size as f64 * 4.0;
        assert!(((want(&par) - logits) / (want(&f32_par) - logits) - 4.85 / 4.0).abs() < 1e-12);
        // On a GPU backend the model measured on a GPU; parsing copies the recipe's backend
        // into the section (checked where this build has the backend).
        assert_eq!(par.backend, Backend::Flex);
        if Backend::Tch.rank_device().built() {
            let parsed = Recipe::parse(&bf16.replace("name: \"t\",", "name: \"t\", backend: Tch,"), "bf16").unwrap();
            assert_eq!(parsed.parallel.unwrap().backend, Backend::Tch);
        }
        let gpu = ParallelRecipe { backend: Backend::Tch, ..par.clone() };
        assert_eq!(gpu.memory_model(), MemoryModel { checkpointing: par.checkpointing, ..MemoryModel::engine_gpu(Precision::Bf16Mixed) });
        assert_eq!((gpu.memory_model().activation_bytes, gpu.memory_model().weight_bytes), (4.75, 7.8));
        let e = Recipe::parse(&bf16.replace("name: \"t\",", "name: \"t\", backend: Wgpu,"), "bf16").unwrap_err().to_string();
        assert!(e.contains("parallel.precision") && e.contains("Wgpu"), "{e}");
        let e = Recipe::parse(&bf16.replace("Bf16Mixed", "Fp8"), "bf16").unwrap_err().to_string();
        assert!(e.contains("F32") && e.contains("Bf16Mixed"), "{e}");
    }

    #[test]
    fn defaults_fill_in() {
        let r = Recipe::parse(GOOD, "good").unwrap();
        assert_eq!(r.output_dir, "runs");
        assert_eq!(r.data, DataRecipe::default());
        assert_eq!(r.optim, OptimConfig::default());
        assert_eq!(r.model_spec().unwrap().seq_len, 64);
    }

    #[test]
    fn the_optim_section_takes_any_subset_and_round_trips() {
        use copus_core::goodput::LrRule;
        let r = Recipe::parse(&GOOD.replace("train:", "optim: (lr: 2e-3, clip_norm: None, lr_rule: Linear), train:"), "r").unwrap();
        assert_eq!(r.optim, OptimConfig::new().with_lr(2e-3).with_clip_norm(None).with_lr_rule(LrRule::Linear));
        let r = Recipe::parse(&GOOD.replace("train:", "optim: (clip_norm: Some(0.5), warmup_steps: 3), train:"), "r").unwrap();
        assert_eq!(r.optim, OptimConfig::new().with_clip_norm(Some(0.5)).with_warmup_steps(3));
        // What a run writes as recipe.ron reads back the same.
        let again = Recipe::parse(&ron::ser::to_string_pretty(&r, ron::ser::PrettyConfig::default()).unwrap(), "again").unwrap();
        assert_eq!(again, r);
        let e = Recipe::parse(&GOOD.replace("train:", "optim: (lrr: 1.0), train:"), "r").unwrap_err().to_string();
        assert!(e.contains("lrr") && e.contains("warmup_steps"), "{e}");
        // The noise estimate's adaptive memory: a number of steps, checked against the EMA's.
        let r = Recipe::parse(&GOOD.replace("train:", "optim: (gns_memory: 500.0), train:"), "r").unwrap();
        assert_eq!(r.optim, OptimConfig::new().with_gns_memory(Some(500.0)));
        let again = Recipe::parse(&ron::ser::to_string_pretty(&r, ron::ser::PrettyConfig::default()).unwrap(), "again").unwrap();
        assert_eq!(again, r);
        let e = Recipe::parse(&GOOD.replace("train:", "optim: (gns_memory: 5.0), train:"), "r").unwrap_err().to_string();
        assert!(e.contains("`gns_memory`") && e.contains("1 / (1 - gns_theta)"), "{e}");
    }

    #[test]
    fn the_shipped_recipes_parse() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut n = 0;
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let comparison =
                p.file_name().is_some_and(|n| ["compare-", "suite-", "evidence-"].iter().any(|s| n.to_string_lossy().starts_with(s)));
            if p.extension().is_some_and(|x| x == "ron") && !comparison {
                match Recipe::load(&p) {
                    Ok(_) => n += 1,
                    // A GPU recipe in a build without its backend: refused, naming the feature.
                    Err(e) if e.to_string().contains("a backend this build has") => {}
                    Err(e) => panic!("{}: {e}", p.display()),
                }
            }
        }
        assert!(n >= 1);
    }

    #[test]
    fn errors_name_the_field_and_what_is_allowed() {
        let unknown = GOOD.replace("max_steps: 3", "max_steps: 3, max_stepz: 4");
        let e = Recipe::parse(&unknown, "r").unwrap_err().to_string();
        assert!(e.contains("max_stepz") && e.contains("max_steps") && !e.contains("the value of"), "{e}");
        // A value of the wrong type or out of range names its field.
        let e = Recipe::parse(&GOOD.replace("max_steps: 3", "max_steps: 3, max_recoveries: -1"), "r").unwrap_err().to_string();
        assert!(e.contains("`max_recoveries`") && e.contains("out of bounds"), "{e}");
        let e = Recipe::parse(&GOOD.replace("max_steps: 3", "max_steps: \"three\""), "r").unwrap_err().to_string();
        assert!(e.contains("`max_steps`") && e.contains("integer"), "{e}");
        // A multi-byte character next to a field name is no panic (recipes/tests/fuzz.rs found one).
        assert!(Recipe::parse(&GOOD.replace("preset:", "prese\u{FFFD}:"), "r").is_err());
        let e = Recipe::parse(&GOOD.replace("tiny-1m", "tiny-2m"), "r").unwrap_err().to_string();
        assert!(e.contains("model.preset") && e.contains("tiny-5m"), "{e}");
        let e = Recipe::parse(&GOOD.replace("global_batch: 8", "global_batch: 1099511627776"), "r").unwrap_err().to_string();
        assert!(e.contains("train.global_batch") && e.contains("at most 16777216"), "{e}");
        let e = Recipe::parse(&GOOD.replace("seq_len: Some(64)", "seq_len: Some(4294967296)"), "r").unwrap_err().to_string();
        assert!(e.contains("model.seq_len") && e.contains("1..=1048576"), "{e}");
        let e = Recipe::parse(&GOOD.replace("max_steps: 3", "max_steps: 18446744073709551615"), "r").unwrap_err().to_string();
        assert!(e.contains("train.max_steps"), "{e}");
        let e = Recipe::parse(&GOOD.replace("global_batch: 8", "global_batch: 7"), "r").unwrap_err().to_string();
        assert_eq!(e, "recipe field `train.global_batch` = 7: a positive multiple of train.micro_batch (2)");
        let bad_optim = GOOD.replace("train:", "optim: (lr: -1.0), train:");
        let e = Recipe::parse(&bad_optim, "r").unwrap_err().to_string();
        assert!(e.starts_with("recipe section `optim`: ") && e.contains("`lr`") && e.contains("> 0"), "{e}");
        let e = Recipe::parse(&GOOD.replace("(preset", "(prest"), "r").unwrap_err().to_string();
        assert!(e.contains("prest"), "{e}");
        let e = Recipe::parse(&GOOD.replace("name: \"t\"", "name: \"../x\""), "r").unwrap_err().to_string();
        assert!(e.contains("`name`"), "{e}");
        let par = |p: &str| GOOD.replace("train:", &format!("parallel: ({p}), train:"));
        let ok = "world_size: 8, layout: Some((dp: 2, tp: 2, pp: 2)), global_batches: [8, 16], micro_batches: [1, 2]";
        Recipe::parse(&par(ok), "r").unwrap();
        let e = Recipe::parse(&par(&ok.replace("tp: 2, pp: 2", "tp: 2, pp: 1")), "r").unwrap_err().to_string();
        assert!(e.contains("parallel.layout") && e.contains('8'), "{e}");
        let e = Recipe::parse(&par(&ok.replace("dp: 2, tp: 2, pp: 2", "dp: 1, tp: 8, pp: 1")), "r").unwrap_err().to_string();
        assert!(e.contains("parallel.layout") && e.contains("tp = 8"), "{e}");
        let e = Recipe::parse(&par(&ok.replace("micro_batches: [1, 2]", "micro_batches: []")), "r").unwrap_err().to_string();
        assert!(e.contains("micro_batches"), "{e}");
        let e = Recipe::parse(&par(&ok.replace("world_size: 8", "world_size: 0")), "r").unwrap_err().to_string();
        assert!(e.contains("parallel.world_size"), "{e}");
        for rule in [
            "Switch((batch_threshold: 0.02, layout_threshold: 0.05, horizon: 0.0, layout_cost: 1.0, cost_smoothing: 0.5))",
            "Learning(rule: (confidence: 1.0, threshold: 0.02, horizon: 0.0, layout_cost: 1.0, dwell_steps: 20, window: 8))",
        ] {
            let e = Recipe::parse(&par(&format!("{ok}, rule: Some({rule})")), "r").unwrap_err().to_string();
            assert_eq!(e, "recipe section `parallel.rule`: `horizon` must be > 0 seconds, got 0");
        }
        // The switch rule as recipes wrote it before the choice existed: the error says what to write.
        let e = Recipe::parse(&par(&format!("{ok}, rule: Some((batch_threshold: 0.02, horizon: 60.0))")), "r").unwrap_err().to_string();
        assert!(e.contains("rule") && e.contains("Learning") && e.contains("Switch"), "{e}");
        // An objective's `rule:` written wrongly is not taken for it.
        let e = Recipe::parse(&par(&format!("{ok}, objective: Some(LrTuned(rule: (Sqrt)))")), "r").unwrap_err().to_string();
        assert!(!e.contains("Switch"), "{e}");
    }

    /// The `data` section: the issue's syntax parses, every field defaults, and each mistake
    /// names its field and what is allowed.
    #[test]
    fn the_data_section_parses_defaults_and_names_its_mistakes() {
        let with = |data: &str| GOOD.replace("train:", &format!("data: ({data}), train:"));
        let r = Recipe::parse(
            &with(r#"source: Text(paths: ["a/", "b/*.txt"]), heldout: Fraction(0.01), tokenizer: Bpe(vocab_size: 512)"#),
            "r",
        )
        .unwrap();
        assert_eq!(r.data.source, Source::Text { paths: vec!["a/".into(), "b/*.txt".into()], split: TextSplit::PerFile });
        let r = Recipe::parse(&with(r#"source: Jsonl(paths: ["x.jsonl"])"#), "r").unwrap();
        assert_eq!(r.data.heldout_rule(), (Heldout::Fraction(0.01), "data.heldout"), "other sources hold out 1%");
        let r = Recipe::parse(&with(""), "r").unwrap();
        assert_eq!(r.data.heldout_rule().0, Heldout::Documents(vec!["macbeth".into(), "the-tempest".into()]));
        let r = Recipe::parse(&with(r#"source: Tokens(paths: ["t.bin"], dtype: Megatron), tokenizer: File("tok.json")"#), "r").unwrap();
        assert!(r.data.source.is_tokens());
        let cases = [
            (r#"heldout: Fraction(0.0)"#, "data.heldout", "0 < f < 1"),
            (r#"heldout: Documents([])"#, "data.heldout", "at least one document"),
            (r#"heldout: Files([])"#, "data.heldout", "at least one file"),
            (r#"heldout: Documents(["x"]), heldout_plays: ["y"]"#, "data.heldout_plays", "one of the two"),
            (r#"source: Sotu, heldout_plays: ["y"]"#, "data.heldout_plays", "only with `source: Shakespeare`"),
            (r#"source: Text(paths: [])"#, "data.source.paths", "files, folders or globs"),
            (r#"source: Jsonl(paths: ["a"], field: "")"#, "data.source.field", "the JSON field"),
            (r#"source: Parquet(paths: ["a"], column: "")"#, "data.source.column", "the column"),
            (r#"source: Tokens(paths: ["a"], dtype: U16)"#, "data.tokenizer", "token shards need the tokenizer"),
        ];
        for (data, field, allowed) in cases {
            let e = Recipe::parse(&with(data), "r").unwrap_err().to_string();
            assert!(e.contains(&format!("`{field}`")) && e.contains(allowed), "{data}: {e}");
        }
        let e = Recipe::parse(&with(r#"source: Tokens(paths: ["a"], dtype: U8)"#), "r").unwrap_err().to_string();
        assert!(e.contains("U8") && e.contains("U16") && e.contains("Megatron"), "{e}");
        let e = Recipe::parse(&with(r#"source: Csv(paths: ["a"])"#), "r").unwrap_err().to_string();
        assert!(e.contains("Csv") && e.contains("Parquet"), "{e}");
    }
}
