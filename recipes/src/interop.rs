//! A trained run's model outside the run: export to the Hugging Face Llama layout, start a
//! recipe from such a directory (`init_from`), the loss on any text (`recipes eval`), and text
//! generation (`recipes generate`).

use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow};
use burn::tensor::Device;
use copus_core::model::ModelSpec;
use copus_models::generate::Sampling;
use copus_models::{Llama, LlamaConfig, hf};
use tokenizers::Tokenizer;

use crate::data::{self, PackedDataset};
use crate::prepare::checked_vocab;
use crate::recipe::Recipe;
use crate::report::progress::Progress;

/// A run folder's model, ready to use.
pub struct RunModel {
    /// The recipe the run was trained with.
    pub recipe: Recipe,
    /// The model's configuration.
    pub cfg: LlamaConfig,
    /// The final weights.
    pub model: Llama,
    /// The run's tokenizer.
    pub tokenizer: Tokenizer,
}

impl RunModel {
    /// The end-of-text token, when the tokenizer has one.
    pub fn eot(&self) -> Option<u32> {
        self.tokenizer.token_to_id("<|endoftext|>")
    }
}

/// Loads a run folder: `recipe.ron`, `tokenizer.json` and `model.safetensors`.
pub fn load_run(run_dir: &Path) -> anyhow::Result<RunModel> {
    let recipe = Recipe::load(&run_dir.join("recipe.ron")).with_context(|| format!("{} is not a run folder", run_dir.display()))?;
    let tpath = run_dir.join("tokenizer.json");
    if !tpath.exists() {
        return Err(anyhow!("{} has no tokenizer.json (runs write one since this version); run the recipe again", run_dir.display()));
    }
    let tokenizer = Tokenizer::from_file(&tpath).map_err(|e| anyhow!("{}: {e}", tpath.display()))?;
    let mut spec = recipe.model_spec()?;
    spec.vocab_size = checked_vocab(&tokenizer, &tpath.display().to_string())?;
    let cfg = LlamaConfig::from_spec(&spec);
    let mut model = cfg.init(&Device::flex());
    copus_models::load_safetensors(&mut model, &run_dir.join("model.safetensors"))?;
    Ok(RunModel { recipe, cfg, model, tokenizer })
}

/// `recipes export`: the run's model in the HF Llama layout, with its tokenizer.
pub fn export(run_dir: &Path, to: &Path) -> anyhow::Result<()> {
    let m = load_run(run_dir)?;
    if let (Ok(a), Ok(b)) = (run_dir.canonicalize(), to.canonicalize())
        && a == b
    {
        return Err(anyhow!("--to {} is the run folder itself; export to another directory", to.display()));
    }
    // Everything is written into a fresh folder beside `to` and moved into place at the end, so
    // a failure (or a kill) never leaves a half-written export where a whole one was.
    let name = to.file_name().ok_or_else(|| anyhow!("--to {}: not a directory name", to.display()))?.to_string_lossy().into_owned();
    let parent = to.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    let staging = parent.join(format!(".{name}.export-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    let written = write_export(&m, &staging);
    let placed = written.and_then(|()| replace_dir(&staging, to));
    if placed.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    placed
}

/// Moves the files written in `from` into the folder `to` (made if missing), each by one
/// rename, so each is either the old file or the new one, whole; other files in `to` are left
/// as they are. Then removes `from`.
fn replace_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    if !to.exists() {
        return std::fs::rename(from, to).with_context(|| format!("moving the export into {}", to.display()));
    }
    if !to.is_dir() {
        return Err(anyhow!("--to {} exists and is not a directory", to.display()));
    }
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let entry = entry?;
        let dest = to.join(entry.file_name());
        std::fs::rename(entry.path(), &dest).with_context(|| format!("moving the export's {} into place", dest.display()))?;
    }
    std::fs::remove_dir(from).with_context(|| format!("removing {}", from.display()))
}

/// Writes the HF directory of `m` (config, weights, tokenizer and its config) into `to`.
fn write_export(m: &RunModel, to: &Path) -> anyhow::Result<()> {
    hf::export(&m.model, &m.cfg, to, m.eot())?;
    m.tokenizer.save(to.join("tokenizer.json"), true).map_err(|e| anyhow!("{}: {e}", to.join("tokenizer.json").display()))?;
    // Without this, transformers' AutoTokenizer would take the Llama tokenizer class and its
    // `<s>`/`</s>` defaults; the run's tokenizer adds no BOS and ends texts with end-of-text.
    let eot = m.eot().map(|_| "<|endoftext|>");
    let config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eot,
        "eos_token": eot,
        "add_bos_token": false,
        "add_eos_token": false,
        "model_max_length": m.cfg.shape.seq_len,
    });
    let tc = to.join("tokenizer_config.json");
    std::fs::write(&tc, serde_json::to_string_pretty(&config)? + "\n").with_context(|| format!("writing {}", tc.display()))?;
    Ok(())
}

/// The weights of an HF Llama directory for a recipe's model of shape `spec`, on `device`. A
/// shape that differs is an error naming the config.json field.
pub fn init_from(dir: &Path, spec: &ModelSpec, device: &Device) -> anyhow::Result<Llama> {
    let (cfg, model) = hf::import(dir, device).with_context(|| format!("`init_from` = {}", dir.display()))?;
    let ours = LlamaConfig::from_spec(spec);
    if spec.qkv_bias {
        return Err(anyhow!("`init_from`: the recipe's model has q/k/v biases (`attention_bias`), which HF Llama checkpoints do not hold"));
    }
    // The run trains with the recipe's RoPE base and norm epsilon; different ones would change
    // the model that was imported.
    for (field, a, b) in [("rope_theta", cfg.rope_theta, ours.rope_theta), ("rms_norm_eps", cfg.norm_eps, ours.norm_eps)] {
        if a != b {
            return Err(anyhow!("`init_from` = {}: config.json `{field}` is {a}, the recipe's model uses {b}", dir.display()));
        }
    }
    let theirs = cfg.spec(&spec.name);
    for (field, a, b) in [
        ("num_hidden_layers", theirs.num_layers, spec.num_layers),
        ("hidden_size", theirs.hidden, spec.hidden),
        ("num_attention_heads", theirs.num_heads, spec.num_heads),
        ("num_key_value_heads", theirs.num_kv_heads, spec.num_kv_heads),
        ("intermediate_size", theirs.ffn_hidden, spec.ffn_hidden),
        ("vocab_size", theirs.vocab_size, spec.vocab_size),
        ("tie_word_embeddings", usize::from(theirs.tied_embeddings), usize::from(spec.tied_embeddings)),
    ] {
        if a != b {
            return Err(anyhow!(
                "`init_from` = {}: config.json `{field}` is {a}, the recipe's model (`model.preset` {} with its tokenizer) has {b}",
                dir.display(),
                spec.name
            ));
        }
    }
    Ok(model)
}

/// What `recipes eval` measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TextLoss {
    /// Tokens of the text (with the end-of-text token).
    pub tokens: usize,
    /// Windows of `seq + 1` tokens evaluated.
    pub windows: usize,
    /// Mean next-token loss, nats per token.
    pub loss: f64,
}

impl TextLoss {
    /// `exp(loss)`.
    pub fn perplexity(&self) -> f64 {
        self.loss.exp()
    }
}

/// Mean next-token loss of `model` on `text`, tokenised by `tokenizer` and cut into windows of
/// `seq + 1` tokens with stride `seq` (as runs cut their held-out text), in micro-batches of
/// `micro`; at most `max_windows` windows.
pub fn eval_text(
    model: &Llama,
    tokenizer: &Tokenizer,
    text: &str,
    seq: usize,
    max_windows: Option<usize>,
    micro: usize,
) -> anyhow::Result<TextLoss> {
    if max_windows == Some(0) {
        return Err(anyhow!("--max-windows 0: evaluate at least one window"));
    }
    let tokens = data::encode(tokenizer, &[text])?;
    let n = tokens.len();
    if n < seq + 1 {
        return Err(anyhow!("the text has {n} tokens; one window needs {} (lower --seq)", seq + 1));
    }
    let windows = PackedDataset::new(tokens, seq, 0, "text")?;
    let count = max_windows.unwrap_or(usize::MAX).min(windows.num_seqs());
    let bar = Progress::new("eval", count.div_ceil(micro.max(1)) as u64);
    let loss = crate::eval::heldout_loss(&windows, count, micro, &model.embed_tokens.weight.device(), |b| {
        let l = f64::from(model.loss_sum(b.inputs, b.targets).into_scalar::<f32>());
        bar.inc(1);
        l
    });
    bar.finish();
    Ok(TextLoss { tokens: n, windows: count, loss })
}

/// `recipes eval`.
pub fn eval_command(run_dir: &Path, text: &Path, seq: Option<usize>, max_windows: Option<usize>) -> anyhow::Result<TextLoss> {
    let m = load_run(run_dir)?;
    let text = std::fs::read_to_string(text).with_context(|| format!("reading {} (UTF-8 text)", text.display()))?;
    let seq = seq.unwrap_or(m.cfg.shape.seq_len);
    if seq == 0 || seq > m.cfg.shape.seq_len {
        return Err(anyhow!("--seq {seq}: 1..={} (the run's sequence length)", m.cfg.shape.seq_len));
    }
    eval_text(&m.model, &m.tokenizer, &text, seq, max_windows, m.recipe.train.micro_batch)
}

/// `recipes generate`: the prompt's continuation.
pub fn generate_command(run_dir: &Path, prompt: &str, max_tokens: usize, sampling: Sampling) -> anyhow::Result<String> {
    sampling.validate().map_err(|e| anyhow!("--{e}"))?;
    let m = load_run(run_dir)?;
    let ids = m.tokenizer.encode(prompt, false).map_err(|e| anyhow!("tokenizing the prompt: {e}"))?.get_ids().to_vec();
    if ids.is_empty() {
        return Err(anyhow!("the prompt is empty"));
    }
    if ids.len() >= m.cfg.shape.seq_len {
        return Err(anyhow!("the prompt has {} tokens; the model reads at most {}", ids.len(), m.cfg.shape.seq_len));
    }
    // Only ids the tokenizer has (the embedding is padded to a multiple of 64).
    let allowed = m.tokenizer.get_vocab_size(true);
    let out = copus_models::generate::generate(&m.model, &ids, max_tokens, m.cfg.shape.seq_len, allowed, &sampling, m.eot(), true);
    m.tokenizer.decode(&out, true).map_err(|e| anyhow!("decoding: {e}"))
}

/// Write a run's model as a Hugging Face Llama directory (config.json, model.safetensors,
/// tokenizer.json) that transformers' LlamaForCausalLM loads.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// The run folder.
    run_dir: PathBuf,
    /// The directory to write.
    #[arg(long)]
    to: PathBuf,
}

impl ExportArgs {
    /// `recipes export`: [`export`], then what was written.
    pub fn exec(self) -> anyhow::Result<()> {
        export(&self.run_dir, &self.to)?;
        println!("wrote {} (config.json, model.safetensors, tokenizer.json)", self.to.display());
        Ok(())
    }
}

/// Mean next-token loss and perplexity of a run's model on any UTF-8 text.
#[derive(clap::Args)]
pub struct EvalArgs {
    /// The run folder.
    run_dir: PathBuf,
    /// The text file.
    #[arg(long)]
    text: PathBuf,
    /// Window length in tokens (default: the run's sequence length).
    #[arg(long)]
    seq: Option<usize>,
    /// Evaluate at most this many windows.
    #[arg(long)]
    max_windows: Option<usize>,
}

impl EvalArgs {
    /// `recipes eval`: [`eval_command`], then its loss and perplexity.
    pub fn exec(self) -> anyhow::Result<()> {
        let r = eval_command(&self.run_dir, &self.text, self.seq, self.max_windows)?;
        println!(
            "{}: {} tokens, {} windows; mean loss {:.4} nats/token, perplexity {:.2}",
            self.text.display(),
            r.tokens,
            r.windows,
            r.loss,
            r.perplexity()
        );
        Ok(())
    }
}

/// Continue a prompt with a run's model (KV cache; greedy at temperature 0).
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// The run folder.
    run_dir: PathBuf,
    /// The text to continue.
    #[arg(long)]
    prompt: String,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Softmax temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Nucleus sampling: the smallest set of tokens holding this much probability.
    #[arg(long, default_value_t = 0.95)]
    top_p: f64,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl GenerateArgs {
    /// `recipes generate`: [`generate_command`], printed after the prompt.
    pub fn exec(self) -> anyhow::Result<()> {
        let sampling = Sampling { temperature: self.temperature, top_p: self.top_p, seed: self.seed };
        let text = generate_command(&self.run_dir, &self.prompt, self.max_tokens, sampling)?;
        println!("{}{text}", self.prompt);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prepare::vocab_of;
    use burn::tensor::Device;

    /// A run folder made here: a tokenizer trained on made-up text, a seeded tiny model.
    fn fake_run(dir: &Path) -> (Recipe, String) {
        let text = "Tomorrow, and tomorrow, and tomorrow, creeps in this petty pace from day to day.\n".repeat(40);
        let tok = data::bpe_tokenizer(&[&text], 300, dir).unwrap();
        tok.save(dir.join("tokenizer.json"), false).unwrap();
        let recipe_text = r#"(
            name: "fake",
            model: (preset: "tiny-1m", seq_len: Some(16)),
            train: (global_batch: 4, micro_batch: 2, max_steps: 1),
        )"#;
        std::fs::write(dir.join("recipe.ron"), recipe_text).unwrap();
        let recipe = Recipe::parse(recipe_text, "fake").unwrap();
        let mut spec = recipe.model_spec().unwrap();
        spec.vocab_size = vocab_of(&tok);
        let device = Device::flex();
        let model = crate::prepare::seeded(&device, 5, || LlamaConfig::from_spec(&spec).init(&device));
        copus_models::save_safetensors(&model, &dir.join("model.safetensors")).unwrap();
        (recipe, text)
    }

    /// `recipes eval` on a text equals the run's own held-out loss over the same windows.
    #[test]
    fn eval_equals_the_runs_held_out_loss() {
        let dir = tempfile::tempdir().unwrap();
        let (_, text) = fake_run(dir.path());
        let m = load_run(dir.path()).unwrap();
        let got = eval_text(&m.model, &m.tokenizer, &text, 16, Some(9), 2).unwrap();
        let windows = PackedDataset::new(data::encode(&m.tokenizer, &[&text]).unwrap(), 16, 0, "held-out").unwrap();
        let want = crate::eval::evaluate(&m.model, &windows, 9, 2);
        assert_eq!(got.windows, 9);
        assert!((got.loss - want).abs() <= 1e-6 * want, "{} vs {want}", got.loss);
        assert!((got.perplexity() - want.exp()).abs() <= 1e-4 * want.exp());
        // Different windows, a different number.
        let all = eval_text(&m.model, &m.tokenizer, &text, 8, None, 2).unwrap();
        assert!(all.windows > 9 && all.loss != got.loss);
    }

    /// An export into an existing folder replaces the files it writes and leaves every other
    /// file there as it was, and no staging folder behind.
    #[test]
    fn an_export_replaces_its_files_and_keeps_the_others() {
        let dir = tempfile::tempdir().unwrap();
        fake_run(dir.path());
        let out = dir.path().join("hf");
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("stale.txt"), "old").unwrap();
        export(dir.path(), &out).unwrap();
        std::fs::write(out.join("config.json"), "old").unwrap();
        export(dir.path(), &out).unwrap();
        assert_eq!(std::fs::read_to_string(out.join("stale.txt")).unwrap(), "old", "another file is kept");
        assert_ne!(std::fs::read_to_string(out.join("config.json")).unwrap(), "old", "an exported file is replaced");
        assert!(out.join("model.safetensors").exists());
        let hidden: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".hf."))
            .collect();
        assert!(hidden.is_empty(), "{hidden:?}");
    }

    /// Export then `init_from` gives the run's model back, bit for bit; a shape that differs is
    /// refused naming the field.
    #[test]
    fn export_and_init_from_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let (recipe, _) = fake_run(dir.path());
        let out = dir.path().join("hf");
        export(dir.path(), &out).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
            assert!(out.join(f).exists(), "{f}");
        }
        let m = load_run(dir.path()).unwrap();
        let mut spec = recipe.model_spec().unwrap();
        spec.vocab_size = vocab_of(&m.tokenizer);
        let back = init_from(&out, &spec, &Device::flex()).unwrap();
        let flat = |l: &Llama| copus_burn::parallel::named_params(l).into_iter().map(|(n, _, _, v)| (n, v)).collect::<Vec<_>>();
        let (a, b) = (flat(&m.model), flat(&back));
        assert_eq!(a.len(), b.len());
        for ((na, va), (nb, vb)) in a.iter().zip(&b) {
            assert_eq!(na, nb);
            assert!(va.iter().zip(vb).all(|(x, y)| x.to_bits() == y.to_bits()), "{na}");
        }
        let bigger = ModelSpec { hidden: 256, ..spec.clone() };
        let e = init_from(&out, &bigger, &Device::flex()).err().unwrap().to_string();
        assert!(e.contains("`hidden_size` is 128") && e.contains("has 256"), "{e}");
        let cpath = out.join("config.json");
        let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cpath).unwrap()).unwrap();
        c["rope_theta"] = serde_json::json!(500000.0);
        std::fs::write(&cpath, c.to_string()).unwrap();
        let e = init_from(&out, &spec, &Device::flex()).err().unwrap().to_string();
        assert!(e.contains("`rope_theta` is 500000"), "{e}");
        assert!(export(dir.path(), dir.path()).unwrap_err().to_string().contains("the run folder itself"));
    }

    #[test]
    fn generate_continues_a_prompt_and_checks_its_settings() {
        let dir = tempfile::tempdir().unwrap();
        fake_run(dir.path());
        let greedy = Sampling::GREEDY;
        let a = generate_command(dir.path(), "Tomorrow, and", 5, greedy).unwrap();
        assert_eq!(a, generate_command(dir.path(), "Tomorrow, and", 5, greedy).unwrap());
        let e = generate_command(dir.path(), "Tomorrow", 5, Sampling { top_p: 2.0, ..greedy }).unwrap_err().to_string();
        assert!(e.contains("top-p"), "{e}");
        let long = "and tomorrow ".repeat(40);
        assert!(generate_command(dir.path(), &long, 5, greedy).unwrap_err().to_string().contains("at most 16"));
    }
}
