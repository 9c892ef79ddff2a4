// Shared by the crates' build.rs (`include!`d): CUDA C to PTX with nvcc, for the `cuda` feature.

/// Compiles `src` (relative to the crate) into `$OUT_DIR/<out>` with the nvcc of the CUDA
/// toolchain (scripts/install-cuda-toolchain.sh: `NVCC`, else `$CUDA_HOME/bin/nvcc`, else
/// `nvcc`), so a kernel that does not compile fails the build here rather than on a GPU host.
/// PTX for compute capability 8.0 (A100) up: the driver compiles it for the GPU at hand.
/// -fmad=false: no contraction into FMAs, so results round as the host loops' do.
fn compile_ptx(src: &str, out: &str) {
    println!("cargo:rerun-if-changed={src}");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| match std::env::var("CUDA_HOME") {
        Ok(home) => format!("{home}/bin/nvcc"),
        Err(_) => "nvcc".into(),
    });
    let status = std::process::Command::new(&nvcc)
        .args(["--ptx", "-arch=compute_80", "-fmad=false", "-O3", "-o"])
        .arg(dir.join(out))
        .arg(src)
        .status()
        .unwrap_or_else(|e| panic!("running {nvcc} (scripts/install-cuda-toolchain.sh): {e}"));
    assert!(status.success(), "{nvcc} failed on {src}");
}
