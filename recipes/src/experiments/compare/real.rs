//! The real comparison: a tiny model trained for real on the Shakespeare text on in-process
//! ranks, every policy on the same data, seed and model, on the wall clock or a modelled one.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::report::progress::Progress;
use anyhow::{Context, anyhow};
use burn::tensor::Device;
use copus_burn::JobBuilder;
use copus_burn::driver::Clock as RunClock;
use copus_core::candidates::{Candidate, CandidateSpace, Enumeration};
use copus_core::decision::DecisionSource;
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

/// The job of one policy of the comparison: the training recipe's job (every engine option it
/// sets) starting at `start`.
pub(crate) fn policy_job(train_recipe: &Recipe, cfg: &LlamaConfig, space: &Enumeration, start: Candidate) -> JobBuilder<LlamaConfig> {
    crate::prepare::job(train_recipe, cfg, space.clone()).start_at(start)
}

/// What every policy of a real comparison trains on: the training recipe, its data, candidate
/// space, model and starting weights.
struct Setup {
    train_recipe: Recipe,
    par: crate::recipe::ParallelRecipe,
    prepared: crate::prepare::Prepared,
    space: CandidateSpace,
    enumeration: Enumeration,
    cfg: LlamaConfig,
    full: copus_burn::parallel::FullParams,
}

/// Loads the training recipe of `r` and prepares its data, space and starting weights.
fn setup(r: &Real) -> anyhow::Result<Setup> {
    let train_recipe = Recipe::load(Path::new(&r.recipe))?;
    let par = train_recipe.parallel.clone().with_context(|| format!("{}: the training recipe needs a `parallel` section", r.recipe))?;
    let prepared = crate::prepare::prepare(&train_recipe)?;
    let space = CandidateSpace::new(
        par.world_size,
        par.global_batches.clone(),
        par.micro_batches.clone(),
        par.schedule,
        par.memory_model(),
        par.device_memory_gib * GIB,
    )?;
    let enumeration = space.enumerate(&prepared.spec);
    if enumeration.feasible.is_empty() {
        return Err(anyhow!("no feasible candidate in the training recipe's space"));
    }
    let cfg = LlamaConfig::from_spec(&prepared.spec);
    let device = Device::flex().autodiff();
    let full = crate::prepare::seeded(&device, train_recipe.train.seed, || full_params(&cfg.init(&device)));
    Ok(Setup { train_recipe, par, prepared, space, enumeration, cfg, full })
}

/// The throughput the policies believe (a profile measured here, or the analytic model of the
/// scenario's cluster) and the clock's description.
fn belief(recipe: &CompareRecipe, r: &Real, s: &Setup) -> anyhow::Result<(Box<dyn ThroughputModel>, String)> {
    let (par, spec) = (&s.par, &s.prepared.spec);
    Ok(match &r.clock {
        Clock::Wall { profile } => {
            let path = profile.as_ref().map(PathBuf::from);
            let loaded = path.as_ref().filter(|p| p.exists()).map(|p| {
                std::fs::read_to_string(p)
                    .map_err(|e| e.to_string())
                    .and_then(|t| ThroughputProfile::from_ron(&t).map_err(|e| e.to_string()))
            });
            let profile = match loaded {
                Some(p) => p.map_err(|e| anyhow!("profile {}: {e}", path.as_ref().map_or(String::new(), |p| p.display().to_string())))?,
                None => {
                    let (feasible, options) = (&s.enumeration.feasible, s.train_recipe.engine_options());
                    measure_profile(&s.cfg, &s.full, feasible, (spec.seq_len, par.profile_steps), &options, path.as_deref())?
                }
            };
            let what = format!(
                "wall clock of this machine ({} in-process ranks); the policies use a throughput profile measured here",
                par.world_size
            );
            (Box::new(profile), what)
        }
        Clock::Analytic { cluster, model } => {
            let cs = cluster.spec()?;
            let clock_spec = match model {
                Some(m) => ModelSpec::preset(m)?,
                None => spec.clone(),
            };
            let what = format!(
                "simulated: analytic model of {} x{} GPUs charging each step as {} (the training math is {}, real), switch costs {} s (batch) / {} s (layout)",
                cluster.preset, par.world_size, clock_spec.name, spec.name, recipe.costs.batch, recipe.costs.layout
            );
            (Box::new(ClusterModel::new(cs, clock_spec)), what)
        }
    })
}

/// Warms the process up (thread pools, allocator) so the first policy is not charged for it.
fn warm_up(s: &Setup, c: Candidate) -> anyhow::Result<()> {
    let mut e = policy_job(&s.train_recipe, &s.cfg, &s.enumeration, c).engine(&s.full)?;
    for i in 0..5u64 {
        let tokens: Vec<i64> = (0..c.global_batch as u64)
            .flat_map(|j| s.prepared.train.sample(i * 64 + j).iter().map(|&t| i64::from(t)).collect::<Vec<_>>())
            .collect();
        e.step(tokens)?;
    }
    Ok(())
}

/// The orchestrator service's client for a policy that is not a baseline, when the scenario
/// names a service; `orch` becomes the embedded fallback it hands over.
fn remote_source(
    recipe: &CompareRecipe,
    r: &Real,
    s: &Setup,
    orch: &mut Orchestrator,
    scorer: &Scorer,
) -> anyhow::Result<Option<copus_service::RemoteSource>> {
    let Some(addr) = &r.service else { return Ok(None) };
    let addr: std::net::SocketAddr = addr.parse().map_err(|e| anyhow!("recipe field `scenario.service` = {addr:?}: {e}"))?;
    let token = std::env::var("COPUS_ORCHESTRATOR_TOKEN").unwrap_or_default();
    let fingerprint = copus_core::orchestrator::RunFingerprint::new(&s.prepared.spec, &s.space);
    let client = copus_service::Client::connect(addr, &token, &recipe.name, fingerprint, &orch.policy_name())?;
    // The embedded orchestrator decides while the service is away.
    let embedded = std::mem::replace(orch, Orchestrator::new(Box::new(copus_core::policy::Static), scorer.clone()));
    Ok(Some(if r.service_synchronous {
        copus_service::RemoteSource::synchronous(client, embedded, std::time::Duration::from_secs(30))
    } else {
        copus_service::RemoteSource::new(client, embedded)
    }))
}

/// One policy's run and its measured (progress, B_simple) trajectory with the progress made.
struct Measured {
    run: PolicyRun,
    trajectory: Vec<(f64, f64)>,
    progress: f64,
}

pub(super) fn real(recipe: &CompareRecipe, r: &Real) -> anyhow::Result<Compared> {
    let s = setup(r)?;
    let (model, clock) = belief(recipe, r, &s)?;
    let feasible = &s.enumeration.feasible;
    let objective: Arc<dyn Objective> = Arc::from(recipe.objective.build());
    let b0 = s.train_recipe.optim.b0 as f64;
    let scorer = Scorer::new(feasible, model.as_ref(), b0, objective)?;
    let plain = Scorer::new(feasible, model.as_ref(), b0, Arc::new(PlainGoodput))?;
    let lineup = lineup(&scorer, recipe.rule(), recipe.cbs_c)?;
    let wall = matches!(r.clock, Clock::Wall { .. });
    if wall {
        warm_up(&s, lineup.copus_start)?;
    }
    let mut runs = Vec::new();
    let (mut copus_trajectory, mut copus_progress) = (Vec::new(), 0.0);
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
        let remote = if baseline { None } else { remote_source(recipe, r, &s, &mut orch, &scorer)? };
        let driver = policy_job(&s.train_recipe, &s.cfg, &s.enumeration, start).clock(clock_of()).build(&s.full)?.driver;
        let m = run_policy((r, &s), name, driver, (orch, remote), baseline, b0)?;
        if !baseline {
            (copus_trajectory, copus_progress) = (m.trajectory, m.progress);
        }
        runs.push(m.run);
    }
    // The oracle on Copus's measured noise trajectory, on the policies' throughput model.
    let oracle = oracle_from(&copus_trajectory, copus_progress, &plain, recipe.costs, lineup.copus_start);
    let target = format!("smoothed training loss {:.3} (EMA {})", r.target_loss, r.loss_ema);
    Ok((runs, oracle, clock, target, None))
}

/// Trains one policy (decided in process, or by the service with the embedded fallback) until
/// its smoothed loss reaches the target or `r.max_steps`.
fn run_policy(
    (r, s): (&Real, &Setup),
    name: String,
    mut driver: copus_burn::Driver<LlamaConfig>,
    (mut orch, mut remote): (Orchestrator, Option<copus_service::RemoteSource>),
    baseline: bool,
    b0: f64,
) -> anyhow::Result<Measured> {
    let data = crate::prepare::TrainSequences(&s.prepared.train);
    let bar = Progress::new(&name, r.max_steps);
    let mut ema = None::<f64>;
    let mut run = PolicyRun { name: name.clone(), baseline, steps: Vec::new(), switches: Vec::new(), time_to_target: None };
    let (mut progress, mut trajectory) = (0.0, Vec::new());
    for _ in 0..r.max_steps {
        let source: &mut dyn DecisionSource = match remote.as_mut() {
            Some(x) => x,
            None => &mut orch,
        };
        let st = driver.step(&data, source).map_err(|e| anyhow!("{name}: {e}"))?;
        let (cur, b) = (st.candidate, st.candidate.global_batch);
        let loss = st.step.metrics.loss;
        let smoothed = ema.map_or(loss, |e| r.loss_ema * e + (1.0 - r.loss_ema) * loss);
        ema = Some(smoothed);
        let phi = st.step.metrics.b_simple;
        let efficiency = phi.map_or(1.0, |p| PlainGoodput.efficiency(b as f64, b0, p));
        progress += b as f64 * efficiency;
        if let Some(p) = phi {
            trajectory.push((progress, p));
        }
        run.steps.push(StepRecord {
            step: st.step.metrics.step,
            time: st.step_clock_secs,
            loss: smoothed,
            global_batch: b,
            micro_batch: cur.micro_batch,
            layout: cur.dims.to_string(),
            throughput: st.samples_per_sec,
            efficiency,
            b_simple: phi,
        });
        bar.set_message(format!("loss {smoothed:.3} B_g {b} {}", cur.dims));
        bar.inc(1);
        if smoothed <= r.target_loss {
            run.time_to_target = Some(st.step_clock_secs);
            break;
        }
        if let Some(w) = st.switch {
            let (from, to) = (describe(&w.from), describe(&w.to));
            run.switches.push(SwitchRecord {
                step: w.step,
                time: st.step_clock_secs,
                from,
                to,
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
    Ok(Measured { run, trajectory, progress })
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
