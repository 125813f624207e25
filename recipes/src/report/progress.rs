//! Logs and progress for the binary. Log lines go through `tracing` (filter `COPUS_LOG`, for
//! example `COPUS_LOG=debug`; `--quiet` means `warn`). On a terminal, long work shows indicatif
//! bars and log lines print above them. Elsewhere (a pipe, a log file, CI) there is no bar, but
//! a progress line in the log every `COPUS_PROGRESS_SECS` seconds (default 10), so a long run
//! is never silent.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

static MULTI: OnceLock<MultiProgress> = OnceLock::new();
static QUIET: AtomicBool = AtomicBool::new(false);

fn multi() -> &'static MultiProgress {
    MULTI.get_or_init(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()))
}

/// Installs the log subscriber: level from `COPUS_LOG`, else `info` (`warn` when `quiet`).
/// A second call (tests) keeps the first subscriber.
pub fn init(quiet: bool) {
    QUIET.store(quiet, Ordering::Relaxed);
    let filter = EnvFilter::try_from_env("COPUS_LOG").unwrap_or_else(|_| EnvFilter::new(if quiet { "warn" } else { "info" }));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(LogWriter)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_timer(tracing_subscriber::fmt::time::uptime())
        .try_init();
}

/// Writes log lines to stderr without tearing the progress bars.
struct LogWriter;

/// One log line's writer.
struct SuspendedStderr;

impl Write for SuspendedStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        multi().suspend(|| std::io::stderr().write_all(buf))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> MakeWriter<'a> for LogWriter {
    type Writer = SuspendedStderr;
    fn make_writer(&'a self) -> Self::Writer {
        SuspendedStderr
    }
}

/// Progress of one long piece of work: a bar on a terminal, periodic log lines elsewhere,
/// nothing under `--quiet`.
pub struct Progress {
    bar: ProgressBar,
    what: String,
    /// When stderr is not a terminal: when the last progress line was logged.
    line: Option<Mutex<Instant>>,
    every: Duration,
}

impl Progress {
    /// Work named `what` of `len` units.
    pub fn new(what: &str, len: u64) -> Self {
        let quiet = QUIET.load(Ordering::Relaxed);
        let terminal = std::io::stderr().is_terminal();
        let bar = if quiet || !terminal { ProgressBar::hidden() } else { multi().add(ProgressBar::new(len)) };
        bar.set_length(len);
        bar.set_style(
            ProgressStyle::with_template("{elapsed_precise} {prefix} [{bar:30}] {pos}/{len} {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(what.to_string());
        let every = std::env::var("COPUS_PROGRESS_SECS").ok().and_then(|s| s.parse::<f64>().ok()).filter(|s| *s > 0.0).unwrap_or(10.0);
        Self {
            bar,
            what: what.to_string(),
            line: (!quiet && !terminal).then(|| Mutex::new(Instant::now())),
            every: Duration::from_secs_f64(every),
        }
    }

    /// Moves to `pos` units done.
    pub fn set_position(&self, pos: u64) {
        self.bar.set_position(pos);
        self.tick();
    }

    /// Adds `n` units done.
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
        self.tick();
    }

    /// Replaces the message after the counts.
    pub fn set_message(&self, msg: String) {
        self.bar.set_message(msg);
    }

    /// Removes the bar.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    fn tick(&self) {
        let Some(last) = &self.line else { return };
        let mut last = last.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() >= self.every {
            *last = Instant::now();
            let len = self.bar.length().unwrap_or(0);
            tracing::info!("{}: {}/{} {}", self.what, self.bar.position(), len, self.bar.message());
        }
    }
}
