//! Real text for training: the corpus a recipe names (the built-in Shakespeare plays and State
//! of the Union addresses, or the user's text, JSON lines, Parquet or token shards), split into
//! training and held-out documents, tokenized once into a cache of memory-mapped token shards
//! (a byte-level BPE trained on the training split, or the recipe's `tokenizer.json`), and
//! packed into sequences visited in an order that is a pure function of (seed, sample index).
//!
//! - [`error`]: what can go wrong, and the cache folder;
//! - [`bpe`]: the tokenizer and the model's vocabulary;
//! - [`spec`]: what a recipe says (source, held-out split, text splitting, token widths);
//! - [`builtin`]: the built-in corpora, fetched from the package registries;
//! - [`documents`]: files, folders and globs to documents;
//! - [`corpus`]: the tokenized cache and its manifest (`recipes prepare`), and token sources;
//! - [`tokens`]: memory-mapped shards and a split's stream over them;
//! - [`packed`]: sequences and the run's sample order.

pub mod bpe;
pub mod builtin;
pub mod corpus;
pub mod documents;
pub mod error;
pub mod packed;
pub mod spec;
pub mod tokens;

pub use bpe::{MAX_VOCAB, bpe_key, bpe_tokenizer, checked_vocab, encode, vocab_of};
pub use builtin::{Play, load_plays, strip_markdown};
pub use error::{DataError, cache_dir, hex, sha256_hex};
pub use packed::{Order, PackedDataset};
