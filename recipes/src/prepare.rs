//! What every run starts from: the recipe's data and tokenizer (`prepare`), the model shape
//! they fix, a fresh run folder, the training split as the driver's data source, seeded
//! initialisation, the job every run on the engine is built from (`job`), and the error of a
//! run that fails.

use std::path::{Path, PathBuf};

use crate::data::{self, PackedDataset};
use crate::recipe::{Recipe, TokenizerRecipe};

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
        (first..first + count as u64).flat_map(|i| self.0.sample(i).iter().map(|&t| i64::from(t))).collect()
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

/// Fetches the corpus, trains or loads the tokenizer, and packs both splits.
pub fn prepare(recipe: &Recipe) -> Result<Prepared, RunError> {
    let mut spec = recipe.model_spec()?;
    let cache = data::cache_dir();
    let plays = data::load_plays(&cache)?;
    let corpus = data::split(plays, &recipe.data.heldout_plays)?;
    let train_texts: Vec<&str> = corpus.train.iter().map(|p| p.text.as_str()).collect();
    let heldout_texts: Vec<&str> = corpus.heldout.iter().map(|p| p.text.as_str()).collect();
    let tokenizer = match &recipe.data.tokenizer {
        TokenizerRecipe::Bpe { vocab_size } => {
            tracing::info!("tokenizer: byte-level BPE, {vocab_size} tokens, trained on {} plays (cached)", corpus.train.len());
            data::bpe_tokenizer(&train_texts, *vocab_size, &cache)?
        }
        TokenizerRecipe::File(path) => {
            tokenizers::Tokenizer::from_file(path).map_err(|e| data::DataError::Tokenizer(format!("`data.tokenizer` file {path}: {e}")))?
        }
    };
    // The embedding covers the tokenizer, rounded up to a multiple of 64 for sharding.
    spec.vocab_size = checked_vocab(&tokenizer, "`data.tokenizer`")?;
    let t = &recipe.train;
    let train = PackedDataset::new(data::encode(&tokenizer, &train_texts)?, spec.seq_len, t.seed, "training")?;
    let heldout = PackedDataset::new(data::encode(&tokenizer, &heldout_texts)?, spec.seq_len, t.seed, "held-out")?;
    tracing::info!(
        "data: {} training sequences, {} held-out ({}) of {} tokens",
        train.num_seqs(),
        heldout.num_seqs(),
        recipe.data.heldout_plays.join(", "),
        spec.seq_len
    );
    Ok(Prepared { spec, train, heldout, checksum: corpus.checksum.clone(), tokenizer })
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

/// The largest vocabulary a model may have: 2^20 ids.
pub const MAX_VOCAB: usize = 1 << 20;

/// The model's vocabulary for a tokenizer: one past its largest id (which is its size when its
/// ids are dense), rounded up to a multiple of 64 (so tensor parallelism can split it), as
/// every run builds it. Every id the tokenizer can produce is then inside the vocabulary.
pub fn vocab_of(tokenizer: &tokenizers::Tokenizer) -> usize {
    let largest = tokenizer.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
    largest.max(tokenizer.get_vocab_size(true)).div_ceil(64) * 64
}

/// [`vocab_of`] for a tokenizer a user supplied, checked: at least one id, at most
/// [`MAX_VOCAB`]; sparse ids are allowed (the vocabulary covers the largest) with a warning.
pub fn checked_vocab(tokenizer: &tokenizers::Tokenizer, what: &str) -> Result<usize, data::DataError> {
    let entries = tokenizer.get_vocab_size(true);
    let largest = tokenizer.get_vocab(true).values().max().copied().unwrap_or(0);
    let vocab = vocab_of(tokenizer);
    if entries == 0 {
        return Err(data::DataError::Tokenizer(format!("{what}: the tokenizer has no tokens")));
    }
    if vocab > MAX_VOCAB {
        return Err(data::DataError::Tokenizer(format!(
            "{what}: ids up to {largest} (a vocabulary of {vocab}); at most {MAX_VOCAB} are allowed"
        )));
    }
    if vocab > entries.div_ceil(64) * 64 {
        tracing::warn!("{what}: {entries} tokens with ids up to {largest}: the model's vocabulary covers the largest id ({vocab})");
    }
    Ok(vocab)
}

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
