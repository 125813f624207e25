//! Pipeline schedules as pure instruction lists, one `Vec<Action>` per stage.
//!
//! copus-burn interprets these lists; here they are built and their invariants checked without
//! tensors. Sends are buffered (a send never waits for its receive), receives block.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// The order in which a pipeline stage runs its micro-batches' forwards and backwards.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (GPipe): `a` micro-batches in flight.
    GPipe,
    /// One-forward-one-backward (PipeDream-flush): at most `pp - stage` in flight.
    OneFOneB,
}

impl ScheduleKind {
    /// Micro-batches whose activations a stage holds at once, at most.
    pub fn max_in_flight(self, stage: usize, pp: usize, num_micro: usize) -> usize {
        match self {
            ScheduleKind::GPipe => num_micro,
            ScheduleKind::OneFOneB => num_micro.min(pp - stage),
        }
    }

    /// Idle fraction of a stage with equal per-micro-batch costs: `(p - 1) / (a + p - 1)`.
    pub fn bubble_fraction(self, pp: usize, num_micro: usize) -> f64 {
        (pp as f64 - 1.0) / (num_micro as f64 + pp as f64 - 1.0)
    }
}

/// One instruction of a stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Action {
    /// Receive micro-batch `mb`'s input activation from the previous stage.
    RecvActivation {
        /// Micro-batch index within the step, in `0..num_micro`.
        mb: usize,
    },
    /// Run micro-batch `mb` forward through this stage's layers.
    Forward {
        /// Micro-batch index within the step, in `0..num_micro`.
        mb: usize,
    },
    /// Send micro-batch `mb`'s output activation to the next stage.
    SendActivation {
        /// Micro-batch index within the step, in `0..num_micro`.
        mb: usize,
    },
    /// Receive the gradient of micro-batch `mb`'s output from the next stage.
    RecvGrad {
        /// Micro-batch index within the step, in `0..num_micro`.
        mb: usize,
    },
    /// Run micro-batch `mb` backward through this stage's layers.
    Backward {
        /// Micro-batch index within the step, in `0..num_micro`.
        mb: usize,
    },
    /// Send the gradient of micro-batch `mb`'s input to the previous stage.
    SendGrad {
        /// Micro-batch index within the step, in `0..num_micro`.
        mb: usize,
    },
}

/// Invalid schedule arguments.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ScheduleError {
    /// Zero stages or zero micro-batches.
    #[error("a pipeline schedule needs pp >= 1 and at least one micro-batch (pp = {pp}, micro-batches = {num_micro})")]
    Empty {
        /// Pipeline stages asked for.
        pp: usize,
        /// Micro-batches per step asked for.
        num_micro: usize,
    },
}

/// The per-stage action lists of a schedule for `pp` stages and `num_micro` micro-batches.
pub fn build(kind: ScheduleKind, pp: usize, num_micro: usize) -> Result<Vec<Vec<Action>>, ScheduleError> {
    if pp == 0 || num_micro == 0 {
        return Err(ScheduleError::Empty { pp, num_micro });
    }
    Ok((0..pp).map(|s| stage_actions(kind, s, pp, num_micro)).collect())
}

fn forward(out: &mut Vec<Action>, stage: usize, pp: usize, mb: usize) {
    if stage > 0 {
        out.push(Action::RecvActivation { mb });
    }
    out.push(Action::Forward { mb });
    if stage + 1 < pp {
        out.push(Action::SendActivation { mb });
    }
}

fn backward(out: &mut Vec<Action>, stage: usize, pp: usize, mb: usize) {
    if stage + 1 < pp {
        out.push(Action::RecvGrad { mb });
    }
    out.push(Action::Backward { mb });
    if stage > 0 {
        out.push(Action::SendGrad { mb });
    }
}

fn stage_actions(kind: ScheduleKind, stage: usize, pp: usize, a: usize) -> Vec<Action> {
    let mut out = Vec::new();
    match kind {
        ScheduleKind::GPipe => {
            (0..a).for_each(|mb| forward(&mut out, stage, pp, mb));
            (0..a).for_each(|mb| backward(&mut out, stage, pp, mb));
        }
        ScheduleKind::OneFOneB => {
            let warmup = (pp - stage - 1).min(a);
            (0..warmup).for_each(|mb| forward(&mut out, stage, pp, mb));
            for i in 0..a - warmup {
                forward(&mut out, stage, pp, warmup + i);
                backward(&mut out, stage, pp, i);
            }
            (a - warmup..a).for_each(|mb| backward(&mut out, stage, pp, mb));
        }
    }
    out
}

/// Result of running a schedule on the event simulator.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    /// Time at which the last stage finishes, in the units of the costs given.
    pub makespan: f64,
    /// Most micro-batches each stage held (forward done, backward not yet) at once.
    pub peak_in_flight: Vec<usize>,
}

/// Runs per-stage lists with forward cost `t_fwd`, backward cost `t_bwd` and free, buffered
/// sends; `None` if the lists deadlock (some receive can never be satisfied).
pub fn simulate(stages: &[Vec<Action>], t_fwd: f64, t_bwd: f64) -> Option<Simulation> {
    use std::collections::HashMap;
    let pp = stages.len();
    let mut pc = vec![0usize; pp];
    let mut clock = vec![0f64; pp];
    let mut held = vec![0usize; pp];
    let mut peak = vec![0usize; pp];
    // (kind, from stage, mb) -> time the message is available.
    let mut mailbox: HashMap<(u8, usize, usize), f64> = HashMap::new();
    loop {
        let mut progressed = false;
        for s in 0..pp {
            while let Some(&act) = stages[s].get(pc[s]) {
                match act {
                    Action::RecvActivation { mb } => match mailbox.remove(&(0, s.wrapping_sub(1), mb)) {
                        Some(t) => clock[s] = clock[s].max(t),
                        None => break,
                    },
                    Action::RecvGrad { mb } => match mailbox.remove(&(1, s + 1, mb)) {
                        Some(t) => clock[s] = clock[s].max(t),
                        None => break,
                    },
                    Action::Forward { .. } => {
                        clock[s] += t_fwd;
                        held[s] += 1;
                        peak[s] = peak[s].max(held[s]);
                    }
                    Action::Backward { .. } => {
                        clock[s] += t_bwd;
                        held[s] = held[s].saturating_sub(1);
                    }
                    Action::SendActivation { mb } => {
                        mailbox.insert((0, s, mb), clock[s]);
                    }
                    Action::SendGrad { mb } => {
                        mailbox.insert((1, s, mb), clock[s]);
                    }
                }
                pc[s] += 1;
                progressed = true;
            }
        }
        if pc.iter().zip(stages).all(|(&p, st)| p == st.len()) {
            let makespan = clock.iter().cloned().fold(0.0, f64::max);
            return Some(Simulation { makespan, peak_in_flight: peak });
        }
        if !progressed {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn position(list: &[Action], a: Action) -> Option<usize> {
        list.iter().position(|&x| x == a)
    }

    fn check_invariants(kind: ScheduleKind, pp: usize, a: usize) -> Result<(), TestCaseError> {
        let stages = build(kind, pp, a).unwrap();
        for (s, list) in stages.iter().enumerate() {
            for mb in 0..a {
                let f = position(list, Action::Forward { mb });
                let b = position(list, Action::Backward { mb });
                prop_assert!(f.is_some() && b.is_some(), "stage {s} runs mb {mb} both ways");
                prop_assert!(f < b, "stage {s}: forward of mb {mb} before its backward");
                prop_assert_eq!(list.iter().filter(|&&x| x == Action::Forward { mb }).count(), 1);
            }
            // Every send has its receive on the neighbouring stage, and vice versa.
            for &act in list {
                let partner = match act {
                    Action::SendActivation { mb } => Some((s + 1, Action::RecvActivation { mb })),
                    Action::SendGrad { mb } => Some((s - 1, Action::RecvGrad { mb })),
                    Action::RecvActivation { mb } => Some((s - 1, Action::SendActivation { mb })),
                    Action::RecvGrad { mb } => Some((s + 1, Action::SendGrad { mb })),
                    _ => None,
                };
                if let Some((peer, want)) = partner {
                    prop_assert!(
                        position(&stages[peer], want).is_some(),
                        "stage {} {:?} has no partner {:?} on stage {}",
                        s,
                        act,
                        want,
                        peer
                    );
                }
            }
        }
        let sim = simulate(&stages, 1.0, 2.0).expect("schedule must not deadlock");
        if kind == ScheduleKind::OneFOneB {
            prop_assert!(sim.peak_in_flight[0] <= pp, "1F1B holds at most pp micro-batches on stage 0");
            for s in 0..pp {
                prop_assert_eq!(sim.peak_in_flight[s], kind.max_in_flight(s, pp, a));
            }
        } else {
            prop_assert_eq!(sim.peak_in_flight[0], a);
        }
        // With free communication both schedules take (a + p - 1) * (t_f + t_b).
        prop_assert!((sim.makespan - (a + pp - 1) as f64 * 3.0).abs() < 1e-9, "makespan {}", sim.makespan);
        Ok(())
    }

    #[test]
    fn one_f_one_b_on_four_stages_by_hand() {
        let s = build(ScheduleKind::OneFOneB, 4, 6).unwrap();
        let compute: Vec<_> = s[1].iter().filter(|a| matches!(a, Action::Forward { .. } | Action::Backward { .. })).copied().collect();
        use Action::{Backward as B, Forward as F};
        // Stage 1 of 4: two warm-up forwards, then alternate, then drain.
        assert_eq!(
            compute,
            vec![
                F { mb: 0 },
                F { mb: 1 },
                F { mb: 2 },
                B { mb: 0 },
                F { mb: 3 },
                B { mb: 1 },
                F { mb: 4 },
                B { mb: 2 },
                F { mb: 5 },
                B { mb: 3 },
                B { mb: 4 },
                B { mb: 5 }
            ]
        );
    }

    #[test]
    fn bubble_matches_the_closed_form() {
        assert!((ScheduleKind::OneFOneB.bubble_fraction(4, 8) - 3.0 / 11.0).abs() < 1e-12);
        assert!(build(ScheduleKind::GPipe, 0, 3).is_err());
    }

    #[test]
    fn a_broken_schedule_is_detected() {
        // Stage 1 waits for an activation stage 0 never sends.
        let broken = vec![vec![Action::Forward { mb: 0 }], vec![Action::RecvActivation { mb: 0 }]];
        assert!(simulate(&broken, 1.0, 1.0).is_none());
    }

    proptest! {
        #[test]
        fn invariants_hold(pp in 1usize..9, a in 1usize..17) {
            check_invariants(ScheduleKind::GPipe, pp, a)?;
            check_invariants(ScheduleKind::OneFOneB, pp, a)?;
        }
    }
}
