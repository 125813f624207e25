//! A scheduler's stop: SIGTERM (Slurm, Kubernetes, `docker stop`), SIGHUP and SIGUSR1 end an adaptive run
//! like the first Ctrl-C: the step finishes, a checkpoint is written, the process exits 0 and
//! prints the resume command, and `--resume` continues the run to its end.

#![forbid(unsafe_code)]

mod common;

use std::time::Duration;

use common::{Run, recipe, wait_for_steps};

fn stops_with_a_checkpoint_on(signal: &str) {
    let dir = tempfile::tempdir().unwrap();
    let (path, folder) = recipe(dir.path(), 100_000);
    let p = path.to_str().unwrap();
    let run = Run::start(&["run", p], &[]);
    wait_for_steps(&folder, 2, Duration::from_secs(600));
    run.signal(signal);
    let (code, out) = run.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0), "exit code after SIG{signal}; stdout:\n{out}");
    assert!(out.contains("resume with:") && out.contains("--resume"), "{out}");
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(folder.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["interrupted"], true);
    let steps = summary["steps"].as_u64().unwrap();
    let checkpoint = folder.join("checkpoints").join(format!("step-{steps:08}.bpk"));
    assert!(checkpoint.exists(), "{} is missing", checkpoint.display());

    // The resumed run continues from that step to a new end.
    let end = (steps + 2).to_string();
    let resumed = Run::start(&["run", p, "--resume", folder.to_str().unwrap(), "--max-steps", &end], &[]);
    let (code, out) = resumed.finish(Duration::from_secs(600));
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains(&format!("{end} steps")), "{out}");
}

#[test]
fn sigterm_finishes_the_step_checkpoints_and_exits_zero() {
    stops_with_a_checkpoint_on("TERM");
}

#[test]
fn sighup_acts_like_sigterm() {
    stops_with_a_checkpoint_on("HUP");
}

/// SIGUSR1: what mpirun passes on to every process, so a multi-process run stops this way.
#[test]
fn sigusr1_acts_like_sigterm() {
    stops_with_a_checkpoint_on("USR1");
}

/// Two processes on one run folder: the second `--resume` is refused while the first runs.
#[test]
fn a_second_resume_of_a_running_folder_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (path, folder) = recipe(dir.path(), 100_000);
    let p = path.to_str().unwrap();
    let first = Run::start(&["run", p], &[]);
    wait_for_steps(&folder, 1, Duration::from_secs(600));
    let second = Run::start(&["run", p, "--resume", folder.to_str().unwrap()], &[]);
    second.wait_for_line("in use by another process", Duration::from_secs(120));
    let (code, _) = second.finish(Duration::from_secs(120));
    assert_ne!(code, Some(0));
    first.signal("TERM");
    let (code, _) = first.finish(Duration::from_secs(120));
    assert_eq!(code, Some(0));
}

/// `recipes run --max-restarts 2`: the training process, killed with SIGKILL mid-run (as the
/// kernel's out-of-memory killer would), is started again from the newest checkpoint and
/// finishes the run; the restart is reported.
#[test]
fn a_supervised_run_killed_with_sigkill_restarts_and_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let (path, folder) = recipe(dir.path(), 12);
    let text = std::fs::read_to_string(&path).unwrap().replace("checkpoint_every: 0", "checkpoint_every: 2");
    std::fs::write(&path, text).unwrap();
    let p = path.to_str().unwrap();
    let run = Run::start(&["run", p, "--max-restarts", "2"], &[]);
    // Once a checkpoint is down and a step after it, the child (whose pid the run folder's lock
    // holds) is killed outright.
    let end = std::time::Instant::now() + Duration::from_secs(600);
    let child = loop {
        let checkpoints = std::fs::read_dir(folder.join("checkpoints"))
            .map_or(0, |d| d.flatten().filter(|e| e.file_name().to_string_lossy().ends_with(".bpk")).count());
        let pid = std::fs::read_to_string(folder.join("run.lock")).ok().and_then(|s| s.trim().parse::<u32>().ok());
        if let Some(pid) = pid.filter(|_| checkpoints > 0) {
            break pid;
        }
        assert!(std::time::Instant::now() < end, "no checkpoint within 10 minutes");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_ne!(child, run.child.id(), "the supervisor is not the training process");
    let killed = std::process::Command::new("kill").args(["-KILL", &child.to_string()]).status().unwrap().success();
    assert!(killed, "kill -KILL {child}");
    let lines = run.wait_for_line("restart 1 of 2", Duration::from_secs(120));
    assert!(lines.iter().any(|l| l.contains("SIGKILL") || l.contains("signal: 9")), "{}", lines.join("\n"));
    let (code, out) = run.finish(Duration::from_secs(600));
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("12 steps"), "{out}");
    assert!(out.contains(&format!("run folder: {}\n", folder.display())), "the restart resumed the same folder: {out}");
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(folder.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 12);
}
