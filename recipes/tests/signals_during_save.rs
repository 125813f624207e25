//! Signals while a checkpoint is being written (feature `fault-injection`, which lets a test
//! stretch the save with `COPUS_TEST_SAVE_PAUSE_MS`): the checkpoint is always finished. One
//! Ctrl-C during the final save of a run that reached its end changes nothing (exit 0); a
//! second signal during the save of an interrupted run quits (exit 130) once the checkpoint is
//! written, and that checkpoint resumes.

#![forbid(unsafe_code)]

mod common;

use std::time::Duration;

use common::{Run, recipe, wait_for_steps};

const PAUSE: (&str, &str) = ("COPUS_TEST_SAVE_PAUSE_MS", "3000");
const MARKER: &str = "copus-test: writing a checkpoint";

#[test]
fn ctrl_c_during_the_final_save_lets_the_run_end_with_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (path, folder) = recipe(dir.path(), 3);
    let run = Run::start(&["run", path.to_str().unwrap()], &[PAUSE]);
    run.wait_for_line(MARKER, Duration::from_secs(600));
    run.signal("INT");
    let (code, out) = run.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "{out}");
    assert!(folder.join("checkpoints").join("step-00000003.bpk").exists());
    assert!(folder.join("summary.json").exists(), "the run ended normally");
}

#[test]
fn a_second_signal_during_the_save_quits_once_the_checkpoint_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let (path, folder) = recipe(dir.path(), 100_000);
    let p = path.to_str().unwrap();
    let run = Run::start(&["run", p], &[PAUSE]);
    wait_for_steps(&folder, 2, Duration::from_secs(600));
    run.signal("TERM");
    run.wait_for_line(MARKER, Duration::from_secs(120));
    run.signal("INT");
    let (code, _) = run.finish(Duration::from_secs(120));
    assert_eq!(code, Some(130));
    // Besides the checkpoints' lineage list.
    let saved: Vec<_> =
        std::fs::read_dir(folder.join("checkpoints")).unwrap().flatten().map(|e| e.file_name()).filter(|n| n != "lineage").collect();
    assert_eq!(saved.len(), 1, "one whole checkpoint and no temporary: {saved:?}");
    let resumed = Run::start(&["run", p, "--resume", folder.to_str().unwrap(), "--max-steps", "4"], &[]);
    let (code, out) = resumed.finish(Duration::from_secs(600));
    assert_eq!(code, Some(0), "{out}");
}
