//! A run's resident memory does not grow with its corpus: a 512 MiB shard of u16 ids (a packed
//! buffer of u32 ids would be 1 GiB) is opened, checked, split and sampled with the process's
//! own (anonymous) memory growing by a few MiB; the ids read come from the page cache through
//! the memory map. In a test binary of its own, so no other test's allocations run beside it.

#![forbid(unsafe_code)]

use recipes::data::corpus::{BuildOptions, DataSpec, open};
use recipes::data::packed::{Order, PackedDataset};
use recipes::data::spec::{Heldout, Source, TokenDtype, TokenizerRecipe};

/// The process's anonymous resident memory in bytes (`RssAnon` of /proc/self/status).
fn rss_anon() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

#[cfg(target_os = "linux")]
#[test]
fn resident_memory_does_not_grow_with_the_corpus() {
    const MIB: u64 = 1 << 20;
    let dir = tempfile::tempdir().unwrap();
    let tok = recipes::data::bpe_tokenizer(&["a few words to make a tokenizer from, words and more words"], 300, dir.path()).unwrap();
    let tpath = dir.path().join("tok.json");
    tok.save(&tpath, false).unwrap();
    // A sparse file: 256 Mi ids of 0 (a valid id), no disk written.
    let bin = dir.path().join("big.bin");
    std::fs::File::create(&bin).unwrap().set_len(512 * MIB).unwrap();
    let spec = DataSpec {
        source: Source::Tokens { paths: vec![bin.display().to_string()], dtype: TokenDtype::U16 },
        heldout: Heldout::Documents(vec![format!("{}#0", bin.display())]),
        heldout_field: "data.heldout",
        tokenizer: TokenizerRecipe::File(tpath.display().to_string()),
        skip_invalid_utf8: false,
    };
    let before = rss_anon();
    let corpus = open(&spec, &dir.path().join("cache"), &BuildOptions::default()).unwrap();
    assert_eq!(corpus.train.len() + corpus.heldout.len(), 256 * MIB);
    let train = PackedDataset::from_store(corpus.train, 128, 1, Order::Keyed, "training").unwrap();
    let n = train.num_seqs() as u64;
    let mut sum = 0u64;
    for i in 0..20_000u64 {
        let s = train.sample(i * 7919 % (3 * n));
        sum += s.iter().map(|&t| u64::from(t)).sum::<u64>() + s.len() as u64;
    }
    assert_eq!(sum, 20_000 * 129, "every id of the sparse file is 0");
    let grown = rss_anon().saturating_sub(before);
    eprintln!("anonymous memory grew by {} KiB for a 512 MiB corpus", grown / 1024);
    assert!(grown < 64 * MIB, "anonymous memory grew by {} MiB for a 512 MiB corpus", grown / MIB);
}
