//! The hindsight oracle: for a known noise [`Trajectory`], the fastest [`Schedule`] of
//! candidates under [`SwitchCosts`], and [`schedule_time`] to cost any schedule on the same terms
//! (a policy's regret).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::error::{PolicyError, check};
use super::scorer::Scorer;
use crate::candidates::Candidate;
use crate::layout::ParallelDims;

/// Noise scale over training, indexed by progress in B0-equivalent samples.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// (progress at which the value starts, B_simple), progress increasing from 0.
    pub points: Vec<(f64, f64)>,
    /// Progress at which training ends (the target).
    pub end: f64,
}

impl Trajectory {
    /// A trajectory from `(progress, B_simple)` points. Errors: no points, a first point not at
    /// progress 0, progress not strictly increasing, a negative or non-finite B_simple, an `end`
    /// not after the last point.
    pub fn new(points: Vec<(f64, f64)>, end: f64) -> Result<Self, PolicyError> {
        if points.is_empty() || points[0].0 != 0.0 {
            return Err(PolicyError::Bad {
                field: "trajectory",
                allowed: "points starting at progress 0",
                value: points.first().map_or(f64::NAN, |p| p.0),
            });
        }
        for w in points.windows(2) {
            check("trajectory progress", w[1].0, w[1].0 > w[0].0, "strictly increasing")?;
        }
        for p in &points {
            check("trajectory B_simple", p.1, p.1 >= 0.0, ">= 0")?;
        }
        let last = points[points.len() - 1].0;
        check("trajectory end", end, end > last, "after the last point")?;
        Ok(Self { points, end })
    }

    /// Segments (start, end, phi).
    fn segments(&self) -> impl Iterator<Item = (f64, f64, f64)> + '_ {
        self.points.iter().enumerate().map(|(i, &(s, phi))| (s, self.points.get(i + 1).map_or(self.end, |p| p.0), phi))
    }
}

/// Costs of switching on the simulated clock, seconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SwitchCosts {
    /// Seconds of a batch-only change (same layout, new B_g and/or B_m).
    pub batch: f64,
    /// Seconds of a layout change (batch changes with it are included).
    pub layout: f64,
}

impl SwitchCosts {
    /// Seconds to go from `a` to `b`: nothing if they are equal, else a layout or a batch change.
    fn between(&self, a: &Candidate, b: &Candidate) -> f64 {
        if a == b {
            0.0
        } else if a.layout_differs(b) {
            self.layout
        } else {
            self.batch
        }
    }
}

/// A schedule: the configuration from each trajectory point on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// One candidate per trajectory segment.
    pub per_segment: Vec<Candidate>,
    /// Seconds to reach the trajectory's end, switches included.
    pub time: f64,
}

/// Seconds that `per_segment` takes on `trajectory`, starting from `initial` (switches to the
/// first segment's candidate are charged). `None` if a candidate has no throughput.
pub fn schedule_time(
    trajectory: &Trajectory,
    per_segment: &[Candidate],
    scorer: &Scorer,
    costs: SwitchCosts,
    initial: Option<Candidate>,
) -> Option<f64> {
    if per_segment.len() != trajectory.points.len() {
        return None;
    }
    let mut prev = initial;
    let mut time = 0.0;
    for ((start, end, phi), c) in trajectory.segments().zip(per_segment) {
        let t = scorer.throughput(c)?;
        time += prev.map_or(0.0, |p| costs.between(&p, c));
        time += (end - start) / scorer.goodput(t, c.global_batch, phi);
        prev = Some(*c);
    }
    Some(time)
}

/// The fastest schedule for a known trajectory (dynamic programming over segments x candidates,
/// O(segments x candidates) with per-layout minima).
pub fn hindsight_oracle(trajectory: &Trajectory, scorer: &Scorer, costs: SwitchCosts, initial: Option<Candidate>) -> Schedule {
    let cands: Vec<(Candidate, f64)> = scorer.candidates().copied().collect();
    let n = cands.len();
    let mut layout_of: Vec<usize> = Vec::with_capacity(n);
    let mut layouts: HashMap<ParallelDims, usize> = HashMap::new();
    for (c, _) in &cands {
        let next = layouts.len();
        layout_of.push(*layouts.entry(c.dims).or_insert(next));
    }
    let num_layouts = layouts.len();
    let segments: Vec<(f64, f64, f64)> = trajectory.segments().collect();
    // cost[i]: best time to finish the segments so far ending in candidate i.
    let mut cost: Vec<f64> = cands.iter().map(|(c, _)| initial.map_or(0.0, |p| costs.between(&p, c))).collect();
    let mut back: Vec<Vec<u32>> = Vec::with_capacity(segments.len());
    for (k, &(start, end, phi)) in segments.iter().enumerate() {
        if k > 0 {
            // Predecessors: the same candidate (free), the best of the same layout (batch cost),
            // the best of any other layout (layout cost). Keep the best per layout and the two
            // best layouts, so "any other layout" is O(1).
            let mut best_layout = vec![(f64::INFINITY, 0usize); num_layouts];
            for i in 0..n {
                if cost[i] < best_layout[layout_of[i]].0 {
                    best_layout[layout_of[i]] = (cost[i], i);
                }
            }
            let (mut first, mut second) = ((f64::INFINITY, 0usize, usize::MAX), (f64::INFINITY, 0usize, usize::MAX));
            for (l, &(v, j)) in best_layout.iter().enumerate() {
                if v < first.0 {
                    second = first;
                    first = (v, j, l);
                } else if v < second.0 {
                    second = (v, j, l);
                }
            }
            let mut from = vec![0u32; n];
            let mut next = vec![0.0; n];
            for i in 0..n {
                let l = layout_of[i];
                let mut b = (cost[i], i);
                let (v, j) = best_layout[l];
                if v + costs.batch < b.0 {
                    b = (v + costs.batch, j);
                }
                let other = if first.2 != l { first } else { second };
                if other.0 + costs.layout < b.0 {
                    b = (other.0 + costs.layout, other.1);
                }
                next[i] = b.0;
                from[i] = b.1 as u32;
            }
            cost = next;
            back.push(from);
        }
        for (i, (c, t)) in cands.iter().enumerate() {
            cost[i] += (end - start) / scorer.goodput(*t, c.global_batch, phi);
        }
    }
    let (mut i, time) = cost.iter().enumerate().fold((0, f64::INFINITY), |b, (i, &v)| if v < b.1 { (i, v) } else { b });
    let mut per_segment = vec![cands[i].0; segments.len()];
    for k in (1..segments.len()).rev() {
        i = back[k - 1][i] as usize;
        per_segment[k - 1] = cands[i].0;
    }
    Schedule { per_segment, time }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::test_util::{d, toy};
    use proptest::prelude::*;

    /// Brute force over every schedule: the reference for the oracle.
    fn brute(traj: &Trajectory, s: &Scorer, costs: SwitchCosts, initial: Option<Candidate>) -> f64 {
        let cands: Vec<Candidate> = s.candidates().map(|c| c.0).collect();
        let k = traj.points.len();
        let mut best = f64::INFINITY;
        let total = cands.len().pow(k as u32);
        for mut code in 0..total {
            let sched: Vec<Candidate> = (0..k)
                .map(|_| {
                    let c = cands[code % cands.len()];
                    code /= cands.len();
                    c
                })
                .collect();
            best = best.min(schedule_time(traj, &sched, s, costs, initial).unwrap());
        }
        best
    }

    fn small_scorer() -> Scorer {
        let (_, p) = toy();
        let cands: Vec<Candidate> = [(d(4, 1, 1), 4), (d(4, 1, 1), 32), (d(2, 2, 1), 4), (d(2, 2, 1), 32)]
            .iter()
            .map(|&(dims, b)| Candidate::new(dims, b, 1).unwrap())
            .collect();
        Scorer::plain(&cands, &p, 4.0).unwrap()
    }

    #[test]
    fn oracle_equals_brute_force_and_beats_every_static_schedule() {
        let s = small_scorer();
        let traj = Trajectory::new(vec![(0.0, 1.0), (100.0, 10.0), (300.0, 200.0), (600.0, 5000.0)], 2000.0).unwrap();
        for costs in
            [SwitchCosts { batch: 0.0, layout: 0.0 }, SwitchCosts { batch: 0.5, layout: 3.0 }, SwitchCosts { batch: 0.0, layout: 1e6 }]
        {
            let start = Candidate::new(d(2, 2, 1), 4, 1).unwrap();
            let o = hindsight_oracle(&traj, &s, costs, Some(start));
            let b = brute(&traj, &s, costs, Some(start));
            assert!((o.time - b).abs() < 1e-9 * b, "oracle {} vs brute force {b}", o.time);
            assert!((schedule_time(&traj, &o.per_segment, &s, costs, Some(start)).unwrap() - o.time).abs() < 1e-9 * o.time);
            for (c, _) in s.candidates() {
                let fixed = vec![*c; traj.points.len()];
                assert!(o.time <= schedule_time(&traj, &fixed, &s, costs, Some(start)).unwrap() + 1e-9);
            }
        }
        // Free switches with growing noise: the oracle moves to larger batches.
        let o = hindsight_oracle(&traj, &s, SwitchCosts { batch: 0.0, layout: 0.0 }, None);
        assert!(o.per_segment[0].global_batch < o.per_segment[3].global_batch, "{:?}", o.per_segment);
    }

    proptest! {
        #[test]
        fn oracle_matches_brute_force_on_random_trajectories(
            phis in proptest::collection::vec(0.1f64..1e4, 1..5),
            batch_cost in 0.0f64..5.0,
            layout_cost in 0.0f64..50.0,
        ) {
            let s = small_scorer();
            let points: Vec<(f64, f64)> = phis.iter().enumerate().map(|(i, &p)| (i as f64 * 150.0, p)).collect();
            let traj = Trajectory::new(points, phis.len() as f64 * 150.0).unwrap();
            let costs = SwitchCosts { batch: batch_cost, layout: layout_cost };
            let o = hindsight_oracle(&traj, &s, costs, None);
            let b = brute(&traj, &s, costs, None);
            prop_assert!((o.time - b).abs() <= 1e-9 * b, "oracle {} vs {}", o.time, b);
        }
    }
}
