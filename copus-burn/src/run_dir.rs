//! A run folder on disk: whole-run checkpoints under `checkpoints/step-N.bpk` with rotation, a
//! resume from the newest one that loads, and log files cut back to a checkpoint's step.
//!
//! One lineage: `checkpoints/lineage` lists, oldest first, the checkpoints the run's current
//! branch went through (each save appends its file; each checkpoint also records its parent in
//! its `extra` map, `copus.run.parent`). A resume continues from the newest checkpoint of that
//! list that loads and cuts the list back to it; a checkpoint file that is not on the list (one
//! of an abandoned branch: a newer checkpoint that was unreadable for a while, the run resumed
//! from an older one, then the newer one came back) is set aside as `*.bpk.branch`, renamed,
//! never deleted, so the run never continues a branch whose logs it has cut. A folder without
//! the list (an older run) resumes as before, from the newest checkpoint that loads.
//!
//! One rule for left-over temporary files holds everywhere: a save writes a uniquely named
//! temporary file and renames it (`checkpoint::write_atomically`), and only the temporaries of
//! processes that no longer run are removed (by the save of the same file, and by every
//! checkpoint save for the whole checkpoints folder), so two processes never delete each other's
//! work in progress.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use copus_core::candidates::Enumeration;

use crate::checkpoint::{remove_dead_temporaries, sync_parent, write_atomically};
use copus_core::decision::DecisionSource;

use crate::driver::{Clock, Driver, DriverError};
use crate::engine::{EngineConfig, EngineError};
use crate::parallel::ParallelLm;

/// Checkpoints kept by default: the newest and the one before, so a save cut short or a damaged
/// newest file still leaves one to resume from.
pub const DEFAULT_KEEP: usize = 2;

/// The key of a checkpoint's parent (the checkpoint file its branch continued from, or
/// `start`) in its `extra` map.
pub const PARENT_KEY: &str = "copus.run.parent";

/// Entries of the lineage list kept (the newest); far more than the checkpoints kept.
const LINEAGE_KEPT: usize = 256;

/// A failure reading or writing a run folder.
#[derive(Debug, thiserror::Error)]
pub enum RunDirError {
    /// A file or folder of the run could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The run folder has no checkpoint to resume from.
    #[error("{0} has no checkpoints to resume from")]
    NoCheckpoints(PathBuf),
    /// Every checkpoint was damaged (each is renamed aside to `*.bad`); the newest one's
    /// error is kept.
    #[error("no checkpoint in {dir} could be loaded: all are damaged (newest: {source})")]
    NoneLoadable {
        /// The checkpoints folder.
        dir: PathBuf,
        /// Why the newest checkpoint did not load.
        #[source]
        source: DriverError,
    },
    /// A checkpoint that is not damaged but cannot continue this run (another model, a newer
    /// format, no driver position, unreadable): the resume stops here rather than go back to an
    /// older one.
    #[error("cannot resume from {path}: {source}")]
    Unusable {
        /// The checkpoint.
        path: PathBuf,
        /// Why.
        #[source]
        source: DriverError,
    },
    /// Another process holds the run folder.
    #[error("run folder {path} is in use by another process{holder}; wait for it to end or use another folder")]
    Busy {
        /// The run folder.
        path: PathBuf,
        /// ` (pid N)` when the holder wrote its process id.
        holder: String,
    },
    /// Saving the checkpoint failed.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

/// A run folder: where a run's checkpoints and logs live.
#[derive(Clone, Debug)]
pub struct RunDir {
    root: PathBuf,
    keep: usize,
}

impl RunDir {
    /// The run folder at `root` (not created here), keeping [`DEFAULT_KEEP`] checkpoints.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into(), keep: DEFAULT_KEEP }
    }

    /// Keeps the newest `keep` checkpoints (at least one).
    pub fn with_keep(mut self, keep: usize) -> Self {
        self.keep = keep.max(1);
        self
    }

    /// The folder itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The folder of the checkpoints, `checkpoints/` under the root.
    pub fn checkpoints_dir(&self) -> PathBuf {
        self.root.join("checkpoints")
    }

    /// Where the checkpoint of `step` goes (`step-00000042.bpk`, so names sort by step).
    pub fn checkpoint_path(&self, step: u64) -> PathBuf {
        self.checkpoints_dir().join(format!("step-{step:08}.bpk"))
    }

    /// The checkpoint files `step-N.bpk` with their steps, oldest first (none if the folder is
    /// missing).
    pub fn checkpoints(&self) -> Vec<(u64, PathBuf)> {
        let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(self.checkpoints_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let step = name.strip_prefix("step-")?.strip_suffix(".bpk")?.parse().ok()?;
                Some((step, e.path()))
            })
            .collect();
        out.sort();
        out
    }

    /// Emergency checkpoints (`copus-emergency-step-N-PID.bpk`, written when a failed layout
    /// change could not roll back) in the folder itself, with their steps.
    pub fn emergency_checkpoints(&self) -> Vec<(u64, PathBuf)> {
        std::fs::read_dir(&self.root)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let rest = name.strip_prefix("copus-emergency-step-")?.strip_suffix(".bpk")?;
                Some((rest.split('-').next()?.parse().ok()?, e.path()))
            })
            .collect()
    }

    /// Takes the run folder for this process until the returned lock is dropped; a second
    /// process gets [`RunDirError::Busy`]. The lock is the operating system's, on `run.lock`, so
    /// it goes with the process however it ends.
    pub fn lock(&self) -> Result<RunLock, RunDirError> {
        use std::io::{Read, Seek, Write};
        let path = self.root.join("run.lock");
        let io = |source| RunDirError::Io { path: path.clone(), source };
        let mut file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let holder = pid.trim().parse::<u32>().map_or(String::new(), |p| format!(" (pid {p})"));
                return Err(RunDirError::Busy { path: self.root.clone(), holder });
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
        }
        file.set_len(0).and_then(|()| file.rewind()).and_then(|()| write!(file, "{}", std::process::id())).map_err(io)?;
        Ok(RunLock { _file: file })
    }

    /// The lineage file's path.
    fn lineage_path(&self) -> PathBuf {
        self.checkpoints_dir().join("lineage")
    }

    /// The checkpoints of the run's current branch, oldest first (`None`: no lineage file, an
    /// older run folder).
    pub fn lineage(&self) -> Option<Vec<String>> {
        let text = std::fs::read_to_string(self.lineage_path()).ok()?;
        Some(text.lines().map(str::trim).filter(|l| !l.is_empty()).map(String::from).collect())
    }

    fn write_lineage(&self, names: &[String]) -> Result<(), RunDirError> {
        let path = self.lineage_path();
        let kept = &names[names.len().saturating_sub(LINEAGE_KEPT)..];
        let text: String = kept.iter().map(|n| format!("{n}\n")).collect();
        write_atomically(&path, text.as_bytes()).map_err(|source| RunDirError::Io { path, source })
    }

    /// Writes a whole-run checkpoint of `driver` at its current step (atomically), recording its
    /// parent and appending it to the lineage, and removes all but the newest `keep`; returns
    /// the file written.
    pub fn save<L: ParallelLm>(
        &self,
        driver: &mut Driver<L>,
        source: &dyn DecisionSource,
        extra: &BTreeMap<String, String>,
    ) -> Result<PathBuf, RunDirError> {
        let dir = self.checkpoints_dir();
        std::fs::create_dir_all(&dir).map_err(|source| RunDirError::Io { path: dir.clone(), source })?;
        let path = self.checkpoint_path(driver.engine().steps_done());
        let mut lineage = self.lineage().unwrap_or_default();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        // A save at the step of the newest entry (the end of a run that just checkpointed)
        // replaces that file: it stays one entry.
        if lineage.last() == Some(&name) {
            lineage.pop();
        }
        let mut extra = extra.clone();
        extra.insert(PARENT_KEY.into(), lineage.last().cloned().unwrap_or_else(|| "start".into()));
        // The list names the checkpoint before it exists: a process killed in between leaves a
        // name without a file (passed over), never a checkpoint the list does not name (which a
        // resume would set aside).
        lineage.push(name);
        self.write_lineage(&lineage)?;
        driver.save_checkpoint(&path, source, &extra)?;
        // Temporaries of any checkpoint's save cut short by a killed process.
        remove_dead_temporaries(&dir, None);
        let all = self.checkpoints();
        for (_, old) in &all[..all.len().saturating_sub(self.keep)] {
            if let Err(e) = std::fs::remove_file(old) {
                tracing::warn!("old checkpoint {} not removed: {e}", old.display());
            }
        }
        tracing::debug!("checkpoint {}", path.display());
        Ok(path)
    }

    /// Continues the run from its newest checkpoint that loads, among `checkpoints/` and the
    /// emergency checkpoints in the folder. Only damage (a truncated file, a hash or the
    /// manifest not matching) falls back to the one before: the damaged file is renamed aside
    /// (`*.bad`) so that it never counts again and no later resume can continue the abandoned
    /// branch. Any other error stops the resume with its cause. An emergency checkpoint that is
    /// resumed from moves into `checkpoints/`. `clock` makes the run's clock for each attempt.
    /// Returns the driver and the checkpoint it came from.
    pub fn resume<L: ParallelLm>(
        &self,
        model: Arc<L>,
        space: &Enumeration,
        clock: impl FnMut() -> Clock,
        source: &mut dyn DecisionSource,
    ) -> Result<(Driver<L>, PathBuf), RunDirError> {
        self.resume_with(model, space, clock, source, &|cfg| cfg)
    }

    /// [`RunDir::resume`], each saved engine configuration passed through `adjust` first
    /// ([`Driver::resume_with`]).
    pub fn resume_with<L: ParallelLm>(
        &self,
        model: Arc<L>,
        space: &Enumeration,
        mut clock: impl FnMut() -> Clock,
        source: &mut dyn DecisionSource,
        adjust: &dyn Fn(EngineConfig) -> EngineConfig,
    ) -> Result<(Driver<L>, PathBuf), RunDirError> {
        let lineage = self.lineage();
        let mut checkpoints = self.checkpoints();
        if let Some(names) = &lineage {
            self.set_aside_other_branches(&mut checkpoints, names);
        }
        let regular = checkpoints.len();
        checkpoints.extend(self.emergency_checkpoints());
        // Newest first; at equal steps a regular checkpoint before an emergency one.
        let mut order: Vec<usize> = (0..checkpoints.len()).collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(checkpoints[i].0), i >= regular));
        if order.is_empty() {
            return Err(RunDirError::NoCheckpoints(self.checkpoints_dir()));
        }
        let mut newest_error = None;
        let mut unusable_emergency = None;
        for i in order {
            let (step, path) = &checkpoints[i];
            match Driver::resume_with(model.clone(), path, space.clone(), clock(), source, adjust) {
                Ok((driver, _)) if i >= regular => {
                    // The emergency state becomes the run's newest checkpoint.
                    let dir = self.checkpoints_dir();
                    std::fs::create_dir_all(&dir).map_err(|source| RunDirError::Io { path: dir.clone(), source })?;
                    let to = self.checkpoint_path(*step);
                    std::fs::rename(path, &to)
                        .and_then(|()| sync_parent(&to))
                        .map_err(|source| RunDirError::Io { path: path.clone(), source })?;
                    tracing::info!("the emergency checkpoint {} is now {}", path.display(), to.display());
                    self.continue_lineage_from(lineage.as_deref(), &to)?;
                    return Ok((driver, to));
                }
                Ok((driver, _)) => {
                    self.continue_lineage_from(lineage.as_deref(), path)?;
                    return Ok((driver, path.clone()));
                }
                Err(e @ DriverError::Engine(EngineError::Damaged { .. })) => {
                    let aside = path.with_extension("bpk.bad");
                    match std::fs::rename(path, &aside).and_then(|()| sync_parent(path)) {
                        Ok(()) => tracing::warn!("checkpoint {} is damaged ({e}); renamed to {}", path.display(), aside.display()),
                        Err(r) => return Err(RunDirError::Io { path: path.clone(), source: r }),
                    }
                    newest_error.get_or_insert(e);
                }
                // An emergency checkpoint that cannot continue the run (one of an older build,
                // without the driver's position) does not block the regular ones.
                Err(e) if i >= regular => {
                    tracing::warn!("emergency checkpoint {} not usable ({e}); left in place", path.display());
                    unusable_emergency.get_or_insert((path.clone(), e));
                }
                Err(e) => return Err(RunDirError::Unusable { path: path.clone(), source: e }),
            }
        }
        match (newest_error, unusable_emergency) {
            (Some(source), _) => Err(RunDirError::NoneLoadable { dir: self.checkpoints_dir(), source }),
            (None, Some((path, source))) => Err(RunDirError::Unusable { path, source }),
            (None, None) => Err(RunDirError::NoCheckpoints(self.checkpoints_dir())),
        }
    }

    /// Keeps the checkpoints on the lineage `names`; renames each other one `*.bpk.branch`.
    fn set_aside_other_branches(&self, checkpoints: &mut Vec<(u64, PathBuf)>, names: &[String]) {
        checkpoints.retain(|(_, path)| {
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if names.iter().any(|n| n == name) {
                return true;
            }
            let aside = path.with_extension("bpk.branch");
            match std::fs::rename(path, &aside).and_then(|()| sync_parent(path)) {
                Ok(()) => tracing::warn!(
                    "checkpoint {} is not of the run's current branch (not in {}); set aside as {}",
                    path.display(),
                    self.lineage_path().display(),
                    aside.display()
                ),
                Err(e) => tracing::warn!("checkpoint {} is not of the run's current branch; not set aside: {e}", path.display()),
            }
            false
        });
    }

    /// The lineage cut back to `from` (the checkpoint a resume continues from), or ending at it
    /// when it is not on the list (an emergency checkpoint, a folder without a lineage).
    fn continue_lineage_from(&self, lineage: Option<&[String]>, from: &Path) -> Result<(), RunDirError> {
        let name = from.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        let mut names = lineage.map(<[String]>::to_vec).unwrap_or_default();
        match names.iter().position(|n| *n == name) {
            Some(i) => names.truncate(i + 1),
            None => names.push(name),
        }
        self.write_lineage(&names)
    }

    /// Cuts the log file `name` of the run back to the lines of steps up to `step` (and a CSV
    /// header), atomically; a torn or unreadable line goes too. A missing file is left missing.
    pub fn truncate_log(&self, name: &str, step: u64) -> Result<(), RunDirError> {
        let path = self.root.join(name);
        let Ok(text) = std::fs::read_to_string(&path) else { return Ok(()) };
        let kept: String = text
            .lines()
            .enumerate()
            .filter(|(i, l)| match log_line_step(l) {
                Some(s) => s <= step,
                None => *i == 0 && !l.is_empty() && !l.starts_with('{'),
            })
            .map(|(_, l)| format!("{l}\n"))
            .collect();
        write_atomically(&path, kept.as_bytes()).map_err(|source| RunDirError::Io { path, source })
    }
}

/// A run folder taken by this process ([`RunDir::lock`]); dropping it lets the folder go.
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
}

/// The step a log line belongs to: a JSON line's `step` (or its `metrics.step` / `record.step`),
/// or a CSV line's first field; `None` for a header or a torn line.
pub fn log_line_step(line: &str) -> Option<u64> {
    if line.starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        return v["step"].as_u64().or_else(|| v["metrics"]["step"].as_u64()).or_else(|| v["record"]["step"].as_u64());
    }
    line.split(',').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_lines_are_cut_back_to_a_step_keeping_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        let csv = "step,a\n1,x\n2,y\n3,z\n";
        std::fs::write(dir.path().join("r.csv"), csv).unwrap();
        let json = "{\"step\": 1}\n{\"metrics\": {\"step\": 2}}\n{\"record\": {\"step\": 3}}\n{\"step\": 4, \"torn";
        std::fs::write(dir.path().join("m.jsonl"), json).unwrap();
        run.truncate_log("r.csv", 2).unwrap();
        run.truncate_log("m.jsonl", 3).unwrap();
        run.truncate_log("missing.jsonl", 3).unwrap();
        assert_eq!(std::fs::read_to_string(dir.path().join("r.csv")).unwrap(), "step,a\n1,x\n2,y\n");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("m.jsonl")).unwrap(),
            "{\"step\": 1}\n{\"metrics\": {\"step\": 2}}\n{\"record\": {\"step\": 3}}\n"
        );
        assert!(!dir.path().join("missing.jsonl").exists());
        // No temporary file is left behind.
        let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
    }

    /// Temporaries of a dead process are removed, of any checkpoint's name; a live process's
    /// (this one's) are kept.
    #[test]
    fn only_dead_processes_temporaries_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        // PID 0 is never a process that wrote a file; this process is alive.
        let dead = [".step-00000004.bpk.0.0.tmp", ".step-00000007.bpk.0.3.tmp"];
        let alive = format!(".step-00000005.bpk.{}.0.tmp", std::process::id());
        for name in dead.iter().copied().chain([alive.as_str(), "step-00000004.bpk", "notes.tmp"]) {
            std::fs::write(dir.path().join(name), b"x").unwrap();
        }
        remove_dead_temporaries(dir.path(), None);
        let mut left: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.file_name().into_string().unwrap()).collect();
        left.sort();
        let mut want = vec![alive, "notes.tmp".to_string(), "step-00000004.bpk".to_string()];
        want.sort();
        if Path::new("/proc/self").exists() {
            assert_eq!(left, want);
        }
    }

    #[test]
    fn checkpoints_are_listed_by_step_and_other_files_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::new(dir.path());
        assert!(run.checkpoints().is_empty());
        std::fs::create_dir_all(run.checkpoints_dir()).unwrap();
        for name in ["step-00000010.bpk", "step-00000002.bpk", ".step-00000011.bpk.7.0.tmp", "notes.txt", "step-x.bpk"] {
            std::fs::write(run.checkpoints_dir().join(name), b"").unwrap();
        }
        let steps: Vec<u64> = run.checkpoints().iter().map(|c| c.0).collect();
        assert_eq!(steps, [2, 10]);
        assert_eq!(run.checkpoint_path(10), run.checkpoints()[1].1);
    }
}
