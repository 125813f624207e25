//! What the signal tests share: a small adaptive recipe on the Shakespeare corpus (fetched into
//! the cache on first use), and the `recipes` binary as a child process whose standard error is
//! read line by line.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

/// Writes a recipe of the 1M preset on 1 rank, `max_steps` steps, into `dir`; returns its path
/// and the run folder it will write.
pub(crate) fn recipe(dir: &Path, max_steps: u64) -> (PathBuf, PathBuf) {
    recipe_on(dir, max_steps, 1)
}

/// [`recipe`] on `world` ranks (data parallel, B_g 4 x `world`).
pub(crate) fn recipe_on(dir: &Path, max_steps: u64, world: usize) -> (PathBuf, PathBuf) {
    let b = 4 * world;
    let text = format!(
        r#"(
            name: "signal",
            output_dir: "{}",
            model: (preset: "tiny-1m", seq_len: Some(32)),
            data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
            train: (global_batch: {b}, micro_batch: 2, max_steps: {max_steps}, eval_every: 0, eval_sequences: 8, checkpoint_every: 0),
            optim: (lr: 3e-3, b0: {b}, warmup_steps: 1, total_steps: {max_steps}),
            parallel: (world_size: {world}, global_batches: [{b}], micro_batches: [2]),
        )"#,
        dir.join("runs").display()
    );
    let path = dir.join("signal.ron");
    std::fs::write(&path, text).unwrap();
    (path, dir.join("runs").join("signal"))
}

/// The `recipes` binary running a command; killed when dropped (also when a test fails).
pub(crate) struct Run {
    pub(crate) child: Child,
    pub(crate) stderr: Receiver<String>,
}

impl Run {
    /// Starts `recipes ARGS` with `envs` set.
    pub(crate) fn start(args: &[&str], envs: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_recipes"));
        cmd.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("start the recipes binary");
        let err = child.stderr.take().unwrap();
        let (tx, stderr) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self { child, stderr }
    }

    /// Sends `signal` (`TERM`, `INT`, `HUP`) to the child.
    pub(crate) fn signal(&self, signal: &str) {
        let ok = Command::new("kill").arg(format!("-{signal}")).arg(self.child.id().to_string()).status().unwrap().success();
        assert!(ok, "kill -{signal} failed");
    }

    /// Waits up to `limit` for a standard-error line containing `marker`; the lines seen.
    pub(crate) fn wait_for_line(&self, marker: &str, limit: Duration) -> Vec<String> {
        let end = Instant::now() + limit;
        let mut seen = Vec::new();
        while let Some(left) = end.checked_duration_since(Instant::now()) {
            match self.stderr.recv_timeout(left) {
                Ok(line) => {
                    let hit = line.contains(marker);
                    seen.push(line);
                    if hit {
                        return seen;
                    }
                }
                Err(_) => break,
            }
        }
        panic!("no line with {marker:?} within {limit:?}; saw:\n{}", seen.join("\n"));
    }

    /// Waits up to `limit` for the child to end; its exit code and standard output.
    pub(crate) fn finish(mut self, limit: Duration) -> (Option<i32>, String) {
        let end = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                let mut out = String::new();
                std::io::Read::read_to_string(self.child.stdout.as_mut().unwrap(), &mut out).unwrap();
                return (status.code(), out);
            }
            assert!(Instant::now() < end, "the child did not end within {limit:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the run folder's `metrics.jsonl` holds `lines` steps.
pub(crate) fn wait_for_steps(folder: &Path, lines: usize, limit: Duration) {
    let end = Instant::now() + limit;
    loop {
        let n = std::fs::read_to_string(folder.join("metrics.jsonl")).map_or(0, |t| t.lines().count());
        if n >= lines {
            return;
        }
        assert!(Instant::now() < end, "{} has {n} steps after {limit:?}", folder.display());
        std::thread::sleep(Duration::from_millis(100));
    }
}
