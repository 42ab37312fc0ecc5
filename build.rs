//! With the `cuda` feature, compiles every `cuda/*.cu` to PTX (embedded through
//! `$OUT_DIR/ptx.rs`, one `pub const NAME: &str` per file), then each PTX to a cubin for its
//! own target with ptxas (`$OUT_DIR/modules.rs`, one `pub const NAME: Module` per file), so
//! that a run loads machine code instead of having the driver compile the PTX first (tens of
//! seconds for this crate's kernels on a machine whose compute cache is cold). Without the
//! feature, does nothing, so the crate builds on machines with no CUDA toolchain.

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
    use std::path::PathBuf;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let ptx = cudaforge::KernelBuilder::new()
        .source_glob("cuda/*.cu")
        .arg("-std=c++17")
        .arg("-O3")
        .arg("--expt-relaxed-constexpr")
        .build_ptx()
        .expect("nvcc failed to build cuda/*.cu (source ../shared/cuda/toolchain.sh first)");
    ptx.write(out_dir.join("ptx.rs"))
        .expect("cannot write ptx.rs");

    let mut stems: Vec<String> = std::fs::read_dir("cuda")
        .expect("cannot read cuda/")
        .filter_map(|e| {
            let p = e.ok()?.path();
            (p.extension()? == "cu").then(|| p.file_stem()?.to_str().map(str::to_owned))?
        })
        .collect();
    stems.sort();
    let ptxas = ptxas_path();
    // One ptxas per file, all at once (decode_attention alone takes ~25 s on two cores).
    let jobs: Vec<_> = stems
        .iter()
        .map(|stem| {
            let src = out_dir.join(format!("{stem}.ptx"));
            let dst = out_dir.join(format!("{stem}.cubin"));
            let text = std::fs::read_to_string(&src)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", src.display()));
            let arch = text
                .lines()
                .find_map(|l| l.trim().strip_prefix(".target "))
                .and_then(|t| t.split(',').next())
                .unwrap_or_else(|| panic!("{} names no .target", src.display()))
                .trim()
                .to_owned();
            let ptxas = ptxas.clone();
            std::thread::spawn(move || {
                let out = std::process::Command::new(&ptxas)
                    .arg(format!("-arch={arch}"))
                    .arg("-O3")
                    .arg(&src)
                    .arg("-o")
                    .arg(&dst)
                    .output()
                    .unwrap_or_else(|e| panic!("cannot run {}: {e}", ptxas.display()));
                if !out.status.success() {
                    panic!(
                        "ptxas failed on {}:\n{}",
                        src.display(),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            })
        })
        .collect();
    for j in jobs {
        j.join().expect("a ptxas job panicked");
    }
    let mut rs = String::new();
    for stem in &stems {
        let name = stem.to_uppercase();
        rs.push_str(&format!(
            "pub const {name}: Module = Module {{ name: \"{stem}\", ptx: super::ptx::{name}, \
             cubin: include_bytes!(concat!(env!(\"OUT_DIR\"), \"/{stem}.cubin\")) }};\n"
        ));
    }
    std::fs::write(out_dir.join("modules.rs"), rs).expect("cannot write modules.rs");
}

/// ptxas of the toolkit nvcc came from: `$CUDA_ROOT`, `$CUDA_HOME` or `$CUDA_PATH`, else
/// the one on `PATH`.
#[cfg(feature = "cuda")]
fn ptxas_path() -> std::path::PathBuf {
    for var in ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"] {
        println!("cargo::rerun-if-env-changed={var}");
        if let Some(root) = std::env::var_os(var) {
            let p = std::path::Path::new(&root).join("bin").join("ptxas");
            if p.exists() {
                return p;
            }
        }
    }
    std::path::PathBuf::from("ptxas")
}
