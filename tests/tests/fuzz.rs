//! Fuzzing the parsers of what peers and files hand copus: the service's frames, checkpoints,
//! and a Hugging Face directory's `config.json` and `model.safetensors`. Each target runs for
//! `COPUS_FUZZ_SECS` (default 3 s) on inputs mutated from valid seeds; it must never panic, and
//! the allocator is capped (2 GiB live), so an input that makes a parser allocate without bound
//! aborts the test.

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::Arc;

use burn::tensor::Device;
use copus_burn::{Engine, EngineConfig, OptimConfig, TrainingState};
use copus_core::orchestrator::{MAX_FRAME, Request, Response, decode, frame_len_within};
use copus_models::hf;
use copus_tests::fuzz::{budget, fuzz};
use copus_tests::{SEQ, config, dims, initial_full, initial_of};

#[global_allocator]
static ALLOCATOR: cap::Cap<std::alloc::System> = cap::Cap::new(std::alloc::System, 2 << 30);

#[test]
fn service_frames() {
    let seeds: Vec<Vec<u8>> = [
        r#"{"Hello":{"version":3,"run":"r","fingerprint":{"model":"m","world_size":2,"global_batches":[2,4],"micro_batches":[1,2]},"nonce":"00112233445566778899aabbccddeeff"}}"#,
        r#"{"Prove":{"proof":"00"}}"#,
        r#"{"Step":{"observation":{"step":3,"current":{"dims":{"dp":2,"tp":1,"pp":1},"global_batch":4,"micro_batch":2,"num_micro":1},"noise":{"grad_sq":1.0,"trace":2.0,"biased":false,"grad_sq_se":0.1,"trace_se":0.2}},"samples_per_sec":10.0}}"#,
        r#"{"Reconfigured":{"seconds":1.5,"layout_changed":true}}"#,
        r#""Bye""#,
        r#"{"Decision":{"step":2,"decision":"Keep"}}"#,
        r#"{"Challenge":{"nonce":"ab","proof":"cd"}}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect();
    let runs = fuzz("service frames", &seeds, budget(), |bytes| {
        let _ = decode::<Request>(bytes);
        let _ = decode::<Response>(bytes);
        if bytes.len() >= 4 {
            let _ = frame_len_within([bytes[0], bytes[1], bytes[2], bytes[3]], MAX_FRAME);
        }
    });
    assert!(runs >= seeds.len() as u64);
}

#[test]
fn checkpoints() {
    let mut e = Engine::new(
        Arc::new(config()),
        initial_full(),
        EngineConfig::new(dims(1, 1, 1), 2, 1, SEQ, OptimConfig::new().with_warmup_steps(1)),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.bpk");
    e.save_checkpoint(&path, &BTreeMap::from([("k".to_string(), "v".to_string())])).unwrap();
    let seed = std::fs::read(&path).unwrap();
    // A checkpoint that loads must be one the original could have written: the same tensors.
    let (want, _, _) = TrainingState::from_bytes(seed.clone()).unwrap();
    let runs = fuzz("checkpoints", &[seed], budget(), |bytes| {
        if let Ok((state, _, _)) = TrainingState::from_bytes(bytes.to_vec()) {
            assert_eq!(state.bytes(), want.bytes(), "a checkpoint that loads holds the original's tensors");
        }
    });
    assert!(runs >= 1);
}

#[test]
fn hugging_face_directories() {
    let dir = tempfile::tempdir().unwrap();
    let model = initial_of(&config());
    hf::export(&model, &config(), dir.path(), None).unwrap();
    let config_json = std::fs::read(dir.path().join("config.json")).unwrap();
    let weights = std::fs::read(dir.path().join("model.safetensors")).unwrap();
    let device = Device::flex();
    // The config alone (it decides every shape), then the weights under a valid config.
    let runs = fuzz("config.json", std::slice::from_ref(&config_json), budget(), |bytes| {
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
            let _ = hf::config_from_hf(&v);
        }
    });
    assert!(runs >= 1);
    let work = tempfile::tempdir().unwrap();
    std::fs::write(work.path().join("config.json"), &config_json).unwrap();
    let runs = fuzz("model.safetensors", &[weights], budget(), |bytes| {
        std::fs::write(work.path().join("model.safetensors"), bytes).unwrap();
        let _ = hf::import(work.path(), &device);
    });
    assert!(runs >= 1);
}
