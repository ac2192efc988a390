//! Writing files so that a crash, a full disk or a concurrent reader never
//! sees half of one, and mapping the files Tessera reads in place (token
//! shards, checkpoint rank files, Hugging Face weights).

pub use memmap2::Mmap;
use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// Replaces `path` with `bytes` atomically and durably: the bytes go to a
/// temporary file in the same directory, which is flushed to the disk and
/// renamed over `path`, and the directory entry is flushed too. A reader
/// sees the old file or the new one, never a truncated one; after a crash
/// or power loss the new file is whole or absent. The temporary file is
/// removed when anything fails.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    sync_dir(dir);
    Ok(())
}

/// Maps `file` into memory, read-only: its bytes are read from the page
/// cache as they are touched, and the ranks of one machine share them.
///
/// The map must only be read through bounds-checked slices. Tessera never
/// writes a file it maps (shards are final once prepared; checkpoints and
/// exports are written to a new name and renamed into place), but another
/// process truncating the file while it is mapped makes a later read fault:
/// the contract of every mapped file, here in one place.
pub fn map_read_only(file: &File) -> io::Result<Mmap> {
    // SAFETY: the map is created from a file opened for reading and handed
    // out as an immutable `Mmap`; the remaining hazard (a file changed by
    // someone else under the map) is the documented contract above.
    unsafe { Mmap::map(file) }
}

/// Flushes a directory's entries (new names, renames) to the disk. Opening
/// a directory and syncing it is how POSIX makes its entries durable; where
/// a system refuses, it has no such need, so a failure is ignored.
pub fn sync_dir(dir: &Path) {
    if let Ok(f) = File::open(dir) {
        let _ = f.sync_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replaced_file_holds_the_new_bytes_and_nothing_is_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        write_atomic(&path, b"first").unwrap();
        write_atomic(&path, b"second, longer").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second, longer");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["out.json"], "a temporary file was left behind");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.json");
        write_atomic(&path, b"old").unwrap();
        // Renaming a file over a directory fails after the bytes are written.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("x"), b"keep").unwrap();
        assert!(write_atomic(&blocked, b"new").is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        let mut names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, ["blocked", "out.json"], "a temporary file was left behind");
    }

    #[test]
    fn a_missing_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(write_atomic(&dir.path().join("no/such/dir/out.json"), b"x").is_err());
    }
}
