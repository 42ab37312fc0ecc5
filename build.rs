//! With the `cuda` feature, compiles every `cuda/*.cu` to PTX (embedded through
//! `$OUT_DIR/ptx.rs`, one `pub const NAME: &str` per file). Without it, does nothing,
//! so the crate builds on machines with no CUDA toolchain.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=cuda");
    #[cfg(feature = "cuda")]
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build_ptx();
    }
}

#[cfg(feature = "cuda")]
fn build_ptx() {
    let out_dir =
        std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let ptx = cudaforge::KernelBuilder::new()
        .source_glob("cuda/*.cu")
        .arg("-std=c++17")
        .arg("-O3")
        .arg("--expt-relaxed-constexpr")
        .build_ptx()
        .expect("nvcc failed to build cuda/*.cu (source ../shared/cuda/toolchain.sh first)");
    ptx.write(out_dir.join("ptx.rs"))
        .expect("cannot write ptx.rs");
}
