//! Writing files so that a crash, a full disk or a concurrent reader never
//! sees half of one, and mapping the files Tessera reads in place (token
//! shards, checkpoint rank files, Hugging Face weights; the last two through
//! [`MappedSafetensors`]).

pub use memmap2::Mmap;
use safetensors::SafeTensors;
use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// Replaces `path` with `bytes` atomically and durably: the bytes go to a
/// temporary file in the same directory, which is flushed to the disk and
/// renamed over `path`, and the directory entry is flushed too. A reader
/// sees the old file or the new one, never a truncated one; after a crash
/// or power loss the new file is whole or absent. The temporary file is
/// removed when anything fails.
///
/// A path that names something other than a file is written through, not
/// replaced: `/dev/null`, a pipe or a terminal (`--out /dev/stdout`) gets
/// the bytes, and stays what it was; renaming over it would swap a device
/// for a regular file. A symbolic link is followed, and the file it points
/// to is replaced, so the link keeps pointing there.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let target = follow_links(path)?;
    let path = target.as_path();
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() && !m.is_dir() => return std::fs::OpenOptions::new().write(true).open(path)?.write_all(bytes),
        _ => {}
    }
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

/// Where `path` leads through symbolic links (a chain of them, relative or
/// absolute), to a file that may not exist yet; `path` itself when it is
/// no link.
fn follow_links(path: &Path) -> io::Result<std::path::PathBuf> {
    let mut at = path.to_path_buf();
    // The kernel's own limit on a chain of links.
    for _ in 0..40 {
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.file_type().is_symlink() => {
                let next = std::fs::read_link(&at)?;
                at = match at.parent() {
                    Some(dir) if next.is_relative() => dir.join(next),
                    _ => next,
                };
            }
            _ => return Ok(at),
        }
    }
    Err(io::Error::other(format!("{}: too many levels of symbolic links", path.display())))
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

self_cell::self_cell!(
    /// A safetensors file mapped into memory with its header parsed once: the
    /// `safetensors` crate's reader borrowing the map this value owns, so one
    /// value can be kept (in a cache of open files, in a model's weights) and
    /// read tensor by tensor. The crate checks the header against the file
    /// (offsets in range, shapes matching sizes); no offset is computed here.
    pub struct MappedSafetensors {
        owner: Mmap,
        #[covariant]
        dependent: SafeTensors,
    }
);

impl MappedSafetensors {
    /// Parses the header of the mapped file `map`.
    pub fn parse(map: Mmap) -> Result<Self, safetensors::SafeTensorError> {
        MappedSafetensors::try_new(map, |bytes| SafeTensors::deserialize(bytes))
    }

    /// The reader: names, and each tensor's view (dtype, shape, bytes).
    pub fn reader(&self) -> &SafeTensors<'_> {
        self.borrow_dependent()
    }
}

impl std::fmt::Debug for MappedSafetensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedSafetensors").field("bytes", &self.borrow_owner().len()).field("tensors", &self.reader().len()).finish()
    }
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
    fn a_pipe_or_a_link_is_written_through_and_stays_what_it_was() {
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        // A named pipe stands for /dev/null, /dev/stdout and the like: a
        // rename would leave a regular file in its place.
        let fifo = dir.path().join("pipe");
        assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).unwrap())
        };
        write_atomic(&fifo, b"through the pipe").unwrap();
        // Checked before waiting for the reader, which waits for ever on a
        // pipe that was renamed away.
        assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "the pipe was replaced");
        assert_eq!(reader.join().unwrap(), b"through the pipe");

        let real = dir.path().join("real.toml");
        let link = dir.path().join("link.toml");
        write_atomic(&real, b"old").unwrap();
        std::os::unix::fs::symlink(&real, &link).unwrap();
        write_atomic(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced by a file");
        assert_eq!(std::fs::read(&real).unwrap(), b"new");
        // A link to nothing yet gets its file made where it points.
        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink(dir.path().join("made.toml"), &dangling).unwrap();
        write_atomic(&dangling, b"x").unwrap();
        assert_eq!(std::fs::read(dir.path().join("made.toml")).unwrap(), b"x");
        assert!(std::fs::symlink_metadata(&dangling).unwrap().file_type().is_symlink());
        // A loop of links is an error, not a hang.
        std::os::unix::fs::symlink(dir.path().join("b"), dir.path().join("a")).unwrap();
        std::os::unix::fs::symlink(dir.path().join("a"), dir.path().join("b")).unwrap();
        assert!(write_atomic(&dir.path().join("a"), b"x").unwrap_err().to_string().contains("symbolic links"));
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
    fn a_mapped_safetensors_file_reads_its_tensors_wherever_it_is_moved() {
        use safetensors::tensor::{serialize, Dtype, TensorView};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let a: Vec<u8> = (0..24).collect();
        let b: Vec<u8> = vec![9; 4];
        let views = [("a", TensorView::new(Dtype::F32, vec![2, 3], &a).unwrap()), ("b", TensorView::new(Dtype::U8, vec![4], &b).unwrap())];
        let bytes = serialize(views, None).unwrap();
        std::fs::write(&path, &bytes).unwrap();
        // Moved into a collection after parsing, as the caches of open files are.
        let files: Vec<MappedSafetensors> = (0..2).map(|_| MappedSafetensors::parse(map_read_only(&File::open(&path).unwrap()).unwrap()).unwrap()).collect();
        for f in &files {
            let view = f.reader().tensor("a").unwrap();
            assert_eq!((view.dtype(), view.shape(), view.data()), (Dtype::F32, &[2, 3][..], &a[..]));
            assert_eq!(f.reader().tensor("b").unwrap().data(), &b[..]);
            assert!(f.reader().tensor("c").is_err());
        }
        // Every truncation is refused with an error, never a panic.
        for cut in 0..bytes.len() {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            let map = map_read_only(&File::open(&path).unwrap()).unwrap();
            assert!(MappedSafetensors::parse(map).is_err(), "a file cut at {cut} bytes was accepted");
        }
    }

    #[test]
    fn a_missing_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(write_atomic(&dir.path().join("no/such/dir/out.json"), b"x").is_err());
    }
}
