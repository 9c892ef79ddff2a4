//! The kernels' PTX from a folder instead of the build's (`DS_RS_PTX_DIR`).
//!
//! Constraint: a GPU is lent for minutes, and tuning a kernel means changing its body and
//! measuring again, while a cuda build of ds-rs takes minutes here and cannot be made there.
//! Solution: the GPU host has nvcc; scripts/gpu-ptx.sh compiles the working tree's
//! nn/kernels/*.cu there with the build's flags, and `DS_RS_PTX_DIR` makes ds-rs load that
//! PTX in place of the PTX it was built with. Only a kernel's body may change this way: the
//! launches (grids, shared memory, arguments) are the build's.

use std::ffi::OsStr;
use std::path::Path;

/// The folder whose PTX files (fused.ptx, flash.ptx) replace the build's.
pub const PTX_DIR_ENV: &str = "DS_RS_PTX_DIR";

/// The PTX of `file` (e.g. "flash.ptx") from `DS_RS_PTX_DIR` where it is set and holds it, said
/// on stderr; None keeps the build's (with a warning where the folder is set but the file
/// cannot be read).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the cuda build's (cuda.rs)
pub(crate) fn overridden(file: &str) -> Option<String> {
    from_dir(std::env::var_os(PTX_DIR_ENV).as_deref(), file)
}

fn from_dir(dir: Option<&OsStr>, file: &str) -> Option<String> {
    let path = Path::new(dir?).join(file);
    match std::fs::read_to_string(&path) {
        Ok(ptx) => {
            eprintln!(
                "warning: {file} from {} ({PTX_DIR_ENV}), not the one ds-rs was built with",
                path.display()
            );
            Some(ptx)
        }
        Err(e) => {
            eprintln!(
                "warning: {PTX_DIR_ENV} is set, but {} cannot be read ({e}): the built {file} runs",
                path.display()
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_folder_replaces_only_the_ptx_it_holds() {
        let dir = std::env::temp_dir().join(format!("ds-rs-ptx-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("flash.ptx"), ".version 9.0\n// tuned\n").unwrap();
        let got = from_dir(Some(dir.as_os_str()), "flash.ptx");
        assert_eq!(got.as_deref(), Some(".version 9.0\n// tuned\n"));
        assert_eq!(from_dir(Some(dir.as_os_str()), "fused.ptx"), None);
        assert_eq!(from_dir(None, "flash.ptx"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
