//! A recipe's corpus, ready to train on: the training and held-out token streams and the
//! tokenizer.
//!
//! Text sources (the built-in corpora, `Text`, `Jsonl`, `Parquet`) are tokenized once into a
//! cache folder, `CACHE/corpora/NAME-KEY/`, of token shards (`train-00000.bin`, ...,
//! `heldout-00000.bin`; u16 ids when the vocabulary fits, else u32), the tokenizer and a
//! manifest: the source files with their sizes and modification times, the tokenizer's hash,
//! the shards, the document counts and the corpus checksum. The key is a hash of the source,
//! the held-out rule and the tokenizer; a later run reuses the folder when its manifest matches
//! the files as they are now, and rebuilds it when not. Documents are read one file at a time
//! and tokenized in parallel batches with a progress bar; the folder is built under another name
//! and renamed into place, so an interrupted build leaves nothing half-written.
//!
//! `Tokens` sources are used where they lie: each shard memory-mapped, its ids checked once
//! against the tokenizer (the check remembered under `CACHE/checked/` by the files' sizes and
//! modification times), the split made by spans of blocks (flat shards, 2^16 ids per block,
//! named `path#k`) or sequences (Megatron, named `path#k`; the index is read into memory,
//! 16 bytes per sequence).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use super::bpe::{BPE_SETTINGS, bpe_tokenizer, id_bound, vocab_of};
use super::builtin::load_plays;
use super::documents::{self, Document, FileStamp, Naming};
use super::error::{DataError, hex, io, sha256_hex};
use super::spec::{Heldout, Source, TextSplit, TokenDtype, TokenizerRecipe, same_file};
use super::tokens::{self, Shard, ShardWriter, Span, TokenStore, Width};
use crate::report::progress::Progress;

/// What the corpus is made from: the recipe's `data` section, resolved.
#[derive(Clone, Debug)]
pub struct DataSpec {
    /// Where the text or tokens are.
    pub source: Source,
    /// What is held out.
    pub heldout: Heldout,
    /// The recipe field the held-out rule came from, for messages.
    pub heldout_field: &'static str,
    /// The tokenizer.
    pub tokenizer: TokenizerRecipe,
    /// Skip files and lines that are not UTF-8 (counted) instead of stopping.
    pub skip_invalid_utf8: bool,
}

/// Sizes of the prepared cache's pieces.
#[derive(Clone, Copy, Debug)]
pub struct BuildOptions {
    /// Ids per shard file.
    pub shard_tokens: u64,
    /// Training text a BPE is trained on, at most (the first documents, in file order).
    pub bpe_sample_bytes: usize,
    /// Text per parallel tokenization batch.
    pub batch_bytes: usize,
}

impl Default for BuildOptions {
    fn default() -> Self {
        Self { shard_tokens: 1 << 27, bpe_sample_bytes: 256 << 20, batch_bytes: 8 << 20 }
    }
}

/// The numbers of a prepared corpus.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    /// Training documents.
    pub train_documents: u64,
    /// Held-out documents.
    pub heldout_documents: u64,
    /// Training ids.
    pub train_tokens: u64,
    /// Held-out ids.
    pub heldout_tokens: u64,
    /// Files or lines skipped as not UTF-8.
    pub skipped: u64,
}

/// A corpus ready to train on.
pub struct Corpus {
    /// Training ids.
    pub train: TokenStore,
    /// Held-out ids.
    pub heldout: TokenStore,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// sha256 over the documents' names and texts in order (text sources), or over the token
    /// files' names, sizes and modification times (`Tokens`).
    pub checksum: String,
    /// Documents and ids per split.
    pub counts: Counts,
    /// The cache folder (text sources).
    pub folder: Option<PathBuf>,
    /// Whether the cache was reused rather than built.
    pub reused: bool,
}

/// Opens the corpus `spec` describes, building its cache under `cache` first when needed.
pub fn open(spec: &DataSpec, cache: &Path, options: &BuildOptions) -> Result<Corpus, DataError> {
    if let Heldout::Fraction(f) = spec.heldout
        && !(f > 0.0 && f < 1.0)
    {
        return Err(DataError::Input(format!("`data.heldout`: Fraction({f}) must lie strictly between 0 and 1")));
    }
    match &spec.source {
        Source::Tokens { paths, dtype } => open_tokens(spec, paths, *dtype, cache),
        _ => open_text(spec, cache, options),
    }
}

/// Bumped when the cache's layout or the tokenization changes.
const CACHE_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Manifest {
    version: u32,
    source: String,
    heldout: String,
    tokenizer: String,
    tokenizer_sha256: String,
    files: Vec<FileStamp>,
    width: Width,
    train_shards: Vec<(String, u64)>,
    heldout_shards: Vec<(String, u64)>,
    counts: Counts,
    checksum: String,
}

/// The files of a text source and how its documents are named.
struct TextFiles {
    files: Vec<PathBuf>,
    naming: Naming,
    /// The source as read (the built-ins are plain text files).
    reading: Source,
}

fn text_files(source: &Source, cache: &Path) -> Result<TextFiles, DataError> {
    let builtin = |dir: PathBuf| -> Result<TextFiles, DataError> {
        let reading = Source::Text { paths: vec![], split: TextSplit::PerFile };
        let mut files = documents::resolve(&reading, &[dir.display().to_string()])?;
        // By document name, as the plays have always been ordered.
        files.sort_by(|a, b| a.file_stem().cmp(&b.file_stem()));
        Ok(TextFiles { files, naming: Naming::Stem, reading })
    };
    match source {
        Source::Shakespeare => builtin(super::builtin::shakespeare_dir(cache)?),
        Source::Sotu => builtin(super::builtin::sotu_dir(cache)?),
        Source::Text { paths, .. } | Source::Jsonl { paths, .. } | Source::Parquet { paths, .. } => {
            Ok(TextFiles { files: documents::resolve(source, paths)?, naming: Naming::Path, reading: source.clone() })
        }
        Source::Tokens { .. } => unreachable!("token sources are not text"),
    }
}

/// Reads every document of `files`, in order; the Shakespeare plays through [`load_plays`]
/// (Markdown stripped, as the plays have always been read).
fn each_document(
    spec: &DataSpec,
    files: &TextFiles,
    cache: &Path,
    each: &mut dyn FnMut(Document) -> Result<(), DataError>,
    file_done: &mut dyn FnMut(u64),
) -> Result<u64, DataError> {
    if spec.source == Source::Shakespeare {
        let dir = super::builtin::shakespeare_dir(cache)?;
        for p in load_plays(cache)? {
            let bytes = p.text.len() as u64;
            each(Document { file: dir.join(format!("{}.txt", p.name)).display().to_string(), name: p.name, text: p.text })?;
            file_done(bytes);
        }
        return Ok(0);
    }
    Ok(documents::read(&files.reading, &files.files, files.naming, spec.skip_invalid_utf8, each, file_done)?.skipped)
}

/// Checks that every held-out file is one of the source's files.
fn check_heldout_files(spec: &DataSpec, files: &[PathBuf]) -> Result<(), DataError> {
    let Heldout::Files(wanted) = &spec.heldout else { return Ok(()) };
    let shown: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    for w in wanted {
        if !shown.iter().any(|s| same_file(w, s)) {
            return Err(DataError::UnknownHeldout {
                field: spec.heldout_field,
                what: "file",
                name: w.clone(),
                allowed: listing(&shown[..shown.len().min(64)], shown.len() as u64, "files"),
            });
        }
    }
    Ok(())
}

/// "the corpus has: a, b, c" or the first names and a count.
/// "allowed: a, b, c" when the corpus has at most 64 names (`total`), else the first and the
/// count.
fn listing(names: &[String], total: u64, what: &str) -> String {
    if total as usize <= names.len() {
        format!("allowed: {}", names.join(", "))
    } else {
        format!("the corpus has {total} {what}, the first: {}, ...", names[..names.len().min(12)].join(", "))
    }
}

/// The tokenizer's identity in a cache key: the BPE's settings, or the file's hash.
fn tokenizer_identity(t: &TokenizerRecipe) -> Result<String, DataError> {
    match t {
        TokenizerRecipe::Bpe { vocab_size } => Ok(format!("bpe {vocab_size}: {}", BPE_SETTINGS)),
        TokenizerRecipe::File(path) => {
            let bytes = std::fs::read(path).map_err(|e| DataError::Tokenizer(format!("`data.tokenizer` file {path}: {e}")))?;
            Ok(format!("file {}", sha256_hex(&bytes)))
        }
    }
}

fn load_tokenizer_file(path: &str) -> Result<Tokenizer, DataError> {
    Tokenizer::from_file(path).map_err(|e| DataError::Tokenizer(format!("`data.tokenizer` file {path}: {e}")))
}

fn ron_of<T: Serialize>(v: &T) -> String {
    ron::to_string(v).expect("recipe types serialize")
}

fn open_text(spec: &DataSpec, cache: &Path, options: &BuildOptions) -> Result<Corpus, DataError> {
    let files = text_files(&spec.source, cache)?;
    check_heldout_files(spec, &files.files)?;
    let stamps: Vec<FileStamp> = files.files.iter().map(|f| FileStamp::of(f)).collect::<Result<_, _>>()?;
    let identity = tokenizer_identity(&spec.tokenizer)?;
    let (source, heldout) = (ron_of(&spec.source), ron_of(&spec.heldout));
    let key = sha256_hex(format!("{CACHE_VERSION}\n{source}\n{heldout}\n{identity}\n{}", spec.skip_invalid_utf8).as_bytes());
    let root = cache.join("corpora");
    let folder = root.join(format!("{}-{}", spec.source.name().to_lowercase(), &key[..16]));
    std::fs::create_dir_all(&root).map_err(io(&root))?;
    // One build at a time across threads and processes; whoever waited finds it built.
    let lock_path = folder.with_extension("lock");
    let lock = std::fs::File::create(&lock_path).map_err(io(&lock_path))?;
    lock.lock().map_err(io(&lock_path))?;
    // Under the lock no one else builds this corpus: a temporary folder left by a build that was
    // killed (its process gone) goes.
    remove_partials(&folder);
    let wanted = |m: &Manifest| {
        m.version == CACHE_VERSION && m.source == source && m.heldout == heldout && m.tokenizer == identity && m.files == stamps
    };
    if let Some(m) = read_manifest(&folder).filter(wanted)
        && let Ok(corpus) = open_built(&folder, &m, spec, true)
    {
        tracing::info!("data: {} (cached)", folder.display());
        return Ok(corpus);
    }
    let m = build(
        spec,
        &files,
        &folder,
        cache,
        options,
        Manifest {
            version: CACHE_VERSION,
            source,
            heldout,
            tokenizer: identity,
            tokenizer_sha256: String::new(),
            files: stamps,
            width: Width::U16,
            train_shards: vec![],
            heldout_shards: vec![],
            counts: Counts::default(),
            checksum: String::new(),
        },
    )?;
    open_built(&folder, &m, spec, false)
}

/// Removes `folder`'s temporary siblings (`NAME.partial-PID`) left by killed builds.
fn remove_partials(folder: &Path) {
    let (Some(dir), Some(name)) = (folder.parent(), folder.file_name().and_then(|n| n.to_str())) else { return };
    let prefix = format!("{name}.partial-");
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if entry.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
            tracing::info!("removing {}, left by an interrupted build", entry.path().display());
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn read_manifest(folder: &Path) -> Option<Manifest> {
    serde_json::from_slice(&std::fs::read(folder.join("manifest.json")).ok()?).ok()
}

fn open_built(folder: &Path, m: &Manifest, spec: &DataSpec, reused: bool) -> Result<Corpus, DataError> {
    let tokenizer = match &spec.tokenizer {
        TokenizerRecipe::Bpe { .. } => {
            let path = folder.join("tokenizer.json");
            let bytes = std::fs::read(&path).map_err(io(&path))?;
            if sha256_hex(&bytes) != m.tokenizer_sha256 {
                return Err(DataError::Tokenizer(format!("{} differs from its manifest", path.display())));
            }
            Tokenizer::from_bytes(&bytes).map_err(|e| DataError::Tokenizer(format!("{}: {e}", path.display())))?
        }
        TokenizerRecipe::File(path) => load_tokenizer_file(path)?,
    };
    let store = |shards: &[(String, u64)]| -> Result<TokenStore, DataError> {
        let mapped: Vec<Shard> = shards.iter().map(|(name, _)| Shard::map(&folder.join(name), m.width)).collect::<Result<_, _>>()?;
        if mapped.iter().zip(shards).any(|(s, (_, n))| s.tokens() != *n) {
            return Err(DataError::Input(format!("{}: a shard's size differs from its manifest", folder.display())));
        }
        Ok(TokenStore::whole(mapped))
    };
    Ok(Corpus {
        train: store(&m.train_shards)?,
        heldout: store(&m.heldout_shards)?,
        tokenizer,
        checksum: m.checksum.clone(),
        counts: m.counts.clone(),
        folder: Some(folder.to_path_buf()),
        reused,
    })
}

/// Trains the recipe's BPE on the first training documents (at most `bpe_sample_bytes` of
/// text), or loads its tokenizer file.
fn tokenizer_for(spec: &DataSpec, files: &TextFiles, cache: &Path, options: &BuildOptions) -> Result<Tokenizer, DataError> {
    let vocab_size = match &spec.tokenizer {
        TokenizerRecipe::File(path) => return load_tokenizer_file(path),
        TokenizerRecipe::Bpe { vocab_size } => *vocab_size,
    };
    // The sample: the first training documents up to the byte budget (the rest is read and
    // passed over; a corpus too large for that is better served by its own `tokenizer.json`).
    let mut texts: Vec<String> = Vec::new();
    let (mut bytes, mut documents) = (0usize, 0u64);
    each_document(
        spec,
        files,
        cache,
        &mut |d| {
            documents += 1;
            if bytes < options.bpe_sample_bytes && !spec.heldout.holds(&d.name, &d.file) {
                bytes += d.text.len();
                texts.push(d.text);
            }
            Ok(())
        },
        &mut |_| {},
    )?;
    if texts.is_empty() {
        // The same errors as after tokenizing: no documents at all, or none left to train on.
        let counts = Counts { heldout_documents: documents, ..Counts::default() };
        check_counts(spec, &counts)?;
    }
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    tracing::info!("tokenizer: byte-level BPE, {vocab_size} tokens, trained on {} training documents (cached)", refs.len());
    bpe_tokenizer(&refs, vocab_size, cache)
}

/// Documents on their way into shards: tokenized in parallel a batch at a time, each followed
/// by the end-of-text id, written to the training or held-out shards in order.
struct Encoder<'a> {
    tokenizer: &'a Tokenizer,
    eot: Option<u32>,
    vocab: usize,
    writers: [ShardWriter; 2],
    counts: Counts,
    batch: Vec<(Document, bool)>,
    batch_bytes: usize,
    limit: usize,
}

impl Encoder<'_> {
    fn push(&mut self, d: Document, held: bool) -> Result<(), DataError> {
        self.batch_bytes += d.text.len();
        self.batch.push((d, held));
        if self.batch_bytes >= self.limit { self.flush() } else { Ok(()) }
    }

    fn flush(&mut self) -> Result<(), DataError> {
        let (tokenizer, eot) = (self.tokenizer, self.eot);
        let encoded: Vec<Result<Vec<u32>, DataError>> = self
            .batch
            .par_iter()
            .map(|(d, _)| {
                let enc = tokenizer.encode(d.text.as_str(), false).map_err(|e| DataError::Tokenizer(format!("{}: {e}", d.name)))?;
                let mut ids = enc.get_ids().to_vec();
                ids.extend(eot);
                Ok(ids)
            })
            .collect();
        for ((d, held), ids) in self.batch.iter().zip(encoded) {
            let ids = ids?;
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab) {
                return Err(DataError::Tokenizer(format!("{}: id {bad} is outside the tokenizer's {} ids", d.name, self.vocab)));
            }
            self.writers[usize::from(*held)].write(&ids)?;
            let c = &mut self.counts;
            let (docs, toks) =
                if *held { (&mut c.heldout_documents, &mut c.heldout_tokens) } else { (&mut c.train_documents, &mut c.train_tokens) };
            *docs += 1;
            *toks += ids.len() as u64;
        }
        self.batch.clear();
        self.batch_bytes = 0;
        Ok(())
    }
}

/// Tokenizes every document into shards under a temporary folder, writes the tokenizer and the
/// manifest there, and renames the folder into place; on failure the temporary folder goes.
fn build(
    spec: &DataSpec,
    files: &TextFiles,
    folder: &Path,
    cache: &Path,
    options: &BuildOptions,
    m: Manifest,
) -> Result<Manifest, DataError> {
    let tokenizer = tokenizer_for(spec, files, cache, options)?;
    let tmp = folder.with_extension(format!("partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    let m = match fill(spec, files, cache, options, &tokenizer, &tmp, m) {
        Ok(m) => m,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    let _ = std::fs::remove_dir_all(folder);
    std::fs::rename(&tmp, folder).map_err(io(folder))?;
    let c = &m.counts;
    tracing::info!(
        "data: tokenized {} + {} documents into {} + {} ids at {}",
        c.train_documents,
        c.heldout_documents,
        c.train_tokens,
        c.heldout_tokens,
        folder.display()
    );
    Ok(m)
}

/// The shards, tokenizer and manifest of the corpus, written into `tmp`.
fn fill(
    spec: &DataSpec,
    files: &TextFiles,
    cache: &Path,
    options: &BuildOptions,
    tokenizer: &Tokenizer,
    tmp: &Path,
    mut m: Manifest,
) -> Result<Manifest, DataError> {
    let vocab = id_bound(tokenizer);
    m.width = Width::for_vocab(vocab_of(tokenizer));
    let mut enc = Encoder {
        tokenizer,
        eot: tokenizer.token_to_id("<|endoftext|>"),
        vocab,
        writers: [
            ShardWriter::new(tmp, "train", m.width, options.shard_tokens),
            ShardWriter::new(tmp, "heldout", m.width, options.shard_tokens),
        ],
        counts: Counts::default(),
        batch: Vec::new(),
        batch_bytes: 0,
        limit: options.batch_bytes,
    };
    let progress = Progress::new("tokenizing", m.files.iter().map(|f| f.size).sum());
    let mut hasher = Sha256::new();
    let (mut names, mut held_found): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
    let skipped = each_document(
        spec,
        files,
        cache,
        &mut |d| {
            hasher.update(d.name.as_bytes());
            hasher.update(d.text.as_bytes());
            let held = spec.heldout.holds(&d.name, &d.file);
            if names.len() < 64 {
                names.push(d.name.clone());
            }
            if held && matches!(spec.heldout, Heldout::Documents(_)) {
                held_found.push(d.name.clone());
            }
            enc.push(d, held)
        },
        &mut |bytes| progress.inc(bytes),
    )?;
    enc.flush()?;
    progress.finish();
    let what = if spec.source == Source::Shakespeare { "play" } else { "document" };
    check_named_documents(spec, &held_found, &names, enc.counts.train_documents + enc.counts.heldout_documents, what)?;
    enc.counts.skipped = skipped;
    check_counts(spec, &enc.counts)?;
    let [train, heldout] = enc.writers;
    m.train_shards = train.finish()?;
    m.heldout_shards = heldout.finish()?;
    m.counts = enc.counts;
    m.checksum = hex(&hasher.finalize());
    let tok_path = tmp.join("tokenizer.json");
    tokenizer.save(&tok_path, false).map_err(|e| DataError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
    m.tokenizer_sha256 = sha256_hex(&std::fs::read(&tok_path).map_err(io(&tok_path))?);
    let manifest = tmp.join("manifest.json");
    std::fs::write(&manifest, serde_json::to_vec_pretty(&m).expect("a manifest serializes")).map_err(io(&manifest))?;
    Ok(m)
}

/// Every document `Documents([..])` names was found.
fn check_named_documents(spec: &DataSpec, found: &[String], names: &[String], total: u64, what: &'static str) -> Result<(), DataError> {
    if let Heldout::Documents(wanted) = &spec.heldout
        && let Some(missing) = wanted.iter().find(|w| !found.contains(w))
    {
        return Err(DataError::UnknownHeldout {
            field: spec.heldout_field,
            what,
            name: missing.clone(),
            allowed: listing(names, total, "documents"),
        });
    }
    Ok(())
}

fn check_counts(spec: &DataSpec, c: &Counts) -> Result<(), DataError> {
    let field = spec.heldout_field;
    if c.train_documents + c.heldout_documents == 0 {
        let paths = spec.source.paths().map_or_else(|| spec.source.name().to_string(), |p| p.join(", "));
        return Err(DataError::Input(format!("`data.source`: {paths} holds no documents (every file empty, or skipped)")));
    }
    if c.train_documents == 0 {
        return Err(DataError::Input(format!("`{field}` leaves the training split empty: every document is held out")));
    }
    if c.heldout_documents == 0 {
        return Err(DataError::Input(format!(
            "`{field}` holds out none of the {} documents: raise the fraction (about 1 / documents at least) or name documents or files",
            c.train_documents
        )));
    }
    Ok(())
}

/// Ids of a flat token shard that make one document for the held-out split.
pub const TOKEN_BLOCK: u64 = 1 << 16;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Checked {
    files: Vec<FileStamp>,
    vocab: usize,
    dtype: TokenDtype,
}

/// Checks every id of `files` against `vocab` once; later runs with the same files (sizes and
/// modification times) skip the scan.
fn check_token_files(files: &[(PathBuf, Width)], vocab: usize, dtype: TokenDtype, cache: &Path) -> Result<(), DataError> {
    let stamps: Vec<FileStamp> = files.iter().map(|(f, _)| FileStamp::of(f)).collect::<Result<_, _>>()?;
    let record = Checked { files: stamps, vocab, dtype };
    let key = sha256_hex(serde_json::to_string(&record).expect("serializes").as_bytes());
    let path = cache.join("checked").join(format!("{}.json", &key[..24]));
    if std::fs::read(&path).ok().and_then(|b| serde_json::from_slice::<Checked>(&b).ok()).is_some_and(|c| c == record) {
        return Ok(());
    }
    files.par_iter().try_for_each(|(f, w)| tokens::check_ids(f, *w, vocab))?;
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = std::fs::write(&path, serde_json::to_vec(&record).expect("serializes"));
    Ok(())
}

/// Maps each token file; returns the shards, each one's documents (first id, length: blocks of
/// a flat shard, a Megatron index's sequences) and the files with their id widths.
#[allow(clippy::type_complexity)]
fn map_token_files(files: &[PathBuf], dtype: TokenDtype) -> Result<(Vec<Shard>, Vec<Vec<(u64, u64)>>, Vec<(PathBuf, Width)>), DataError> {
    // Each shard's documents: (first id, length).
    let mut shards = Vec::new();
    let mut docs: Vec<Vec<(u64, u64)>> = Vec::new();
    let mut checked = Vec::new();
    for f in files {
        match dtype {
            TokenDtype::U16 | TokenDtype::U32 => {
                let width = if dtype == TokenDtype::U16 { Width::U16 } else { Width::U32 };
                let shard = Shard::map(f, width)?;
                let n = shard.tokens();
                docs.push((0..n.div_ceil(TOKEN_BLOCK)).map(|k| (k * TOKEN_BLOCK, TOKEN_BLOCK.min(n - k * TOKEN_BLOCK))).collect());
                shards.push(shard);
                checked.push((f.clone(), width));
            }
            TokenDtype::Megatron => {
                let idx = tokens::idx_path(f);
                if !idx.exists() {
                    return Err(DataError::Input(format!("{}: no Megatron index {} beside it", f.display(), idx.display())));
                }
                let index = tokens::read_megatron_index(&idx)?;
                let shard = Shard::map(f, index.width)?;
                if let Some(&(start, len)) = index.sequences.iter().find(|(s, l)| s + l > shard.tokens()) {
                    return Err(DataError::Input(format!(
                        "{}: its index has a sequence at ids {start}..{} past the file's {} ids",
                        f.display(),
                        start + len,
                        shard.tokens()
                    )));
                }
                docs.push(index.sequences);
                shards.push(shard);
                checked.push((f.clone(), index.width));
            }
        }
    }
    Ok((shards, docs, checked))
}

fn open_tokens(spec: &DataSpec, paths: &[String], dtype: TokenDtype, cache: &Path) -> Result<Corpus, DataError> {
    let TokenizerRecipe::File(tpath) = &spec.tokenizer else {
        return Err(DataError::Input(
            "`data.tokenizer`: token shards need the tokenizer that made them: File(\"path/to/tokenizer.json\")".into(),
        ));
    };
    let tokenizer = load_tokenizer_file(tpath)?;
    let vocab = id_bound(&tokenizer);
    let files = documents::resolve(&spec.source, paths)?;
    check_heldout_files(spec, &files)?;
    let (shards, docs, checked) = map_token_files(&files, dtype)?;
    check_token_files(&checked, vocab, dtype, cache)?;
    let (mut train, mut held) = (Vec::new(), Vec::new());
    let mut counts = Counts::default();
    let mut found: Vec<String> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for (i, (f, ds)) in files.iter().zip(&docs).enumerate() {
        let shown = f.display().to_string();
        for (k, &(start, len)) in ds.iter().enumerate() {
            let name = format!("{shown}#{k}");
            let span = Span { shard: i, start, len };
            if names.len() < 64 {
                names.push(name.clone());
            }
            if spec.heldout.holds(&name, &shown) {
                found.push(name);
                held.push(span);
                counts.heldout_documents += 1;
                counts.heldout_tokens += len;
            } else {
                train.push(span);
                counts.train_documents += 1;
                counts.train_tokens += len;
            }
        }
    }
    check_named_documents(spec, &found, &names, counts.train_documents + counts.heldout_documents, "document")?;
    check_counts(spec, &counts)?;
    let stamps: Vec<FileStamp> = files.iter().map(|f| FileStamp::of(f)).collect::<Result<_, _>>()?;
    let checksum = sha256_hex(serde_json::to_string(&stamps).expect("serializes").as_bytes());
    let shards = Arc::new(shards);
    Ok(Corpus {
        train: TokenStore::new(shards.clone(), train),
        heldout: TokenStore::new(shards, held),
        tokenizer,
        checksum,
        counts,
        folder: None,
        reused: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::packed::{Order, PackedDataset};

    fn spec(source: Source, heldout: Heldout, tokenizer: TokenizerRecipe) -> DataSpec {
        DataSpec { source, heldout, heldout_field: "data.heldout", tokenizer, skip_invalid_utf8: false }
    }

    fn all(store: &TokenStore) -> Vec<u32> {
        let mut out = Vec::new();
        store.read(0, store.len() as usize, &mut out);
        out
    }

    /// Document `i`'s made-up word (letters only, so the pre-tokenizer keeps it whole).
    fn word(i: usize) -> String {
        format!("qu{}{}zk", (b'a' + (i / 26) as u8) as char, (b'a' + (i % 26) as u8) as char)
    }

    /// A folder of `n` small text files, each with its own made-up word repeated.
    fn text_folder(dir: &Path, n: usize) -> PathBuf {
        let root = dir.join("texts");
        std::fs::create_dir_all(&root).unwrap();
        let base = "Now is the winter of our discontent made glorious summer by this sun of York.\n".repeat(5);
        for i in 0..n {
            std::fs::write(root.join(format!("doc-{i:03}.txt")), format!("{base}{}", format!("{} ", word(i)).repeat(200))).unwrap();
        }
        root
    }

    /// The folder `root` as whole-file documents, a 300-id BPE.
    fn text_spec(root: &Path, heldout: Heldout) -> DataSpec {
        spec(
            Source::Text { paths: vec![root.display().to_string()], split: TextSplit::PerFile },
            heldout,
            TokenizerRecipe::Bpe { vocab_size: 300 },
        )
    }

    fn small() -> BuildOptions {
        BuildOptions { shard_tokens: 500, bpe_sample_bytes: 1 << 20, batch_bytes: 2_000 }
    }

    #[test]
    fn a_text_folder_is_tokenized_once_reused_and_rebuilt_when_a_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let root = text_folder(dir.path(), 40);
        let cache = dir.path().join("cache");
        let s = text_spec(&root, Heldout::Fraction(0.3));
        let first = open(&s, &cache, &small()).unwrap();
        assert!(!first.reused);
        // Held out by the hash of each document's name, whatever order files are found in.
        let held: u64 = (0..40)
            .filter(|i| super::super::spec::fraction_of(&root.join(format!("doc-{i:03}.txt")).display().to_string()) < 0.3)
            .count() as u64;
        assert_eq!(first.counts.heldout_documents, held);
        assert_eq!(first.counts.train_documents, 40 - held);
        // The streams are each document's ids and an end-of-text id, in file order.
        let eot = first.tokenizer.token_to_id("<|endoftext|>").unwrap();
        let mut expect = Vec::new();
        for i in 0..40 {
            let path = root.join(format!("doc-{i:03}.txt"));
            if super::super::spec::fraction_of(&path.display().to_string()) >= 0.3 {
                let text = std::fs::read_to_string(&path).unwrap();
                expect.extend(first.tokenizer.encode(text.as_str(), false).unwrap().get_ids());
                expect.push(eot);
            }
        }
        assert_eq!(all(&first.train), expect);
        assert_eq!(first.train.len(), first.counts.train_tokens);
        let folder = first.folder.clone().unwrap();
        assert!(
            std::fs::read_dir(&folder).unwrap().filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("train-")).count()
                > 1,
            "several shards"
        );
        // Reused while the files are as they were.
        let again = open(&s, &cache, &small()).unwrap();
        assert!(again.reused);
        assert_eq!(all(&again.train), expect);
        assert_eq!(again.checksum, first.checksum);
        // A changed file (size or time) rebuilds it.
        std::fs::write(root.join("doc-000.txt"), "something else entirely, and longer than before").unwrap();
        let rebuilt = open(&s, &cache, &small()).unwrap();
        assert!(!rebuilt.reused);
        assert_ne!(rebuilt.checksum, first.checksum);
    }

    /// Two recipes holding out different documents get two tokenizers, and neither has seen its
    /// held-out document: each document's made-up word, repeated there, is a token only of the
    /// tokenizer trained with that document.
    #[test]
    fn held_out_text_never_reaches_the_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let root = text_folder(dir.path(), 2);
        let cache = dir.path().join("cache");
        let name = |i: usize| root.join(format!("doc-{i:03}.txt")).display().to_string();
        let holding_out = |i: usize| {
            let s = text_spec(&root, Heldout::Documents(vec![name(i)]));
            open(&s, &cache, &small()).unwrap().tokenizer
        };
        let (no_0, no_1) = (holding_out(0), holding_out(1));
        let pieces = |t: &Tokenizer, w: &str| t.encode(w, false).unwrap().get_ids().len();
        assert!(pieces(&no_0, &word(0)) > 1, "document 0's word is not a token of the tokenizer without it");
        assert_eq!(pieces(&no_1, &word(0)), 1, "but it is one where document 0 was trained on");
        assert!(pieces(&no_1, &word(1)) > 1);
        assert_eq!(pieces(&no_0, &word(1)), 1);
    }

    #[test]
    fn bad_splits_and_names_are_errors_that_say_what_exists() {
        let dir = tempfile::tempdir().unwrap();
        let root = text_folder(dir.path(), 3);
        let cache = dir.path().join("cache");
        let text = Source::Text { paths: vec![root.display().to_string()], split: TextSplit::PerFile };
        let bpe = TokenizerRecipe::Bpe { vocab_size: 300 };
        let e =
            open(&spec(text.clone(), Heldout::Documents(vec!["nope".into()]), bpe.clone()), &cache, &small()).err().unwrap().to_string();
        assert!(e.contains("`data.heldout`: no document named `nope`") && e.contains("doc-001.txt"), "{e}");
        let e =
            open(&spec(text.clone(), Heldout::Files(vec!["other.txt".into()]), bpe.clone()), &cache, &small()).err().unwrap().to_string();
        assert!(e.contains("no file named `other.txt`"), "{e}");
        let every: Vec<String> = (0..3).map(|i| root.join(format!("doc-{i:03}.txt")).display().to_string()).collect();
        let e = open(&spec(text.clone(), Heldout::Files(every), bpe.clone()), &cache, &small()).err().unwrap().to_string();
        assert!(e.contains("every document is held out"), "{e}");
        let e = open(&spec(text.clone(), Heldout::Fraction(1.5), bpe.clone()), &cache, &small()).err().unwrap().to_string();
        assert!(e.contains("Fraction(1.5)"), "{e}");
        let e = open(&spec(text, Heldout::Fraction(1e-9), bpe.clone()), &cache, &small()).err().unwrap().to_string();
        assert!(e.contains("`data.heldout` holds out none of the 3 documents"), "{e}");
        // An empty corpus.
        let empty = dir.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        std::fs::write(empty.join("a.txt"), "").unwrap();
        let e = open(
            &spec(Source::Text { paths: vec![empty.display().to_string()], split: TextSplit::BlankLines }, Heldout::Fraction(0.5), bpe),
            &cache,
            &small(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("no documents"), "{e}");
        // Nothing half-built is left behind by the failures.
        let left: Vec<String> =
            std::fs::read_dir(cache.join("corpora")).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert!(left.iter().all(|n| n.ends_with(".lock")), "{left:?}");
    }

    #[test]
    fn jsonl_and_parquet_sources_read_their_field() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let jsonl = dir.path().join("d.jsonl");
        let line =
            |i: usize| serde_json::json!({"id": i, "body": format!("document number {i} says hello to the world. ").repeat(4)}).to_string();
        std::fs::write(&jsonl, (0..30).map(line).collect::<Vec<_>>().join("\n")).unwrap();
        let s = spec(
            Source::Jsonl { paths: vec![jsonl.display().to_string()], field: "body".into() },
            Heldout::Documents(vec![format!("{}:3", jsonl.display())]),
            TokenizerRecipe::Bpe { vocab_size: 300 },
        );
        let c = open(&s, &cache, &small()).unwrap();
        assert_eq!((c.counts.train_documents, c.counts.heldout_documents), (29, 1));
        let held = c.tokenizer.decode(&all(&c.heldout), true).unwrap();
        assert_eq!(held, format!("document number {} says hello to the world. ", 2).repeat(4));
        let pq = dir.path().join("shards");
        std::fs::create_dir_all(&pq).unwrap();
        let texts: Vec<String> = (0..20).map(|i| format!("row {i} of the parquet shard. ").repeat(3)).collect();
        let refs: Vec<Option<&str>> = texts.iter().map(|t| Some(t.as_str())).collect();
        crate::data::documents::tests::write_parquet(&pq.join("train-00000-of-00002.parquet"), &refs[..10]);
        crate::data::documents::tests::write_parquet(&pq.join("train-00001-of-00002.parquet"), &refs[10..]);
        let s = spec(
            Source::Parquet { paths: vec![pq.display().to_string()], column: "text".into() },
            Heldout::Files(vec![pq.join("train-00001-of-00002.parquet").display().to_string()]),
            TokenizerRecipe::Bpe { vocab_size: 300 },
        );
        let c = open(&s, &cache, &small()).unwrap();
        assert_eq!((c.counts.train_documents, c.counts.heldout_documents), (10, 10));
        let train = c.tokenizer.decode(&all(&c.train), true).unwrap();
        assert!(train.starts_with("row 0 of the parquet shard.") && !train.contains("row 10 "), "{train}");
    }

    /// A tokenizer file made from a tiny BPE.
    fn tokenizer_file(dir: &Path) -> (String, Tokenizer) {
        let tok = crate::data::bpe_tokenizer(&["tiny corpus of words and more words for merges"], 300, dir).unwrap();
        let path = dir.join("tok.json");
        tok.save(&path, false).unwrap();
        (path.display().to_string(), tok)
    }

    #[test]
    fn flat_and_megatron_token_shards_are_split_by_blocks_and_sequences() {
        let dir = tempfile::tempdir().unwrap();
        let cache = dir.path().join("cache");
        let (tpath, tok) = tokenizer_file(dir.path());
        let vocab = crate::data::bpe::id_bound(&tok) as u32;
        // Three blocks of flat u16 ids: the third block partial.
        let n = 2 * TOKEN_BLOCK + 1000;
        let ids: Vec<u16> = (0..n).map(|i| (i % u64::from(vocab)) as u16).collect();
        let bin = dir.path().join("flat.bin");
        std::fs::write(&bin, ids.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let shown = bin.display().to_string();
        let s = spec(
            Source::Tokens { paths: vec![shown.clone()], dtype: TokenDtype::U16 },
            Heldout::Documents(vec![format!("{shown}#1")]),
            TokenizerRecipe::File(tpath.clone()),
        );
        let c = open(&s, &cache, &small()).unwrap();
        assert_eq!((c.counts.train_tokens, c.counts.heldout_tokens), (TOKEN_BLOCK + 1000, TOKEN_BLOCK));
        let mut out = Vec::new();
        c.train.read(TOKEN_BLOCK - 2, 4, &mut out);
        let at = |i: u64| u32::from(ids[i as usize]);
        assert_eq!(
            out,
            [at(TOKEN_BLOCK - 2), at(TOKEN_BLOCK - 1), at(2 * TOKEN_BLOCK), at(2 * TOKEN_BLOCK + 1)],
            "the held-out block is skipped"
        );
        // Megatron: int32 ids, three sequences, the middle one held out.
        let mbin = dir.path().join("m_text_document.bin");
        let seqs: [&[u32]; 3] = [&[1, 2, 3], &[4, 5, 6, 7, 8], &[9, 10]];
        std::fs::write(&mbin, seqs.concat().iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        tokens::write_megatron_index(&tokens::idx_path(&mbin), Width::U32, &[3, 5, 2]).unwrap();
        let mshown = mbin.display().to_string();
        let s = spec(
            Source::Tokens { paths: vec![mshown.clone()], dtype: TokenDtype::Megatron },
            Heldout::Documents(vec![format!("{mshown}#1")]),
            TokenizerRecipe::File(tpath.clone()),
        );
        let c = open(&s, &cache, &small()).unwrap();
        assert_eq!(all(&c.train), [1, 2, 3, 9, 10]);
        assert_eq!(all(&c.heldout), [4, 5, 6, 7, 8]);
        // Ids outside the tokenizer, a length not a whole number of ids, a missing index, a BPE.
        // The first id past the tokenizer's (not past the model's vocabulary, rounded up to 64).
        std::fs::write(&bin, [vocab as u16, 1].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        let flat = |p: &Path| Source::Tokens { paths: vec![p.display().to_string()], dtype: TokenDtype::U16 };
        let e = open(&spec(flat(&bin), Heldout::Fraction(0.5), TokenizerRecipe::File(tpath.clone())), &cache, &small())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("flat.bin") && e.contains("position 0") && e.contains("outside the tokenizer's vocabulary"), "{e}");
        std::fs::write(&bin, [1u8, 2, 3]).unwrap();
        let e = open(&spec(flat(&bin), Heldout::Fraction(0.5), TokenizerRecipe::File(tpath.clone())), &cache, &small())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a whole number of U16 ids"), "{e}");
        std::fs::remove_file(tokens::idx_path(&mbin)).unwrap();
        let meg = Source::Tokens { paths: vec![mshown], dtype: TokenDtype::Megatron };
        let e = open(&spec(meg, Heldout::Fraction(0.5), TokenizerRecipe::File(tpath)), &cache, &small()).err().unwrap().to_string();
        assert!(e.contains("no Megatron index"), "{e}");
        let e = open(&spec(flat(&bin), Heldout::Fraction(0.5), TokenizerRecipe::Bpe { vocab_size: 300 }), &cache, &small())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("need the tokenizer that made them"), "{e}");
    }

    /// The sequences a run reads depend only on sample indices, through a reopening of the
    /// cache (what a resumed process does) and across an epoch boundary; each epoch visits
    /// every sequence once. (The run-level test with a batch change and a resume is
    /// `adaptive::tests::a_run_on_a_user_corpus_resumes_across_a_batch_change_on_the_same_data`.)
    #[test]
    fn samples_depend_only_on_their_index_across_a_reopened_cache_and_epochs() {
        let dir = tempfile::tempdir().unwrap();
        let root = text_folder(dir.path(), 12);
        let cache = dir.path().join("cache");
        let s = text_spec(&root, Heldout::Documents(vec![root.join("doc-000.txt").display().to_string()]));
        let dataset = || PackedDataset::from_store(open(&s, &cache, &small()).unwrap().train, 16, 5, Order::Keyed, "training").unwrap();
        let run = dataset();
        let n = run.num_seqs() as u64;
        let read = |d: &PackedDataset, first: u64, count: u64| (first..first + count).map(|i| d.sample(i).into_owned()).collect::<Vec<_>>();
        let steps: Vec<Vec<u32>> = [(0, 4), (4, 4), (8, 8)].iter().flat_map(|&(f, c)| read(&run, f, c)).collect();
        assert_eq!(steps, read(&run, 0, 16));
        let resumed = dataset();
        let span = n + 8;
        assert_eq!(read(&resumed, 8, span), read(&run, 8, span), "past the end of epoch 0 ({n} sequences)");
        // Epoch 1 visits every sequence once again.
        let mut e1: Vec<usize> = (n..2 * n).map(|i| resumed.sequence_of_sample(i)).collect();
        e1.sort_unstable();
        assert_eq!(e1, (0..n as usize).collect::<Vec<_>>());
    }
}
