//! The training side: a client on a background thread that never blocks the training loop and
//! reconnects with backoff, and `RemoteSource`, the service as the driver's decision source
//! with an embedded orchestrator that decides while the service is away.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::time::{Duration, Instant};

use copus_core::orchestrator::{
    MAX_FRAME, Orchestrator, OrchestratorState, PROTOCOL_VERSION, Request, Response, RunFingerprint, SessionMac, Side, client_proof,
    decode, encode, frame_len_within, nonce, proof_matches, service_proof,
};
use copus_core::policy::{Decision, StepObservation};

use copus_core::decision::{DecisionSource, SourceStateError};

use crate::error::ServiceError;

/// The service as the driver's decision source, backed by an embedded orchestrator that sees
/// every observation too and decides while the service is away. Decisions from the service
/// arrive asynchronously; one is applied at the first step boundary after it arrives, unless
/// it was made for a configuration that has changed since. In synchronous mode each step
/// waits (up to a timeout) for its own decision, so a run decides exactly as with the embedded
/// orchestrator alone, also across an outage of the service.
pub struct RemoteSource {
    client: Client,
    embedded: Orchestrator,
    /// The first step observed in the current configuration.
    since: u64,
    last_step: u64,
    /// Synchronous mode: how long a step waits for its decision.
    wait: Option<Duration>,
    /// Steps decided by the embedded orchestrator because the service was away.
    fallback_steps: u64,
    away: bool,
}

impl RemoteSource {
    /// Decisions from `client`, applied as they arrive (training never waits); `embedded`
    /// decides while the service is away (build it like the service's).
    pub fn new(client: Client, embedded: Orchestrator) -> Self {
        Self { client, embedded, since: 0, last_step: 0, wait: None, fallback_steps: 0, away: false }
    }

    /// Decisions from `client`, each step waiting up to `timeout` for its own.
    pub fn synchronous(client: Client, embedded: Orchestrator, timeout: Duration) -> Self {
        Self { wait: Some(timeout), ..Self::new(client, embedded) }
    }

    /// Why the service was last unavailable, if it ever was.
    pub fn unavailable(&self) -> Option<&str> {
        self.client.unavailable()
    }

    /// Steps the embedded orchestrator decided because the service was away.
    pub fn fallback_steps(&self) -> u64 {
        self.fallback_steps
    }

    fn fall_back(&mut self, local: Decision) -> Decision {
        if !self.away {
            tracing::warn!(
                "orchestrator service unavailable ({}); the embedded orchestrator decides until it is back",
                self.client.unavailable().unwrap_or("no answer")
            );
            self.away = true;
        }
        self.fallback_steps += 1;
        local
    }
}

impl DecisionSource for RemoteSource {
    fn name(&self) -> String {
        "orchestrator service".into()
    }
    fn on_step(&mut self, obs: &StepObservation, samples_per_sec: f64) -> Decision {
        self.last_step = obs.step;
        // What the service must know to continue from here if it has to be reconnected: the
        // state before this step (the step itself follows in the same message).
        let before = Arc::new(self.embedded.state());
        let local = self.embedded.on_step_measured(obs, samples_per_sec);
        self.client.observe(*obs, samples_per_sec, before);
        if let Some(timeout) = self.wait {
            // The client thread answers for this very step: a decision (also right after a
            // reconnection), or word that there will be none.
            return match self.client.wait_for(obs.step, timeout) {
                Some(d) => {
                    self.back();
                    d
                }
                None => self.fall_back(local),
            };
        }
        if !self.client.connected() {
            return self.fall_back(local);
        }
        let got = self.client.poll();
        if self.client.overdue() {
            return self.fall_back(local);
        }
        self.back();
        match got {
            Some((s, d)) if s >= self.since => d,
            _ => Decision::Keep,
        }
    }
    fn on_reconfigured(&mut self, seconds: f64, layout_changed: bool) {
        self.embedded.on_reconfigured(seconds, layout_changed);
        self.client.reconfigured(seconds, layout_changed);
        self.since = self.last_step + 1;
    }
    fn save_state(&self) -> Option<String> {
        serde_json::to_string(&self.embedded.state()).ok()
    }
    fn restore_state(&mut self, state: &str) -> Result<(), SourceStateError> {
        let state: OrchestratorState = serde_json::from_str(state)?;
        self.embedded.restore(&state).map_err(|e| SourceStateError::Mismatch(e.to_string()))?;
        // The service learns it on the next (re)connection's handover.
        self.client.hand_over(Arc::new(state));
        Ok(())
    }
}

impl RemoteSource {
    fn back(&mut self) {
        if self.away {
            tracing::info!("orchestrator service back after {} step(s) decided by the embedded orchestrator", self.fallback_steps);
            self.away = false;
        }
    }
}

/// Messages from the training loop to the client thread.
enum Outgoing {
    /// A step, and the embedded orchestrator's state before it (handed over on reconnecting).
    Step(StepObservation, f64, Arc<OrchestratorState>),
    Reconfigured(f64, bool),
    /// Hand this state over now (a resumed run).
    State(Arc<OrchestratorState>),
}

/// What the client thread reports to the training side.
enum Status {
    /// The connection was lost (or a message could not be sent) at this step, or between steps.
    Lost(Option<u64>, String),
    /// Reconnected.
    Back,
    /// Not connected, and not trying again yet, at this step.
    Away(u64),
}

/// Where the client connects and how it introduces itself.
#[derive(Clone)]
struct Endpoint {
    addr: SocketAddr,
    token: String,
    run: String,
    fingerprint: RunFingerprint,
    /// The policy the run expects the service to run.
    policy: String,
    /// How long a whole answer may take, from the request sent to its last byte.
    deadline: Duration,
}

/// How long the service may take for a whole answer (a decision, an acknowledgement), from the
/// request sent to the answer's last byte, before the client counts the connection as lost and
/// the embedded orchestrator decides: a service that answers a byte at a time cannot hold the
/// run without decisions.
pub const ANSWER_DEADLINE: Duration = Duration::from_secs(30);

impl Endpoint {
    /// Connects and says hello; then hands over `state` if given. Returns the connection and
    /// the session's sealing of every later frame.
    fn open(&self, state: Option<&OrchestratorState>) -> Result<(TcpStream, SessionMac), ServiceError> {
        let addr = self.addr;
        let mut stream =
            TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|source| ServiceError::Connect { addr, source })?;
        stream.set_nodelay(true)?;
        // The handshake: the service must prove it knows the token before this side proves it
        // does; the token itself never crosses the wire.
        let client_nonce = nonce();
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            run: self.run.clone(),
            fingerprint: self.fingerprint.clone(),
            nonce: client_nonce.clone(),
        };
        let service_nonce = match exchange(&mut stream, &hello, self.deadline)? {
            Response::Challenge { nonce, proof }
                if proof_matches(&service_proof(&self.token, &client_nonce, &nonce, &self.fingerprint), &proof) =>
            {
                nonce
            }
            Response::Challenge { .. } => {
                return Err(ServiceError::Refused {
                    addr,
                    reason: "could not prove it knows the shared token: a different COPUS_ORCHESTRATOR_TOKEN there or here, or not the orchestrator service; nothing was sent to it".into(),
                });
            }
            Response::Error(e) => return Err(ServiceError::Refused { addr, reason: format!("refused the session: {e}") }),
            other => return Err(ServiceError::Refused { addr, reason: format!("gave an unexpected answer {other:?}") }),
        };
        let prove = Request::Prove { proof: client_proof(&self.token, &client_nonce, &service_nonce, &self.fingerprint) };
        let mut mac = SessionMac::new(&self.token, &client_nonce, &service_nonce, &self.fingerprint, Side::Client);
        // The welcome is the first sealed frame; a refusal comes unsealed (the service has no
        // session with a client that did not prove the token).
        send_frame(&mut stream, &encode(&prove)?, self.deadline)?;
        let body = read_body(&mut stream, self.deadline)?;
        let answer = mac.open::<Response>(&body).or_else(|sealed| match decode::<Response>(&body) {
            Ok(Response::Error(e)) => Ok(Response::Error(e)),
            _ => Err(sealed),
        })?;
        match answer {
            Response::Welcome { policy } if policy != self.policy => {
                return Err(ServiceError::Refused {
                    addr,
                    reason: format!("runs policy `{policy}`, this run's is `{}`; start the service with that policy", self.policy),
                });
            }
            Response::Welcome { .. } => {}
            Response::Error(e) => return Err(ServiceError::Refused { addr, reason: format!("refused the session: {e}") }),
            other => return Err(ServiceError::Refused { addr, reason: format!("gave an unexpected answer {other:?}") }),
        }
        if let Some(state) = state {
            match exchange_sealed(&mut stream, &mut mac, &Request::Resume(Box::new(state.clone())), self.deadline)? {
                Response::Ack => {}
                Response::Error(e) => return Err(ServiceError::Refused { addr, reason: format!("refused the handover: {e}") }),
                other => return Err(ServiceError::Refused { addr, reason: format!("gave an unexpected answer {other:?}") }),
            }
        }
        Ok((stream, mac))
    }
}

/// The first and the longest pause between reconnection attempts.
pub const BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(30));

/// The training side of the service: never blocks the training loop.
pub struct Client {
    outgoing: Sender<Outgoing>,
    decisions: Receiver<(u64, Decision)>,
    status: Receiver<Status>,
    connected: bool,
    unavailable: Option<String>,
    /// How long the service may take for a whole answer.
    deadline: Duration,
    /// The newest step handed over, and since when a step has been waiting for its decision.
    observed: u64,
    waiting_since: Option<Instant>,
}

impl Client {
    /// Connects, authenticates and starts the background thread. A refused hello (wrong token,
    /// protocol version or run), or a service running another policy than `policy`, is an
    /// error here.
    pub fn connect(addr: SocketAddr, token: &str, run: &str, fingerprint: RunFingerprint, policy: &str) -> Result<Self, ServiceError> {
        Self::connect_with_deadline(addr, token, run, fingerprint, policy, ANSWER_DEADLINE)
    }

    /// [`Client::connect`] with another deadline for a whole answer than [`ANSWER_DEADLINE`].
    pub fn connect_with_deadline(
        addr: SocketAddr,
        token: &str,
        run: &str,
        fingerprint: RunFingerprint,
        policy: &str,
        deadline: Duration,
    ) -> Result<Self, ServiceError> {
        let endpoint = Endpoint { addr, token: token.into(), run: run.into(), fingerprint, policy: policy.into(), deadline };
        let stream = endpoint.open(None)?;
        let (outgoing, rx) = channel::<Outgoing>();
        let (dtx, decisions) = channel();
        let (stx, status) = channel();
        std::thread::Builder::new()
            .name("copus-orchestrator-client".into())
            .spawn(move || client_thread(endpoint, stream, rx, dtx, stx))?;
        Ok(Self { outgoing, decisions, status, connected: true, unavailable: None, deadline, observed: 0, waiting_since: None })
    }

    /// Hands an observation, the step's measured samples/s and the embedded orchestrator's
    /// state before the step to the background thread (never waits).
    pub fn observe(&mut self, obs: StepObservation, samples_per_sec: f64, before: Arc<OrchestratorState>) {
        if self.outgoing.send(Outgoing::Step(obs, samples_per_sec, before)).is_err() {
            self.mark_lost("the client thread ended".into());
            return;
        }
        self.observed = obs.step;
        self.waiting_since.get_or_insert_with(Instant::now);
    }

    /// Reports a carried-out reconfiguration.
    pub fn reconfigured(&mut self, seconds: f64, layout_changed: bool) {
        let _ = self.outgoing.send(Outgoing::Reconfigured(seconds, layout_changed));
    }

    /// Hands the service `state` (a resumed run's orchestrator state).
    pub fn hand_over(&mut self, state: Arc<OrchestratorState>) {
        let _ = self.outgoing.send(Outgoing::State(state));
    }

    /// Whether the service is reachable, as far as the client knows now.
    pub fn connected(&mut self) -> bool {
        self.read_status();
        self.connected
    }

    /// The newest decision that has arrived, if any (older ones are superseded).
    pub fn poll(&mut self) -> Option<(u64, Decision)> {
        self.read_status();
        let mut last = None;
        loop {
            match self.decisions.try_recv() {
                Ok(d) => {
                    // The clock of the next unanswered step starts when this one is answered.
                    self.waiting_since = (d.0 < self.observed).then(Instant::now);
                    last = Some(d);
                }
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return last,
            }
        }
    }

    /// Whether a step has waited longer than the deadline for its decision (a service that
    /// accepts steps but answers too slowly, or a byte at a time); says so in
    /// [`Client::unavailable`].
    pub fn overdue(&mut self) -> bool {
        let late = self.waiting_since.is_some_and(|t| t.elapsed() > self.deadline);
        if late {
            self.unavailable = Some(format!("no decision within {:?} of its step", self.deadline));
        }
        late
    }

    /// Waits up to `timeout` for the decision about `step`; `None` as soon as the client thread
    /// reports that this step will get none (the service is away or was lost).
    pub fn wait_for(&mut self, step: u64, timeout: Duration) -> Option<Decision> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            match self.decisions.recv_timeout(Duration::from_millis(2)) {
                Ok((s, d)) if s == step => return Some(d),
                Ok(_) => {}
                Err(_) => {
                    if self.read_status() == Some(step) {
                        return None;
                    }
                }
            }
        }
        // Late, not lost: this step falls back; the connection stays.
        self.unavailable = Some(format!("no decision for step {step} within {:.1} s", timeout.as_secs_f64()));
        None
    }

    /// Why the service was last unavailable, if it ever was.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    /// Takes in the thread's reports; returns the step the last of them said gets no decision.
    fn read_status(&mut self) -> Option<u64> {
        let mut none_for = None;
        while let Ok(s) = self.status.try_recv() {
            match s {
                Status::Lost(step, why) => {
                    self.waiting_since = None;
                    self.mark_lost(why);
                    none_for = step.or(none_for);
                }
                Status::Away(step) => {
                    self.connected = false;
                    none_for = Some(step);
                }
                Status::Back => {
                    // Decisions of the old session are stale: the run has moved on since.
                    while self.decisions.try_recv().is_ok() {}
                    self.connected = true;
                }
            }
        }
        none_for
    }

    fn mark_lost(&mut self, why: String) {
        self.connected = false;
        self.unavailable = Some(why);
    }
}

/// The client's background thread: sends each message while connected; while not, drops
/// messages (the embedded orchestrator decides) and reconnects with exponential backoff,
/// handing over the embedded orchestrator's state.
fn client_thread(
    endpoint: Endpoint,
    stream: (TcpStream, SessionMac),
    rx: Receiver<Outgoing>,
    dtx: Sender<(u64, Decision)>,
    stx: Sender<Status>,
) {
    let mut stream = Some(stream);
    let mut backoff = BACKOFF.0;
    let mut next_attempt = Instant::now();
    for msg in rx {
        let step = match &msg {
            Outgoing::Step(o, _, _) => Some(o.step),
            _ => None,
        };
        let (req, state) = match msg {
            Outgoing::Step(observation, samples_per_sec, before) => (Request::Step { observation, samples_per_sec }, Some(before)),
            Outgoing::Reconfigured(seconds, layout_changed) => (Request::Reconfigured { seconds, layout_changed }, None),
            Outgoing::State(s) => (Request::Resume(Box::new((*s).clone())), Some(s)),
        };
        if stream.is_none() {
            // Only a message that carries the whole state can reconnect: a reconfiguration
            // while away is part of the state the next step carries.
            let Some(state) = state else { continue };
            if Instant::now() < next_attempt {
                if let Some(step) = step {
                    let _ = stx.send(Status::Away(step));
                }
                continue;
            }
            match endpoint.open(Some(&state)) {
                Ok(s) => {
                    stream = Some(s);
                    backoff = BACKOFF.0;
                    let _ = stx.send(Status::Back);
                }
                Err(e) => {
                    tracing::debug!("reconnecting to the orchestrator: {e}");
                    next_attempt = Instant::now() + backoff;
                    backoff = (backoff * 2).min(BACKOFF.1);
                    let _ = stx.send(Status::Lost(step, format!("{e:#}")));
                    continue;
                }
            }
        }
        let Some((s, mac)) = stream.as_mut() else { continue };
        match exchange_sealed(s, mac, &req, endpoint.deadline) {
            Ok(Response::Decision { step, decision }) => {
                let _ = dtx.send((step, decision));
            }
            Ok(Response::Ack) | Ok(Response::Welcome { .. }) => {}
            Ok(Response::Challenge { .. }) => {
                stream = None;
                next_attempt = Instant::now() + backoff;
                let _ = stx.send(Status::Lost(step, "the orchestrator answered a step with a handshake challenge".into()));
            }
            Ok(Response::Error(e)) => {
                stream = None;
                next_attempt = Instant::now() + backoff;
                let _ = stx.send(Status::Lost(step, format!("the orchestrator refused a message: {e}")));
            }
            Err(e) => {
                // A lost connection, or a message that could not be encoded: either way the
                // service's view may now lag the run's, so reconnect (handing over the state) at
                // the next step.
                stream = None;
                next_attempt = Instant::now();
                let _ = stx.send(Status::Lost(step, e.to_string()));
            }
        }
    }
    if let Some((s, mac)) = stream.as_mut() {
        let _ = exchange_sealed(s, mac, &Request::Bye, endpoint.deadline);
    }
}

/// Sends `req` unsealed (the handshake) and reads the whole unsealed answer within `deadline`
/// of sending it.
pub(crate) fn exchange(stream: &mut TcpStream, req: &Request, deadline: Duration) -> Result<Response, ServiceError> {
    send_frame(stream, &encode(req)?, deadline)?;
    Ok(decode::<Response>(&read_body(stream, deadline)?)?)
}

/// Sends `req` sealed and reads the sealed answer within `deadline`; an answer whose seal fails
/// is an error (the caller drops the connection).
pub(crate) fn exchange_sealed(
    stream: &mut TcpStream,
    mac: &mut SessionMac,
    req: &Request,
    deadline: Duration,
) -> Result<Response, ServiceError> {
    send_frame(stream, &mac.seal(req)?, deadline)?;
    Ok(mac.open::<Response>(&read_body(stream, deadline)?)?)
}

fn send_frame(stream: &mut TcpStream, frame: &[u8], deadline: Duration) -> Result<(), ServiceError> {
    stream.set_write_timeout(Some(deadline))?;
    stream.write_all(frame).map_err(ServiceError::Lost)
}

/// The body of the next frame, whole within `deadline`.
pub(crate) fn read_body(stream: &mut TcpStream, deadline: Duration) -> Result<Vec<u8>, ServiceError> {
    let until = Instant::now() + deadline;
    let mut header = [0u8; 4];
    read_by(stream, &mut header, until, deadline)?;
    let n = frame_len_within(header, MAX_FRAME)?;
    let mut body = vec![0u8; n];
    read_by(stream, &mut body, until, deadline)?;
    Ok(body)
}

/// Fills `buf` from `stream` by `until`, however the bytes trickle in.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], until: Instant, deadline: Duration) -> Result<(), ServiceError> {
    let mut got = 0;
    while got < buf.len() {
        let left = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()).ok_or_else(|| {
            ServiceError::Lost(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("no whole answer within {deadline:?}")))
        })?;
        stream.set_read_timeout(Some(left))?;
        match stream.read(&mut buf[got..]) {
            Ok(0) => return Err(ServiceError::Lost(std::io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(ServiceError::Lost(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no whole answer within {deadline:?}"),
                )));
            }
            Err(e) => return Err(ServiceError::Lost(e)),
        }
    }
    Ok(())
}
