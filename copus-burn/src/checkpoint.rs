//! Checkpoints: the whole training state and the engine configuration in one burnpack file (the
//! format burn-store and Burn's optimizer records use), loadable into any layout.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use burn_pack::Scalar;
use copus_core::gns::GnsEstimator;
use copus_core::model::ParamSpec;
use serde::{Deserialize, Serialize};

use crate::engine::{Engine, EngineConfig, EngineError};
use crate::parallel::ParallelLm;
use crate::state::{TrainingState, checksum};
use crate::wire;

impl TrainingState {
    /// Writes the state, the engine configuration and `extra` (the caller's data position, RNG
    /// seed, ...) to one burnpack file, atomically: a uniquely named temporary file is written
    /// and synced, renamed over `path`, and the folder synced, so a crash at any moment leaves
    /// either the previous file or the new one, whole.
    pub fn save(&self, path: &Path, specs: &[ParamSpec], cfg: &EngineConfig, extra: &BTreeMap<String, String>) -> Result<(), EngineError> {
        let err = |m: String| EngineError::Checkpoint { path: path.display().to_string(), message: m };
        let bytes = self.to_bytes(specs, cfg, extra).map_err(|e| err(checkpoint_message(e)))?;
        write_atomically(path, &bytes).map_err(|e| err(e.to_string()))
    }

    /// Reads a file written by [`TrainingState::save`].
    pub fn load(path: &Path) -> Result<(Self, EngineConfig, BTreeMap<String, String>), EngineError> {
        let err = |m: String| EngineError::Checkpoint { path: path.display().to_string(), message: m };
        let bytes = std::fs::read(path).map_err(|e| err(format!("cannot be read: {e}")))?;
        Self::from_bytes(bytes).map_err(|e| match e {
            EngineError::Damaged { message, .. } => EngineError::Damaged { path: path.display().to_string(), message },
            other => err(checkpoint_message(other)),
        })
    }

    /// The checkpoint file's bytes, in memory (what a multi-process run sends its processes).
    pub fn to_bytes(&self, specs: &[ParamSpec], cfg: &EngineConfig, extra: &BTreeMap<String, String>) -> Result<Vec<u8>, EngineError> {
        let err = |m: String| EngineError::Checkpoint { path: "(in memory)".into(), message: m };
        self.check(specs)?;
        let shape_of: HashMap<&str, &[usize]> = specs.iter().map(|s| (s.name.as_str(), s.shape.as_slice())).collect();
        let mut tensors = Vec::new();
        let mut add = |key: String, name: &str, values: &[f32]| -> Result<(), EngineError> {
            let shape = shape_of.get(name).ok_or_else(|| err(format!("`{name}` is not a parameter of the model")))?;
            tensors.push((key, shape.to_vec(), values.to_vec()));
            Ok(())
        };
        for (name, v) in &self.params {
            add(format!("param/{name}"), name, v)?;
        }
        for (name, fields) in &self.optim {
            for (field, v) in fields {
                add(format!("optim/{name}/{field}"), name, v)?;
            }
        }
        for (name, v) in self.previous.iter().flatten() {
            add(format!("previous/{name}"), name, v)?;
        }
        let manifest = tensors.iter().map(|(k, _, v): &(String, Vec<usize>, Vec<f32>)| (k.clone(), (v.len(), checksum(v)))).collect();
        let meta = CheckpointMeta {
            format: FORMAT,
            manifest,
            step: self.step,
            tokens_seen: self.tokens_seen,
            gns: self.gns.clone(),
            has_previous: self.previous.is_some(),
            scalars: self.scalars.iter().flat_map(|(n, f)| f.iter().map(move |(k, v)| (n.clone(), k.clone(), *v))).collect(),
            config: cfg.clone(),
            extra: extra.clone(),
        };
        let meta = serde_json::to_string(&meta).map_err(|e| err(e.to_string()))?;
        wire::pack(META_KEY, &meta, tensors).map_err(err)
    }

    /// Reads what [`TrainingState::to_bytes`] wrote.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<(Self, EngineConfig, BTreeMap<String, String>), EngineError> {
        let err = |m: String| EngineError::Checkpoint { path: "(in memory)".into(), message: m };
        let damaged = |m: String| EngineError::Damaged { path: "(in memory)".into(), message: m };
        let (meta, tensors, has_header_hash) = wire::unpack_hashed(META_KEY, bytes).map_err(|e| {
            if e.starts_with("no `") {
                // A file of the run's checkpoint folder whose header key is gone is damaged too.
                damaged("no copus metadata (not a copus checkpoint, or its header is damaged)".into())
            } else {
                damaged(format!("not a readable checkpoint: {e}"))
            }
        })?;
        // Checkpoints written before rank devices existed have no `devices` (Flex everywhere),
        // before wait timeouts none (the default), before content hashes no manifest.
        let mut meta: serde_json::Value = serde_json::from_str(&meta).map_err(|e| damaged(format!("metadata: {e}")))?;
        // A newer build's format is not damage: say so before its metadata is read as this
        // build's.
        if let Some(f) = meta.get("format").and_then(serde_json::Value::as_u64).filter(|&f| f > u64::from(FORMAT)) {
            return Err(err(format!("format {f} is not supported (this build reads formats 1 to {FORMAT})")));
        }
        if let Some(config) = meta.get_mut("config") {
            fill_config_defaults(config);
        }
        let meta: CheckpointMeta = serde_json::from_value(meta).map_err(|e| damaged(format!("metadata: {e}")))?;
        match meta.format {
            FORMAT => {}
            f @ (1 | 2) if ALLOW_UNVERIFIED.load(std::sync::atomic::Ordering::Relaxed) => {
                tracing::warn!("a format-{f} checkpoint has no content hashes of the current kind; its tensors are loaded unverified")
            }
            f @ (1 | 2) => {
                return Err(err(format!(
                    "a format-{f} checkpoint cannot be verified (no content hashes of the current kind); it is loaded only when asked for explicitly (`recipes run --resume DIR --allow-unverified`, or `copus_burn::checkpoint::allow_unverified(true)`)"
                )));
            }
            f => return Err(err(format!("format {f} is not supported (this build reads formats 1 to {FORMAT})"))),
        }
        if meta.format == FORMAT {
            if !has_header_hash {
                return Err(damaged("the header's hash is missing (a damaged file)".into()));
            }
            verify_manifest(&meta.manifest, &tensors).map_err(damaged)?;
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
        for (key, _, values) in tensors {
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

/// The message of an in-memory error, for a file's error.
fn checkpoint_message(e: EngineError) -> String {
    match e {
        EngineError::Checkpoint { message, .. } | EngineError::Damaged { message, .. } => message,
        other => other.to_string(),
    }
}

/// Whether checkpoints of formats 1 and 2, which hold no content hashes of the current kind, load
/// (unverified). Off unless the user asks.
static ALLOW_UNVERIFIED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lets checkpoints of formats 1 and 2 load without verification from now on in this process
/// (`true`), or refuses them again (`false`, the default). Their tensors cannot be checked
/// against content hashes, so damage in them goes unnoticed.
pub fn allow_unverified(allow: bool) {
    ALLOW_UNVERIFIED.store(allow, std::sync::atomic::Ordering::Relaxed);
}

const META_KEY: &str = "copus.checkpoint";
/// The format this build writes: 2 added the manifest of content hashes, 3 made them XXH3.
const FORMAT: u32 = 3;

/// Checks the file's tensors against the manifest: nothing missing, nothing extra, every
/// element count and content hash as stored.
fn verify_manifest(manifest: &BTreeMap<String, (usize, u64)>, tensors: &[crate::wire::Named]) -> Result<(), String> {
    let mut seen = std::collections::BTreeSet::new();
    for (key, _, values) in tensors {
        let Some(&(len, hash)) = manifest.get(key) else {
            return Err(format!("tensor `{key}` is not in the checkpoint's manifest (an extra tensor)"));
        };
        if values.len() != len {
            return Err(format!("tensor `{key}` has {} elements, the manifest says {len}", values.len()));
        }
        let computed = checksum(values);
        if computed != hash {
            return Err(format!("tensor `{key}` is corrupt: its content hash is {computed:016x}, the manifest says {hash:016x}"));
        }
        seen.insert(key.as_str());
    }
    if let Some(missing) = manifest.keys().find(|k| !seen.contains(k.as_str())) {
        return Err(format!("tensor `{missing}` is missing"));
    }
    Ok(())
}

/// Removes temporary files of earlier saves to `path` by processes that no longer run (killed
/// mid-write). Only where running processes can be listed (`/proc`).
fn remove_stale_temporaries(path: &Path, name: &str) {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    remove_dead_temporaries(dir, Some(name));
}

/// Removes the temporary files `.{NAME}.{PID}.{K}.tmp` in `dir` (of one name, or of any) whose
/// writing process no longer runs: the one rule for left-over temporaries. A live process's
/// save in progress is never touched. Only where running processes can be listed (`/proc`).
pub(crate) fn remove_dead_temporaries(dir: &Path, name: Option<&str>) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = file.strip_prefix('.').and_then(|r| r.strip_suffix(".tmp")) else { continue };
        // NAME.PID.K, where NAME may hold dots itself.
        let mut parts = rest.rsplitn(3, '.');
        let (Some(_k), Some(pid), Some(of)) = (parts.next(), parts.next(), parts.next()) else { continue };
        if name.is_some_and(|n| n != of) {
            continue;
        }
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Writes `bytes` to `path` through a temporary file of a name no other save uses, synced
/// before the rename; then syncs the folder so the new name is durable too.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "checkpoint".into());
    let tmp = path.with_file_name(format!(".{name}.{}.{}.tmp", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed)));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return result;
    }
    remove_stale_temporaries(path, &name);
    sync_parent(path)
}

/// Syncs the folder holding `path`, so a new name in it (a rename) survives a power loss. Some
/// file systems (network, FUSE) cannot sync a folder: there it warns and goes on, the file
/// itself being synced by its writer.
pub(crate) fn sync_parent(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        match std::fs::File::open(dir).and_then(|d| d.sync_all()) {
            Ok(()) => {}
            Err(e) if matches!(e.raw_os_error(), Some(22) | Some(95)) => {
                tracing::warn!("{}: the folder cannot be synced here ({e}); the file itself is", dir.display());
            }
            Err(e) => return Err(e),
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

#[derive(Serialize, Deserialize)]
struct CheckpointMeta {
    format: u32,
    /// Every tensor's element count and content hash ([`checksum`]), by key.
    #[serde(default)]
    manifest: BTreeMap<String, (usize, u64)>,
    step: u64,
    tokens_seen: u64,
    gns: GnsEstimator,
    has_previous: bool,
    scalars: Vec<(String, String, Scalar)>,
    config: EngineConfig,
    extra: BTreeMap<String, String>,
}

impl<L: ParallelLm> Engine<L> {
    /// Saves the whole training state and configuration to `path` (one file), with the caller's
    /// `extra` entries (data position, seed, ...).
    pub fn save_checkpoint(&mut self, path: &Path, extra: &BTreeMap<String, String>) -> Result<u64, EngineError> {
        let state = self.stage_state()?;
        state.save(path, self.specs(), self.config(), extra)?;
        Ok(state.bytes())
    }

    /// Starts an engine from a checkpoint, in the saved configuration or in `cfg` (any layout of
    /// any world size the model fits). Returns the caller's `extra` entries too.
    pub fn resume(model: Arc<L>, path: &Path, cfg: Option<EngineConfig>) -> Result<(Self, BTreeMap<String, String>), EngineError> {
        let (state, saved, extra) = TrainingState::load(path)?;
        let engine = Self::from_state(model, &state, cfg.unwrap_or(saved))?;
        Ok((engine, extra))
    }
}

/// Fills in the engine settings an older checkpoint's configuration lacks with their defaults
/// (Burn's `Config` derive reads none of them as optional): `devices` (Flex everywhere),
/// `timeout_secs`, and since the MPI reduction mode, checkpointing and precision,
/// `exact_reductions`, `checkpointing` and `precision`.
fn fill_config_defaults(config: &mut serde_json::Value) {
    if let Some(config) = config.as_object_mut() {
        config.entry("devices").or_insert_with(|| serde_json::json!([]));
        config.entry("timeout_secs").or_insert_with(|| serde_json::json!(1800.0));
        config.entry("exact_reductions").or_insert_with(|| serde_json::json!(false));
        config.entry("checkpointing").or_insert_with(|| serde_json::json!("None"));
        config.entry("precision").or_insert_with(|| serde_json::json!("F32"));
        config.entry("zero1").or_insert_with(|| serde_json::json!(false));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::OptimConfig;
    use copus_core::layout::ParallelDims;

    /// A configuration saved before the newer settings existed loads with their defaults.
    #[test]
    fn an_older_configuration_loads_with_the_defaults() {
        let cfg = EngineConfig::new(ParallelDims::serial(), 4, 2, 16, OptimConfig::default());
        let mut json = serde_json::to_value(&cfg).unwrap();
        for key in ["devices", "timeout_secs", "exact_reductions", "checkpointing", "precision", "zero1"] {
            json.as_object_mut().unwrap().remove(key).unwrap();
        }
        assert!(serde_json::from_value::<EngineConfig>(json.clone()).is_err(), "Config's derive reads no default");
        fill_config_defaults(&mut json);
        assert_eq!(
            serde_json::to_value(serde_json::from_value::<EngineConfig>(json).unwrap()).unwrap(),
            serde_json::to_value(&cfg).unwrap()
        );
    }
}
