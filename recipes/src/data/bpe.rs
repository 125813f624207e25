//! The tokenizer: a byte-level BPE trained on the training split (cached by the exact text it
//! saw), and the model's vocabulary for any tokenizer.

use std::path::Path;

use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use super::error::{DataError, hex, io};

/// The largest vocabulary a model may have: 2^20 ids.
pub const MAX_VOCAB: usize = 1 << 20;

/// The model's vocabulary for a tokenizer: one past its largest id (which is its size when its
/// ids are dense), rounded up to a multiple of 64 (so tensor parallelism can split it), as
/// every run builds it. Every id the tokenizer can produce is then inside the vocabulary.
pub fn vocab_of(tokenizer: &tokenizers::Tokenizer) -> usize {
    id_bound(tokenizer).div_ceil(64) * 64
}

/// One past the largest id the tokenizer has (its size when its ids are dense): every id it
/// produces is below it, and a stored id at or above it did not come from it.
pub fn id_bound(tokenizer: &tokenizers::Tokenizer) -> usize {
    let largest = tokenizer.get_vocab(true).values().max().map_or(0, |&id| id as usize + 1);
    largest.max(tokenizer.get_vocab_size(true))
}

/// [`vocab_of`] for a tokenizer a user supplied, checked: at least one id, at most
/// [`MAX_VOCAB`]; sparse ids are allowed (the vocabulary covers the largest) with a warning.
pub fn checked_vocab(tokenizer: &tokenizers::Tokenizer, what: &str) -> Result<usize, DataError> {
    let entries = tokenizer.get_vocab_size(true);
    let largest = tokenizer.get_vocab(true).values().max().copied().unwrap_or(0);
    let vocab = vocab_of(tokenizer);
    if entries == 0 {
        return Err(DataError::Tokenizer(format!("{what}: the tokenizer has no tokens")));
    }
    if vocab > MAX_VOCAB {
        return Err(DataError::Tokenizer(format!(
            "{what}: ids up to {largest} (a vocabulary of {vocab}); at most {MAX_VOCAB} are allowed"
        )));
    }
    if vocab > entries.div_ceil(64) * 64 {
        tracing::warn!("{what}: {entries} tokens with ids up to {largest}: the model's vocabulary covers the largest id ({vocab})");
    }
    Ok(vocab)
}

/// The tokenizer trainer's settings, part of every cache key (change it with the settings).
pub(crate) const BPE_SETTINGS: &str = "byte-level BPE v1: min_frequency 2, byte alphabet, <|endoftext|>, no prefix space";

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
