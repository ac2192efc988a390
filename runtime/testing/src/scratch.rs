//! Directories for one test, removed when the test is done with them.

use std::ops::Deref;
use std::path::{Path, PathBuf};

/// A fresh, empty directory named after the test, removed with everything
/// in it when dropped (a `tempfile::TempDir`), so a test run leaves nothing
/// behind and two runs never share one. It reads as a [`Path`].
#[derive(Debug)]
pub struct Scratch(tempfile::TempDir);

impl Scratch {
    /// A new directory whose name begins `tessera-{name}-`.
    ///
    /// # Panics
    ///
    /// When the system's temporary directory cannot be written: a test
    /// cannot run without one.
    pub fn new(name: &str) -> Scratch {
        let dir = tempfile::Builder::new().prefix(&format!("tessera-{name}-")).tempdir();
        Scratch(dir.unwrap_or_else(|e| panic!("cannot create a scratch directory for `{name}` in {}: {e}", std::env::temp_dir().display())))
    }

    /// The path.
    pub fn path(&self) -> &Path {
        self.0.path()
    }

    /// The path, owned.
    pub fn to_path_buf(&self) -> PathBuf {
        self.0.path().to_path_buf()
    }
}

impl Deref for Scratch {
    type Target = Path;

    fn deref(&self) -> &Path {
        self.0.path()
    }
}

impl From<&Scratch> for PathBuf {
    fn from(s: &Scratch) -> PathBuf {
        s.to_path_buf()
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        self.0.path()
    }
}

#[cfg(test)]
mod tests {
    use super::Scratch;

    #[test]
    fn a_scratch_directory_is_fresh_and_gone_after_use() {
        let a = Scratch::new("unit");
        let b = Scratch::new("unit");
        assert_ne!(a.to_path_buf(), b.to_path_buf());
        std::fs::write(a.join("f"), b"x").unwrap();
        let kept = a.to_path_buf();
        drop(a);
        assert!(!kept.exists());
        assert!(std::fs::read_dir(&*b).unwrap().next().is_none());
    }
}
