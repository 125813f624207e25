//! Prints the throughput-optimal layout per global batch on a cluster preset (analytic model).
//!
//! `cargo run --release -p copus-core --example best_layouts -- [MODEL] [CLUSTER] [NODES]`
//! MODEL is a preset name (default llama-3.2-3b); CLUSTER is h100, mi210 or h200.

#![forbid(unsafe_code)]

use copus_core::candidates::Candidate;
use copus_core::layout::ParallelDims;
use copus_core::model::ModelSpec;
use copus_core::throughput::{ClusterModel, ClusterSpec, ThroughputModel};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = args.first().map_or("llama-3.2-3b", |s| s.as_str());
    let model = match ModelSpec::preset(model) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let nodes: usize = match args.get(2).map(|s| s.parse()) {
        None => 1,
        Some(Ok(n)) if n >= 1 => n,
        Some(_) => {
            eprintln!("error: NODES must be a whole number >= 1, got `{}`", args[2]);
            std::process::exit(2);
        }
    };
    let cluster = match args.get(1).map_or("h100", |s| s.as_str()) {
        "h100" => ClusterSpec::h100_nvlink(nodes),
        "mi210" => ClusterSpec::mi210(nodes),
        "h200" => ClusterSpec::h200(),
        other => {
            eprintln!("error: unknown cluster `{other}`; allowed: h100, mi210, h200");
            std::process::exit(2);
        }
    };
    let cm = ClusterModel::new(cluster, model);
    println!("{} on {} (analytic model)", cm.model.name, cm.cluster.name);
    println!("{:>6}  {:<14} {:>4} {:>12}  {:<14} {:>12}", "B_g", "best layout", "B_m", "samples/s", "pure dp", "samples/s");
    let mut b = 1;
    while b <= 2048 {
        let mut best: Option<(Candidate, f64)> = None;
        let mut dp_only: Option<(Candidate, f64)> = None;
        for dims in ParallelDims::all(cm.cluster.world_size()) {
            for mb in [1, 2, 4, 8, 16] {
                let Ok(c) = Candidate::new(dims, b, mb) else { continue };
                let Some(t) = cm.samples_per_sec(&c) else { continue };
                if best.is_none_or(|(_, bt)| t > bt) {
                    best = Some((c, t));
                }
                if dims.tp == 1 && dims.pp == 1 && dp_only.is_none_or(|(_, bt)| t > bt) {
                    dp_only = Some((c, t));
                }
            }
        }
        match best {
            Some((c, t)) => {
                let (d, dt) = dp_only.map_or(("-".to_string(), "-".to_string()), |(c, t)| (c.dims.to_string(), format!("{t:.1}")));
                println!("{b:>6}  {:<14} {:>4} {t:>12.1}  {d:<14} {dt:>12}", c.dims.to_string(), c.micro_batch);
            }
            None => println!("{b:>6}  (nothing fits)"),
        }
        b *= 2;
    }
}
