//! `recipes bench step` (the default bench): training-step time on the Flex CPU backend against PyTorch eager, on the
//! reference shape (d_model 256, 4 layers, 8 heads, 4 kv heads, ffn 688, vocab 4096, sequence
//! 256, micro-batch 8, fp32, AdamW) and on tiny-20m at sequence 256, with the thread count set
//! on both sides, a per-phase breakdown of each step, and the noise-scale probe's own cost (the
//! same micro-batch split with the probe on and off).

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, anyhow};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Int, Tensor, TensorData};
use copus_burn::{CausalLm, OptimConfig, cross_entropy_sum, grads};
use copus_core::model::ModelSpec;
use copus_models::LlamaConfig;

use super::probe::{probe_on_off, probe_work};
use super::{Shape, int2, median, shapes, tokens};

/// Seconds of each phase of one training step.
#[derive(Clone, Copy, Debug, Default)]
pub struct Phases {
    /// Embedding, decoder layers and the final norm, forward, under autodiff.
    pub body: f64,
    /// LM head and the loss, forward.
    pub head_loss: f64,
    /// The backward pass, gradients collected per parameter.
    pub backward: f64,
    /// The probe's work at one micro-batch per step: |g - g_prev|^2 and keeping g (|g|^2 is the
    /// clipping norm, read with or without the probe).
    pub probe: f64,
    /// |g|^2 for clipping, then AdamW.
    pub optimizer: f64,
}

impl Phases {
    /// The whole step.
    pub fn step(&self) -> f64 {
        self.body + self.head_loss + self.backward + self.probe + self.optimizer
    }
}

/// The copus step on one shape, one step per call: the model, its AdamW and the probe's last
/// gradient.
pub struct CopusStep {
    device: Device,
    model: copus_models::Llama,
    optim: copus_burn::optim::AdamW,
    previous: Option<GradientsParams>,
    spec: ModelSpec,
    micro_batch: usize,
    steps: usize,
}

impl CopusStep {
    /// A freshly initialised model of `shape` (seed 0) on Flex under autodiff.
    pub fn new(shape: &Shape) -> Self {
        Self::on(shape, Device::flex().autodiff())
    }

    /// A freshly initialised model of `shape` (seed 0) on `device` (under autodiff).
    pub fn on(shape: &Shape, device: Device) -> Self {
        device.seed(0);
        let model = LlamaConfig::from_spec(&shape.spec).init(&device);
        let cfg = OptimConfig { warmup_steps: 0, clip_norm: None, ..OptimConfig::default() };
        let optim = cfg.adamw(&model.no_decay_predicates());
        Self { device, model, optim, previous: None, spec: shape.spec.clone(), micro_batch: shape.micro_batch, steps: 0 }
    }

    /// The inputs and targets of step `index`'s micro-batch, on the step's device.
    pub fn micro_batch(&self, index: usize) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let (ids, tgt) = tokens(&self.spec, self.micro_batch, index);
        let shape = [self.micro_batch, self.spec.seq_len];
        (int2(ids, shape, &self.device), int2(tgt, shape, &self.device))
    }

    /// One micro-batch's forward pass, summed loss and backward pass, nothing updated: what an
    /// operator count measures.
    pub fn forward_backward(&self, inputs: Tensor<2, Int>, targets: Tensor<2, Int>) {
        let loss = cross_entropy_sum(self.model.head(self.model.hidden(inputs)), targets);
        drop(GradientsParams::from_grads(loss.backward(), &self.model));
    }

    /// One training step, timed phase by phase.
    pub fn step(&mut self) -> Phases {
        let n = (self.micro_batch * self.spec.seq_len) as f64;
        let (inputs, targets) = self.micro_batch(self.steps);
        self.steps += 1;
        let mut p = Phases::default();
        let t = Instant::now();
        let h = self.model.hidden(inputs);
        p.body = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let loss = cross_entropy_sum(self.model.head(h), targets).div_scalar(n);
        let value = loss.clone().into_scalar::<f32>();
        p.head_loss = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let g = GradientsParams::from_grads(loss.backward(), &self.model);
        p.backward = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let diff = self.previous.as_ref().map(|prev| grads::diff_sq_norm(&self.model, &g, prev));
        self.previous = Some(grads::scaled(&self.model, &g, 1.0));
        p.probe = t.elapsed().as_secs_f64();
        let t = Instant::now();
        // |g|^2 for clipping, which a step does with or without the probe.
        let sq = grads::sq_norm(&self.model, &g);
        assert!(value.is_finite() && sq.is_finite() && diff.is_none_or(f64::is_finite));
        self.model = self.optim.step(1e-3, self.model.clone(), g);
        // The step is done once its weights can be read.
        let _ = self.model.embed_tokens.weight.val().slice([0..1, 0..1]).into_data();
        p.optimizer = t.elapsed().as_secs_f64();
        p
    }
}

/// The GEMMs timed on their own, `(m, k, n)`: the reference step's LM head, then tiny-20m's
/// (sequence 256, 8 sequences) projections forward (q and o, k and v, gate and up, down, the LM
/// head) and one weight gradient.
pub const GEMMS: [(usize, usize, usize); 7] =
    [(2048, 256, 4096), (2048, 512, 512), (2048, 512, 256), (2048, 512, 1376), (2048, 1376, 512), (2048, 512, 4096), (512, 2048, 1376)];

/// GFLOP/s of an `[m, k] x [k, n]` fp32 GEMM on the plain Flex device, as Flex's matmul and as
/// copus's fused linear (the path of every linear layer): the median of `reps` products after
/// one, each read back.
pub fn gemm_gflops((m, k, n): (usize, usize, usize), reps: usize) -> (f64, f64) {
    let device = Device::flex();
    let a: Tensor<2> = Tensor::random([m, k], burn::tensor::Distribution::Default, &device);
    let b: Tensor<2> = Tensor::random([k, n], burn::tensor::Distribution::Default, &device);
    let gflops = |f: &dyn Fn() -> Tensor<2>| {
        let secs = millis_of(reps, || drop(f().slice([0..1, 0..1]).into_data())) / 1e3;
        2.0 * (m * k * n) as f64 / secs / 1e9
    };
    (gflops(&|| a.clone().matmul(b.clone())), gflops(&|| copus_burn::fused::linear(a.clone(), b.clone(), None)))
}

/// Where `bench/torch_step.py` is: `COPUS_TORCH_STEP`, else next to this executable (the GPU
/// bundle), else in this crate's sources.
fn torch_step_script() -> PathBuf {
    if let Some(p) = std::env::var_os("COPUS_TORCH_STEP") {
        return PathBuf::from(p);
    }
    let beside = std::env::current_exe().ok().and_then(|e| e.parent().map(|d| d.join("torch_step.py")));
    beside.filter(|p| p.is_file()).unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("bench/torch_step.py"))
}

/// PyTorch eager on one shape (`bench/torch_step.py`), a process that steps on request, so
/// that the two sides can step in turn.
pub struct Torch {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Threads PyTorch runs on, as it reports them.
    pub threads: usize,
    /// The last step's peak memory as PyTorch's caching allocator reserved it (CUDA; 0 on the
    /// CPU).
    pub peak_bytes: u64,
}

impl Torch {
    /// Starts PyTorch on `shape` with `threads` threads, or says why it could not.
    pub fn start(shape: &Shape, threads: usize) -> anyhow::Result<Self> {
        Self::start_with(shape, threads, &[])
    }

    /// [`Self::start`] with more of torch_step.py's options (`--attention sdpa`, ...).
    pub fn start_with(shape: &Shape, threads: usize, options: &[&str]) -> anyhow::Result<Self> {
        let script = torch_step_script();
        let s = &shape.spec;
        let dims = format!(
            "{},{},{},{},{},{},{},{}",
            s.hidden, s.num_layers, s.num_heads, s.num_kv_heads, s.ffn_hidden, s.vocab_size, s.seq_len, shape.micro_batch
        );
        let mut child = Command::new("python3")
            .arg(&script)
            .args(["--threads", &threads.to_string(), "--shape", &dims])
            .args(options)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| anyhow!("cannot run python3: {e}"))?;
        let (stdin, stdout) = (child.stdin.take().expect("piped"), child.stdout.take().expect("piped"));
        let mut torch = Self { child, stdin, stdout: BufReader::new(stdout), threads: 0, peak_bytes: 0 };
        let ready = torch.answer();
        torch.threads = ready?["threads"].as_u64().unwrap_or(0) as usize;
        Ok(torch)
    }

    /// The next answer; when there is none, the last line PyTorch wrote to stderr (its error).
    fn answer(&mut self) -> anyhow::Result<serde_json::Value> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            let _ = self.child.kill();
            let mut err = String::new();
            if let Some(mut e) = self.child.stderr.take() {
                let _ = e.read_to_string(&mut err);
            }
            return Err(anyhow!("{}", err.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("python3 exited")));
        }
        let v: serde_json::Value = serde_json::from_str(&line)?;
        match v["error"].as_str() {
            Some(e) => Err(anyhow!("{e}")),
            None => Ok(v),
        }
    }

    fn request(&mut self, line: &str) -> anyhow::Result<serde_json::Value> {
        writeln!(self.stdin, "{line}").and_then(|()| self.stdin.flush()).context("PyTorch stopped reading")?;
        self.answer()
    }

    /// One training step: body, head and loss, backward, optimizer (no probe).
    pub fn step(&mut self) -> anyhow::Result<Phases> {
        let v = self.request("step")?;
        self.peak_bytes = v["peak_reserved_bytes"].as_u64().unwrap_or(0);
        let f = |k: &str| v[k].as_f64().with_context(|| format!("no {k} in PyTorch's answer"));
        Ok(Phases { body: f("body")?, head_loss: f("head_loss")?, backward: f("backward")?, probe: 0.0, optimizer: f("optimizer")? })
    }

    /// Operator calls (`aten::` events of PyTorch's profiler) of one micro-batch's forward, loss
    /// and backward.
    pub fn operator_calls(&mut self) -> anyhow::Result<u64> {
        self.request("count")?["aten_calls"].as_u64().context("no aten_calls in PyTorch's answer")
    }

    /// GFLOP/s of each of `gemms` `(m, k, n)`, each alone.
    pub fn gemm_gflops(&mut self, gemms: &[(usize, usize, usize)]) -> anyhow::Result<Vec<f64>> {
        let list = gemms.iter().map(|(m, k, n)| format!("{m}x{k}x{n}")).collect::<Vec<_>>().join(",");
        let v = self.request(&format!("gemm {list}"))?;
        Ok(v["gemm_gflops"].as_array().context("no gemm_gflops")?.iter().filter_map(|x| x.as_f64()).collect())
    }
}

impl Drop for Torch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// PyTorch's side of [`alternate`]: its phases per timed step and the threads it reported, or
/// none when it was not asked for, or why it could not run.
pub type TheirSide = anyhow::Result<Option<(Vec<Phases>, usize)>>;

/// Steps `copus` and (when given) PyTorch in turn, one step each per round, the first side
/// alternating between rounds, so that the machine's drift falls on both: the phases of each
/// side's timed steps, and per timed round PyTorch's step time over copus's.
pub fn alternate(
    mut copus: CopusStep,
    torch: Option<anyhow::Result<Torch>>,
    steps: usize,
    warmup: usize,
) -> (Vec<Phases>, TheirSide, Vec<f64>) {
    let mut server = torch.transpose();
    let (mut ours, mut theirs, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..warmup + steps {
        let their_step = |server: &mut anyhow::Result<Option<Torch>>| match server {
            Ok(Some(t)) => match t.step() {
                Ok(p) => Some(p),
                Err(e) => {
                    *server = Err(e);
                    None
                }
            },
            _ => None,
        };
        let first = if round % 2 == 1 { their_step(&mut server) } else { None };
        let o = copus.step();
        let t = if round % 2 == 0 { their_step(&mut server) } else { first };
        if round >= warmup {
            ours.push(o);
            if let Some(t) = t {
                ratios.push(t.step() / o.step());
                theirs.push(t);
            }
        }
    }
    let theirs = server.map(|s| s.map(|t| (theirs, t.threads)));
    (ours, theirs, ratios)
}

/// Prints the phase table of an [`alternate`] run on `shape`: each phase's median for copus and
/// PyTorch with their ratio, then tokens/s and the per-round ratio's median and range.
pub fn phase_table(shape: &Shape, (ours, theirs, ratios): (Vec<Phases>, TheirSide, Vec<f64>)) {
    let tokens = (shape.micro_batch * shape.spec.seq_len) as f64;
    let ours = median_phases(&ours);
    let theirs_phases = theirs.as_ref().ok().and_then(Option::as_ref).map(|(p, _)| median_phases(p));
    println!("| phase | copus s | PyTorch s | PyTorch / copus |\n|---|---:|---:|---:|");
    let rows: [(&str, PhaseOf); 6] = [
        ("embedding + decoder layers + final norm, forward", |p| p.body),
        ("LM head + loss, forward", |p| p.head_loss),
        ("backward", |p| p.backward),
        ("noise-scale probe: |g - g_prev|^2", |p| p.probe),
        ("|g|^2 (clipping) + AdamW", |p| p.optimizer),
        ("training step", Phases::step),
    ];
    for (name, f) in rows {
        let (a, b) = (f(&ours), theirs_phases.as_ref().map(f));
        match b {
            Some(b) if name.starts_with("noise-scale probe") => println!("| {name} | {a:.4} | {b:.4} (none) | |"),
            Some(b) => println!("| {name} | {a:.4} | {b:.4} | {:.2} |", b / a),
            None => println!("| {name} | {a:.4} | | |"),
        }
    }
    let step = ours.step();
    match (&theirs, theirs_phases) {
        (Ok(Some((_, threads))), Some(their)) => {
            let lo = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = ratios.iter().copied().fold(0.0, f64::max);
            println!(
                "tokens/s: copus {:.0}, PyTorch {:.0}; ratio (PyTorch step time / copus step time, the two stepping in turn): {:.2}, the median over {} rounds ({lo:.2}-{hi:.2}) (PyTorch reported {threads} threads)",
                tokens / step,
                tokens / their.step(),
                median(ratios.clone()),
                ratios.len(),
            );
        }
        (Err(e), _) => println!("tokens/s: copus {:.0}; PyTorch eager: not measured ({e})", tokens / step),
        _ => println!("tokens/s: copus {:.0}", tokens / step),
    }
}

/// Sets the number of threads of rayon's global pool (Flex's GEMM and the fused loss run on
/// it); returns how many it has, which differs if the pool had already started.
pub fn set_threads(threads: usize) -> usize {
    let _ = rayon::ThreadPoolBuilder::new().num_threads(threads).build_global();
    rayon::current_num_threads()
}

/// Reads one phase (or the whole step) of a step's times.
type PhaseOf = fn(&Phases) -> f64;

/// Medians of each phase over steps.
fn median_phases(v: &[Phases]) -> Phases {
    let m = |f: fn(&Phases) -> f64| median(v.iter().map(f).collect());
    Phases {
        body: m(|p| p.body),
        head_loss: m(|p| p.head_loss),
        backward: m(|p| p.backward),
        probe: m(|p| p.probe),
        optimizer: m(|p| p.optimizer),
    }
}

/// Median milliseconds of `f` over 5 runs after one.
fn millis(f: impl FnMut()) -> f64 {
    millis_of(5, f)
}

/// Median milliseconds of `f` over `reps` runs after one.
fn millis_of(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    )
}

/// Forward and backward of `op` on a fresh leaf holding `x`; the gradient is read back.
fn forward_backward<const D: usize>(x: &Tensor<D>, op: impl Fn(Tensor<D>) -> Tensor<D>) {
    let a = x.clone().require_grad();
    let g = op(a.clone()).sum().backward();
    let _ = a.grad(&g).expect("a gradient").into_data();
}

/// Per-op table on the reference shape's tensors: each fused op against Burn's decomposed form
/// (forward and backward under autodiff), and the LM head's backward GEMMs with transposed and
/// with contiguous operands.
pub fn op_table() {
    let device = Device::flex().autodiff();
    device.seed(1);
    println!("\n| op, forward + backward under autodiff | fused ms | Burn ms | Burn / fused |\n|---|---:|---:|---:|");
    let mut rows = fused_op_rows(&device);
    rows.push(attention_row(&device));
    rows.push(linear_row(&device));
    for (name, ours, theirs) in rows {
        println!("| {name} | {ours:.2} | {theirs:.2} | {:.2} |", theirs / ours);
    }
    lm_head_gemm_table();
}

/// A row of the per-op table: the op, fused ms, Burn's ms.
type OpRow = (&'static str, f64, f64);

/// The softmaxes, SiLU, the SwiGLU product and the cross entropy, fused against Burn's.
fn fused_op_rows(device: &Device) -> Vec<OpRow> {
    use burn::tensor::Distribution;
    use burn::tensor::activation;
    use copus_burn::fused;
    let scores: Tensor<4> = Tensor::random([8, 4, 512, 256], Distribution::Normal(0.0, 2.0), device);
    let gate: Tensor<3> = Tensor::random([8, 256, 688], Distribution::Normal(0.0, 2.0), device);
    let up: Tensor<3> = Tensor::random([8, 256, 688], Distribution::Normal(0.0, 1.0), device).require_grad();
    let logits: Tensor<3> = Tensor::random([8, 256, 4096], Distribution::Normal(0.0, 2.0), device);
    let targets = int2((0..8 * 256).map(|j| (j * 17 % 4096) as i64).collect(), [8, 256], device);
    let ce = |f: fn(Tensor<3>, Tensor<2, Int>) -> Tensor<1>| {
        let a = logits.clone().require_grad();
        let g = f(a.clone(), targets.clone()).backward();
        let _ = a.grad(&g).expect("a gradient").into_data();
    };
    vec![
        (
            "softmax over [8,4,512,256] (attention)",
            millis(|| forward_backward(&scores, fused::softmax)),
            millis(|| forward_backward(&scores, |x| activation::softmax(x, 3))),
        ),
        (
            "causal softmax of scaled [8,4,512,256] scores (2 query heads per kv head)",
            millis(|| forward_backward(&scores, |x| fused::causal_softmax(x, 0.17, 256, 0))),
            millis(|| {
                forward_backward(&scores, |x| {
                    let mask: Vec<f32> = (0..512 * 256).map(|i| if i % 256 <= (i / 256) % 256 { 0.0 } else { -1e30 }).collect();
                    let mask = Tensor::<4>::from_data(TensorData::new(mask, [1, 1, 512, 256]), &x.device());
                    activation::softmax(x.mul_scalar(0.17) + mask, 3)
                })
            }),
        ),
        (
            "SiLU of [8,256,688] (SwiGLU gate)",
            millis(|| forward_backward(&gate, fused::silu)),
            millis(|| forward_backward(&gate, activation::silu)),
        ),
        (
            "SwiGLU product silu(gate) * up of [8,256,688]",
            millis(|| forward_backward(&gate, |g| fused::swiglu(g, up.clone()))),
            millis(|| forward_backward(&gate, |g| activation::silu(g) * up.clone())),
        ),
        ("cross entropy of [8,256,4096] logits", millis(|| ce(fused::cross_entropy_sum)), millis(|| ce(log_softmax_loss))),
    ]
}

/// Attention of the reference shape: 8 sequences of 256, 4 kv heads of 2 query heads, e 64;
/// fused against Burn's matmuls around the fused causal softmax.
fn attention_row(device: &Device) -> OpRow {
    use burn::tensor::Distribution;
    use copus_burn::fused;
    let [q, k, v]: [Tensor<4>; 3] = [[8, 4, 512, 64], [8, 4, 256, 64], [8, 4, 256, 64]]
        .map(|d| Tensor::random(d, Distribution::Normal(0.0, 1.0), device).require_grad());
    let attention = |f: &dyn Fn(Tensor<4>, Tensor<4>, Tensor<4>) -> Tensor<3>| {
        millis(|| {
            let g = f(q.clone(), k.clone(), v.clone()).sum().backward();
            let _ = (q.grad(&g).expect("a gradient").into_data(), k.grad(&g).expect("a gradient"), v.grad(&g).expect("a gradient"));
        })
    };
    (
        "causal attention, q [8,4,512,64] (2 query heads per kv head), k and v [8,4,256,64]; Burn: its matmuls around the fused causal softmax",
        attention(&|q, k, v| fused::causal_attention(q, k, v, 0.125, 256, 0)),
        attention(&|q, k, v| {
            let probs = fused::causal_softmax(q.matmul(k.swap_dims(2, 3)), 0.125, 256, 0);
            probs.matmul(v).reshape([8, 8, 256, 64]).swap_dims(1, 2).reshape([8, 256, 512])
        }),
    )
}

/// tiny-20m's gate projection, input and weight tracked: the fused linear against Burn's.
fn linear_row(device: &Device) -> OpRow {
    use burn::tensor::Distribution;
    use copus_burn::fused;
    let (lx, lw): (Tensor<3>, Tensor<2>) = (
        Tensor::random([8, 256, 512], Distribution::Normal(0.0, 1.0), device).require_grad(),
        Tensor::random([512, 1376], Distribution::Normal(0.0, 0.05), device).require_grad(),
    );
    let linear = |f: fn(Tensor<3>, Tensor<2>, Option<Tensor<1>>) -> Tensor<3>| {
        millis(|| {
            let g = f(lx.clone(), lw.clone(), None).sum().backward();
            let _ = (lx.grad(&g).expect("a gradient").into_data(), lw.grad(&g).expect("a gradient").into_data());
        })
    };
    (
        "linear [8,256,512] x [512,1376] (tiny-20m's gate projection); Burn: its linear (matmul)",
        linear(fused::linear),
        linear(burn::tensor::module::linear),
    )
}

/// The LM head's backward GEMMs (without autodiff) with a transposed operand against a
/// contiguous copy.
fn lm_head_gemm_table() {
    use burn::tensor::Distribution;
    let plain = Device::flex();
    let x: Tensor<2> = Tensor::random([2048, 256], Distribution::Default, &plain);
    let g: Tensor<2> = Tensor::random([2048, 4096], Distribution::Default, &plain);
    let w: Tensor<2> = Tensor::random([256, 4096], Distribution::Default, &plain);
    let (xt, wt) = (x.clone().transpose().add_scalar(0.0), w.clone().transpose().add_scalar(0.0));
    let run = |f: &dyn Fn() -> Tensor<2>| millis(|| drop(f().slice([0..1, 0..1]).into_data()));
    println!("\n| LM-head backward GEMM | transposed operand ms | contiguous operand ms |\n|---|---:|---:|");
    println!(
        "| dW = x^T g, [256,2048]x[2048,4096] | {:.2} | {:.2} |",
        run(&|| x.clone().transpose().matmul(g.clone())),
        run(&|| xt.clone().matmul(g.clone()))
    );
    println!(
        "| dx = g W^T, [2048,4096]x[4096,256] | {:.2} | {:.2} |",
        run(&|| g.clone().matmul(w.clone().transpose())),
        run(&|| g.clone().matmul(wt.clone()))
    );
}

/// Prints the tables: per shape, each phase for copus and PyTorch with the ratio, then the
/// probe's cost on and off for two micro-batch splits.
pub fn run(steps: usize, warmup: usize, torch: bool, threads: usize) {
    let ours_threads = set_threads(threads);
    println!(
        "threads: copus {ours_threads} (rayon pool of Flex and the fused kernels), PyTorch {threads} (torch.set_num_threads); medians of {steps} steps after {warmup} warm-up"
    );
    for shape in shapes() {
        let s = &shape.spec;
        println!(
            "\n{}: d_model {}, {} layers, {} heads, {} kv heads, ffn {}, vocab {}, seq {}, micro-batch {}, fp32, AdamW",
            s.name, s.hidden, s.num_layers, s.num_heads, s.num_kv_heads, s.ffn_hidden, s.vocab_size, s.seq_len, shape.micro_batch
        );
        let server = torch.then(|| Torch::start(&shape, threads));
        phase_table(&shape, alternate(CopusStep::new(&shape), server, steps, warmup));
        println!(
            "| probe, same split | step, probe on s | step, probe off s | whole-step cost | probe's work on ms | off ms | probe's work / step |\n|---|---:|---:|---:|---:|---:|---:|"
        );
        for num_micro in [1, 4] {
            let (on, off) = probe_on_off(&shape, num_micro, steps, warmup.max(1));
            let (work_on, work_off) = probe_work(&shape, num_micro, steps);
            println!(
                "| {num_micro} x {} sequences | {on:.4} | {off:.4} | {:+.2}% | {:.2} | {:.2} | {:.2}% |",
                shape.micro_batch / num_micro,
                100.0 * (on - off) / off,
                1e3 * work_on,
                1e3 * work_off,
                100.0 * (work_on - work_off) / off
            );
        }
    }
    op_table();
    let theirs = torch.then(|| Torch::start(&shapes().remove(0), threads).and_then(|mut t| t.gemm_gflops(&GEMMS)));
    println!(
        "\n| GEMM fp32, [m,k]x[k,n] | Flex matmul GFLOP/s | copus linear GFLOP/s | PyTorch GFLOP/s | copus linear / PyTorch |\n|---|---:|---:|---:|---:|"
    );
    for (i, &(m, k, n)) in GEMMS.iter().enumerate() {
        let (flex, ours) = gemm_gflops((m, k, n), 5);
        match theirs.as_ref().map(|t| t.as_ref().map(|g| g.get(i).copied())) {
            Some(Ok(Some(g))) => println!("| [{m},{k}]x[{k},{n}] | {flex:.1} | {ours:.1} | {g:.1} | {:.2} |", ours / g),
            _ => println!("| [{m},{k}]x[{k},{n}] | {flex:.1} | {ours:.1} | | |"),
        }
    }
}

/// The summed cross entropy through Burn's `log_softmax`: the unfused form the op table times
/// the fused loss against.
fn log_softmax_loss(logits_bsv: Tensor<3>, targets_bs: Tensor<2, Int>) -> Tensor<1> {
    burn::tensor::activation::log_softmax(logits_bsv, 2).gather(2, targets_bs.unsqueeze_dim::<3>(2)).sum().neg()
}
