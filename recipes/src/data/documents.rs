//! From a recipe's paths to documents: files, folders and globs resolved to a sorted list of
//! files, and each file read as documents (a whole text file or its paragraphs, JSON lines,
//! Parquet rows), one at a time, so a corpus is never held whole.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use super::error::{DataError, io};
use super::spec::{Source, TextSplit, TokenDtype};

/// A file of the corpus and what identifies its content for the cache.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileStamp {
    /// The path as the recipe's paths found it.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Modification time, nanoseconds since the epoch (0 where the system has none).
    pub modified_ns: u64,
}

impl FileStamp {
    /// The stamp of `path` now.
    pub fn of(path: &Path) -> Result<Self, DataError> {
        let meta = std::fs::metadata(path).map_err(io(path))?;
        let modified_ns = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        Ok(Self { path: path.display().to_string(), size: meta.len(), modified_ns })
    }
}

/// One document: its name (what held-out `Documents` and `Fraction` go by), the file it came
/// from and its text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    /// `macbeth`, `dir/a.txt`, `dir/a.txt#3`, `x.jsonl:12`, `train-0.parquet#7`.
    pub name: String,
    /// The file, as the source found it.
    pub file: String,
    /// The text.
    pub text: String,
}

/// Whether a file found inside a folder belongs to the source (a file named directly always
/// does).
fn wanted(source: &Source, path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.starts_with('.') {
        return false;
    }
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    match source {
        Source::Jsonl { .. } => matches!(ext, "jsonl" | "json" | "ndjson"),
        Source::Parquet { .. } => ext == "parquet",
        Source::Tokens { .. } => ext == "bin",
        _ => true,
    }
}

/// Every wanted file below `dir`, sorted; folders reached through symbolic links are not
/// entered (a link loop would never end), linked files are read. Files of another kind are
/// counted in `passed_over`.
fn walk(dir: &Path, source: &Source, out: &mut Vec<PathBuf>, passed_over: &mut u64) -> Result<(), DataError> {
    let mut entries: Vec<(PathBuf, bool)> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .map(|e| e.and_then(|e| Ok((e.path(), e.file_type()?.is_dir()))).map_err(io(dir)))
        .collect::<Result<_, _>>()?;
    entries.sort();
    for (p, is_dir) in entries {
        let hidden = p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with('.'));
        if is_dir {
            if !hidden {
                walk(&p, source, out, passed_over)?;
            }
        } else if wanted(source, &p) {
            out.push(p);
        } else if !hidden {
            *passed_over += 1;
        }
    }
    Ok(())
}

/// The files a source's paths name: files as given, every wanted file below a folder (hidden
/// ones skipped; `.jsonl`/`.json`/`.ndjson`, `.parquet` or `.bin` for those sources), glob
/// matches; sorted by path, each once. A path that does not exist, a glob that matches nothing
/// and a list that comes to no file are errors naming the path.
pub fn resolve(source: &Source, paths: &[String]) -> Result<Vec<PathBuf>, DataError> {
    if paths.is_empty() {
        return Err(DataError::Input(format!("`data.source`: {}(paths: []) names no file; give files, folders or globs", source.name())));
    }
    let mut files = Vec::new();
    let mut passed_over = 0u64;
    for p in paths {
        if p.contains(['*', '?', '[']) {
            let matches = glob::glob(p).map_err(|e| DataError::Input(format!("`data.source.paths`: `{p}` is not a valid glob ({e})")))?;
            let before = files.len();
            for m in matches {
                let m = m.map_err(|e| DataError::Input(format!("`data.source.paths`: `{p}`: {e}")))?;
                if m.is_dir() {
                    walk(&m, source, &mut files, &mut passed_over)?;
                } else if wanted(source, &m) {
                    files.push(m);
                } else {
                    passed_over += 1;
                }
            }
            if files.len() == before {
                return Err(DataError::Input(format!("`data.source.paths`: `{p}` matches no file")));
            }
            continue;
        }
        let path = PathBuf::from(p);
        if path.is_dir() {
            let before = files.len();
            walk(&path, source, &mut files, &mut passed_over)?;
            if files.len() == before {
                return Err(DataError::Input(format!("`data.source.paths`: the folder `{p}` holds no {} file", kind_of_file(source))));
            }
        } else if path.is_file() {
            files.push(path);
        } else {
            return Err(DataError::Input(format!("`data.source.paths`: `{p}` does not exist")));
        }
    }
    files.sort();
    files.dedup();
    if passed_over > 0 {
        tracing::warn!(
            "data: {passed_over} files in the source's folders and globs are not {} files and were passed over",
            kind_of_file(source)
        );
    }
    Ok(files)
}

fn kind_of_file(source: &Source) -> &'static str {
    match source {
        Source::Jsonl { .. } => "`.jsonl`/`.json`/`.ndjson`",
        Source::Parquet { .. } => "`.parquet`",
        Source::Tokens { dtype: TokenDtype::Megatron, .. } => "`.bin` (with its `.idx`)",
        Source::Tokens { .. } => "`.bin`",
        _ => "readable",
    }
}

/// What reading the files came to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Documents handed on.
    pub documents: u64,
    /// Files or lines skipped as not UTF-8 (only when the recipe allows it).
    pub skipped: u64,
}

/// How documents are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Naming {
    /// By file stem (the built-in corpora: `macbeth`, `2021_joseph_r_biden_d`).
    Stem,
    /// By path, with `#n` or `:line` within a file.
    Path,
}

/// Reads `files` as `source` says, calling `each` on every document in order and `file_done`
/// with each file's size when it is read. Invalid UTF-8 is an error naming the file and byte
/// offset, or (with `skip_invalid`) a skipped file or line, counted.
pub fn read(
    source: &Source,
    files: &[PathBuf],
    naming: Naming,
    skip_invalid: bool,
    each: &mut dyn FnMut(Document) -> Result<(), DataError>,
    file_done: &mut dyn FnMut(u64),
) -> Result<ReadStats, DataError> {
    let mut stats = ReadStats::default();
    for path in files {
        let shown = path.display().to_string();
        let bytes_of_file = std::fs::metadata(path).map_err(io(path))?.len();
        let base = match naming {
            Naming::Stem => path.file_stem().and_then(|s| s.to_str()).unwrap_or("document").to_string(),
            Naming::Path => shown.clone(),
        };
        let mut emit = |name: String, text: String, stats: &mut ReadStats| {
            stats.documents += 1;
            each(Document { name, file: shown.clone(), text })
        };
        match source {
            Source::Jsonl { field, .. } => read_jsonl(path, &base, field, skip_invalid, &mut stats, &mut emit)?,
            Source::Parquet { column, .. } => read_parquet(path, &base, column, &mut stats, &mut emit)?,
            Source::Tokens { .. } => return Err(DataError::Input("token shards hold no text".into())),
            Source::Text { split: TextSplit::BlankLines, .. } => {
                if let Some(text) = read_utf8(path, skip_invalid, &mut stats)? {
                    for (k, para) in paragraphs(&text).enumerate() {
                        emit(format!("{base}#{k}"), para, &mut stats)?;
                    }
                }
            }
            Source::Text { .. } | Source::Shakespeare | Source::Sotu => {
                if let Some(text) = read_utf8(path, skip_invalid, &mut stats)? {
                    emit(base, text, &mut stats)?;
                }
            }
        }
        file_done(bytes_of_file);
    }
    Ok(stats)
}

/// The paragraphs of a text: runs of lines that are not blank, joined by newlines.
pub fn paragraphs(text: &str) -> impl Iterator<Item = String> + '_ {
    let mut lines = text.lines().peekable();
    std::iter::from_fn(move || {
        while lines.peek().is_some_and(|l| l.trim().is_empty()) {
            lines.next();
        }
        let mut para = Vec::new();
        while let Some(l) = lines.peek().filter(|l| !l.trim().is_empty()) {
            para.push(*l);
            lines.next();
        }
        (!para.is_empty()).then(|| para.join("\n"))
    })
}

fn read_utf8(path: &Path, skip_invalid: bool, stats: &mut ReadStats) -> Result<Option<String>, DataError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    match String::from_utf8(bytes) {
        Ok(s) => Ok(Some(s)),
        Err(_) if skip_invalid => {
            stats.skipped += 1;
            Ok(None)
        }
        Err(e) => Err(DataError::NotUtf8 { path: path.display().to_string(), offset: e.utf8_error().valid_up_to() as u64 }),
    }
}

type Emit<'a> = dyn FnMut(String, String, &mut ReadStats) -> Result<(), DataError> + 'a;

fn read_jsonl(
    path: &Path,
    base: &str,
    field: &str,
    skip_invalid: bool,
    stats: &mut ReadStats,
    emit: &mut Emit<'_>,
) -> Result<(), DataError> {
    let file = std::fs::File::open(path).map_err(io(path))?;
    let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
    let (mut line, mut offset, mut number) = (Vec::new(), 0u64, 0u64);
    loop {
        line.clear();
        let n = reader.read_until(b'\n', &mut line).map_err(io(path))?;
        if n == 0 {
            return Ok(());
        }
        number += 1;
        let start = offset;
        offset += n as u64;
        let text = match std::str::from_utf8(&line) {
            Ok(t) => t,
            Err(_) if skip_invalid => {
                stats.skipped += 1;
                continue;
            }
            Err(e) => return Err(DataError::NotUtf8 { path: path.display().to_string(), offset: start + e.valid_up_to() as u64 }),
        };
        if text.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| DataError::Input(format!("{}:{number}: not a JSON object ({e})", path.display())))?;
        match value.get(field) {
            Some(serde_json::Value::String(s)) => emit(format!("{base}:{number}"), s.clone(), stats)?,
            Some(other) => {
                return Err(DataError::Input(format!(
                    "{}:{number}: the field `{field}` is {}, not a string (set `field` in `data.source`)",
                    path.display(),
                    json_kind(other)
                )));
            }
            None => {
                return Err(DataError::Input(format!(
                    "{}:{number}: no field `{field}` (set `field` in `data.source` to the one holding the text)",
                    path.display()
                )));
            }
        }
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn read_parquet(path: &Path, base: &str, column: &str, stats: &mut ReadStats, emit: &mut Emit<'_>) -> Result<(), DataError> {
    use parquet::basic::{ConvertedType, LogicalType, Type as Physical};
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::RowAccessor;
    let perr = |e: parquet::errors::ParquetError| DataError::Input(format!("{}: not a readable Parquet file ({e})", path.display()));
    let file = std::fs::File::open(path).map_err(io(path))?;
    let reader = SerializedFileReader::new(file).map_err(perr)?;
    let schema = reader.metadata().file_metadata().schema_descr_ptr();
    let root = schema.root_schema();
    let names: Vec<String> = root.get_fields().iter().map(|f| f.name().to_string()).collect();
    let Some(field) = root.get_fields().iter().find(|f| f.name() == column) else {
        return Err(DataError::Input(format!(
            "{}: no column `{column}` (set `column` in `data.source`); columns: {}",
            path.display(),
            names.join(", ")
        )));
    };
    let is_string = field.is_primitive()
        && field.get_physical_type() == Physical::BYTE_ARRAY
        && (matches!(field.get_basic_info().logical_type_ref(), Some(LogicalType::String))
            || field.get_basic_info().converted_type() == ConvertedType::UTF8);
    if !is_string {
        let found = if field.is_primitive() { format!("{:?}", field.get_physical_type()) } else { "a group".into() };
        return Err(DataError::Input(format!("{}: the column `{column}` holds {found}, not UTF-8 strings", path.display())));
    }
    let projection =
        parquet::schema::types::Type::group_type_builder(root.name()).with_fields(vec![field.clone()]).build().map_err(perr)?;
    let rows = reader.get_row_iter(Some(projection)).map_err(perr)?;
    let mut nulls = 0u64;
    for (k, row) in rows.enumerate() {
        let row = row.map_err(perr)?;
        match row.get_string(0) {
            Ok(s) => emit(format!("{base}#{k}"), s.clone(), stats)?,
            // A null text is no document (counted, and said).
            Err(_) => nulls += 1,
        }
    }
    if nulls > 0 {
        tracing::warn!("{}: {nulls} rows with a null `{column}` hold no document", path.display());
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn collect(source: &Source, files: &[PathBuf], skip: bool) -> Result<(Vec<Document>, ReadStats), DataError> {
        let mut docs = Vec::new();
        let stats = read(
            source,
            files,
            Naming::Path,
            skip,
            &mut |d| {
                docs.push(d);
                Ok(())
            },
            &mut |_| {},
        )?;
        Ok((docs, stats))
    }

    #[test]
    fn folders_globs_and_files_resolve_sorted_once() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("a/sub")).unwrap();
        for f in ["a/2.txt", "a/1.txt", "a/sub/3.txt", "a/.hidden", "b.txt", "c.md"] {
            std::fs::write(d.join(f), "x").unwrap();
        }
        let text = Source::Text { paths: vec![], split: TextSplit::PerFile };
        let s = |p: &str| d.join(p).display().to_string();
        let files = resolve(&text, &[s("a"), s("*.txt"), s("a/1.txt")]).unwrap();
        let rel: Vec<String> = files.iter().map(|f| f.strip_prefix(d).unwrap().display().to_string()).collect();
        assert_eq!(rel, ["a/1.txt", "a/2.txt", "a/sub/3.txt", "b.txt"]);
        let e = resolve(&text, &[s("nope")]).unwrap_err().to_string();
        assert!(e.contains("nope") && e.contains("does not exist"), "{e}");
        let e = resolve(&text, &[s("*.rs")]).unwrap_err().to_string();
        assert!(e.contains("matches no file"), "{e}");
        let jsonl = Source::Jsonl { paths: vec![], field: "text".into() };
        let e = resolve(&jsonl, &[s("a")]).unwrap_err().to_string();
        assert!(e.contains("holds no `.jsonl`"), "{e}");
        assert!(resolve(&text, &[]).unwrap_err().to_string().contains("names no file"));
    }

    #[test]
    fn text_files_and_paragraphs_become_documents() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.txt");
        std::fs::write(&f, "one\ntwo\n\n  \nthree\n\n\n").unwrap();
        let per_file = Source::Text { paths: vec![], split: TextSplit::PerFile };
        let (docs, _) = collect(&per_file, std::slice::from_ref(&f), false).unwrap();
        assert_eq!(docs.len(), 1);
        assert_eq!(docs[0].text, "one\ntwo\n\n  \nthree\n\n\n");
        let paras = Source::Text { paths: vec![], split: TextSplit::BlankLines };
        let (docs, stats) = collect(&paras, std::slice::from_ref(&f), false).unwrap();
        let shown = f.display().to_string();
        assert_eq!(
            docs.iter().map(|d| (d.name.clone(), d.text.clone())).collect::<Vec<_>>(),
            [(format!("{shown}#0"), "one\ntwo".to_string()), (format!("{shown}#1"), "three".to_string())]
        );
        assert_eq!(stats.documents, 2);
    }

    #[test]
    fn invalid_utf8_is_named_with_its_offset_or_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let (good, bad) = (dir.path().join("good.txt"), dir.path().join("bad.txt"));
        std::fs::write(&good, "fine").unwrap();
        std::fs::write(&bad, b"abc\xffdef").unwrap();
        let text = Source::Text { paths: vec![], split: TextSplit::PerFile };
        let e = collect(&text, &[bad.clone(), good.clone()], false).unwrap_err().to_string();
        assert!(e.contains("bad.txt") && e.contains("byte 3"), "{e}");
        let (docs, stats) = collect(&text, &[bad, good], true).unwrap();
        assert_eq!((docs.len(), stats.skipped), (1, 1));
        // In JSON lines the offset counts from the start of the file.
        let j = dir.path().join("x.jsonl");
        std::fs::write(&j, b"{\"text\": \"ok\"}\n{\"text\": \"b\xffd\"}\n").unwrap();
        let jsonl = Source::Jsonl { paths: vec![], field: "text".into() };
        let e = collect(&jsonl, std::slice::from_ref(&j), false).unwrap_err().to_string();
        assert!(e.contains("x.jsonl") && e.contains("byte 26"), "{e}");
        let (docs, stats) = collect(&jsonl, &[j], true).unwrap();
        assert_eq!((docs.len(), stats.skipped), (1, 1));
    }

    #[test]
    fn jsonl_lines_need_their_string_field() {
        let dir = tempfile::tempdir().unwrap();
        let j = dir.path().join("x.jsonl");
        std::fs::write(&j, "{\"text\": \"a\", \"id\": 1}\n\n{\"content\": \"b\", \"text\": \"c\"}\n").unwrap();
        let with = |field: &str| Source::Jsonl { paths: vec![], field: field.into() };
        let (docs, _) = collect(&with("text"), std::slice::from_ref(&j), false).unwrap();
        let shown = j.display().to_string();
        assert_eq!(
            docs.iter().map(|d| (d.name.as_str(), d.text.as_str())).collect::<Vec<_>>(),
            [(format!("{shown}:1").as_str(), "a"), (format!("{shown}:3").as_str(), "c")]
        );
        let e = collect(&with("content"), std::slice::from_ref(&j), false).unwrap_err().to_string();
        assert!(e.contains("x.jsonl:1") && e.contains("no field `content`"), "{e}");
        let e = collect(&with("id"), std::slice::from_ref(&j), false).unwrap_err().to_string();
        assert!(e.contains("x.jsonl:1") && e.contains("a number, not a string"), "{e}");
        std::fs::write(&j, "not json\n").unwrap();
        let e = collect(&with("text"), &[j], false).unwrap_err().to_string();
        assert!(e.contains("x.jsonl:1") && e.contains("not a JSON object"), "{e}");
    }

    /// Writes a Parquet file with a string column `text`, an integer column `n` and a
    /// null text in the middle.
    pub(crate) fn write_parquet(path: &Path, texts: &[Option<&str>]) {
        use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        let schema =
            parquet::schema::parser::parse_message_type("message doc { OPTIONAL BYTE_ARRAY text (UTF8); REQUIRED INT64 n; }").unwrap();
        let props = std::sync::Arc::new(WriterProperties::builder().set_compression(parquet::basic::Compression::SNAPPY).build());
        let mut w = SerializedFileWriter::new(std::fs::File::create(path).unwrap(), std::sync::Arc::new(schema), props).unwrap();
        let mut rg = w.next_row_group().unwrap();
        let values: Vec<ByteArray> = texts.iter().flatten().map(|t| ByteArray::from(*t)).collect();
        let levels: Vec<i16> = texts.iter().map(|t| i16::from(t.is_some())).collect();
        let mut col = rg.next_column().unwrap().unwrap();
        col.typed::<ByteArrayType>().write_batch(&values, Some(&levels), None).unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let ns: Vec<i64> = (0..texts.len() as i64).collect();
        col.typed::<Int64Type>().write_batch(&ns, None, None).unwrap();
        col.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
    }

    #[test]
    fn parquet_rows_are_read_from_the_string_column_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("train-0.parquet");
        write_parquet(&p, &[Some("first row"), None, Some("third row")]);
        let with = |column: &str| Source::Parquet { paths: vec![], column: column.into() };
        let (docs, _) = collect(&with("text"), std::slice::from_ref(&p), false).unwrap();
        let shown = p.display().to_string();
        assert_eq!(
            docs.iter().map(|d| (d.name.clone(), d.text.clone())).collect::<Vec<_>>(),
            [(format!("{shown}#0"), "first row".to_string()), (format!("{shown}#2"), "third row".to_string())]
        );
        let e = collect(&with("n"), std::slice::from_ref(&p), false).unwrap_err().to_string();
        assert!(e.contains("`n` holds INT64, not UTF-8 strings"), "{e}");
        let e = collect(&with("body"), std::slice::from_ref(&p), false).unwrap_err().to_string();
        assert!(e.contains("no column `body`") && e.contains("text, n"), "{e}");
        std::fs::write(&p, "not parquet").unwrap();
        let e = collect(&with("text"), &[p], false).unwrap_err().to_string();
        assert!(e.contains("not a readable Parquet file"), "{e}");
    }
}
