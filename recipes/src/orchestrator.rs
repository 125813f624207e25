//! `recipes orchestrator RECIPE --profile FILE`: the recipe's candidate space served to training
//! runs over TCP (copus-service), each session deciding with the named policy over the measured
//! throughput profile.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use clap::builder::TypedValueParser as _;
use copus_core::orchestrator::{Orchestrator, RunFingerprint};
use copus_core::policy::Scorer;
use copus_core::throughput::ThroughputProfile;
use copus_service::{MakeOrchestrator, PolicyName, ServiceConfig, policy_by_name, spawn};

/// Serves decisions for runs of the recipe at `recipe_path` on `listen` until the process ends;
/// the shared token comes from `COPUS_ORCHESTRATOR_TOKEN`.
pub fn serve(recipe_path: &Path, profile: &Path, policy: PolicyName, listen: SocketAddr) -> anyhow::Result<()> {
    let token = std::env::var("COPUS_ORCHESTRATOR_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .context("set COPUS_ORCHESTRATOR_TOKEN to the shared token the training runs will present")?;
    let recipe = crate::load_recipe(recipe_path)?;
    let par = recipe.parallel.clone().context("the recipe needs a `parallel` section (the candidate space)")?;
    let text = std::fs::read_to_string(profile).with_context(|| format!("reading the profile {}", profile.display()))?;
    let profile = ThroughputProfile::from_ron(&text)?;
    let spec = recipe.model_spec()?;
    let space = par.space()?;
    let fingerprint = RunFingerprint::new(&spec, &space);
    let feasible = space.enumerate(&spec).feasible;
    let scorer = Scorer::new(&feasible, &profile, recipe.optim.b0 as f64, std::sync::Arc::from(par.objective(&recipe.optim).build()))?;
    let rule = par.copus_rule(recipe.train.time_budget_secs);
    // The recipe's ranks are one machine's.
    let ranks_per_node = par.world_size;
    policy_by_name(policy, &scorer, rule, ranks_per_node)?;
    let make: MakeOrchestrator = Arc::new(move || {
        let p = policy_by_name(policy, &scorer, rule, ranks_per_node).expect("checked above");
        Orchestrator::new(p, scorer.clone())
    });
    let handle = spawn(listen, ServiceConfig::new(token, fingerprint.clone()), make)?;
    tracing::info!("orchestrator listening on {} for runs of {fingerprint}", handle.addr);
    Ok(handle.join()?)
}

/// Serve decisions over TCP to training runs (token from COPUS_ORCHESTRATOR_TOKEN).
#[derive(clap::Args)]
pub struct OrchestratorArgs {
    /// A training recipe with a `parallel` section (the candidate space).
    recipe: PathBuf,
    /// Throughput profile of the candidates (from `recipes profile`).
    #[arg(long)]
    profile: PathBuf,
    /// The decision policy.
    #[arg(long, default_value_t = PolicyName::Copus, value_parser = policy_name())]
    policy: PolicyName,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7450")]
    listen: SocketAddr,
}

impl OrchestratorArgs {
    /// `recipes orchestrator`: [`serve`] until the process ends.
    pub fn exec(self) -> anyhow::Result<()> {
        serve(&self.recipe, &self.profile, self.policy, self.listen)
    }
}

/// `--policy`: one of the service's policy names, listed in `--help` and in the error.
fn policy_name() -> impl clap::builder::TypedValueParser<Value = PolicyName> {
    clap::builder::PossibleValuesParser::new(PolicyName::ALL.map(PolicyName::as_str))
        .map(|s| s.parse::<PolicyName>().expect("one of the listed names"))
}
