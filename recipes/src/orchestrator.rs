//! `recipes orchestrator RECIPE --profile FILE`: the recipe's candidate space served to training
//! runs over TCP (copus-service), each session deciding with the named policy over the measured
//! throughput profile.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
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
    let rule = par.switch_rule(recipe.train.time_budget_secs);
    policy_by_name(policy, &scorer, rule)?;
    let make: MakeOrchestrator = Arc::new(move || {
        let p = policy_by_name(policy, &scorer, rule).expect("checked above");
        Orchestrator::new(p, scorer.clone())
    });
    let handle = spawn(listen, ServiceConfig::new(token, fingerprint.clone()), make)?;
    tracing::info!("orchestrator listening on {} for runs of {fingerprint}", handle.addr);
    Ok(handle.join()?)
}
