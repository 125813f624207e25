//! In-memory reconfiguration, with rollback, and checkpoints.
//!
//! A layout change stages the whole training state in host memory, independent of layout
//! ([`TrainingState`]: full parameters, AdamW moments and step counts, the previous gradient of
//! the single-micro-batch probe, the step and token counters and the noise-scale estimator),
//! stops the old ranks (dropping their process groups), starts the new ones from the staged
//! state and verifies element counts and checksums of every parameter and optimizer tensor
//! each rank loaded. Any failure after staging restarts the old configuration from the staged
//! state, so nothing is lost. A change of B_g or B_m alone only changes the data split, the
//! accumulation count and the learning rate.
//!
//! A checkpoint is the same staged state in one burnpack file (the format burn-store and
//! Burn's optimizer records use), loadable into any layout.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Instant;

use burn::tensor::TensorData;
use burn_pack::Scalar;
use copus_core::gns::GnsEstimator;
use copus_core::layout::{Coord, ParallelDims, stage_of_layer};
use copus_core::model::{ModelSpec, ParamSpec, Placement};
use serde::{Deserialize, Serialize};

use crate::engine::{Engine, EngineConfig, EngineError, RankResume, ReconfigPhase};
use crate::parallel::{FullParams, ParallelLm, ShardError, ShardPlan, ShardSource, holds, shard_values, unshard};

/// A 64-bit checksum of a tensor's values (bit patterns and length).
pub fn checksum(values: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ values.len() as u64;
    for v in values {
        h = (h ^ u64::from(v.to_bits())).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(5);
    }
    h
}

/// Everything needed to continue training, in host memory, independent of the layout.
#[derive(Clone, Debug)]
pub struct TrainingState {
    /// Full parameters by global name, row-major.
    pub params: BTreeMap<String, Vec<f32>>,
    /// Optimizer state tensors (AdamW's two moments) by parameter and field, full shape.
    pub optim: BTreeMap<String, BTreeMap<String, Vec<f32>>>,
    /// Optimizer state scalars (step counts) by parameter and field.
    pub scalars: BTreeMap<String, BTreeMap<String, Scalar>>,
    /// The previous step's gradient (kept for the single-micro-batch probe).
    pub previous: Option<BTreeMap<String, Vec<f32>>>,
    /// Optimizer steps taken.
    pub step: u64,
    /// Training tokens consumed.
    pub tokens_seen: u64,
    /// The noise-scale estimator.
    pub gns: GnsEstimator,
}

impl TrainingState {
    /// The state before the first step, from full parameters.
    pub fn fresh(spec: &ModelSpec, full: &FullParams, gns_theta: f64) -> Result<Self, EngineError> {
        let mut params = BTreeMap::new();
        for p in spec.param_specs() {
            let data = full.get(&p.name).ok_or_else(|| EngineError::Shard(ShardError::Missing(p.name.clone())))?;
            if data.shape().to_vec() != p.shape {
                return Err(EngineError::Shard(ShardError::Shape { name: p.name.clone(), got: data.shape().to_vec(), expected: p.shape }));
            }
            let values = data.iter::<f32>().collect();
            params.insert(p.name, values);
        }
        if let Some(extra) = full.keys().find(|k| !params.contains_key(*k)) {
            return Err(EngineError::Shard(ShardError::Layout(format!("parameter `{extra}` is not part of the model"))));
        }
        let gns = GnsEstimator::new(gns_theta).map_err(|e| EngineError::Train(crate::TrainError::Gns(e)))?;
        Ok(Self { params, optim: BTreeMap::new(), scalars: BTreeMap::new(), previous: None, step: 0, tokens_seen: 0, gns })
    }

    /// Bytes of tensor data held.
    pub fn bytes(&self) -> u64 {
        let n: usize = self.params.values().map(Vec::len).sum::<usize>()
            + self.optim.values().flat_map(|f| f.values()).map(Vec::len).sum::<usize>()
            + self.previous.iter().flat_map(|p| p.values()).map(Vec::len).sum::<usize>();
        4 * n as u64
    }

    /// What the rank with `plan` starts from, and the checksums it must report after loading.
    #[allow(clippy::type_complexity)]
    pub(crate) fn rank_init(&self, specs: &[ParamSpec], plan: &ShardPlan) -> Result<(ShardSource, RankResume, Vec<(String, u64)>), EngineError> {
        let num_layers = specs
            .iter()
            .filter_map(|s| if let Placement::Layer(i) = s.placement { Some(i + 1) } else { None })
            .max()
            .unwrap_or(0);
        let (tp, t) = (plan.dims.tp, plan.tp_rank);
        let mut shards = HashMap::new();
        let mut resume = RankResume { step: self.step, tokens_seen: self.tokens_seen, gns: Some(self.gns.clone()), ..RankResume::default() };
        let mut hashes = Vec::new();
        let mut previous = self.previous.as_ref().map(|_| HashMap::new());
        for spec in specs {
            if !holds(spec, plan, num_layers) {
                continue;
            }
            let full = self.params.get(&spec.name).ok_or_else(|| EngineError::Shard(ShardError::Missing(spec.name.clone())))?;
            let (shape, values) = shard_values(spec, full, tp, t)?;
            hashes.push((spec.name.clone(), checksum(&values)));
            shards.insert(spec.name.clone(), TensorData::new(values, shape.clone()));
            for (field, full) in self.optim.get(&spec.name).into_iter().flatten() {
                let (shape, values) = shard_values(spec, full, tp, t)?;
                hashes.push((format!("{}#{field}", spec.name), checksum(&values)));
                resume.optim.push((spec.name.clone(), field.clone(), shape, values));
            }
            for (field, v) in self.scalars.get(&spec.name).into_iter().flatten() {
                resume.scalars.push((spec.name.clone(), field.clone(), *v));
            }
            if let (Some(prev), Some(out)) = (&self.previous, previous.as_mut()) {
                if let Some(full) = prev.get(&spec.name) {
                    out.insert(spec.name.clone(), shard_values(spec, full, tp, t)?.1);
                }
            }
        }
        resume.previous = previous;
        Ok((ShardSource::new(shards), resume, hashes))
    }

    /// Writes the state, the engine configuration and `extra` (the caller's data position, RNG
    /// seed, ...) to one burnpack file, atomically.
    pub fn save(&self, path: &Path, specs: &[ParamSpec], cfg: &EngineConfig, extra: &BTreeMap<String, String>) -> Result<(), EngineError> {
        let err = |m: String| EngineError::Checkpoint { path: path.display().to_string(), message: m };
        let shape_of: HashMap<&str, &[usize]> = specs.iter().map(|s| (s.name.as_str(), s.shape.as_slice())).collect();
        let tensor = |key: String, name: &str, values: &[f32]| -> Result<burn_pack::Tensor, EngineError> {
            let shape = shape_of.get(name).ok_or_else(|| err(format!("`{name}` is not a parameter of the model")))?;
            let (bytes, shape, dtype) = TensorData::new(values.to_vec(), shape.to_vec()).into_parts();
            Ok(burn_pack::Tensor::new(key, dtype, shape, None, bytes))
        };
        let mut tensors = Vec::new();
        for (name, v) in &self.params {
            tensors.push(tensor(format!("param/{name}"), name, v)?);
        }
        for (name, fields) in &self.optim {
            for (field, v) in fields {
                tensors.push(tensor(format!("optim/{name}/{field}"), name, v)?);
            }
        }
        for (name, v) in self.previous.iter().flatten() {
            tensors.push(tensor(format!("previous/{name}"), name, v)?);
        }
        let meta = CheckpointMeta {
            format: 1,
            step: self.step,
            tokens_seen: self.tokens_seen,
            gns: self.gns.clone(),
            has_previous: self.previous.is_some(),
            scalars: self.scalars.iter().flat_map(|(n, f)| f.iter().map(move |(k, v)| (n.clone(), k.clone(), *v))).collect(),
            config: cfg.clone(),
            extra: extra.clone(),
        };
        let meta = serde_json::to_string(&meta).map_err(|e| err(e.to_string()))?;
        let tmp = path.with_extension("tmp");
        burn_pack::Writer::new(tensors)
            .with_metadata(META_KEY, &meta)
            .overwrite(true)
            .auto_extension(false)
            .write_to_file(&tmp)
            .map_err(|e| err(format!("{e:?}")))?;
        std::fs::rename(&tmp, path).map_err(|e| err(e.to_string()))
    }

    /// Reads a file written by [`TrainingState::save`].
    pub fn load(path: &Path) -> Result<(Self, EngineConfig, BTreeMap<String, String>), EngineError> {
        let err = |m: String| EngineError::Checkpoint { path: path.display().to_string(), message: m };
        let reader = burn_pack::Reader::from_file(path).map_err(|e| err(format!("not a readable checkpoint: {e:?}")))?;
        let meta = reader.metadata().get(META_KEY).ok_or_else(|| err("no copus metadata (not a copus checkpoint)".into()))?;
        let meta: CheckpointMeta = serde_json::from_str(meta).map_err(|e| err(format!("metadata: {e}")))?;
        if meta.format != 1 {
            return Err(err(format!("format {} is not supported (this build reads format 1)", meta.format)));
        }
        let mut state = Self {
            params: BTreeMap::new(),
            optim: BTreeMap::new(),
            scalars: BTreeMap::new(),
            previous: meta.has_previous.then(BTreeMap::new),
            step: meta.step,
            tokens_seen: meta.tokens_seen,
            gns: meta.gns,
        };
        for (n, f, v) in meta.scalars {
            state.scalars.entry(n).or_default().insert(f, v);
        }
        for t in reader.into_tensors().map_err(|e| err(format!("{e:?}")))? {
            let (key, dtype, shape, _, bytes) = t.into_parts().map_err(|e| err(format!("{e:?}")))?;
            let values: Vec<f32> = TensorData::from_bytes(bytes, shape, dtype).iter::<f32>().collect();
            if let Some(name) = key.strip_prefix("param/") {
                state.params.insert(name.to_string(), values);
            } else if let Some(rest) = key.strip_prefix("optim/") {
                let (name, field) = rest.rsplit_once('/').ok_or_else(|| err(format!("unexpected tensor {key}")))?;
                state.optim.entry(name.to_string()).or_default().insert(field.to_string(), values);
            } else if let Some(name) = key.strip_prefix("previous/") {
                state.previous.get_or_insert_with(BTreeMap::new).insert(name.to_string(), values);
            } else {
                return Err(err(format!("unexpected tensor {key}")));
            }
        }
        Ok((state, meta.config, meta.extra))
    }
}

const META_KEY: &str = "copus.checkpoint";

#[derive(Serialize, Deserialize)]
struct CheckpointMeta {
    format: u32,
    step: u64,
    tokens_seen: u64,
    gns: GnsEstimator,
    has_previous: bool,
    scalars: Vec<(String, String, Scalar)>,
    config: EngineConfig,
    extra: BTreeMap<String, String>,
}

/// What a reconfiguration did and how long it took.
#[derive(Clone, Debug, PartialEq)]
pub struct ReconfigReport {
    /// Configuration before, `dp2,tp2,pp2 B_g=16 B_m=2`.
    pub from: String,
    /// Configuration after.
    pub to: String,
    /// Whether the layout changed (otherwise only B_g / B_m).
    pub layout_changed: bool,
    /// Seconds to stage the state in host memory.
    pub stage_secs: f64,
    /// Seconds to stop the old ranks, start the new ones, load and verify.
    pub rebuild_secs: f64,
    /// Seconds in all.
    pub total_secs: f64,
    /// Bytes staged.
    pub bytes: u64,
}

fn describe(cfg: &EngineConfig) -> String {
    format!("{} B_g={} B_m={}", cfg.dims, cfg.global_batch, cfg.micro_batch)
}

impl<L: ParallelLm> Engine<L> {
    /// Stages the whole training state in host memory (the ranks keep running).
    pub fn stage_state(&mut self) -> Result<TrainingState, EngineError> {
        let exports = self.export()?;
        let dims = self.cfg.dims;
        let grid = self.grid();
        let num_layers = self.model.spec().num_layers;
        let first = exports.first().ok_or_else(|| EngineError::Dead("no ranks".into()))?;
        let mut state = TrainingState {
            params: BTreeMap::new(),
            optim: BTreeMap::new(),
            scalars: BTreeMap::new(),
            previous: first.previous.as_ref().map(|_| BTreeMap::new()),
            step: first.step,
            tokens_seen: first.tokens_seen,
            gns: first.gns.clone(),
        };
        // Index each exporting rank's tensors by name.
        type Index<'a> = HashMap<&'a str, &'a Vec<f32>>;
        let params: Vec<Index> = exports.iter().map(|e| e.params.iter().map(|(n, v)| (n.as_str(), v)).collect()).collect();
        let prev: Vec<Index> =
            exports.iter().map(|e| e.previous.iter().flatten().map(|(n, v)| (n.as_str(), v)).collect()).collect();
        let mut optim: Vec<HashMap<&str, Vec<(&str, &Vec<f32>)>>> = vec![HashMap::new(); exports.len()];
        for (r, e) in exports.iter().enumerate() {
            for (n, f, v) in &e.optim {
                optim[r].entry(n.as_str()).or_default().push((f.as_str(), v));
            }
        }
        for spec in &self.specs {
            let stage = match spec.placement {
                Placement::Layer(i) => stage_of_layer(i, num_layers, dims.pp),
                Placement::Last => dims.pp - 1,
                Placement::First | Placement::FirstAndLast => 0,
            };
            let holders: Vec<usize> = (0..dims.tp).map(|t| grid.rank(Coord { dp: 0, tp: t, pp: stage })).collect();
            let gather = |index: &[Index], what: &str| -> Result<Option<Vec<f32>>, EngineError> {
                let shards: Option<Vec<Vec<f32>>> = holders.iter().map(|&r| index[r].get(spec.name.as_str()).map(|v| (*v).clone())).collect();
                match shards {
                    Some(s) => Ok(Some(unshard(spec, &s, dims.tp)?)),
                    None if what == "parameter" => Err(EngineError::Shard(ShardError::Missing(format!("{} on stage {stage}", spec.name)))),
                    None => Ok(None),
                }
            };
            let full = gather(&params, "parameter")?.expect("parameters are always exported");
            state.params.insert(spec.name.clone(), full);
            if let (Some(p), Some(full)) = (state.previous.as_mut(), gather(&prev, "previous")?) {
                p.insert(spec.name.clone(), full);
            }
            if let Some(fields) = optim[holders[0]].get(spec.name.as_str()) {
                for (field, _) in fields {
                    let mut shards = Vec::with_capacity(holders.len());
                    for &r in &holders {
                        let v = optim[r]
                            .get(spec.name.as_str())
                            .and_then(|fs| fs.iter().find(|(f, _)| f == field))
                            .ok_or_else(|| EngineError::Shard(ShardError::Missing(format!("{}#{field} on rank {r}", spec.name))))?;
                        shards.push(v.1.clone());
                    }
                    state.optim.entry(spec.name.clone()).or_default().insert(field.to_string(), unshard(spec, &shards, dims.tp)?);
                }
            }
            for (n, f, v) in &exports[holders[0]].scalars {
                if n == &spec.name {
                    state.scalars.entry(n.clone()).or_default().insert(f.clone(), *v);
                }
            }
        }
        Ok(state)
    }

    /// Switches to layout `dims` with `global_batch` and `micro_batch` between steps, keeping
    /// weights, optimizer state, counters and the estimator. Invalid targets are refused with
    /// the engine untouched; a failure after staging rolls back to the old configuration.
    pub fn reconfigure(&mut self, dims: ParallelDims, global_batch: usize, micro_batch: usize) -> Result<ReconfigReport, EngineError> {
        let start = Instant::now();
        let old = self.cfg.clone();
        let target = EngineConfig { dims, global_batch, micro_batch, ..old.clone() };
        target.validate()?;
        dims.check_model(&self.model.spec()).map_err(|e| EngineError::Layout { dims: dims.to_string(), reason: e.to_string() })?;
        if dims.world_size() != old.dims.world_size() {
            return Err(EngineError::Layout {
                dims: dims.to_string(),
                reason: format!("has {} ranks; this engine runs {}", dims.world_size(), old.dims.world_size()),
            });
        }
        if dims == old.dims {
            self.set_batch(global_batch, micro_batch)?;
            let secs = start.elapsed().as_secs_f64();
            return Ok(ReconfigReport {
                from: describe(&old),
                to: describe(&target),
                layout_changed: false,
                stage_secs: 0.0,
                rebuild_secs: secs,
                total_secs: secs,
                bytes: 0,
            });
        }
        let state = self.stage_state()?;
        let stage_secs = start.elapsed().as_secs_f64();
        let fault = self.fault.take();
        self.stop_cluster();
        let attempt = if fault == Some(ReconfigPhase::AfterStaging) {
            Err((ReconfigPhase::AfterStaging, "injected failure after staging".to_string()))
        } else {
            self.launch(&state, &target, fault).map_err(|e| {
                let phase = fault.unwrap_or(match e {
                    EngineError::Verify(_) => ReconfigPhase::Verify,
                    _ => ReconfigPhase::Load,
                });
                (phase, e.to_string())
            })
        };
        match attempt {
            Ok(cluster) => {
                self.set_cluster(cluster);
                self.cfg = target.clone();
                let total = start.elapsed().as_secs_f64();
                Ok(ReconfigReport {
                    from: describe(&old),
                    to: describe(&target),
                    layout_changed: true,
                    stage_secs,
                    rebuild_secs: total - stage_secs,
                    total_secs: total,
                    bytes: state.bytes(),
                })
            }
            Err((phase, message)) => match self.launch(&state, &old, None) {
                Ok(cluster) => {
                    self.set_cluster(cluster);
                    self.cfg = old.clone();
                    Err(EngineError::RolledBack { phase, message, target: describe(&target), restored: describe(&old) })
                }
                Err(e) => {
                    let msg = format!("reconfiguration failed at {phase:?} ({message}) and the rollback failed too ({e})");
                    self.dead = Some(msg.clone());
                    Err(EngineError::Dead(msg))
                }
            },
        }
    }

    /// Saves the whole training state and configuration to `path` (one file), with the caller's
    /// `extra` entries (data position, seed, ...).
    pub fn save_checkpoint(&mut self, path: &Path, extra: &BTreeMap<String, String>) -> Result<u64, EngineError> {
        let state = self.stage_state()?;
        state.save(path, &self.specs, &self.cfg, extra)?;
        Ok(state.bytes())
    }

    /// Starts an engine from a checkpoint, in the saved configuration or in `cfg` (any layout of
    /// any world size the model fits). Returns the caller's `extra` entries too.
    pub fn resume(model: std::sync::Arc<L>, path: &Path, cfg: Option<EngineConfig>) -> Result<(Self, BTreeMap<String, String>), EngineError> {
        let (state, saved, extra) = TrainingState::load(path)?;
        let engine = Self::from_state(model, &state, cfg.unwrap_or(saved))?;
        Ok((engine, extra))
    }
}
