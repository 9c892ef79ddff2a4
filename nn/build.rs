//! kernels/emu: the fused kernels built for the host, which the CPU tests run (Note [kernels
//! on the host] in src/kernels/gpu/mod.rs). With the `cuda` feature also kernels/fused.cu and
//! kernels/flash.cu to PTX (build-support/ptx.rs).
include!("../build-support/ptx.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for f in [
        "kernels/fused.cu",
        "kernels/flash.cu",
        "kernels/common.cuh",
        "kernels/mma.cuh",
        "kernels/shared_tiles.cuh",
        "kernels/emu/cuda_emu.h",
        "kernels/emu/emu.cpp",
        "kernels/emu/scheduler.cpp",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .opt_level(2)
        .warnings(true)
        .extra_warnings(true)
        // CUDA code copies tiles through 16-byte vectors (uint4) over other element types,
        // which nvcc allows and g++'s type-based aliasing would not
        .flag("-fno-strict-aliasing")
        .file("kernels/emu/emu.cpp")
        .file("kernels/emu/scheduler.cpp")
        .compile("ds_kernels_emu");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        compile_ptx("kernels/fused.cu", "fused.ptx");
        compile_ptx("kernels/flash.cu", "flash.ptx");
    }
}
