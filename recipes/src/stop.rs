//! Stop requests of an adaptive run: SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes and
//! `docker stop` send), SIGHUP and SIGUSR1 (what mpirun passes on to every process; SIGTERM
//! and SIGINT sent to mpirun become SIGKILL within seconds, so `kill -USR1 <mpirun>` or Slurm's
//! `--signal=USR1@120` stops a multi-process run). The first signal asks the run to stop after
//! its step with a checkpoint; a second one, or one after the loop, quits at once (exit code
//! 130), except while a checkpoint is being written: then the checkpoint is finished first.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

/// Set by the first SIGINT (Ctrl-C), SIGTERM or SIGHUP: finish the step, save a checkpoint,
/// stop.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// Set once the training loop is over and its last checkpoint is written: a signal then quits
/// at once.
static LOOP_DONE: AtomicBool = AtomicBool::new(false);
/// Set while a checkpoint is being written: a signal then lets it finish.
static SAVING: AtomicBool = AtomicBool::new(false);
/// Signals received since the run started (the loop takes `INTERRUPTED` back when it acts on it).
static SIGNALS: AtomicU32 = AtomicU32::new(0);
/// Set by a second signal during a save: quit (exit code 130) once the checkpoint is written.
static QUIT_AFTER_SAVE: AtomicBool = AtomicBool::new(false);

/// Set by SIGUSR1, which acts like the first SIGINT. mpirun passes SIGUSR1 on to every process
/// (SIGTERM and SIGINT sent to mpirun become SIGKILL after a few seconds, too soon for a
/// checkpoint), so `kill -USR1 <mpirun>` or Slurm's `--signal=USR1@120` stops a multi-process
/// run with a checkpoint.
static USR1: OnceLock<Arc<AtomicBool>> = OnceLock::new();

/// Whether SIGUSR1 arrived since the last call.
fn usr1_taken() -> bool {
    USR1.get().is_some_and(|f| f.swap(false, Ordering::SeqCst))
}

/// Ends the process at once (exit code 130), and under mpirun the serving processes with it.
fn quit_now() -> ! {
    #[cfg(feature = "mpi")]
    if copus_burn::mpi::role() != copus_burn::mpi::Role::Single {
        copus_burn::mpi::abort_job("interrupted");
    }
    std::process::exit(130);
}

/// SIGINT (Ctrl-C), SIGTERM (what Slurm, Kubernetes and `docker stop` send) and SIGHUP all act
/// alike. The first asks the run to stop after its step with a checkpoint (exit code 0, with the
/// resume command); a second one, or one after the loop, quits at once, except while a
/// checkpoint is being written: then the checkpoint is finished first.
fn install() {
    let installed = ctrlc::set_handler(|| {
        INTERRUPTED.store(true, Ordering::SeqCst);
        let again = SIGNALS.fetch_add(1, Ordering::SeqCst) > 0;
        if SAVING.load(Ordering::SeqCst) {
            if again {
                QUIT_AFTER_SAVE.store(true, Ordering::SeqCst);
                eprintln!(
                    "
interrupted again: quitting as soon as the checkpoint being written is saved"
                );
            } else {
                eprintln!(
                    "
interrupted: finishing the checkpoint being written, then stopping"
                );
            }
            return;
        }
        if again || LOOP_DONE.load(Ordering::SeqCst) {
            quit_now();
        }
        eprintln!(
            "
interrupted: finishing the step and saving a checkpoint (a second signal quits at once)"
        );
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

/// Installs the handlers (once per process) and forgets the signals of an earlier run.
pub(crate) fn catch() {
    LOOP_DONE.store(false, Ordering::SeqCst);
    QUIT_AFTER_SAVE.store(false, Ordering::SeqCst);
    SIGNALS.store(0, Ordering::SeqCst);
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
    SAVING.store(true, Ordering::SeqCst);
    let saved = save();
    SAVING.store(false, Ordering::SeqCst);
    if QUIT_AFTER_SAVE.load(Ordering::SeqCst) {
        match &saved {
            Ok(_) => eprintln!("checkpoint written; quitting"),
            Err(e) => eprintln!("the checkpoint failed ({e}); quitting"),
        }
        quit_now();
    }
    saved
}
