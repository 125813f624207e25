//! Stop requests of an adaptive run: SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes and
//! `docker stop` send), SIGHUP and SIGUSR1 (what mpirun passes on to every process; SIGTERM
//! and SIGINT sent to mpirun become SIGKILL within seconds, so `kill -USR1 <mpirun pid>` stops a
//! multi-process run). The first signal asks the run to stop after its step with a checkpoint;
//! a second SIGINT, SIGTERM or SIGHUP, or one after the loop, quits at once (exit code 130),
//! except while a checkpoint is being written: then the checkpoint is finished first. SIGUSR1
//! only ever asks for the stop.
//!
//! Whether a signal may quit at once and whether a save is under way are decided under one lock,
//! so a signal can neither end the process inside a save that has begun nor be lost as the save
//! ends.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Set by the first signal: finish the step, save a checkpoint, stop.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Set once the training loop is over and its last checkpoint is written: a signal then quits
/// at once.
static LOOP_DONE: AtomicBool = AtomicBool::new(false);
/// SIGINT, SIGTERM and SIGHUP received since the run started (the loop takes `INTERRUPTED` back
/// when it acts on it).
static SIGNALS: AtomicU32 = AtomicU32::new(0);
/// Set by SIGUSR1, which asks for the stop like the first SIGINT.
static USR1: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Checkpoints being written, and whether a signal asked to quit once they are. The signal
/// handler runs on its own thread (not in signal context), so a lock is safe here.
static SAVES: Mutex<Saves> = Mutex::new(Saves { writing: 0, quit_after: false });

/// See [`SAVES`].
struct Saves {
    writing: u32,
    quit_after: bool,
}

fn saves() -> std::sync::MutexGuard<'static, Saves> {
    SAVES.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether SIGUSR1 arrived since the last call.
fn usr1_taken() -> bool {
    USR1.get().is_some_and(|f| f.swap(false, Ordering::SeqCst))
}

/// Ends the process at once (exit code 130), and under mpirun the serving processes with it.
fn quit_now() -> ! {
    #[cfg(feature = "mpi")]
    if copus_burn::comm::mpi::role() != copus_burn::comm::mpi::Role::Single {
        copus_burn::comm::mpi::abort_job("interrupted");
    }
    std::process::exit(130);
}

/// A signal that may end the process: at once when no save is under way (holding the lock, so
/// none can begin), else once the saves under way are written.
fn quit_unless_saving() {
    let mut s = saves();
    if s.writing == 0 {
        quit_now();
    }
    if !s.quit_after {
        s.quit_after = true;
        eprintln!("\ninterrupted again: quitting as soon as the checkpoint being written is saved");
    }
}

/// Installs the handlers (once per process).
fn install() {
    let installed = ctrlc::set_handler(|| {
        INTERRUPTED.store(true, Ordering::SeqCst);
        let again = SIGNALS.fetch_add(1, Ordering::SeqCst) > 0;
        if again || LOOP_DONE.load(Ordering::SeqCst) {
            quit_unless_saving();
        } else {
            eprintln!("\ninterrupted: finishing the step and saving a checkpoint (a second signal quits at once)");
        }
    });
    if let Err(e) = installed {
        tracing::debug!("signal handler not installed: {e}");
    }
    #[cfg(unix)]
    if USR1.get().is_none() {
        let flag = Arc::new(AtomicBool::new(false));
        match signal_hook::flag::register(signal_hook::consts::SIGUSR1, flag.clone()) {
            Ok(_) => {
                let _ = USR1.set(flag);
            }
            Err(e) => tracing::debug!("SIGUSR1 handler not installed: {e}"),
        }
    }
}

/// Installs the handlers (once per process) and forgets the requests of an earlier run. Call it
/// first thing in a run, so a signal during its setup already asks for a stop.
pub(crate) fn catch() {
    LOOP_DONE.store(false, Ordering::SeqCst);
    INTERRUPTED.store(false, Ordering::SeqCst);
    saves().quit_after = false;
    SIGNALS.store(0, Ordering::SeqCst);
    let _ = usr1_taken();
    install();
}

/// The flag the training loop takes a stop request from (set by the first signal).
pub(crate) fn flag() -> &'static AtomicBool {
    &INTERRUPTED
}

/// Whether a stop was asked for since the last call: through `stop` (the loop's flag, which a
/// test may set) or SIGUSR1. Takes the request.
pub(crate) fn requested(stop: &AtomicBool) -> bool {
    stop.swap(false, Ordering::SeqCst) | usr1_taken()
}

/// The loop and its last checkpoint are done: a signal now quits at once.
pub(crate) fn loop_done() {
    LOOP_DONE.store(true, Ordering::SeqCst);
}

/// Runs `save` (a checkpoint being written) so that a signal meanwhile lets it finish; after a
/// second signal during it, quits once it is written.
pub(crate) fn saving<T, E: std::fmt::Display>(save: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    saves().writing += 1;
    let saved = save();
    let mut s = saves();
    s.writing -= 1;
    if s.writing == 0 && s.quit_after {
        match &saved {
            Ok(_) => eprintln!("checkpoint written; quitting"),
            Err(e) => eprintln!("the checkpoint failed ({e}); quitting"),
        }
        quit_now();
    }
    saved
}

/// Asks the process `pid` (a supervised run's child) to stop as SIGTERM does: it finishes its
/// step, writes a checkpoint and exits.
#[allow(unsafe_code)]
pub(crate) fn terminate(pid: u32) {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return };
    // SAFETY: kill(2) takes any pid and signal number and touches no memory of this process;
    // the pid is the supervised child's, which this process has not yet waited for, so it
    // cannot have been reused.
    let _ = unsafe { libc::kill(pid, libc::SIGTERM) };
}
