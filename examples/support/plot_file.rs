//! Where an example writes its plot: checked before the run, so that a bad path is an
//! error at once, not after minutes of measuring.

use std::path::{Path, PathBuf};

/// `path` (given with `flag`) made absolute, once a file could be opened there for writing
/// (its directory created, an existing file left as it is).
pub fn writable(path: &Path, flag: &str) -> Result<PathBuf, String> {
    let path = std::path::absolute(path).map_err(|e| format!("{flag} {path:?}: {e}"))?;
    let cannot = |e: std::io::Error| {
        let path = path.display();
        format!("cannot write the plot to {path}: {e} (give another with {flag} FILE.svg)")
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(cannot)?;
    }
    let existed = path.exists();
    let file = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&path);
    file.map_err(cannot)?;
    if !existed {
        let _ = std::fs::remove_file(&path);
    }
    Ok(path)
}
