//! The real comparison: a tiny model trained for real on the Shakespeare text on in-process
//! ranks, every policy on the same data, seed and model, on the wall clock or a modelled one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::report::progress::Progress;
use anyhow::{Context, anyhow};
use burn::tensor::Device;
use copus_burn::driver::Clock as RunClock;
use copus_burn::{DecisionSource, Driver, Engine, EngineConfig};
use copus_core::candidates::{Candidate, CandidateSpace};
use copus_core::goodput::{Objective, PlainGoodput};
use copus_core::memory::GIB;
use copus_core::model::ModelSpec;
use copus_core::orchestrator::Orchestrator;
use copus_core::policy::{Scorer, SwitchCosts, Trajectory, hindsight_oracle};
use copus_core::throughput::{ClusterModel, ThroughputModel, ThroughputProfile};
use copus_models::{LlamaConfig, full_params};

use super::records::{Compared, PolicyRun, StepRecord, SwitchRecord, describe, secs};
use super::schema::{Clock, CompareRecipe, Real};
use crate::profile::measure_profile;
use crate::recipe::Recipe;
use copus_core::policy::{Entry, lineup};

pub(super) fn real(recipe: &CompareRecipe, r: &Real) -> anyhow::Result<Compared> {
    let train_recipe = Recipe::load(Path::new(&r.recipe))?;
    let par = train_recipe.parallel.clone().with_context(|| format!("{}: the training recipe needs a `parallel` section", r.recipe))?;
    let prepared = crate::prepare::prepare(&train_recipe)?;
    let spec = prepared.spec.clone();
    let space = CandidateSpace::new(
        par.world_size,
        par.global_batches.clone(),
        par.micro_batches.clone(),
        par.schedule,
        par.memory_model(),
        par.device_memory_gib * GIB,
    )?;
    let enumeration = space.enumerate(&spec);
    let feasible = enumeration.feasible.clone();
    if feasible.is_empty() {
        return Err(anyhow!("no feasible candidate in the training recipe's space"));
    }
    let cfg = LlamaConfig::from_spec(&spec);
    let device = Device::flex().autodiff();
    let full = crate::prepare::seeded(&device, train_recipe.train.seed, || full_params(&cfg.init(&device)));
    // The throughput the policies believe, and the clock.
    let (model, clock): (Box<dyn ThroughputModel>, String) = match &r.clock {
        Clock::Wall { profile } => {
            let path = profile.as_ref().map(PathBuf::from);
            let loaded = path.as_ref().filter(|p| p.exists()).map(|p| {
                std::fs::read_to_string(p)
                    .map_err(|e| e.to_string())
                    .and_then(|t| ThroughputProfile::from_ron(&t).map_err(|e| e.to_string()))
            });
            let profile = match loaded {
                Some(p) => p.map_err(|e| anyhow!("profile {}: {e}", path.as_ref().map_or(String::new(), |p| p.display().to_string())))?,
                None => measure_profile(&cfg, &full, &feasible, spec.seq_len, par.profile_steps, path.as_deref())?,
            };
            (
                Box::new(profile),
                format!(
                    "wall clock of this machine ({} in-process ranks); the policies use a throughput profile measured here",
                    par.world_size
                ),
            )
        }
        Clock::Analytic { cluster, model } => {
            let cs = cluster.spec()?;
            let clock_spec = match model {
                Some(m) => ModelSpec::preset(m)?,
                None => spec.clone(),
            };
            (
                Box::new(ClusterModel::new(cs, clock_spec.clone())),
                format!(
                    "simulated: analytic model of {} x{} GPUs charging each step as {} (the training math is {}, real), switch costs {} s (batch) / {} s (layout)",
                    cluster.preset, par.world_size, clock_spec.name, spec.name, recipe.costs.batch, recipe.costs.layout
                ),
            )
        }
    };
    let objective: Arc<dyn Objective> = Arc::from(recipe.objective.build());
    let b0 = train_recipe.optim.b0 as f64;
    let scorer = Scorer::new(&feasible, model.as_ref(), b0, objective)?;
    let plain = Scorer::new(&feasible, model.as_ref(), b0, Arc::new(PlainGoodput))?;
    let lineup = lineup(&scorer, recipe.rule(), recipe.cbs_c)?;
    let wall = matches!(r.clock, Clock::Wall { .. });
    if wall {
        // Warm the process up (thread pools, allocator) so the first policy is not charged for it.
        let c = lineup.copus_start;
        let ec =
            EngineConfig::new(c.dims, c.global_batch, c.micro_batch, spec.seq_len, train_recipe.optim.clone()).with_schedule(par.schedule);
        let mut e = Engine::new(Arc::new(cfg.clone()), &full, ec)?;
        for i in 0..5u64 {
            let tokens: Vec<i64> =
                (0..c.global_batch as u64).flat_map(|j| prepared.train.sample(i * 64 + j).iter().map(|&t| i64::from(t))).collect();
            e.step(tokens)?;
        }
    }
    let mut runs = Vec::new();
    let mut copus_trajectory: Vec<(f64, f64)> = Vec::new();
    let mut copus_progress = 0.0;
    let data = crate::prepare::TrainSequences(&prepared.train);
    let clock_of = || match wall {
        true => RunClock::Wall,
        false => {
            let s = scorer.clone();
            RunClock::Modelled {
                step_secs: Box::new(move |c: &Candidate| c.global_batch as f64 / s.throughput(c).unwrap_or(f64::NAN)),
                batch_switch_secs: recipe.costs.batch,
                layout_switch_secs: recipe.costs.layout,
            }
        }
    };
    for Entry { policy, start, baseline } in lineup.entries {
        let name = policy.name();
        let mut orch = Orchestrator::new(policy, scorer.clone());
        let mut remote = match (&r.service, baseline) {
            (Some(addr), false) => {
                let addr: std::net::SocketAddr = addr.parse().map_err(|e| anyhow!("recipe field `scenario.service` = {addr:?}: {e}"))?;
                let token = std::env::var("COPUS_ORCHESTRATOR_TOKEN").unwrap_or_default();
                let fingerprint = copus_core::orchestrator::RunFingerprint::new(&spec, &space);
                let client = copus_service::Client::connect(addr, &token, &recipe.name, fingerprint, &orch.policy_name())?;
                // The embedded orchestrator decides while the service is away.
                let embedded = std::mem::replace(&mut orch, Orchestrator::new(Box::new(copus_core::policy::Static), scorer.clone()));
                Some(if r.service_synchronous {
                    copus_service::RemoteSource::synchronous(client, embedded, std::time::Duration::from_secs(30))
                } else {
                    copus_service::RemoteSource::new(client, embedded)
                })
            }
            _ => None,
        };
        let ec = EngineConfig::new(start.dims, start.global_batch, start.micro_batch, spec.seq_len, train_recipe.optim.clone())
            .with_schedule(par.schedule);
        let mut driver = Driver::new(Engine::new(Arc::new(cfg.clone()), &full, ec)?, enumeration.clone(), clock_of())?;
        let bar = Progress::new(&name, r.max_steps);
        let mut ema = None::<f64>;
        let mut run = PolicyRun { name: name.clone(), baseline, steps: Vec::new(), switches: Vec::new(), time_to_target: None };
        let mut progress = 0.0;
        let mut trajectory = Vec::new();
        for _ in 0..r.max_steps {
            let source: &mut dyn DecisionSource = match remote.as_mut() {
                Some(x) => x,
                None => &mut orch,
            };
            let s = driver.step(&data, source).map_err(|e| anyhow!("{name}: {e}"))?;
            let (cur, b) = (s.candidate, s.candidate.global_batch);
            let loss = s.step.metrics.loss;
            let smoothed = ema.map_or(loss, |e| r.loss_ema * e + (1.0 - r.loss_ema) * loss);
            ema = Some(smoothed);
            let phi = s.step.metrics.b_simple;
            let efficiency = phi.map_or(1.0, |p| PlainGoodput.efficiency(b as f64, b0, p));
            progress += b as f64 * efficiency;
            if let Some(p) = phi {
                trajectory.push((progress, p));
            }
            run.steps.push(StepRecord {
                step: s.step.metrics.step,
                time: s.step_clock_secs,
                loss: smoothed,
                global_batch: b,
                micro_batch: cur.micro_batch,
                layout: cur.dims.to_string(),
                throughput: s.samples_per_sec,
                efficiency,
                b_simple: phi,
            });
            bar.set_message(format!("loss {smoothed:.3} B_g {b} {}", cur.dims));
            bar.inc(1);
            if smoothed <= r.target_loss {
                run.time_to_target = Some(s.step_clock_secs);
                break;
            }
            if let Some(w) = s.switch {
                run.switches.push(SwitchRecord {
                    step: w.step,
                    time: s.step_clock_secs,
                    from: describe(&w.from),
                    to: describe(&w.to),
                    cost: w.clock_secs,
                    layout: w.layout_changed,
                });
            }
        }
        bar.finish();
        if let Some(remote) = remote.as_ref().filter(|r| r.fallback_steps() > 0) {
            run.name = format!(
                "{name} ({} steps decided in process while the orchestrator service was away: {})",
                remote.fallback_steps(),
                remote.unavailable().unwrap_or("unavailable")
            );
        }
        tracing::info!("{name}: {}", run.time_to_target.map_or("did not reach the target".into(), |t| format!("{} s", secs(t))));
        if !baseline {
            copus_trajectory = trajectory;
            copus_progress = progress;
        }
        runs.push(run);
    }
    // The oracle on Copus's measured noise trajectory, on the policies' throughput model.
    let oracle = oracle_from(&copus_trajectory, copus_progress, &plain, recipe.costs, lineup.copus_start);
    let target = format!("smoothed training loss {:.3} (EMA {})", r.target_loss, r.loss_ema);
    Ok((runs, oracle, clock, target, None))
}

/// Compresses a measured (progress, B_simple) series to at most 64 segments and runs the oracle.
fn oracle_from(points: &[(f64, f64)], end: f64, scorer: &Scorer, costs: SwitchCosts, start: Candidate) -> Option<f64> {
    if points.len() < 2 || end <= 0.0 {
        return None;
    }
    let every = points.len().div_ceil(64);
    let mut pts: Vec<(f64, f64)> = vec![(0.0, points[0].1)];
    for chunk in points.chunks(every).skip(1) {
        let p = chunk[0].0;
        let phi = chunk.iter().map(|x| x.1).sum::<f64>() / chunk.len() as f64;
        if p > pts.last().expect("non-empty").0 && p < end {
            pts.push((p, phi.max(0.0)));
        }
    }
    let traj = Trajectory::new(pts, end).ok()?;
    Some(hindsight_oracle(&traj, scorer, costs, Some(start)).time)
}
