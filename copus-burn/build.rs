//! With feature `tch`: compiles cpp/torch_glue.cpp (the vector-Jacobian product, the operator counter and AdamW in `_foreach_` operations) against the
//! headers of the libtorch that the `tch` crate links, found the way tch's build finds it (the
//! `LIBTORCH` folder, or with `LIBTORCH_USE_PYTORCH` the PyTorch of `python3`, or of
//! `PYTHON_SYS_EXECUTABLE`).

#[cfg(feature = "tch")]
use std::env;
#[cfg(feature = "tch")]
use std::path::PathBuf;
#[cfg(feature = "tch")]
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cpp/torch_glue.cpp");
    for var in ["LIBTORCH", "LIBTORCH_USE_PYTORCH", "LIBTORCH_INCLUDE", "LIBTORCH_CXX11_ABI", "PYTHON_SYS_EXECUTABLE", "DOCS_RS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    // Type-checks without libtorch (`DOCS_RS=1 cargo check`) compile no C++.
    #[cfg(feature = "tch")]
    if env::var_os("DOCS_RS").is_none() {
        compile_glue();
    }
}

/// Compiles cpp/torch_glue.cpp into a static library linked into copus-burn.
#[cfg(feature = "tch")]
fn compile_glue() {
    let (includes, abi) = libtorch_headers();
    let mut build = cc::Build::new();
    build.cpp(true).std("c++17").file("cpp/torch_glue.cpp").define("_GLIBCXX_USE_CXX11_ABI", abi.as_str()).warnings(false);
    for dir in includes {
        build.include(dir);
    }
    build.compile("copus_torch_glue");
}

/// The include folders and the C++11 ABI flag (`1` or `0`) of the libtorch to build against.
#[cfg(feature = "tch")]
fn libtorch_headers() -> (Vec<PathBuf>, String) {
    if env::var_os("LIBTORCH_USE_PYTORCH").is_some() {
        let python = env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".into());
        let script = "import torch\nfrom torch.utils import cpp_extension\nprint(int(torch._C._GLIBCXX_USE_CXX11_ABI))\nfor p in cpp_extension.include_paths(): print(p)";
        let out = Command::new(&python).args(["-c", script]).output().unwrap_or_else(|e| panic!("running {python}: {e}"));
        assert!(out.status.success(), "{python} could not import torch: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut lines = text.lines();
        let abi = lines.next().unwrap_or("1").trim().to_owned();
        return (lines.map(PathBuf::from).collect(), abi);
    }
    let root = PathBuf::from(env::var("LIBTORCH").expect("feature tch needs LIBTORCH or LIBTORCH_USE_PYTORCH=1, as the tch crate does"));
    let include = env::var("LIBTORCH_INCLUDE").map(PathBuf::from).unwrap_or(root);
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into());
    (vec![include.join("include"), include.join("include/torch/csrc/api/include")], abi)
}
