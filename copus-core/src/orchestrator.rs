//! The orchestrator: turns step observations into validated decisions. The same logic runs
//! embedded (a direct call from the training loop) or as a separate service; this module holds
//! the logic and the wire protocol (length-prefixed JSON frames with a size limit, a protocol
//! version, a shared token and the fingerprint of the run's candidate space), so both modes
//! behave identically.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::candidates::Candidate;
use crate::policy::{Decision, Policy, PolicyState, Scorer, StepObservation};

/// Largest frame accepted once a session is authenticated, bytes.
pub const MAX_FRAME: usize = 64 * 1024;

/// Largest frame accepted before it (the `Hello`), bytes: an unauthenticated peer can make the
/// service hold no more than this per connection.
pub const MAX_HELLO: usize = 4 * 1024;

/// The protocol version this build speaks; a `Hello` of another is refused. Version 3: the
/// shared token never crosses the wire; each side proves it knows it (HMAC-SHA256 over both
/// sides' nonces and the run's fingerprint). Version 4: every frame after the handshake is
/// sealed with a session key and a sequence number ([`SessionMac`]).
pub const PROTOCOL_VERSION: u32 = 4;

/// The shortest shared token the service accepts.
pub const MIN_TOKEN_LEN: usize = 16;

/// What identifies a run's decision problem: the model and the candidate space. A service
/// serves only runs with its own fingerprint, so it cannot send decisions made for another
/// model, world size or batch lists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunFingerprint {
    /// The model's shape (without the vocabulary, which follows the run's tokenizer).
    pub model: String,
    /// Ranks of the run, which every layout must use.
    pub world_size: usize,
    /// Global batch sizes considered, sorted and deduplicated.
    pub global_batches: Vec<usize>,
    /// Micro-batch sizes considered, sorted and deduplicated.
    pub micro_batches: Vec<usize>,
}

impl RunFingerprint {
    /// The fingerprint of searching `space` for `model`.
    pub fn new(model: &crate::model::ModelSpec, space: &crate::candidates::CandidateSpace) -> Self {
        let sorted = |v: &[usize]| {
            let mut v = v.to_vec();
            v.sort_unstable();
            v.dedup();
            v
        };
        Self {
            model: format!(
                "layers {} hidden {} heads {}/{} ffn {} seq {}",
                model.num_layers, model.hidden, model.num_heads, model.num_kv_heads, model.ffn_hidden, model.seq_len
            ),
            world_size: space.world_size,
            global_batches: sorted(&space.global_batches),
            micro_batches: sorted(&space.micro_batches),
        }
    }
}

impl std::fmt::Display for RunFingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "model ({}), {} ranks, B_g {:?}, B_m {:?}", self.model, self.world_size, self.global_batches, self.micro_batches)
    }
}

/// What the training side sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// First message: the protocol version, a run name, the run's fingerprint and the
    /// client's nonce. The service answers with a [`Response::Challenge`].
    Hello {
        /// Must equal [`PROTOCOL_VERSION`].
        version: u32,
        /// The run's name; only for the service's logs, not checked.
        run: String,
        /// Must equal the service's fingerprint: the run and the service search the same space.
        fingerprint: RunFingerprint,
        /// A fresh random nonce of the client ([`nonce`]), which the service's proof covers.
        nonce: String,
    },
    /// Second message: the client's proof that it knows the token ([`client_proof`]), sent only
    /// after the service proved it knows the token too.
    Prove {
        /// Hex HMAC-SHA256.
        proof: String,
    },
    /// Continue from what an orchestrator learned so far (a client that decided on its own
    /// while the service was away hands its state over on reconnecting).
    Resume(Box<OrchestratorState>),
    /// A finished step, with what was measured.
    Step {
        /// The step, its configuration and the noise estimate, as the policy sees them.
        observation: StepObservation,
        /// Measured samples/s of the step (0 when not measured).
        samples_per_sec: f64,
    },
    /// A reconfiguration was carried out and took `seconds`.
    Reconfigured {
        /// Seconds it took on the run's clock.
        seconds: f64,
        /// Whether the layout changed (only layout changes feed the policy's cost estimate).
        layout_changed: bool,
    },
    /// The run ends.
    Bye,
}

/// What the orchestrator answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Response {
    /// The answer to a `Hello`: the service's nonce and its proof that it knows the token
    /// ([`service_proof`]).
    Challenge {
        /// A fresh random nonce of the service.
        nonce: String,
        /// Hex HMAC-SHA256.
        proof: String,
    },
    /// Accepted the client's proof.
    Welcome {
        /// The name of the policy that will decide, for the client's logs.
        policy: String,
    },
    /// The decision after a step (apply at the next optimizer-step boundary).
    Decision {
        /// The step of the observation the decision answers.
        step: u64,
        /// Keep, or the configuration to change to (always a feasible candidate).
        decision: Decision,
    },
    /// Acknowledgement of a `Reconfigured` or `Bye`.
    Ack,
    /// The request was refused; the reason, for the client to show.
    Error(String),
}

/// Why a frame or a session's first request was refused.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum ProtocolError {
    /// A frame longer than [`MAX_FRAME`].
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME}")]
    TooLarge(usize),
    /// Not a valid message: the decoder's reason.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// The peer's proof did not match the token (a wrong token on one side), or a request came
    /// before the session was authenticated.
    #[error("wrong token (the proof of knowing it did not match)")]
    Unauthorized,
    /// The peer speaks another protocol version.
    #[error("protocol version {got} is not supported (this side speaks version {PROTOCOL_VERSION})")]
    Version {
        /// The version offered.
        got: u32,
    },
    /// The run is not the one the service decides for.
    #[error("the service decides for {service}; this run is {run}")]
    Fingerprint {
        /// The service's fingerprint, as text.
        service: String,
        /// The fingerprint the run sent, as text.
        run: String,
    },
    /// A number that JSON cannot carry (NaN or infinite); the message is not sent.
    #[error("`{0}` is not a finite number")]
    NonFinite(String),
    /// A frame after the handshake whose MAC does not match its bytes, or whose sequence
    /// number is not the next one (altered, replayed, reordered or reflected on the way).
    #[error("a frame failed its authentication ({0}); the connection is dropped")]
    Forged(&'static str),
}

/// A protocol message: it names its first non-finite number, if any (JSON would write it as
/// `null`, which the other side cannot read back as a number).
pub trait Message: Serialize {
    /// The path of the first NaN or infinite number in the message.
    fn non_finite(&self) -> Option<String>;
}

fn first_bad(fields: impl IntoIterator<Item = (String, f64)>) -> Option<String> {
    fields.into_iter().find(|(_, v)| !v.is_finite()).map(|(f, _)| f)
}

fn state_fields(prefix: &str, s: &OrchestratorState) -> Vec<(String, f64)> {
    let mut out: Vec<(String, f64)> = s.measured.iter().enumerate().map(|(i, (_, v))| (format!("{prefix}.measured[{i}]"), *v)).collect();
    out.extend(s.learned.measured.iter().enumerate().map(|(i, (_, v))| (format!("{prefix}.learned.measured[{i}]"), *v)));
    out.extend(s.learned.layout_cost.map(|v| (format!("{prefix}.learned.layout_cost"), v)));
    out
}

impl Message for Request {
    fn non_finite(&self) -> Option<String> {
        match self {
            Request::Step { observation, samples_per_sec } => {
                let mut fields = vec![("Step.samples_per_sec".to_string(), *samples_per_sec)];
                fields.extend(observation.remaining_secs.map(|r| ("Step.observation.remaining_secs".to_string(), r)));
                if let Some(n) = &observation.noise {
                    for (f, v) in [("grad_sq", n.grad_sq), ("trace", n.trace), ("grad_sq_se", n.grad_sq_se), ("trace_se", n.trace_se)] {
                        fields.push((format!("Step.observation.noise.{f}"), v));
                    }
                }
                first_bad(fields)
            }
            Request::Reconfigured { seconds, .. } => first_bad([("Reconfigured.seconds".to_string(), *seconds)]),
            Request::Resume(state) => first_bad(state_fields("Resume", state)),
            Request::Hello { .. } | Request::Prove { .. } | Request::Bye => None,
        }
    }
}

impl Message for Response {
    fn non_finite(&self) -> Option<String> {
        None
    }
}

/// Encodes a message as a frame: 4-byte big-endian length, then JSON. A NaN or infinite
/// number is refused here, naming its field, and never reaches the wire.
pub fn encode<T: Message>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    if let Some(field) = msg.non_finite() {
        return Err(ProtocolError::NonFinite(field));
    }
    let body = serde_json::to_vec(msg).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    if body.len() > MAX_FRAME {
        return Err(ProtocolError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// The length a frame header announces, refusing oversized frames before reading them.
pub fn frame_len(header: [u8; 4]) -> Result<usize, ProtocolError> {
    frame_len_within(header, MAX_FRAME)
}

/// The length a frame header announces, refusing frames over `limit` bytes before reading them.
pub fn frame_len_within(header: [u8; 4], limit: usize) -> Result<usize, ProtocolError> {
    let n = u32::from_be_bytes(header) as usize;
    if n > limit { Err(ProtocolError::TooLarge(n)) } else { Ok(n) }
}

/// Decodes a frame body. Never panics, whatever the bytes.
pub fn decode<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ProtocolError> {
    if body.len() > MAX_FRAME {
        return Err(ProtocolError::TooLarge(body.len()));
    }
    serde_json::from_slice(body).map_err(|e| ProtocolError::Malformed(e.to_string()))
}

/// What an orchestrator learned during a run, for a whole-run checkpoint: the policy's state and
/// the throughput the orchestrator measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OrchestratorState {
    /// The policy's name when saved (a resume under another policy is refused).
    pub policy: String,
    /// What the policy learned ([`Policy::learned`]).
    pub learned: PolicyState,
    /// The orchestrator's own measured throughput (for reports and the feasibility check).
    pub measured: Vec<(Candidate, f64)>,
    /// How many measurements each of those holds (while fewer than the scorer's settled count
    /// it is a mean, see [`Scorer::observe_throughput`]); absent in older states, which then
    /// count as settled.
    #[serde(default)]
    pub measured_counts: Vec<(Candidate, u32)>,
    /// Decisions refused so far because their target was not a feasible candidate.
    pub refused: u64,
}

/// The decision logic shared by both modes: a policy, and the candidates it may choose from.
pub struct Orchestrator {
    policy: Box<dyn Policy>,
    scorer: Scorer,
    refused: u64,
}

impl Orchestrator {
    /// A policy choosing among `scorer`'s candidates.
    pub fn new(policy: Box<dyn Policy>, scorer: Scorer) -> Self {
        Self { policy, scorer, refused: 0 }
    }

    /// The name of the policy deciding ([`Policy::name`]).
    pub fn policy_name(&self) -> String {
        self.policy.name()
    }

    /// The candidates and the throughput the orchestrator now believes (for reports).
    pub fn scorer(&self) -> &Scorer {
        &self.scorer
    }

    /// Decisions refused so far because their target was not a feasible candidate.
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// The decision after a step. A decision whose target is not one of the feasible
    /// candidates is never passed on: the answer is then `Keep`.
    pub fn on_step(&mut self, obs: &StepObservation) -> Decision {
        let d = self.policy.decide(obs);
        let target = d.target(obs.current);
        if target != obs.current && !is_candidate(&self.scorer, &target) {
            self.refused += 1;
            return Decision::Keep;
        }
        d
    }

    /// The decision after a step that ran at `samples_per_sec` on the run's clock: the
    /// measurement replaces the throughput model's value of that configuration
    /// ([`Scorer::observe_throughput`]) before the policy decides. A non-positive value (not
    /// measured) or a non-finite one is ignored.
    pub fn on_step_measured(&mut self, obs: &StepObservation, samples_per_sec: f64) -> Decision {
        if samples_per_sec.is_finite() {
            self.policy.observe_throughput(&obs.current, samples_per_sec);
            self.scorer.observe_throughput(&obs.current, samples_per_sec);
        }
        self.on_step(obs)
    }

    /// Reports a carried-out reconfiguration (its measured cost feeds the payback test).
    pub fn on_reconfigured(&mut self, seconds: f64, layout_changed: bool) {
        self.policy.observe_reconfiguration(seconds, layout_changed);
    }

    /// What the orchestrator learned so far.
    pub fn state(&self) -> OrchestratorState {
        OrchestratorState {
            policy: self.policy_name(),
            learned: self.policy.learned(),
            measured: self.scorer.measured(),
            measured_counts: self.scorer.measurement_counts(),
            refused: self.refused,
        }
    }

    /// Continues from [`Self::state`] of an orchestrator with the same policy and candidates.
    /// Both Copus rules are named `copus`; the state's `rule` tells them apart (absent: the
    /// switch rule), so a run started under one is not continued under the other.
    pub fn restore(&mut self, state: &OrchestratorState) -> Result<(), RestoreError> {
        let named = |name: String, rule: &Option<String>| match rule {
            Some(r) => format!("{name} ({r})"),
            None => name,
        };
        let running_rule = self.policy.learned().rule;
        if state.policy != self.policy_name() || state.learned.rule != running_rule {
            return Err(RestoreError {
                saved: named(state.policy.clone(), &state.learned.rule),
                running: named(self.policy_name(), &running_rule),
            });
        }
        self.policy.restore_learned(&state.learned);
        self.scorer.set_measured(&state.measured);
        self.scorer.set_measurement_counts(&state.measured_counts);
        self.refused = state.refused;
        Ok(())
    }

    /// Answers one request of an authenticated session.
    pub fn handle(&mut self, req: Request) -> Response {
        match req {
            Request::Hello { .. } | Request::Prove { .. } => Response::Error("already authenticated".into()),
            Request::Resume(state) => match self.restore(&state) {
                Ok(()) => Response::Ack,
                Err(e) => Response::Error(e.to_string()),
            },
            Request::Step { observation, samples_per_sec } => {
                Response::Decision { step: observation.step, decision: self.on_step_measured(&observation, samples_per_sec) }
            }
            Request::Reconfigured { seconds, layout_changed } => {
                self.on_reconfigured(seconds, layout_changed);
                Response::Ack
            }
            Request::Bye => Response::Ack,
        }
    }
}

fn is_candidate(scorer: &Scorer, c: &Candidate) -> bool {
    scorer.throughput(c).is_some()
}

/// Checks a session's first request: a `Hello` of this protocol version for `fingerprint`;
/// returns the client's nonce. The token is checked after, by the client's [`Request::Prove`].
pub fn check_hello(req: &Request, fingerprint: &RunFingerprint) -> Result<String, ProtocolError> {
    match req {
        Request::Hello { version, fingerprint: theirs, nonce, .. } => {
            if *version != PROTOCOL_VERSION {
                return Err(ProtocolError::Version { got: *version });
            }
            if theirs != fingerprint {
                return Err(ProtocolError::Fingerprint { service: fingerprint.to_string(), run: theirs.to_string() });
            }
            if nonce.len() < 32 || nonce.len() > 128 {
                return Err(ProtocolError::Malformed(format!("a nonce of {} characters (32 to 128 expected)", nonce.len())));
            }
            Ok(nonce.clone())
        }
        _ => Err(ProtocolError::Unauthorized),
    }
}

/// A fresh random nonce: 32 bytes from the operating system's generator, as hex.
pub fn nonce() -> String {
    use rand::TryRngCore;
    let mut bytes = [0u8; 32];
    rand::rngs::OsRng.try_fill_bytes(&mut bytes).expect("the operating system's random generator");
    hex(&bytes)
}

/// The service's proof that it knows `token`: HMAC-SHA256 under the token over the role, both
/// nonces (the client's first) and the run's fingerprint, as hex.
pub fn service_proof(token: &str, client_nonce: &str, service_nonce: &str, fingerprint: &RunFingerprint) -> String {
    hex(&hmac::Mac::finalize(mac(token, "copus service", client_nonce, service_nonce, fingerprint)).into_bytes())
}

/// The client's proof that it knows `token` (another role, the nonces the other way round, so
/// neither side's proof can be replayed as the other's).
pub fn client_proof(token: &str, client_nonce: &str, service_nonce: &str, fingerprint: &RunFingerprint) -> String {
    hex(&hmac::Mac::finalize(mac(token, "copus client", service_nonce, client_nonce, fingerprint)).into_bytes())
}

/// Bytes a sealed frame adds to its message: its sequence number (8) and its MAC (32).
pub const SEAL: usize = 8 + 32;

/// The side of an authenticated session that sends a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The training run's client.
    Client,
    /// The orchestrator service.
    Service,
}

/// The authentication of a session's frames after the handshake. Both sides derive one key
/// from the token and the two nonces (HMAC-SHA256 under the token over a role, the nonces and
/// the fingerprint, as the proofs are), so a key never crosses the wire and each connection has
/// its own. Every frame then carries its sequence number (counted per direction from 0) and an
/// HMAC-SHA256 under the session key over the sender's side, the number and the message's
/// bytes: a changed byte, a replayed, dropped or reordered frame, or a frame sent back to its
/// sender fails [`SessionMac::open`].
#[derive(Clone)]
pub struct SessionMac {
    key: [u8; 32],
    side: Side,
    sent: u64,
    received: u64,
}

impl std::fmt::Debug for SessionMac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionMac").field("side", &self.side).field("sent", &self.sent).field("received", &self.received).finish()
    }
}

impl SessionMac {
    /// The session of a handshake with these nonces, for `side`.
    pub fn new(token: &str, client_nonce: &str, service_nonce: &str, fingerprint: &RunFingerprint, side: Side) -> Self {
        let digest = hmac::Mac::finalize(mac(token, "copus session key", client_nonce, service_nonce, fingerprint)).into_bytes();
        let mut key = [0u8; 32];
        key.copy_from_slice(&digest);
        Self { key, side, sent: 0, received: 0 }
    }

    fn tag(&self, from: Side, seq: u64, body: &[u8]) -> [u8; 32] {
        use hmac::Mac;
        let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        m.update(&[u8::from(from == Side::Service)]);
        m.update(&seq.to_be_bytes());
        m.update(body);
        let mut out = [0u8; 32];
        out.copy_from_slice(&m.finalize().into_bytes());
        out
    }

    /// `msg` as a sealed frame: 4-byte big-endian length, the sequence number, the MAC, then
    /// the JSON [`encode`] would send.
    pub fn seal<T: Message>(&mut self, msg: &T) -> Result<Vec<u8>, ProtocolError> {
        let plain = encode(msg)?;
        let body = &plain[4..];
        let seq = self.sent;
        let tag = self.tag(self.side, seq, body);
        let len = SEAL + body.len();
        if len > MAX_FRAME {
            return Err(ProtocolError::TooLarge(len));
        }
        let mut out = Vec::with_capacity(4 + len);
        out.extend_from_slice(&(len as u32).to_be_bytes());
        out.extend_from_slice(&seq.to_be_bytes());
        out.extend_from_slice(&tag);
        out.extend_from_slice(body);
        self.sent += 1;
        Ok(out)
    }

    /// The message of a sealed frame's body (after its length), if its MAC matches and its
    /// number is the next from the other side; the count moves on only then.
    pub fn open<T: for<'de> Deserialize<'de>>(&mut self, frame: &[u8]) -> Result<T, ProtocolError> {
        if frame.len() < SEAL {
            return Err(ProtocolError::Forged("shorter than its seal"));
        }
        let seq = u64::from_be_bytes(frame[..8].try_into().expect("8 bytes"));
        let (tag, body) = (&frame[8..SEAL], &frame[SEAL..]);
        let from = if self.side == Side::Client { Side::Service } else { Side::Client };
        let expected = self.tag(from, seq, body);
        let mut diff = 0u8;
        for (a, b) in expected.iter().zip(tag) {
            diff |= a ^ b;
        }
        if diff != 0 {
            return Err(ProtocolError::Forged("its MAC does not match"));
        }
        if seq != self.received {
            return Err(ProtocolError::Forged("not the next sequence number"));
        }
        self.received += 1;
        decode(body)
    }
}

/// Whether `proof` is `expected` (the comparison takes the same time wherever they differ).
pub fn proof_matches(expected: &str, proof: &str) -> bool {
    let (a, b) = (expected.as_bytes(), proof.as_bytes());
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= usize::from(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0));
    }
    diff == 0
}

fn mac(token: &str, role: &str, first: &str, second: &str, fingerprint: &RunFingerprint) -> hmac::Hmac<sha2::Sha256> {
    use hmac::Mac;
    let mut m = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(token.as_bytes()).expect("HMAC takes a key of any length");
    for part in [role, first, second, &fingerprint.to_string()] {
        m.update(&(part.len() as u64).to_le_bytes());
        m.update(part.as_bytes());
    }
    m
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A saved orchestrator state of another policy than the one running.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("the saved state is of policy `{saved}`, this run's is `{running}`")]
pub struct RestoreError {
    /// The policy the state was saved by.
    pub saved: String,
    /// The policy of the orchestrator asked to restore it.
    pub running: String,
}

/// A shared token too short to resist guessing.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("the token has {chars} characters; use at least {MIN_TOKEN_LEN}")]
pub struct WeakToken {
    /// Its length in characters.
    pub chars: usize,
}

/// Checks a service's shared token is long enough to resist guessing.
pub fn check_token(token: &str) -> Result<(), WeakToken> {
    let chars = token.chars().count();
    if chars < MIN_TOKEN_LEN {
        return Err(WeakToken { chars });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::ParallelDims;
    use crate::policy::Static;
    use crate::throughput::{ProfileEntry, ThroughputProfile};
    use proptest::prelude::*;

    fn scorer() -> Scorer {
        let e = |dp, tp, b, s| ProfileEntry { dp, tp, pp: 1, global_batch: b, micro_batch: 1, samples_per_sec: s };
        let p = ThroughputProfile::new("t".into(), "m".into(), vec![e(2, 1, 2, 10.0), e(2, 1, 4, 15.0), e(1, 2, 2, 12.0)]).unwrap();
        let cands: Vec<Candidate> = p
            .entries()
            .iter()
            .map(|x| Candidate::new(ParallelDims { dp: x.dp, tp: x.tp, pp: x.pp }, x.global_batch, x.micro_batch).unwrap())
            .collect();
        Scorer::plain(&cands, &p, 2.0).unwrap()
    }

    /// Always asks for a configuration that is not a candidate.
    struct Rogue;
    impl Policy for Rogue {
        fn name(&self) -> String {
            "rogue".into()
        }
        fn decide(&mut self, obs: &StepObservation) -> Decision {
            Decision::ChangeBatch(Candidate { global_batch: 1024, num_micro: 512, ..obs.current })
        }
    }

    #[test]
    fn messages_round_trip_and_rejected_decisions_are_not_passed_on() {
        let cur = Candidate::new(ParallelDims { dp: 2, tp: 1, pp: 1 }, 2, 1).unwrap();
        let obs = StepObservation { step: 3, current: cur, noise: None, remaining_secs: None };
        for req in [
            Request::Hello { version: PROTOCOL_VERSION, run: "r".into(), fingerprint: fp(), nonce: nonce() },
            Request::Step { observation: obs, samples_per_sec: 5.0 },
            Request::Reconfigured { seconds: 1.5, layout_changed: true },
            Request::Bye,
        ] {
            let frame = encode(&req).unwrap();
            let n = frame_len(frame[..4].try_into().unwrap()).unwrap();
            assert_eq!(decode::<Request>(&frame[4..4 + n]).unwrap(), req);
        }
        let mut o = Orchestrator::new(Box::new(Rogue), scorer());
        assert_eq!(o.on_step(&obs), Decision::Keep);
        assert_eq!(o.refused(), 1);
        let mut s = Orchestrator::new(Box::new(Static), scorer());
        assert_eq!(
            s.handle(Request::Step { observation: obs, samples_per_sec: 1.0 }),
            Response::Decision { step: 3, decision: Decision::Keep }
        );
    }

    /// An orchestrator restored from another's state decides as that one does from then on.
    #[test]
    fn a_restored_orchestrator_continues_as_the_original() {
        use crate::policy::{Copus, SwitchRule};
        let d = |dp, tp| ParallelDims { dp, tp, pp: 1 };
        // No dwell time or confirmation: every decision below can change something.
        let rule = SwitchRule { horizon: 100.0, layout_cost: 5.0, min_dwell_steps: 1, confirm_steps: 1, ..SwitchRule::default() };
        let make = || Orchestrator::new(Box::new(Copus::new(scorer(), rule).unwrap()), scorer());
        let (mut a, mut b) = (make(), make());
        let noise = |phi: f64| Some(crate::gns::NoiseEstimate { grad_sq: 1.0, trace: phi, biased: false, grad_sq_se: 0.0, trace_se: 0.0 });
        let small = Candidate::new(d(2, 1), 2, 1).unwrap();
        // Measurements that differ from the profile, and a measured switch cost.
        a.on_step_measured(&StepObservation { step: 1, current: small, noise: noise(1.0), remaining_secs: None }, 3.0);
        a.on_step_measured(&StepObservation { step: 2, current: small, noise: noise(1.0), remaining_secs: None }, 5.0);
        a.on_reconfigured(20.0, true);
        let saved = a.state();
        assert_eq!(saved.learned.layout_cost, Some(12.5));
        assert_eq!(saved.measured, vec![(small, 4.0)]);
        let text = serde_json::to_string(&saved).unwrap();
        b.restore(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(b.state(), saved);
        for (c, t) in a.scorer().candidates() {
            assert_eq!(b.scorer().throughput(c), Some(*t), "{c}");
        }
        for (step, phi) in [(3, 0.5), (4, 2.0), (5, 8.0), (6, 30.0)] {
            let obs = StepObservation { step, current: small, noise: noise(phi), remaining_secs: None };
            assert_eq!(a.on_step_measured(&obs, 4.5), b.on_step_measured(&obs, 4.5));
            // The orchestrator's own scorer goes on averaging as the original's does.
            assert_eq!(b.scorer().throughput(&small), a.scorer().throughput(&small), "step {step}");
        }
        // After 3, 5 and 4.5 x 4 the mean of six measurements, by hand.
        let mean = a.scorer().throughput(&small).unwrap();
        assert!((mean - (3.0 + 5.0 + 4.0 * 4.5) / 6.0).abs() < 1e-12, "{mean}");
        let mut other = Orchestrator::new(Box::new(Static), scorer());
        assert!(other.restore(&saved).unwrap_err().to_string().contains("copus"));
        // The rule on the structured belief is also named `copus`: a switch-rule state (which
        // says no rule, as every state saved before did) is refused by it, and the other way.
        let learning = || Orchestrator::new(crate::CopusRule::default().policy(&scorer(), 2).unwrap(), scorer());
        let e = learning().restore(&saved).unwrap_err().to_string();
        assert_eq!(e, "the saved state is of policy `copus`, this run's is `copus (learning)`");
        let mut l = learning();
        l.on_step_measured(&StepObservation { step: 1, current: small, noise: noise(1.0), remaining_secs: Some(50.0) }, 3.0);
        let theirs = l.state();
        assert_eq!(theirs.learned.rule.as_deref(), Some("learning"));
        assert!(make().restore(&theirs).unwrap_err().to_string().contains("`copus (learning)`"));
        learning().restore(&theirs).unwrap();
    }

    fn fp() -> RunFingerprint {
        let space = crate::candidates::CandidateSpace::new(
            2,
            vec![4, 2],
            vec![1],
            crate::schedule::ScheduleKind::OneFOneB,
            crate::memory::MemoryModel::fp32(),
            1e12,
        )
        .unwrap();
        RunFingerprint::new(&crate::model::ModelSpec::tiny_1m(), &space)
    }

    #[test]
    fn tokens_versions_fingerprints_and_sizes_are_checked() {
        let n = nonce();
        let hello = || Request::Hello { version: PROTOCOL_VERSION, run: "r".into(), fingerprint: fp(), nonce: n.clone() };
        assert_eq!(check_hello(&hello(), &fp()), Ok(n.clone()));
        assert_eq!(check_hello(&Request::Bye, &fp()), Err(ProtocolError::Unauthorized));
        let old = Request::Hello { version: 1, run: "r".into(), fingerprint: fp(), nonce: n.clone() };
        assert_eq!(check_hello(&old, &fp()), Err(ProtocolError::Version { got: 1 }));
        let short = Request::Hello { version: PROTOCOL_VERSION, run: "r".into(), fingerprint: fp(), nonce: "ab".into() };
        assert!(matches!(check_hello(&short, &fp()), Err(ProtocolError::Malformed(_))));
        let other = RunFingerprint { world_size: 4, ..fp() };
        let e = check_hello(&hello(), &other).unwrap_err().to_string();
        assert!(e.contains("4 ranks") && e.contains("2 ranks") && e.contains("B_g [2, 4]"), "{e}");
        assert!(check_token("short").unwrap_err().to_string().contains("at least 16"));
        // The proofs: each side's needs the token; neither is the other's; a changed nonce or
        // fingerprint changes them.
        let s = nonce();
        assert_ne!(n, s);
        let sp = service_proof("secret-token-0123", &n, &s, &fp());
        let cp = client_proof("secret-token-0123", &n, &s, &fp());
        assert_eq!(sp.len(), 64);
        assert!(proof_matches(&sp, &service_proof("secret-token-0123", &n, &s, &fp())));
        assert!(!proof_matches(&sp, &service_proof("secret-token-0124", &n, &s, &fp())));
        assert!(!proof_matches(&sp, &cp));
        assert!(!proof_matches(&cp, &client_proof("secret-token-0123", &s, &n, &fp())));
        assert!(!proof_matches(&sp, &service_proof("secret-token-0123", &n, &s, &other)));
        assert!(!proof_matches(&sp, &sp[..63]));
        assert!(check_token("0123456789abcdef").is_ok());
        assert_eq!(frame_len((MAX_FRAME as u32 + 1).to_be_bytes()), Err(ProtocolError::TooLarge(MAX_FRAME + 1)));
        assert!(matches!(decode::<Request>(b"{\"Step\": 5}"), Err(ProtocolError::Malformed(_))));
    }

    #[test]
    fn non_finite_numbers_never_reach_the_wire() {
        let cur = Candidate::new(ParallelDims { dp: 2, tp: 1, pp: 1 }, 2, 1).unwrap();
        let obs = StepObservation { step: 1, current: cur, noise: None, remaining_secs: None };
        let e = encode(&Request::Step { observation: obs, samples_per_sec: f64::INFINITY }).unwrap_err();
        assert_eq!(e.to_string(), "`Step.samples_per_sec` is not a finite number");
        let noisy = StepObservation {
            noise: Some(crate::gns::NoiseEstimate { grad_sq: 1.0, trace: f64::NAN, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }),
            remaining_secs: None,
            ..obs
        };
        let e = encode(&Request::Step { observation: noisy, samples_per_sec: 1.0 }).unwrap_err();
        assert_eq!(e, ProtocolError::NonFinite("Step.observation.noise.trace".into()));
        let late = StepObservation { remaining_secs: Some(f64::INFINITY), ..obs };
        let e = encode(&Request::Step { observation: late, samples_per_sec: 1.0 }).unwrap_err();
        assert_eq!(e, ProtocolError::NonFinite("Step.observation.remaining_secs".into()));
        let e = encode(&Request::Reconfigured { seconds: f64::NEG_INFINITY, layout_changed: true }).unwrap_err();
        assert!(e.to_string().contains("Reconfigured.seconds"));
        let mut state = OrchestratorState::default();
        state.learned.layout_cost = Some(f64::NAN);
        assert!(encode(&Request::Resume(Box::new(state))).unwrap_err().to_string().contains("Resume.learned.layout_cost"));
        // Finite messages encode and decode to themselves.
        let req = Request::Step { observation: obs, samples_per_sec: 1.5 };
        assert_eq!(decode::<Request>(&encode(&req).unwrap()[4..]).unwrap(), req);
    }

    proptest! {
        #[test]
        fn the_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<Request>(&bytes);
            let _ = decode::<Response>(&bytes);
            if bytes.len() >= 4 {
                let _ = frame_len(bytes[..4].try_into().unwrap());
            }
        }

        #[test]
        fn mutated_frames_never_panic(flip in 0usize..200, val in any::<u8>()) {
            let cur = Candidate::new(ParallelDims { dp: 2, tp: 1, pp: 1 }, 2, 1).unwrap();
            let frame =
                encode(&Request::Step { observation: StepObservation { step: 1, current: cur, noise: None, remaining_secs: None }, samples_per_sec: 2.0 }).unwrap();
            let mut body = frame[4..].to_vec();
            let i = flip % body.len();
            body[i] = val;
            let _ = decode::<Request>(&body);
        }
    }

    /// A sealed frame opens on the other side and only there, once, in order, unchanged.
    #[test]
    fn sealed_frames_open_once_in_order_unchanged_and_only_across() {
        let fp = fp();
        let (cn, sn) = (nonce(), nonce());
        let mut client = SessionMac::new("0123456789abcdef-key", &cn, &sn, &fp, Side::Client);
        let mut service = SessionMac::new("0123456789abcdef-key", &cn, &sn, &fp, Side::Service);
        let body = |frame: &[u8]| frame[4..].to_vec();
        let (a, b) = (body(&client.seal(&Request::Bye).unwrap()), body(&client.seal(&Request::Bye).unwrap()));
        assert_eq!(a.len(), SEAL + serde_json::to_vec(&Request::Bye).unwrap().len());
        // Out of order: the second before the first.
        let mut late = service.clone();
        assert!(matches!(late.open::<Request>(&b), Err(ProtocolError::Forged(_))));
        assert!(matches!(service.open::<Request>(&a), Ok(Request::Bye)));
        // Replayed.
        assert!(matches!(service.open::<Request>(&a), Err(ProtocolError::Forged(_))));
        assert!(matches!(service.open::<Request>(&b), Ok(Request::Bye)));
        // Changed in any byte: the number, the tag or the message.
        let c = body(&client.seal(&Request::Bye).unwrap());
        for at in [0, 7, 8, 39, SEAL, c.len() - 1] {
            let mut bad = c.clone();
            bad[at] ^= 0x20;
            assert!(matches!(service.clone().open::<Request>(&bad), Err(ProtocolError::Forged(_))), "byte {at}");
        }
        // Sent back to its sender (the client opening its own frame), or under another key.
        assert!(matches!(client.clone().open::<Request>(&c), Err(ProtocolError::Forged(_))));
        let mut other = SessionMac::new("0123456789abcdef-key", &nonce(), &sn, &fp, Side::Service);
        assert!(matches!(other.open::<Request>(&a), Err(ProtocolError::Forged(_))));
        assert!(matches!(service.open::<Request>(&c), Ok(Request::Bye)));
        assert!(matches!(service.open::<Request>(&[0u8; 10]), Err(ProtocolError::Forged(_))));
    }
}
