//! The simulated cluster clock on synthetic statistics: a known noise-scale trajectory and
//! McCandlish's progress model, in which a step at global batch B with noise scale phi advances
//! training by `B * SE(B)` reference-batch samples and costs `B / throughput` seconds of the
//! simulated clock (plus modelled switch costs). Policies run through the same `decide` calls
//! as in real training, in microseconds per step.
//!
//! The clock's throughput is the `scorer` handed to [`simulate`], which need not be the one
//! the policies hold: [`perturbed`] makes a truth that differs from the policies' model by a
//! per-candidate error drawn once per seed, and [`SimConfig::jitter`] varies every step's
//! time. The policies learn throughput only from the measured samples/s of the steps they run
//! ([`Policy::observe_throughput`]), as in training.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::candidates::Candidate;
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{ChiSquared, Distribution, StandardNormal};

use crate::gns::{GnsEstimator, Memory, NoiseEstimate, StepStats};
use crate::goodput::Objective;
use crate::policy::{Decision, Policy, Scorer, SwitchCosts, Trajectory};

/// A decreasing loss curve over progress: `L(p) = l_inf + a * (1 + p / p0)^(-alpha)`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossCurve {
    /// Irreducible loss: the curve's limit as progress grows.
    pub l_inf: f64,
    /// Excess loss at progress 0, above `l_inf`.
    pub a: f64,
    /// Progress scale, reference-batch samples: the excess has fallen by `2^alpha` at `p0`.
    pub p0: f64,
    /// Decay exponent of the excess loss over progress.
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
    /// Reference batch B0 of the true efficiency `truth`.
    pub b0: f64,
    /// How the policies' noise estimate is made.
    pub noise: SimNoise,
    /// Steps before the first estimate is shown (the estimator's warm-up).
    pub warmup_steps: u64,
    /// Give up after this many steps ([`SimRun::time_to_target`] is then `None`).
    pub max_steps: u64,
    /// Seed of the noise estimate's random error; the same seed gives the same run.
    pub seed: u64,
    /// Keep every step in [`SimRun::steps`] (else only the last; long runs hold gigabytes).
    pub record_steps: bool,
    /// Standard deviation of the natural log of each step's time (log-normal, with the step's
    /// true mean time as its mean; 0: every step takes its mean time). Measured here: 0.1 to
    /// 0.3.
    pub jitter: f64,
}

/// The truth a policy does not know: every candidate's throughput of `scorer` times an error
/// `exp(sigma * z)`, `z` standard normal, drawn once per candidate from `seed` (the same
/// candidate and seed always draw the same error). The policies keep the unperturbed scorer as
/// their prior; [`simulate`] runs the clock on this one.
pub fn perturbed(scorer: &Scorer, sigma: f64, seed: u64) -> Result<Scorer, crate::policy::PolicyError> {
    let key = |c: &Candidate| {
        let d = c.dims;
        [d.dp, d.tp, d.pp, c.global_batch, c.micro_batch]
            .iter()
            .fold(0x5eed_u64, |h, &x| h.rotate_left(13) ^ (x as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
    };
    scorer.map_prior(|c, t| t * (sigma * normal(seed ^ 0xe770_4e55, key(c))).exp())
}

/// A structured truth: every candidate's throughput of `scorer` times `exp(e)`, the errors `e`
/// one joint draw from `seed` of the family terms of [`crate::belief`] (global, tensor and
/// pipeline degree, data-parallel span over nodes of `ranks_per_node` ranks, micro-batch and
/// its pairing with tp, layout, the trend in B_g / B_m, and a small independent part, with the
/// standard deviations of `priors`). Unlike [`perturbed`], candidates that share a family share
/// its error, as the errors of a real model do: the same layout at twice the batch is off by
/// nearly the same factor.
pub fn structured(
    scorer: &Scorer,
    priors: &crate::belief::FamilyPriors,
    ranks_per_node: usize,
    seed: u64,
) -> Result<Scorer, crate::policy::PolicyError> {
    let candidates: Vec<Candidate> = scorer.candidates().map(|(c, _)| *c).collect();
    let draw = crate::belief::Belief::new(&candidates, priors, ranks_per_node).sample(&mut StdRng::seed_from_u64(seed ^ 0x5712_0c7e));
    scorer.map_prior(|c, t| candidates.iter().position(|d| d == c).map_or(t, |i| t * draw[i].exp()))
}

/// How a simulation makes the noise estimate the policies see.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum SimNoise {
    /// The true noise scale times an independent log-normal error each step (0: exact).
    LogNormal {
        /// Standard deviation of the natural log of the error factor.
        error: f64,
    },
    /// Each step draws the probe's numbers (the mean squared micro-batch gradient norm L and
    /// the step's T) from their sampling distribution, with micro-batch gradients `G + xi`, xi
    /// Gaussian with isotropic covariance `tr(Sigma) / (p_eff B_m)` in `p_eff` dimensions,
    /// |G|^2 = 1 and tr(Sigma) = the trajectory's B_simple; they feed copus-core's
    /// [`GnsEstimator`] with EMA factor `theta` and `memory`, and the policies see only its
    /// output (noise, lag and non-positive |G|^2 estimates included).
    Estimator {
        /// Effective dimension of the gradient noise (smaller: noisier estimates).
        p_eff: f64,
        /// The estimator's EMA factor (training uses 0.95).
        theta: f64,
        /// How far back the estimate reaches (the EMA alone unless named).
        #[serde(default)]
        memory: Memory,
    },
}

/// The noise of a single-micro-batch step's gradient, kept for the next step's difference norm:
/// its component along G and the squared norm of the rest.
#[derive(Clone, Copy)]
struct StepNoise {
    along: f64,
    perp_sq: f64,
}

/// A chi-squared draw with `k` degrees of freedom (0 for `k <= 0`).
fn chi2(rng: &mut StdRng, k: f64) -> f64 {
    if k > 0.0 { ChiSquared::new(k).map_or(k, |d| d.sample(rng)) } else { 0.0 }
}

/// Draws a step's [`StepStats`] for `c` under noise scale `phi` (|G|^2 = 1) in `p_eff`
/// dimensions, exactly: with `s2 = phi / (p_eff B_m)` per dimension and micro-batch noise
/// split into its component along G and the rest, `L` and `T` share the draws they share in
/// training (the mean of the micro-batch gradients is the step's gradient). With one
/// micro-batch the probe differences consecutive steps (G held fixed): `previous` is the last
/// step's noise when it too had one micro-batch, and the new noise is drawn as a component
/// along the old one's perpendicular part plus the rest, so T and the difference norm share
/// their draws. Returns the stats and, for n == 1, this step's noise.
fn draw_stats(rng: &mut StdRng, c: &Candidate, phi: f64, p_eff: f64, previous: Option<StepNoise>) -> (StepStats, Option<StepNoise>) {
    let (n, bm) = (c.global_batch / c.micro_batch, c.micro_batch);
    if n == 1 {
        let s2 = phi / (p_eff * bm as f64);
        let along: f64 = StandardNormal.sample(rng);
        let along = along * s2.sqrt();
        let (perp_sq, diff_sq_norm) = match previous {
            Some(prev) => {
                // Along the previous perpendicular direction, and the p_eff - 2 others.
                let c_old: f64 = StandardNormal.sample(rng);
                let c_old = c_old * s2.sqrt();
                let rest = s2 * chi2(rng, p_eff - 2.0);
                let diff = (along - prev.along).powi(2) + (c_old - prev.perp_sq.sqrt()).powi(2) + rest;
                (c_old * c_old + rest, Some(diff))
            }
            None => (s2 * chi2(rng, p_eff - 1.0), None),
        };
        let t = 1.0 + 2.0 * along + along * along + perp_sq;
        let stats = StepStats { micro_batch: bm, num_micro: 1, mean_micro_sq_norm: t, grad_sq_norm: t, diff_sq_norm };
        return (stats, Some(StepNoise { along, perp_sq }));
    }
    let nf = n as f64;
    let s2 = phi / (p_eff * bm as f64);
    // Sum over micro-batches of the noise along G, and the within/between parts of the rest.
    let along: f64 = StandardNormal.sample(rng);
    let a = along * (nf * s2).sqrt();
    let within_along = s2 * chi2(rng, nf - 1.0);
    let mean_perp = s2 * chi2(rng, p_eff - 1.0);
    let within_perp = s2 * chi2(rng, (nf - 1.0) * (p_eff - 1.0));
    let sum_sq = a * a / nf + within_along + mean_perp + within_perp;
    let mean_sq = (a * a / nf + mean_perp) / nf;
    let l = 1.0 + 2.0 * a / nf + sum_sq / nf;
    let t = 1.0 + 2.0 * a / nf + mean_sq;
    (StepStats { micro_batch: bm, num_micro: n, mean_micro_sq_norm: l.max(0.0), grad_sq_norm: t.max(0.0), diff_sq_norm: None }, None)
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
    /// Samples/s the step ran at on the simulated clock (the truth with the step's jitter).
    pub throughput: f64,
    /// True statistical efficiency of the step.
    pub efficiency: f64,
    /// The true noise scale during the step.
    pub b_simple: f64,
}

/// A configuration change.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimSwitch {
    /// The step after which the configuration changed.
    pub step: u64,
    /// At this simulated time (before paying the cost).
    pub time: f64,
    /// The configuration before the change.
    pub from: Candidate,
    /// The configuration after it.
    pub to: Candidate,
    /// Seconds charged on the simulated clock: [`SwitchCosts::layout`] or [`SwitchCosts::batch`].
    pub cost: f64,
}

/// A policy's simulated run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimRun {
    /// The policy's name ([`Policy::name`]).
    pub policy: String,
    /// The steps run: all of them with [`SimConfig::record_steps`], else only the latest (and
    /// the final one).
    pub steps: Vec<SimStep>,
    /// Every configuration change, in order.
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
    /// The estimator's EMA factor or memory is out of range.
    #[error("the noise estimator: {0}")]
    Estimator(#[from] crate::gns::GnsError),
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
    let u1 = ((mix(seed ^ k.wrapping_mul(2)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let u2 = ((mix(seed ^ k.wrapping_mul(2).wrapping_add(1)) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
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
    let mut noise_source = NoiseSource::new(cfg)?;
    let mut run = SimRun { policy: policy.name(), steps: Vec::new(), switches: Vec::new(), time_to_target: None, refused: 0 };
    for step in 1..=cfg.max_steps {
        let mean = scorer.throughput(&cur).expect("only candidates are run");
        // Mean-preserving in time: the step takes `b / mean` seconds on average.
        let t = mean * (-cfg.jitter * normal(cfg.seed ^ 0x0a17_7e55, step) + 0.5 * cfg.jitter * cfg.jitter).exp();
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
        let s = SimStep { step, time, progress, candidate: cur, throughput: t, efficiency, b_simple: phi };
        if cfg.record_steps || run.steps.is_empty() {
            run.steps.push(s);
        } else {
            run.steps[0] = s;
        }
        let noise = noise_source.observe(cfg, trajectory, &cur, phi, step, progress);
        // The run's time to go at its current pace: what a run with a sample budget knows.
        let remaining_secs = Some((trajectory.end - progress) / gain * b / mean);
        let obs = crate::policy::StepObservation { step, current: cur, noise, remaining_secs };
        policy.observe_throughput(&cur, t);
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

/// What a simulated run tells its policy of the noise scale: an estimator fed each step's drawn
/// statistics (and the previous step's noise, for the next difference norm), or the truth under
/// a log-normal error.
struct NoiseSource {
    rng: StdRng,
    estimator: Option<GnsEstimator>,
    previous: Option<StepNoise>,
}

impl NoiseSource {
    /// The source `cfg` asks for; an estimator's EMA factor must be in range.
    fn new(cfg: &SimConfig) -> Result<Self, SimError> {
        let rng = StdRng::seed_from_u64(cfg.seed);
        let estimator = match cfg.noise {
            SimNoise::Estimator { theta, memory, .. } => Some(GnsEstimator::new(theta).and_then(|e| e.with_memory(memory))?),
            SimNoise::LogNormal { .. } => None,
        };
        Ok(Self { rng, estimator, previous: None })
    }

    /// The noise estimate the policy sees after `step`, which ran `cur` at noise scale `phi` and
    /// reached `progress` (`None` during the warm-up steps).
    fn observe(
        &mut self,
        cfg: &SimConfig,
        trajectory: &Trajectory,
        cur: &Candidate,
        phi: f64,
        step: u64,
        progress: f64,
    ) -> Option<NoiseEstimate> {
        match (cfg.noise, self.estimator.as_mut()) {
            (SimNoise::Estimator { p_eff, .. }, Some(est)) => {
                // The step's own statistics (at the noise scale it ran under).
                let (stats, noise) = draw_stats(&mut self.rng, cur, phi, p_eff, self.previous);
                self.previous = noise;
                // Draws are valid by construction (finite, non-negative).
                let _ = est.observe(&stats);
                est.estimate().filter(|_| step > cfg.warmup_steps)
            }
            (SimNoise::LogNormal { error }, _) => (step > cfg.warmup_steps).then(|| {
                let seen = phi_at(trajectory, progress) * (error * normal(cfg.seed, step)).exp();
                NoiseEstimate { grad_sq: 1.0, trace: seen, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }
            }),
            (SimNoise::Estimator { .. }, None) => unreachable!("the estimator exists in estimator mode"),
        }
    }
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
        SimConfig {
            costs,
            truth: Arc::new(PlainGoodput),
            b0: 8.0,
            noise: SimNoise::LogNormal { error: 0.0 },
            warmup_steps: 5,
            max_steps: 1_000_000,
            seed: 1,
            record_steps: true,
            jitter: 0.0,
        }
    }

    fn best_layout(scorer: &Scorer, b: usize) -> Candidate {
        scorer.candidates().filter(|(c, _)| c.global_batch == b).max_by(|x, y| x.1.total_cmp(&y.1)).unwrap().0
    }

    /// Noise rising from 2 to 256 sequences over training, as the loss falls.
    fn rising() -> Trajectory {
        let points: Vec<(f64, f64)> = (0..8).map(|i| (i as f64 * 1.0e5, 2f64.powi(i + 1))).collect();
        Trajectory::new(points, 8.0e5).unwrap()
    }

    /// The estimator-driven noise at the calibrated effective dimension.
    fn realistic(costs: SwitchCosts, seed: u64) -> SimConfig {
        SimConfig { noise: SimNoise::Estimator { p_eff: 18.5, theta: 0.95, memory: Memory::Fixed }, seed, ..config(costs) }
    }

    /// Records the B_simple estimate each step; never changes anything.
    struct Recorder(Vec<Option<f64>>, Vec<f64>);
    impl Policy for Recorder {
        fn name(&self) -> String {
            "recorder".into()
        }
        fn decide(&mut self, obs: &crate::policy::StepObservation) -> Decision {
            self.0.push(obs.b_simple());
            self.1.push(obs.noise.map_or(0.0, |n| n.grad_sq_se / n.grad_sq.abs().max(1e-12)));
            Decision::Keep
        }
    }

    #[test]
    fn the_simulated_estimator_is_unbiased_on_a_flat_trajectory() {
        let (scorer, _) = setup();
        let traj = Trajectory::new(vec![(0.0, 32.0)], 3.0e5).unwrap();
        // n >= 2 micro-batches (at n == 1 the ratio of smoothed differencing estimates is biased
        // upwards at this noise level, as in training).
        for (b, m) in [(64, 8), (16, 1), (32, 4)] {
            let c = scorer.candidates().map(|x| x.0).find(|c| c.global_batch == b && c.micro_batch == m).unwrap();
            let mut rec = Recorder(Vec::new(), Vec::new());
            simulate(&mut rec, &scorer, &traj, c, &realistic(SwitchCosts { batch: 0.0, layout: 0.0 }, 7)).unwrap();
            // After the EMA has forgotten its start (100 steps), the smoothed estimates average
            // to the truth within 10%; they also vary (the estimator is noisy) and the
            // estimator reports an uncertainty.
            let seen: Vec<f64> = rec.0.iter().skip(100).map(|x| x.unwrap_or(f64::INFINITY)).collect();
            let finite: Vec<f64> = seen.iter().copied().filter(|x| x.is_finite()).collect();
            assert!(finite.len() * 10 >= seen.len() * 9, "{} of {} estimates are defined", finite.len(), seen.len());
            let mean = finite.iter().sum::<f64>() / finite.len() as f64;
            assert!((mean / 32.0 - 1.0).abs() < 0.10, "B_g {b} B_m {m}: mean estimate {mean}");
            let spread = (finite.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / finite.len() as f64).sqrt();
            assert!(spread > 0.01 * mean, "B_g {b} B_m {m}: the estimates do not vary ({spread})");
            let rel = rec.1.iter().skip(100).sum::<f64>() / (rec.1.len() - 100) as f64;
            assert!(rel > 0.0 && rel.is_finite(), "B_g {b} B_m {m}: reported relative error of |G|^2 {rel}");
        }
    }

    #[test]
    fn copus_does_not_oscillate_at_a_layout_crossover() {
        let (scorer, _) = setup();
        // The noise scale at which the best layout over all candidates changes, found by
        // bisection on the scorer.
        let layout_at = |phi: f64| scorer.best(phi, |_| true).unwrap().candidate.dims;
        let (mut lo, mut hi) = (1.0f64, 256.0f64);
        assert_ne!(layout_at(lo), layout_at(hi), "the layouts must cross over in 1..256");
        for _ in 0..50 {
            let mid = (lo * hi).sqrt();
            if layout_at(mid) == layout_at(lo) { lo = mid } else { hi = mid }
        }
        let traj = Trajectory::new(vec![(0.0, lo)], 8.0e5).unwrap();
        // Hysteresis under the estimator's noise; exploration (a bounded number of trials, each
        // of a candidate never measured) is tested on its own.
        let rule = SwitchRule { horizon: 3600.0, layout_cost: 20.0, explore: 0.0, ..SwitchRule::default() };
        for seed in 0..3 {
            for p_eff in [6.0, 18.5] {
                let cfg = SimConfig {
                    noise: SimNoise::Estimator { p_eff, theta: 0.95, memory: Memory::Fixed },
                    seed,
                    ..config(SwitchCosts { batch: 0.5, layout: 20.0 })
                };
                let mut copus = Copus::new(scorer.clone(), rule).unwrap();
                let run = simulate(&mut copus, &scorer, &traj, best_layout(&scorer, 1), &cfg).unwrap();
                let layouts: Vec<_> = run.switches.iter().filter(|s| s.from.dims != s.to.dims).collect();
                assert!(layouts.len() <= 2, "seed {seed}, p_eff {p_eff}: {} layout switches at the crossover", layouts.len());
                // Never back to a layout it left.
                for w in layouts.windows(2) {
                    assert_ne!(w[0].from.dims, w[1].to.dims, "seed {seed}, p_eff {p_eff}: went back and forth");
                }
                assert!(run.switches.len() <= 12, "seed {seed}, p_eff {p_eff}: {} switches", run.switches.len());
            }
        }
    }

    #[test]
    fn copus_switches_layout_and_beats_every_fixed_layout_baseline() {
        let (scorer, _) = setup();
        // The premise: the throughput-optimal layout differs between small and large B_g.
        let (small, large) = (best_layout(&scorer, 1), best_layout(&scorer, 256));
        assert_ne!(small.dims, large.dims, "the cluster model must make the best layout depend on B_g");
        let costs = SwitchCosts { batch: 0.5, layout: 20.0 };
        // Two seeds of the estimator-driven noise.
        for seed in [1, 3] {
            let cfg = realistic(costs, seed);
            // Realistic noise: the estimator on simulated gradient statistics; Copus's layout cost
            // is its own estimate from a 30 s prior, not the clock's 20 s.
            let traj = rising();
            let rule = SwitchRule { horizon: 3600.0, layout_cost: 30.0, ..SwitchRule::default() };
            let mut copus = Copus::new(scorer.clone(), rule).unwrap();
            let initial = best_layout(&scorer, 1);
            let c_run = simulate(&mut copus, &scorer, &traj, initial, &cfg).unwrap();
            assert!(c_run.switches.iter().any(|s| s.from.dims != s.to.dims), "Copus never changed layout");
            assert!((copus.layout_cost() - 20.0).abs() < 10.0, "the cost estimate moved towards the clock's 20 s: {}", copus.layout_cost());
            let t_copus = c_run.time_to_target.unwrap();
            let mut baselines: Vec<(String, f64)> = Vec::new();
            for b in [1, 2, 4, 8, 16, 32, 64, 128, 256] {
                let c = best_layout(&scorer, b);
                baselines.push((format!("static {b}"), simulate(&mut Static, &scorer, &traj, c, &cfg).unwrap().time_to_target.unwrap()));
            }
            let smallest_on = |layout: ParallelDims| {
                scorer
                    .candidates()
                    .filter(|(c, _)| c.dims == layout)
                    .map(|(c, _)| c.global_batch)
                    .min()
                    .and_then(|b| scorer.fastest(layout, b))
                    .unwrap()
            };
            for (label, layout) in [("pessimistic", small.dims), ("optimistic", large.dims)] {
                let mut p = CbsFixedLayout::new(scorer.clone(), layout, 1.0, true).unwrap();
                baselines.push((
                    format!("cbs {label}"),
                    simulate(&mut p, &scorer, &traj, smallest_on(layout), &cfg).unwrap().time_to_target.unwrap(),
                ));
            }
            let mut m = MerrillWarmup::new(scorer.clone());
            baselines.push(("merrill".into(), simulate(&mut m, &scorer, &traj, initial, &cfg).unwrap().time_to_target.unwrap()));
            // AdaptDL's batch adaptation on every fixed layout (so on the best one in hindsight).
            let mut layouts: Vec<ParallelDims> = scorer.candidates().map(|(c, _)| c.dims).collect();
            layouts.sort_by_key(|d| (d.dp, d.tp, d.pp));
            layouts.dedup();
            for l in layouts {
                let mut a = DpOnlyGoodput::new(scorer.clone(), rule).unwrap();
                baselines.push((
                    format!("goodput on {l}"),
                    simulate(&mut a, &scorer, &traj, smallest_on(l), &cfg).unwrap().time_to_target.unwrap(),
                ));
            }
            for (name, t) in &baselines {
                assert!(t_copus < *t, "seed {seed}: Copus {t_copus:.1} s is not faster than {name} {t:.1} s");
            }
            // And the oracle bounds it from below (within the step discretisation).
            let oracle = hindsight_oracle(&traj, &scorer, costs, Some(initial));
            assert!(oracle.time <= t_copus * 1.001, "oracle {} vs copus {t_copus}", oracle.time);
            assert!(schedule_time(&traj, &oracle.per_segment, &scorer, costs, Some(initial)).is_some());
        }
    }

    /// The truth of a perturbed simulation is not the policies' model: errors of the requested
    /// size, per candidate, the same for a seed and different across seeds, and enough to
    /// reorder the layouts at some B_g.
    #[test]
    fn the_perturbed_truth_differs_from_the_scorer() {
        let (scorer, _) = setup();
        let truth = perturbed(&scorer, 0.25, 7).unwrap();
        let logs: Vec<f64> = scorer.candidates().map(|(c, t)| (truth.throughput(c).unwrap() / t).ln()).collect();
        let n = logs.len() as f64;
        let mean = logs.iter().sum::<f64>() / n;
        let sd = (logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        assert!(n >= 50.0, "{n} candidates");
        assert!((0.18..0.32).contains(&sd), "log-error spread {sd}, asked 0.25");
        assert!(mean.abs() < 0.1, "log-error mean {mean}");
        assert!(logs.iter().all(|x| x.abs() > 0.0), "some candidate kept its prior exactly");
        let again = perturbed(&scorer, 0.25, 7).unwrap();
        let other = perturbed(&scorer, 0.25, 8).unwrap();
        let c = scorer.candidates().next().unwrap().0;
        assert_eq!(again.throughput(&c), truth.throughput(&c));
        assert_ne!(other.throughput(&c), truth.throughput(&c));
        let reordered = [1usize, 4, 16, 64, 256].iter().filter(|&&b| best_layout(&scorer, b) != best_layout(&truth, b)).count();
        assert!(reordered >= 1, "the error never changes the fastest candidate of a B_g");
        // sigma 0 is the scorer itself.
        let same = perturbed(&scorer, 0.0, 7).unwrap();
        assert!(scorer.candidates().all(|(c, t)| same.throughput(c) == Some(*t)));
    }

    /// A structured truth shares its errors within families: two batches of one layout and
    /// micro-batch are off by nearly the same factor (their log errors differ only by the
    /// trend and the candidates' own terms), while the independent truth draws them apart;
    /// the same seed gives the same truth.
    #[test]
    fn the_structured_truth_shares_errors_within_families() {
        let (scorer, _) = setup();
        let priors = crate::belief::FamilyPriors::default();
        let pairs: Vec<(Candidate, Candidate)> = scorer
            .candidates()
            .filter_map(|(a, _)| {
                let b = Candidate::new(a.dims, a.global_batch * 2, a.micro_batch).ok()?;
                scorer.throughput(&b).map(|_| (*a, b))
            })
            .collect();
        assert!(pairs.len() >= 20, "{} pairs", pairs.len());
        let spread = |truth: &Scorer| {
            let d: Vec<f64> = pairs
                .iter()
                .map(|(a, b)| {
                    let e = |c: &Candidate| (truth.throughput(c).unwrap() / scorer.throughput(c).unwrap()).ln();
                    e(a) - e(b)
                })
                .collect();
            (d.iter().map(|x| x * x).sum::<f64>() / d.len() as f64).sqrt()
        };
        let (mut shared, mut independent) = (0.0, 0.0);
        for seed in 0..8 {
            shared += spread(&structured(&scorer, &priors, 8, seed).unwrap()) / 8.0;
            independent += spread(&perturbed(&scorer, 0.25, seed).unwrap()) / 8.0;
        }
        // By hand: a pair differs by its own terms (sqrt 2 x 0.03) and the trend over ln 2
        // (0.05 x 0.69), about 0.06; the independent truth by sqrt 2 x 0.25, about 0.35.
        assert!(shared < 0.12, "pairs of a layout drift apart by {shared}");
        assert!(independent > 0.25, "independent errors too alike: {independent}");
        let (a, b) = (structured(&scorer, &priors, 8, 3).unwrap(), structured(&scorer, &priors, 8, 3).unwrap());
        assert!(scorer.candidates().all(|(c, _)| a.throughput(c) == b.throughput(c)));
    }

    /// A prior that ranks the candidates of every B_g wrongly (its favourite is truly half as
    /// fast as it says): Copus, which learns throughput only from the steps it runs, ends on the
    /// truly fastest candidate of the B_g it chooses (within its layout threshold) on every
    /// seed; with exploration off it stays on the prior's wrong choice on most seeds (the
    /// main rule alone sometimes leaves it, when the measured favourite's shortfall rescales
    /// the others).
    #[test]
    fn exploration_corrects_a_prior_in_the_wrong_order() {
        let (scorer, _) = setup();
        let favourite = |c: &Candidate| best_layout(&scorer, c.global_batch) == *c;
        let truth = scorer.map_prior(|c, t| if favourite(c) { 0.5 * t } else { t }).unwrap();
        let traj = Trajectory::new(vec![(0.0, 64.0)], 4.0e5).unwrap();
        let ends = |explore: f64, seed: u64| {
            let rule = SwitchRule { horizon: 3600.0, layout_cost: 20.0, explore, ..SwitchRule::default() };
            let mut copus = Copus::new(scorer.clone(), rule).unwrap();
            let cfg = SimConfig { jitter: 0.1, ..realistic(SwitchCosts { batch: 0.5, layout: 20.0 }, seed) };
            let run = simulate(&mut copus, &truth, &traj, best_layout(&scorer, 8), &cfg).unwrap();
            let last = run.steps.last().unwrap().candidate;
            let fastest = best_layout(&truth, last.global_batch);
            (last, truth.throughput(&last).unwrap() / truth.throughput(&fastest).unwrap(), run)
        };
        let mut stuck = Vec::new();
        for seed in [1, 2, 3] {
            let (last, ratio, run) = ends(0.3, seed);
            assert!(ratio >= 1.0 / 1.05, "seed {seed}: ends on {last}, {ratio:.2} of the fastest at its B_g");
            let trials = run.switches.len();
            assert!(trials <= 40, "seed {seed}: {trials} switches");
            let (blind, blind_ratio, _) = ends(0.0, seed);
            stuck.push((seed, blind, blind_ratio, favourite(&blind) && blind_ratio < 0.9));
        }
        assert!(stuck.iter().filter(|s| s.3).count() >= 2, "without exploration: {stuck:?}");
    }
}
