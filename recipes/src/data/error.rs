//! What can go wrong with data, and the cache folder everything fetched or built goes in.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use thiserror::Error;

/// Data that could not be had.
#[derive(Debug, Error)]
pub enum DataError {
    /// A built-in corpus could not be fetched.
    #[error(
        "could not fetch the {corpus} corpus ({why}).\nTo place it by hand, either\n  - {by_hand}\n\
         then run again. Set COPUS_CACHE to use another cache folder."
    )]
    Fetch {
        /// Which corpus.
        corpus: &'static str,
        /// What went wrong.
        why: String,
        /// How to place it by hand.
        by_hand: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {err}")]
    Io {
        /// File.
        path: String,
        /// Error.
        err: std::io::Error,
    },
    /// A download is not the published one.
    #[error("{path} has sha256 {got}, expected {expected}; delete it and run again")]
    Checksum {
        /// File.
        path: String,
        /// Its hash.
        got: String,
        /// The published hash.
        expected: &'static str,
    },
    /// A held-out document or file that the corpus does not have.
    #[error("`{field}`: no {what} named `{name}`; {allowed}")]
    UnknownHeldout {
        /// The recipe field.
        field: &'static str,
        /// Document or file.
        what: &'static str,
        /// Name given.
        name: String,
        /// What the corpus has (all of it, or the first names and a count).
        allowed: String,
    },
    /// A file that is not UTF-8.
    #[error("{path}: not UTF-8 at byte {offset} (convert it, or set `data.skip_invalid_utf8: true` to skip such files and lines)")]
    NotUtf8 {
        /// File.
        path: String,
        /// Byte offset of the first invalid byte.
        offset: u64,
    },
    /// Input that cannot be used, said with where and why.
    #[error("{0}")]
    Input(String),
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

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |err| DataError::Io { path: path.display().to_string(), err }
}

/// The cache folder: `$COPUS_CACHE`, else the user's cache folder, else `./.copus-cache`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("COPUS_CACHE")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("copus")))
        .unwrap_or_else(|| PathBuf::from(".copus-cache"))
}

/// Lower-case hex of bytes (a digest).
pub fn hex(digest: &[u8]) -> String {
    digest.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Lower-case hex of the sha256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex(&Sha256::digest(bytes))
}
