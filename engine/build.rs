//! With the `cuda` feature: kernels/adam.cu (the optimizer step on a GPU) to PTX
//! (build-support/ptx.rs). Without: nothing.
include!("../build-support/ptx.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        compile_ptx("kernels/adam.cu", "adam.ptx");
    }
}
