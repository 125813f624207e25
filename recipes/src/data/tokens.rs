//! Token ids on disk, memory-mapped: shards of little-endian u16 or u32 ids (the prepared cache,
//! nanoGPT's `.bin`), Megatron's indexed `.bin`/`.idx`, and a split's stream as spans over
//! them. Reading a window copies its ids out of the mapping; the ids are never copied into the
//! process's own memory (a split's spans are, 24 bytes each, and a Megatron index's sequences,
//! 16 bytes each), so a run's resident memory does not grow with the ids.

#![allow(unsafe_code)]

use std::io::Read;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::error::{DataError, io};

/// The width of one stored id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Width {
    /// Little-endian u16.
    U16,
    /// Little-endian u32 (Megatron's int32 ids read as u32: a negative id is out of any
    /// vocabulary).
    U32,
}

impl Width {
    /// Bytes per id.
    pub fn bytes(self) -> usize {
        match self {
            Self::U16 => 2,
            Self::U32 => 4,
        }
    }

    /// The narrowest width that holds ids below `vocab`.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab <= 1 << 16 { Self::U16 } else { Self::U32 }
    }
}

enum Ids {
    Mapped(Mmap),
    Owned(Vec<u32>),
}

/// One file of ids, memory-mapped (or ids in memory, for text a caller encodes itself).
pub struct Shard {
    ids: Ids,
    width: Width,
    tokens: u64,
}

impl Shard {
    /// Maps `path` read-only; its length must be a whole number of ids.
    pub fn map(path: &Path, width: Width) -> Result<Self, DataError> {
        let file = std::fs::File::open(path).map_err(io(path))?;
        let len = file.metadata().map_err(io(path))?.len();
        if len % width.bytes() as u64 != 0 {
            return Err(DataError::Input(format!(
                "{}: {len} bytes is not a whole number of {:?} ids ({} bytes each); is `dtype` right?",
                path.display(),
                width,
                width.bytes()
            )));
        }
        let ids = if len == 0 {
            Ids::Owned(Vec::new())
        } else {
            // SAFETY: the mapping is read-only. Its bytes change only if the file is written
            // while mapped: the prepared cache never is (a rebuild writes a new folder and renames
            // it into place; the old files live on until unmapped), and docs/data.md tells users
            // not to rewrite `Tokens` shards under a running run (a truncated file would fault
            // the reader, as it would any memory-mapped reader).
            Ids::Mapped(unsafe { Mmap::map(&file) }.map_err(io(path))?)
        };
        Ok(Self { ids, width, tokens: len / width.bytes() as u64 })
    }

    /// Ids held in memory.
    pub fn owned(ids: Vec<u32>) -> Self {
        let tokens = ids.len() as u64;
        Self { ids: Ids::Owned(ids), width: Width::U32, tokens }
    }

    /// Ids in the shard.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Appends ids `start..start + count` to `out`.
    fn read(&self, start: u64, count: usize, out: &mut Vec<u32>) {
        let (s, w) = (start as usize, self.width.bytes());
        match &self.ids {
            Ids::Owned(v) => out.extend_from_slice(&v[s..s + count]),
            Ids::Mapped(m) => {
                let bytes = &m[s * w..(s + count) * w];
                match self.width {
                    Width::U16 => out.extend(bytes.chunks_exact(2).map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))),
                    Width::U32 => out.extend(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
                }
            }
        }
    }
}

/// A run of ids of one shard that belongs to a split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The shard.
    pub shard: usize,
    /// First id in it.
    pub start: u64,
    /// Ids.
    pub len: u64,
}

/// A split's ids: spans over shards, read as one stream.
pub struct TokenStore {
    shards: std::sync::Arc<Vec<Shard>>,
    spans: Vec<Span>,
    /// Stream offset of each span.
    starts: Vec<u64>,
    len: u64,
}

impl TokenStore {
    /// The stream of `spans` over `shards`, adjacent spans merged.
    pub fn new(shards: std::sync::Arc<Vec<Shard>>, spans: impl IntoIterator<Item = Span>) -> Self {
        let mut merged: Vec<Span> = Vec::new();
        for s in spans.into_iter().filter(|s| s.len > 0) {
            match merged.last_mut() {
                Some(l) if l.shard == s.shard && l.start + l.len == s.start => l.len += s.len,
                _ => merged.push(s),
            }
        }
        let mut starts = Vec::with_capacity(merged.len());
        let mut len = 0;
        for s in &merged {
            starts.push(len);
            len += s.len;
        }
        Self { shards, spans: merged, starts, len }
    }

    /// Every id of every shard, in order.
    pub fn whole(shards: Vec<Shard>) -> Self {
        let spans: Vec<Span> = shards.iter().enumerate().map(|(i, s)| Span { shard: i, start: 0, len: s.tokens }).collect();
        Self::new(std::sync::Arc::new(shards), spans)
    }

    /// Ids held in memory.
    pub fn in_memory(ids: Vec<u32>) -> Self {
        Self::whole(vec![Shard::owned(ids)])
    }

    /// Ids in the stream.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the stream is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends the stream's ids `start..start + count` to `out` (they may cross shards).
    pub fn read(&self, mut start: u64, mut count: usize, out: &mut Vec<u32>) {
        assert!(start + count as u64 <= self.len, "ids {start}+{count} past the stream's {}", self.len);
        let mut k = self.starts.partition_point(|&s| s <= start) - 1;
        while count > 0 {
            let span = self.spans[k];
            let at = start - self.starts[k];
            let take = (span.len - at).min(count as u64) as usize;
            self.shards[span.shard].read(span.start + at, take, out);
            start += take as u64;
            count -= take;
            k += 1;
        }
    }

    /// The one slice of memory ids `start..start + count` lie in, when the stream is one
    /// in-memory shard (no copy).
    pub fn slice(&self, start: u64, count: usize) -> Option<&[u32]> {
        match (self.spans.as_slice(), self.shards.first().map(|s| &s.ids)) {
            ([one], Some(Ids::Owned(v))) if self.shards.len() == 1 => {
                let s = (one.start + start) as usize;
                Some(&v[s..s + count])
            }
            _ => None,
        }
    }
}

/// The largest id in `path`'s ids (read through the page cache in chunks, not mapped, so a
/// check of a large shard leaves no resident pages behind), or an error naming the first id at
/// or above `vocab` and its position.
pub fn check_ids(path: &Path, width: Width, vocab: usize) -> Result<(), DataError> {
    let mut file = std::io::BufReader::with_capacity(1 << 20, std::fs::File::open(path).map_err(io(path))?);
    let mut buf = vec![0u8; 1 << 20];
    let (w, mut position) = (width.bytes(), 0u64);
    loop {
        let mut filled = 0;
        while filled < buf.len() {
            let n = file.read(&mut buf[filled..]).map_err(io(path))?;
            if n == 0 {
                break;
            }
            filled += n;
        }
        let whole = filled - filled % w;
        for (i, b) in buf[..whole].chunks_exact(w).enumerate() {
            let id = match width {
                Width::U16 => u32::from(u16::from_le_bytes([b[0], b[1]])),
                Width::U32 => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            };
            if id as usize >= vocab {
                return Err(DataError::Input(format!(
                    "{}: id {id} at position {} is outside the tokenizer's vocabulary of {vocab}; were the shards made with this tokenizer?",
                    path.display(),
                    position + i as u64
                )));
            }
        }
        position += (whole / w) as u64;
        if filled < buf.len() {
            return Ok(());
        }
    }
}

/// Megatron's index of a `.bin`: the width of its ids and each sequence's (first id, length).
#[derive(Debug, PartialEq, Eq)]
pub struct MegatronIndex {
    /// Width of the ids in the `.bin`.
    pub width: Width,
    /// Each sequence's first id (in ids, not bytes) and length.
    pub sequences: Vec<(u64, u64)>,
}

/// The `.idx` beside a Megatron `.bin` (`x.bin` -> `x.idx`).
pub fn idx_path(bin: &Path) -> PathBuf {
    bin.with_extension("idx")
}

const MEGATRON_MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";

/// Reads a Megatron `.idx`: magic `MMIDIDX\0\0`, version 1, a dtype code (8 uint16, 4 int32 are
/// the ones Megatron writes for token ids), sequence and document counts, then the sequences'
/// lengths (int32) and byte offsets (int64); the document index after them is not needed.
pub fn read_megatron_index(idx: &Path) -> Result<MegatronIndex, DataError> {
    let bytes = std::fs::read(idx).map_err(io(idx))?;
    let bad = |why: String| DataError::Input(format!("{}: not a Megatron index ({why})", idx.display()));
    let u64_at = |at: usize| -> Result<u64, DataError> {
        bytes
            .get(at..at + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .ok_or_else(|| bad(format!("ends at byte {}", bytes.len())))
    };
    if bytes.get(..9) != Some(&MEGATRON_MAGIC[..]) {
        return Err(bad("no MMIDIDX header".into()));
    }
    let version = u64_at(9)?;
    if version != 1 {
        return Err(bad(format!("version {version}, expected 1")));
    }
    let width = match bytes.get(17) {
        Some(8) => Width::U16,
        Some(4) => Width::U32,
        Some(c) => return Err(bad(format!("dtype code {c}; token ids are uint16 (8) or int32 (4)"))),
        None => return Err(bad("no dtype".into())),
    };
    let count = usize::try_from(u64_at(18)?).map_err(|_| bad("sequence count too large".into()))?;
    // Checked: a damaged count must not overflow the arithmetic.
    let (lengths, pointers) = (34usize, count.checked_mul(4).and_then(|n| n.checked_add(34)));
    let need = pointers.and_then(|p| count.checked_mul(8).and_then(|n| n.checked_add(p)));
    let (Some(pointers), Some(need)) = (pointers, need) else {
        return Err(bad(format!("a sequence count of {count} cannot be right")));
    };
    if bytes.len() < need {
        return Err(bad(format!("{count} sequences need {need} bytes, the file has {}", bytes.len())));
    }
    let sequences = (0..count)
        .map(|i| {
            let l = u32::from_le_bytes(bytes[lengths + 4 * i..lengths + 4 * i + 4].try_into().expect("4 bytes"));
            let p = u64::from_le_bytes(bytes[pointers + 8 * i..pointers + 8 * i + 8].try_into().expect("8 bytes"));
            (p / width.bytes() as u64, u64::from(l))
        })
        .collect();
    Ok(MegatronIndex { width, sequences })
}

/// Writes a Megatron `.idx` for sequences of the given lengths laid end to end (tests and
/// tools that make small indexed datasets).
pub fn write_megatron_index(idx: &Path, width: Width, lengths: &[u32]) -> std::io::Result<()> {
    let mut out = MEGATRON_MAGIC.to_vec();
    out.extend(1u64.to_le_bytes());
    out.push(match width {
        Width::U16 => 8,
        Width::U32 => 4,
    });
    out.extend((lengths.len() as u64).to_le_bytes());
    out.extend((lengths.len() as u64 + 1).to_le_bytes());
    for l in lengths {
        out.extend(l.to_le_bytes());
    }
    let mut at = 0u64;
    for l in lengths {
        out.extend(at.to_le_bytes());
        at += u64::from(*l) * width.bytes() as u64;
    }
    for d in 0..=lengths.len() as u64 {
        out.extend(d.to_le_bytes());
    }
    std::fs::write(idx, out)
}

/// Writes ids as `width` shards of at most `per_shard` ids into a folder, named
/// `{prefix}-00000.bin`, ...
pub struct ShardWriter {
    dir: PathBuf,
    prefix: &'static str,
    width: Width,
    per_shard: u64,
    current: Option<(std::io::BufWriter<std::fs::File>, u64)>,
    /// Written shards: file name and ids.
    pub written: Vec<(String, u64)>,
}

impl ShardWriter {
    /// A writer into `dir`.
    pub fn new(dir: &Path, prefix: &'static str, width: Width, per_shard: u64) -> Self {
        Self { dir: dir.to_path_buf(), prefix, width, per_shard: per_shard.max(1), current: None, written: Vec::new() }
    }

    /// Appends ids.
    pub fn write(&mut self, mut ids: &[u32]) -> Result<(), DataError> {
        use std::io::Write;
        while !ids.is_empty() {
            if self.current.as_ref().is_none_or(|(_, n)| *n == self.per_shard) {
                self.close_current()?;
                let name = format!("{}-{:05}.bin", self.prefix, self.written.len());
                let path = self.dir.join(&name);
                let f = std::fs::File::create(&path).map_err(io(&path))?;
                self.written.push((name, 0));
                self.current = Some((std::io::BufWriter::with_capacity(1 << 20, f), 0));
            }
            let (w, n) = self.current.as_mut().expect("an open shard");
            let take = ((self.per_shard - *n) as usize).min(ids.len());
            let mut bytes = Vec::with_capacity(take * self.width.bytes());
            for &id in &ids[..take] {
                match self.width {
                    Width::U16 => bytes.extend(u16::try_from(id).expect("the width holds the vocabulary").to_le_bytes()),
                    Width::U32 => bytes.extend(id.to_le_bytes()),
                }
            }
            let path = self.dir.join(&self.written.last().expect("a shard").0);
            w.write_all(&bytes).map_err(io(&path))?;
            *n += take as u64;
            self.written.last_mut().expect("a shard").1 = *n;
            ids = &ids[take..];
        }
        Ok(())
    }

    fn close_current(&mut self) -> Result<(), DataError> {
        use std::io::Write;
        if let Some((mut w, _)) = self.current.take() {
            let path = self.dir.join(&self.written.last().expect("a shard").0);
            w.flush().map_err(io(&path))?;
            w.get_ref().sync_all().map_err(io(&path))?;
        }
        Ok(())
    }

    /// Flushes the last shard; returns the shards written.
    pub fn finish(mut self) -> Result<Vec<(String, u64)>, DataError> {
        self.close_current()?;
        Ok(std::mem::take(&mut self.written))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_written_and_mapped_read_back_across_boundaries() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<u32> = (0..1000).map(|i| (i * 7919) % 60_000).collect();
        let mut w = ShardWriter::new(dir.path(), "train", Width::U16, 300);
        w.write(&ids[..450]).unwrap();
        w.write(&ids[450..]).unwrap();
        let written = w.finish().unwrap();
        assert_eq!(written.iter().map(|(_, n)| *n).collect::<Vec<_>>(), [300, 300, 300, 100]);
        let shards: Vec<Shard> = written.iter().map(|(n, _)| Shard::map(&dir.path().join(n), Width::U16).unwrap()).collect();
        let store = TokenStore::whole(shards);
        assert_eq!(store.len(), 1000);
        let mut out = Vec::new();
        store.read(250, 400, &mut out);
        assert_eq!(out, &ids[250..650]);
        // Spans pick parts of shards; adjacent ones merge.
        let shards = std::sync::Arc::new(written.iter().map(|(n, _)| Shard::map(&dir.path().join(n), Width::U16).unwrap()).collect());
        let spans = [Span { shard: 0, start: 10, len: 5 }, Span { shard: 0, start: 15, len: 5 }, Span { shard: 2, start: 0, len: 3 }];
        let store = TokenStore::new(shards, spans);
        assert_eq!(store.spans.len(), 2);
        let mut out = Vec::new();
        store.read(0, 13, &mut out);
        assert_eq!(out, [&ids[10..20], &ids[600..603]].concat());
    }

    #[test]
    fn bad_shards_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("odd.bin");
        std::fs::write(&odd, [1u8, 2, 3]).unwrap();
        let e = Shard::map(&odd, Width::U16).err().unwrap().to_string();
        assert!(e.contains("odd.bin") && e.contains("3 bytes") && e.contains("U16"), "{e}");
        let high = dir.path().join("high.bin");
        std::fs::write(&high, [5u16, 7, 900, 2].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
        assert!(check_ids(&high, Width::U16, 901).is_ok());
        let e = check_ids(&high, Width::U16, 512).unwrap_err().to_string();
        assert!(e.contains("high.bin") && e.contains("id 900 at position 2") && e.contains("512"), "{e}");
    }

    #[test]
    fn a_megatron_index_round_trips_and_a_foreign_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let idx = dir.path().join("d.idx");
        write_megatron_index(&idx, Width::U32, &[3, 5, 2]).unwrap();
        let got = read_megatron_index(&idx).unwrap();
        assert_eq!(got, MegatronIndex { width: Width::U32, sequences: vec![(0, 3), (3, 5), (8, 2)] });
        std::fs::write(&idx, b"MMIDIDX\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00\x06").unwrap();
        let e = read_megatron_index(&idx).unwrap_err().to_string();
        assert!(e.contains("dtype code 6"), "{e}");
        std::fs::write(&idx, b"hello").unwrap();
        assert!(read_megatron_index(&idx).unwrap_err().to_string().contains("no MMIDIDX header"));
        // A count that would overflow the sizes is an error, not a panic.
        let mut huge = b"MMIDIDX\x00\x00".to_vec();
        huge.extend(1u64.to_le_bytes());
        huge.push(8);
        huge.extend(u64::MAX.to_le_bytes());
        huge.extend(0u64.to_le_bytes());
        std::fs::write(&idx, huge).unwrap();
        assert!(read_megatron_index(&idx).unwrap_err().to_string().contains("cannot be right"));
    }
}
