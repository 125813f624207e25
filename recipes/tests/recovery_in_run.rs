//! A run whose rank panics in the middle of a step recovers in the process (feature
//! `fault-injection`, whose hook `COPUS_TEST_PANIC_AT=STEP:RANK` plants the panic): it ends
//! normally, logs the recovery in `decisions.jsonl`, and from the snapshot on trains the losses
//! of the same recipe run without the fault.

#![forbid(unsafe_code)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Run, recipe_on};

/// Each `metrics.jsonl` line's step and loss, in order.
fn losses(folder: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(folder.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["metrics"]["step"].as_u64().unwrap(), v["metrics"]["loss"].as_f64().unwrap())
        })
        .collect()
}

#[test]
fn a_rank_panic_mid_run_is_recovered_and_the_run_matches_the_uninterrupted_one() {
    let (clean_dir, faulted_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (clean, clean_folder) = recipe_on(clean_dir.path(), 6, 2);
    let (code, out) = Run::start(&["run", clean.to_str().unwrap()], &[]).finish(Duration::from_secs(600));
    assert_eq!(code, Some(0), "{out}");

    // Rank 1 panics in step 4; the driver's snapshot is the start (step 0): three steps lost.
    let (faulted, folder) = recipe_on(faulted_dir.path(), 6, 2);
    let (code, out) = Run::start(&["run", faulted.to_str().unwrap()], &[("COPUS_TEST_PANIC_AT", "3:1")]).finish(Duration::from_secs(600));
    assert_eq!(code, Some(0), "the run recovers and ends normally: {out}");

    let decisions = std::fs::read_to_string(folder.join("decisions.jsonl")).unwrap();
    let recoveries: Vec<serde_json::Value> =
        decisions.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()).filter(|v| v.get("recovery").is_some()).collect();
    assert_eq!(recoveries.len(), 1, "{decisions}");
    let r = &recoveries[0]["recovery"];
    assert_eq!((r["failed_step"].as_u64(), r["back_to_step"].as_u64(), r["lost_steps"].as_u64()), (Some(4), Some(0), Some(3)), "{r}");
    assert_eq!(r["cause"]["Rank"]["rank"].as_u64(), Some(1), "{r}");
    assert!(recoveries[0]["why"].as_str().unwrap().contains("planted panic"));

    // Steps 1-3, lost, then 1-6 again: the last six lines are the clean run's, exactly.
    let (got, want) = (losses(&folder), losses(&clean_folder));
    let steps: Vec<u64> = got.iter().map(|x| x.0).collect();
    assert_eq!(steps, vec![1, 2, 3, 1, 2, 3, 4, 5, 6]);
    assert_eq!(got[3..], want[..], "losses after the recovery");
    let summary: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(folder.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"].as_u64(), Some(6));

    // A resume from the final checkpoint (after the recovery) keeps its line.
    let (code, out) = Run::start(&["run", faulted.to_str().unwrap(), "--resume", folder.to_str().unwrap(), "--max-steps", "7"], &[])
        .finish(Duration::from_secs(600));
    assert_eq!(code, Some(0), "{out}");
    let decisions = std::fs::read_to_string(folder.join("decisions.jsonl")).unwrap();
    assert_eq!(decisions.lines().filter(|l| l.contains("\"recovery\"")).count(), 1, "{decisions}");
    assert_eq!(losses(&folder).last().map(|x| x.0), Some(7));
}
