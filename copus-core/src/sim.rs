//! The simulated cluster clock on synthetic statistics: a known noise-scale trajectory and
//! McCandlish's progress model, in which a step at global batch B with noise scale phi advances
//! training by `B * SE(B)` reference-batch samples and costs `B / throughput` seconds of the
//! simulated clock (plus modelled switch costs). Policies run through the same `decide` calls
//! as in real training, in microseconds per step.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::candidates::Candidate;
use crate::gns::NoiseEstimate;
use crate::goodput::Objective;
use crate::policy::{Decision, Policy, Scorer, SwitchCosts, Trajectory};

/// A decreasing loss curve over progress: `L(p) = l_inf + a * (1 + p / p0)^(-alpha)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossCurve {
    /// Irreducible loss.
    pub l_inf: f64,
    /// Initial excess loss.
    pub a: f64,
    /// Progress scale, reference-batch samples.
    pub p0: f64,
    /// Decay exponent.
    pub alpha: f64,
}

impl LossCurve {
    /// Loss after `progress` reference-batch samples.
    pub fn loss(&self, progress: f64) -> f64 {
        self.l_inf + self.a * (1.0 + progress.max(0.0) / self.p0).powf(-self.alpha)
    }

    /// Progress at which the loss reaches `loss` (`None` if never).
    pub fn progress_for(&self, loss: f64) -> Option<f64> {
        if loss <= self.l_inf {
            return None;
        }
        if loss >= self.l_inf + self.a {
            return Some(0.0);
        }
        Some(self.p0 * (((loss - self.l_inf) / self.a).powf(-1.0 / self.alpha) - 1.0))
    }
}

/// Settings of a simulation.
#[derive(Clone)]
pub struct SimConfig {
    /// Switch costs on the simulated clock.
    pub costs: SwitchCosts,
    /// The statistical efficiency that governs true progress (the policies may believe another).
    pub truth: Arc<dyn Objective>,
    /// Reference batch of the truth.
    pub b0: f64,
    /// Relative error of the noise estimate the policies see (log-normal, 0 = exact).
    pub estimate_error: f64,
    /// Steps before the first estimate is shown (the estimator's warm-up).
    pub warmup_steps: u64,
    /// Give up after this many steps.
    pub max_steps: u64,
    /// Seed of the estimate error.
    pub seed: u64,
}

/// One simulated step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimStep {
    /// Step index (1-based after the step).
    pub step: u64,
    /// Simulated seconds at the end of the step (switches before it included).
    pub time: f64,
    /// Reference-batch samples of progress after the step.
    pub progress: f64,
    /// The configuration of the step.
    pub candidate: Candidate,
    /// Samples/s of the configuration.
    pub throughput: f64,
    /// True statistical efficiency of the step.
    pub efficiency: f64,
    /// The true noise scale during the step.
    pub b_simple: f64,
}

/// A configuration change.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimSwitch {
    /// After this step.
    pub step: u64,
    /// At this simulated time (before paying the cost).
    pub time: f64,
    /// From.
    pub from: Candidate,
    /// To.
    pub to: Candidate,
    /// Seconds charged.
    pub cost: f64,
}

/// A policy's simulated run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimRun {
    /// Policy name.
    pub policy: String,
    /// Every step.
    pub steps: Vec<SimStep>,
    /// Every switch.
    pub switches: Vec<SimSwitch>,
    /// Simulated seconds to reach the trajectory's end (`None` if `max_steps` ran out).
    pub time_to_target: Option<f64>,
    /// Decisions refused because the target was not a candidate.
    pub refused: u64,
}

/// Why a simulation could not run.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum SimError {
    /// The starting configuration has no throughput.
    #[error("the initial configuration {0:?} is not a candidate of the scorer")]
    Initial(Candidate),
}

/// The noise scale at `progress` (piecewise constant).
pub fn phi_at(trajectory: &Trajectory, progress: f64) -> f64 {
    let i = trajectory.points.partition_point(|(s, _)| *s <= progress);
    trajectory.points[i.saturating_sub(1)].1
}

/// A deterministic standard normal from a counter (Box-Muller on a splitmix64 stream).
fn normal(seed: u64, k: u64) -> f64 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let u1 = ((mix(seed ^ (2 * k)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let u2 = ((mix(seed ^ (2 * k + 1)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Runs `policy` from `initial` until the trajectory's end on the simulated clock.
pub fn simulate(
    policy: &mut dyn Policy,
    scorer: &Scorer,
    trajectory: &Trajectory,
    initial: Candidate,
    cfg: &SimConfig,
) -> Result<SimRun, SimError> {
    let mut cur = initial;
    if scorer.throughput(&cur).is_none() {
        return Err(SimError::Initial(initial));
    }
    let (mut time, mut progress) = (0.0f64, 0.0f64);
    let mut run = SimRun { policy: policy.name(), steps: Vec::new(), switches: Vec::new(), time_to_target: None, refused: 0 };
    for step in 1..=cfg.max_steps {
        let t = scorer.throughput(&cur).expect("only candidates are run");
        let phi = phi_at(trajectory, progress);
        let b = cur.global_batch as f64;
        let efficiency = cfg.truth.efficiency(b, cfg.b0, phi);
        let gain = b * efficiency;
        let secs = b / t;
        if progress + gain >= trajectory.end {
            let done = time + secs * (trajectory.end - progress) / gain;
            run.steps.push(SimStep {
                step,
                time: done,
                progress: trajectory.end,
                candidate: cur,
                throughput: t,
                efficiency,
                b_simple: phi,
            });
            run.time_to_target = Some(done);
            return Ok(run);
        }
        time += secs;
        progress += gain;
        run.steps.push(SimStep { step, time, progress, candidate: cur, throughput: t, efficiency, b_simple: phi });
        let noise = (step > cfg.warmup_steps).then(|| {
            let seen = phi_at(trajectory, progress) * (cfg.estimate_error * normal(cfg.seed, step)).exp();
            NoiseEstimate { grad_sq: 1.0, trace: seen, biased: false }
        });
        let obs = crate::policy::StepObservation { step, current: cur, noise };
        let decision = policy.decide(&obs);
        let target = decision.target(cur);
        if target == cur {
            continue;
        }
        if scorer.throughput(&target).is_none() {
            run.refused += 1;
            continue;
        }
        let layout = matches!(decision, Decision::ChangeLayout(_));
        let cost = if layout { cfg.costs.layout } else { cfg.costs.batch };
        run.switches.push(SimSwitch { step, time, from: cur, to: target, cost });
        time += cost;
        policy.observe_reconfiguration(cost, layout);
        cur = target;
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candidates::CandidateSpace;
    use crate::goodput::PlainGoodput;
    use crate::layout::ParallelDims;
    use crate::memory::MemoryModel;
    use crate::model::ModelSpec;
    use crate::policy::{CbsFixedLayout, Copus, DpOnlyGoodput, MerrillWarmup, Static, SwitchRule, hindsight_oracle, schedule_time};
    use crate::schedule::ScheduleKind;
    use crate::throughput::{ClusterModel, ClusterSpec};

    #[test]
    fn the_loss_curve_inverts() {
        let c = LossCurve { l_inf: 2.0, a: 6.0, p0: 1e4, alpha: 0.4 };
        for p in [0.0, 10.0, 1e4, 3e6] {
            let l = c.loss(p);
            assert!((c.progress_for(l).unwrap() - p).abs() <= 1e-6 * p.max(1.0), "{p}");
        }
        assert_eq!(c.progress_for(1.9), None);
    }

    #[test]
    fn a_static_run_takes_the_closed_form_time() {
        let (scorer, _) = setup();
        let c = *scorer.candidates().next().map(|(c, _)| c).unwrap();
        let traj = Trajectory::new(vec![(0.0, 50.0)], 1e6).unwrap();
        let cfg = config(SwitchCosts { batch: 0.0, layout: 0.0 });
        let run = simulate(&mut Static, &scorer, &traj, c, &cfg).unwrap();
        let t = scorer.throughput(&c).unwrap();
        let b = c.global_batch as f64;
        // progress/s = t * SE(b) with SE = (phi + b0) / (phi + b).
        let want = 1e6 / (t * (50.0 + cfg.b0) / (50.0 + b));
        assert!((run.time_to_target.unwrap() - want).abs() < 1e-9 * want);
        assert!(run.switches.is_empty());
    }

    fn setup() -> (Scorer, Vec<Candidate>) {
        let spec = ModelSpec::llama_3_2_3b();
        let cluster = ClusterSpec::h100_nvlink(1);
        let space = CandidateSpace::new(
            8,
            vec![1, 2, 4, 8, 16, 32, 64, 128, 256],
            vec![1, 2, 4, 8],
            ScheduleKind::OneFOneB,
            MemoryModel::mixed_bf16(),
            cluster.memory_bytes,
        )
        .unwrap();
        let feasible = space.enumerate(&spec).feasible;
        let model = ClusterModel::new(cluster, spec);
        (Scorer::new(&feasible, &model, 8.0, Arc::new(PlainGoodput)).unwrap(), feasible)
    }

    fn config(costs: SwitchCosts) -> SimConfig {
        SimConfig { costs, truth: Arc::new(PlainGoodput), b0: 8.0, estimate_error: 0.0, warmup_steps: 5, max_steps: 1_000_000, seed: 1 }
    }

    fn best_layout(scorer: &Scorer, b: usize) -> Candidate {
        scorer.candidates().filter(|(c, _)| c.global_batch == b).max_by(|x, y| x.1.total_cmp(&y.1)).unwrap().0
    }

    /// Noise rising from 2 to 256 sequences over training, as the loss falls.
    fn rising() -> Trajectory {
        let points: Vec<(f64, f64)> = (0..8).map(|i| (i as f64 * 1.0e5, 2f64.powi(i + 1))).collect();
        Trajectory::new(points, 8.0e5).unwrap()
    }

    #[test]
    fn copus_switches_layout_and_beats_every_fixed_layout_baseline() {
        let (scorer, _) = setup();
        // The premise: the throughput-optimal layout differs between small and large B_g.
        let (small, large) = (best_layout(&scorer, 1), best_layout(&scorer, 256));
        assert_ne!(small.dims, large.dims, "the cluster model must make the best layout depend on B_g");
        let costs = SwitchCosts { batch: 0.5, layout: 20.0 };
        let cfg = config(costs);
        let traj = rising();
        let rule = SwitchRule { horizon: 3600.0, layout_cost: costs.layout, ..SwitchRule::default() };
        let mut copus = Copus::new(scorer.clone(), rule).unwrap();
        let initial = best_layout(&scorer, 1);
        let c_run = simulate(&mut copus, &scorer, &traj, initial, &cfg).unwrap();
        assert!(c_run.switches.iter().any(|s| s.from.dims != s.to.dims), "Copus never changed layout");
        let t_copus = c_run.time_to_target.unwrap();
        let mut baselines: Vec<(String, f64)> = Vec::new();
        for b in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
            let c = best_layout(&scorer, b);
            baselines.push((format!("static {b}"), simulate(&mut Static, &scorer, &traj, c, &cfg).unwrap().time_to_target.unwrap()));
        }
        for (label, layout) in [("pessimistic", small.dims), ("optimistic", large.dims)] {
            let mut p = CbsFixedLayout::new(scorer.clone(), layout, 1.0, true).unwrap();
            let start = scorer
                .candidates()
                .filter(|(c, _)| c.dims == layout)
                .map(|(c, _)| c.global_batch)
                .min()
                .and_then(|b| scorer.fastest(layout, b))
                .unwrap();
            baselines.push((format!("cbs {label}"), simulate(&mut p, &scorer, &traj, start, &cfg).unwrap().time_to_target.unwrap()));
        }
        let mut m = MerrillWarmup::new(scorer.clone());
        baselines.push(("merrill".into(), simulate(&mut m, &scorer, &traj, initial, &cfg).unwrap().time_to_target.unwrap()));
        let dp = ParallelDims { dp: 8, tp: 1, pp: 1 };
        let dp_start = scorer.fastest(dp, 8).unwrap();
        let mut a = DpOnlyGoodput::new(scorer.clone(), rule).unwrap();
        baselines.push(("dp-only".into(), simulate(&mut a, &scorer, &traj, dp_start, &cfg).unwrap().time_to_target.unwrap()));
        for (name, t) in &baselines {
            assert!(t_copus < *t, "Copus {t_copus:.1} s is not faster than {name} {t:.1} s");
        }
        // And the oracle bounds it from below (within the step discretisation).
        let oracle = hindsight_oracle(&traj, &scorer, costs, Some(initial));
        assert!(oracle.time <= t_copus * 1.001, "oracle {} vs copus {t_copus}", oracle.time);
        assert!(schedule_time(&traj, &oracle.per_segment, &scorer, costs, Some(initial)).is_some());
    }
}
