//! The orchestrator as a separate service (`recipes orchestrator`), and the client the training
//! loop uses to reach it.
//!
//! The service listens on TCP (127.0.0.1 by default), one session per connection, at most
//! [`ServiceConfig::max_connections`] at once (more are closed on arrival). A session's first
//! frame must be `Hello` with the protocol version, the shared token and the fingerprint of the
//! run's candidate space, within [`ServiceConfig::handshake_timeout`] and in at most
//! [`MAX_HELLO`] bytes; only then may frames grow to [`MAX_FRAME`]. An authenticated session
//! that stays silent for [`ServiceConfig::idle_timeout`], or sends half a frame and stalls for
//! [`ServiceConfig::frame_timeout`], is closed. Each session gets its own policy, built from the
//! service's candidate space and throughput profile; the decision logic is copus-core's
//! `Orchestrator`, the same as embedded, so decisions outside the feasible candidates are never
//! passed on. A failing `accept` (out of file descriptors, say) is logged and survived.
//!
//! The client runs on a background thread: the training loop hands it observations without
//! waiting and picks up decisions when they have arrived, applying each at the next
//! optimizer-step boundary. The training side keeps an embedded orchestrator that sees every
//! observation too. When the service goes away, the embedded one decides (and the log says
//! so) while the client reconnects with exponential backoff; on reconnecting it hands the
//! service the embedded orchestrator's state, so the service continues exactly where the run
//! is.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use copus_core::orchestrator::{
    MAX_FRAME, MAX_HELLO, Orchestrator, OrchestratorState, PROTOCOL_VERSION, ProtocolError, Request, Response, RunFingerprint,
    authenticate, check_token, decode, encode, frame_len_within,
};
use copus_core::policy::{Copus, Decision, DpOnlyGoodput, MerrillWarmup, Policy, Scorer, Static, StepObservation, SwitchRule};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Builds a named policy over a scorer: `copus`, `dp-only`, `merrill` or `static`.
pub fn policy_by_name(name: PolicyName, scorer: &Scorer, rule: SwitchRule) -> anyhow::Result<Box<dyn Policy>> {
    Ok(match name {
        PolicyName::Copus => Box::new(Copus::new(scorer.clone(), rule)?),
        PolicyName::DpOnly => Box::new(DpOnlyGoodput::new(scorer.clone(), rule)?),
        PolicyName::Merrill => Box::new(MerrillWarmup::new(scorer.clone())),
        PolicyName::Static => Box::new(Static),
    })
}

/// The policies the service can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyName {
    /// Goodput over B_g, B_m and the 3D layout.
    Copus,
    /// Goodput over B_g on data-parallel layouts only (AdaptDL/Pollux).
    DpOnly,
    /// Batch warm-up in the style of Merrill et al.
    Merrill,
    /// The initial configuration, never changed.
    Static,
}

/// Builds each session's orchestrator.
pub type MakeOrchestrator = Arc<dyn Fn() -> Orchestrator + Send + Sync>;

/// How the service runs.
#[derive(Clone)]
pub struct ServiceConfig {
    /// The shared token (at least [`copus_core::orchestrator::MIN_TOKEN_LEN`] characters).
    pub token: String,
    /// The run the service decides for.
    pub fingerprint: RunFingerprint,
    /// Open connections at most; more are closed on arrival.
    pub max_connections: usize,
    /// Connections that have not said hello yet, at most; a new one closes the oldest.
    pub max_unauthenticated: usize,
    /// Time for a new connection to complete its `Hello`.
    pub handshake_timeout: Duration,
    /// Silence after which an authenticated session is closed.
    pub idle_timeout: Duration,
    /// Time for the rest of a frame once its header has arrived.
    pub frame_timeout: Duration,
}

impl ServiceConfig {
    /// The defaults: 256 connections, 64 of them before their hello, 5 s to say hello, 1 h of
    /// silence, 10 s per frame.
    pub fn new(token: String, fingerprint: RunFingerprint) -> Self {
        Self {
            token,
            fingerprint,
            max_connections: 256,
            max_unauthenticated: 64,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(3600),
            frame_timeout: Duration::from_secs(10),
        }
    }
}

/// Why reading a frame stopped.
enum ReadEnd {
    /// The peer closed the connection between frames.
    Closed,
    /// No (complete) frame in time.
    Timeout,
    /// A bad frame: answered with an error, then the session ends.
    Bad(ProtocolError),
}

/// Reads one frame of at most `limit` bytes: its first byte within `wait`, then the whole frame
/// within `frame_timeout`. The body buffer is sized by the checked header only.
async fn read_frame(stream: &mut tokio::net::TcpStream, limit: usize, wait: Duration, frame_timeout: Duration) -> Result<Vec<u8>, ReadEnd> {
    let mut header = [0u8; 4];
    match tokio::time::timeout(wait, stream.read_exact(&mut header[..1])).await {
        Err(_) => return Err(ReadEnd::Timeout),
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(ReadEnd::Closed),
        Ok(Err(e)) => return Err(ReadEnd::Bad(ProtocolError::Malformed(e.to_string()))),
        Ok(Ok(_)) => {}
    }
    let rest = async {
        stream.read_exact(&mut header[1..]).await.map_err(|e| ReadEnd::Bad(ProtocolError::Malformed(e.to_string())))?;
        let n = frame_len_within(header, limit).map_err(ReadEnd::Bad)?;
        let mut body = vec![0u8; n];
        stream.read_exact(&mut body).await.map_err(|e| ReadEnd::Bad(ProtocolError::Malformed(e.to_string())))?;
        Ok(body)
    };
    tokio::time::timeout(frame_timeout, rest).await.unwrap_or(Err(ReadEnd::Timeout))
}

/// The connections that have not said hello yet, oldest first: when there are
/// [`ServiceConfig::max_unauthenticated`] of them, a new one closes the oldest, so silent
/// connections can never keep a real client out.
#[derive(Default)]
struct Waiting {
    next: u64,
    queue: std::collections::VecDeque<(u64, Arc<tokio::sync::Notify>)>,
}

/// A connection's place among the [`Waiting`]; it leaves on hello or when the session ends.
struct Unauthenticated {
    id: u64,
    evicted: Arc<tokio::sync::Notify>,
    waiting: Arc<std::sync::Mutex<Waiting>>,
}

impl Unauthenticated {
    fn join(waiting: &Arc<std::sync::Mutex<Waiting>>, cap: usize) -> Self {
        let mut w = waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while w.queue.len() >= cap.max(1) {
            if let Some((_, oldest)) = w.queue.pop_front() {
                oldest.notify_one();
            }
        }
        let (id, evicted) = (w.next, Arc::new(tokio::sync::Notify::new()));
        w.next += 1;
        w.queue.push_back((id, evicted.clone()));
        Self { id, evicted, waiting: waiting.clone() }
    }
}

impl Drop for Unauthenticated {
    fn drop(&mut self) {
        let mut w = self.waiting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        w.queue.retain(|(id, _)| *id != self.id);
    }
}

async fn session(mut stream: tokio::net::TcpStream, cfg: Arc<ServiceConfig>, make: MakeOrchestrator, pending: Unauthenticated) {
    let mut orch: Option<Orchestrator> = None;
    let mut pending = Some(pending);
    loop {
        // Before the hello: one small frame, whole within the handshake timeout (and before a
        // newer connection evicts this one). After it: full frames, each whole within the frame
        // timeout once it has started.
        let read = match (&orch, &pending) {
            (None, Some(p)) => {
                let hello = read_frame(&mut stream, MAX_HELLO, cfg.handshake_timeout, cfg.handshake_timeout);
                tokio::select! {
                    _ = p.evicted.notified() => return,
                    r = tokio::time::timeout(cfg.handshake_timeout, hello) => r.unwrap_or(Err(ReadEnd::Timeout)),
                }
            }
            (None, None) => return,
            (Some(_), _) => read_frame(&mut stream, MAX_FRAME, cfg.idle_timeout, cfg.frame_timeout).await,
        };
        let reply = match read {
            Err(ReadEnd::Closed) | Err(ReadEnd::Timeout) => return,
            Err(ReadEnd::Bad(e)) => Err(e.to_string()),
            Ok(body) => match decode::<Request>(&body) {
                Ok(req) => match orch.as_mut() {
                    None => match authenticate(&req, &cfg.token, &cfg.fingerprint) {
                        Ok(()) => {
                            let o = make();
                            let welcome = Response::Welcome { policy: o.policy_name() };
                            orch = Some(o);
                            pending = None;
                            Ok(welcome)
                        }
                        Err(e) => Err(e.to_string()),
                    },
                    Some(o) => match o.handle(req) {
                        Response::Error(e) => Err(e),
                        r => Ok(r),
                    },
                },
                Err(e) => Err(e.to_string()),
            },
        };
        let (frame, last) = match reply {
            Ok(r) => (encode(&r), false),
            Err(e) => (encode(&Response::Error(e)), true),
        };
        let Ok(frame) = frame else { return };
        if stream.write_all(&frame).await.is_err() || last {
            return;
        }
    }
}

/// Serves sessions on `listener` until `stop` fires. Connections beyond the cap are closed on
/// arrival; a failing `accept` is logged and retried after a pause.
pub async fn serve(
    listener: TcpListener,
    cfg: ServiceConfig,
    make: MakeOrchestrator,
    stop: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    check_token(&cfg.token).map_err(std::io::Error::other)?;
    let slots = Arc::new(tokio::sync::Semaphore::new(cfg.max_connections.max(1)));
    let waiting = Arc::new(std::sync::Mutex::new(Waiting::default()));
    let cfg = Arc::new(cfg);
    let mut stop = stop;
    let mut refused = 0u64;
    loop {
        let accepted = tokio::select! {
            _ = &mut stop => return Ok(()),
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => match slots.clone().try_acquire_owned() {
                Ok(slot) => {
                    let pending = Unauthenticated::join(&waiting, cfg.max_unauthenticated);
                    let (cfg, make) = (cfg.clone(), make.clone());
                    tokio::spawn(async move {
                        session(stream, cfg, make, pending).await;
                        drop(slot);
                    });
                }
                Err(_) => {
                    refused += 1;
                    if refused.is_power_of_two() {
                        tracing::warn!(
                            "{refused} connection(s) refused so far (at the cap of {}; latest from {peer})",
                            cfg.max_connections
                        );
                    }
                    drop(stream);
                }
            },
            Err(e) => {
                tracing::warn!("accepting a connection failed ({e}); the service goes on");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A running service: its address, and the means to stop it or wait for it.
pub struct ServiceHandle {
    /// The bound address.
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl ServiceHandle {
    /// Waits until the service ends; an error if it failed. (Dropping the handle stops it.)
    pub fn join(mut self) -> anyhow::Result<()> {
        let t = self.thread.take().expect("joined once");
        t.join().map_err(|_| anyhow!("the service thread panicked"))?.map_err(|e| anyhow!("the service failed: {e}"))
    }
}

impl Drop for ServiceHandle {
    /// Stops the service at once: the listener closes and every session is dropped, as if the
    /// process had died.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts the service on a background runtime; returns its handle (port 0 picks a port).
pub fn spawn(addr: SocketAddr, cfg: ServiceConfig, make: MakeOrchestrator) -> anyhow::Result<ServiceHandle> {
    check_token(&cfg.token).map_err(|e| anyhow!("COPUS_ORCHESTRATOR_TOKEN: {e}"))?;
    let (tx, rx) = channel();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
    let thread = std::thread::spawn(move || -> Result<(), String> {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                return Err(e.to_string());
            }
        };
        rt.block_on(async move {
            match TcpListener::bind(addr).await {
                Ok(l) => {
                    let _ = tx.send(l.local_addr().map_err(|e| e.to_string()));
                    serve(l, cfg, make, stop_rx).await.map_err(|e| e.to_string())
                }
                Err(e) => {
                    let m = format!("cannot listen on {addr}: {e}");
                    let _ = tx.send(Err(m.clone()));
                    Err(m)
                }
            }
        })
    });
    let bound = rx.recv().map_err(|_| anyhow!("the service thread ended"))?.map_err(anyhow::Error::msg)?;
    Ok(ServiceHandle { addr: bound, stop: Some(stop_tx), thread: Some(thread) })
}

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

impl copus_burn::DecisionSource for RemoteSource {
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
        self.back();
        match self.client.poll() {
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
    fn restore_state(&mut self, state: &str) -> Result<(), String> {
        let state: OrchestratorState =
            serde_json::from_str(state).map_err(|e| format!("the saved orchestrator state does not parse: {e}"))?;
        self.embedded.restore(&state)?;
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
}

impl Endpoint {
    /// Connects and says hello; then hands over `state` if given.
    fn open(&self, state: Option<&OrchestratorState>) -> anyhow::Result<TcpStream> {
        let addr = self.addr;
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| anyhow!("orchestrator at {addr}: {e}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        stream.set_nodelay(true)?;
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            token: self.token.clone(),
            run: self.run.clone(),
            fingerprint: self.fingerprint.clone(),
        };
        match exchange(&mut stream, &hello)? {
            Response::Welcome { policy } if policy != self.policy => {
                return Err(anyhow!(
                    "orchestrator at {addr} runs policy `{policy}`, this run's is `{}`; start the service with that policy",
                    self.policy
                ));
            }
            Response::Welcome { .. } => {}
            Response::Error(e) => return Err(anyhow!("orchestrator at {addr} refused the session: {e}")),
            other => return Err(anyhow!("orchestrator at {addr}: unexpected answer {other:?}")),
        }
        if let Some(state) = state {
            match exchange(&mut stream, &Request::Resume(state.clone()))? {
                Response::Ack => {}
                Response::Error(e) => return Err(anyhow!("orchestrator at {addr} refused the handover: {e}")),
                other => return Err(anyhow!("orchestrator at {addr}: unexpected answer {other:?}")),
            }
        }
        Ok(stream)
    }
}

/// The first and the longest pause between reconnection attempts.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(30));

/// The training side of the service: never blocks the training loop.
pub struct Client {
    outgoing: Sender<Outgoing>,
    decisions: Receiver<(u64, Decision)>,
    status: Receiver<Status>,
    connected: bool,
    unavailable: Option<String>,
}

impl Client {
    /// Connects, authenticates and starts the background thread. A refused hello (wrong token,
    /// protocol version or run), or a service running another policy than `policy`, is an
    /// error here.
    pub fn connect(addr: SocketAddr, token: &str, run: &str, fingerprint: RunFingerprint, policy: &str) -> anyhow::Result<Self> {
        let endpoint = Endpoint { addr, token: token.into(), run: run.into(), fingerprint, policy: policy.into() };
        let stream = endpoint.open(None)?;
        let (outgoing, rx) = channel::<Outgoing>();
        let (dtx, decisions) = channel();
        let (stx, status) = channel();
        std::thread::Builder::new()
            .name("copus-orchestrator-client".into())
            .spawn(move || client_thread(endpoint, stream, rx, dtx, stx))?;
        Ok(Self { outgoing, decisions, status, connected: true, unavailable: None })
    }

    /// Hands an observation, the step's measured samples/s and the embedded orchestrator's
    /// state before the step to the background thread (never waits).
    pub fn observe(&mut self, obs: StepObservation, samples_per_sec: f64, before: Arc<OrchestratorState>) {
        if self.outgoing.send(Outgoing::Step(obs, samples_per_sec, before)).is_err() {
            self.mark_lost("the client thread ended".into());
        }
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
                Ok(d) => last = Some(d),
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return last,
            }
        }
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
fn client_thread(endpoint: Endpoint, stream: TcpStream, rx: Receiver<Outgoing>, dtx: Sender<(u64, Decision)>, stx: Sender<Status>) {
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
            Outgoing::State(s) => (Request::Resume((*s).clone()), Some(s)),
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
        let Some(s) = stream.as_mut() else { continue };
        match exchange(s, &req) {
            Ok(Response::Decision { step, decision }) => {
                let _ = dtx.send((step, decision));
            }
            Ok(Response::Ack) | Ok(Response::Welcome { .. }) => {}
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
    if let Some(s) = stream.as_mut() {
        let _ = exchange(s, &Request::Bye);
    }
}

fn exchange(stream: &mut TcpStream, req: &Request) -> anyhow::Result<Response> {
    let frame = encode(req).map_err(|e| anyhow!("not sent: {e}"))?;
    stream.write_all(&frame).map_err(|e| anyhow!("orchestrator connection lost: {e}"))?;
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).map_err(|e| anyhow!("orchestrator connection lost: {e}"))?;
    let n = frame_len_within(header, MAX_FRAME)?;
    let mut body = vec![0u8; n];
    stream.read_exact(&mut body).map_err(|e| anyhow!("orchestrator connection lost: {e}"))?;
    Ok(decode::<Response>(&body)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use copus_core::candidates::{Candidate, CandidateSpace};
    use copus_core::gns::NoiseEstimate;
    use copus_core::layout::ParallelDims;
    use copus_core::memory::{GIB, MemoryModel};
    use copus_core::model::ModelSpec;
    use copus_core::schedule::ScheduleKind;
    use copus_core::throughput::{ProfileEntry, ThroughputProfile};

    const TOKEN: &str = "0123456789abcdef-test";

    fn scorer() -> Scorer {
        let e = |dp, tp, b, m, s| ProfileEntry { dp, tp, pp: 1, global_batch: b, micro_batch: m, samples_per_sec: s };
        let p = ThroughputProfile::new(
            "t".into(),
            "m".into(),
            vec![e(1, 2, 2, 1, 10.0), e(1, 2, 4, 2, 14.0), e(2, 1, 2, 1, 9.0), e(2, 1, 4, 1, 16.0), e(2, 1, 8, 1, 30.0)],
        )
        .unwrap();
        let cands: Vec<Candidate> = p
            .entries()
            .iter()
            .map(|x| Candidate::new(ParallelDims { dp: x.dp, tp: x.tp, pp: x.pp }, x.global_batch, x.micro_batch).unwrap())
            .collect();
        Scorer::plain(&cands, &p, 2.0).unwrap()
    }

    fn fingerprint() -> RunFingerprint {
        let space = CandidateSpace::new(2, vec![2, 4, 8], vec![1, 2], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB).unwrap();
        RunFingerprint::new(&ModelSpec::tiny_1m(), &space)
    }

    fn config() -> ServiceConfig {
        ServiceConfig::new(TOKEN.into(), fingerprint())
    }

    fn make() -> MakeOrchestrator {
        Arc::new(|| {
            let s = scorer();
            let rule = SwitchRule { layout_cost: 0.0, min_dwell_steps: 1, confirm_steps: 1, ..SwitchRule::default() };
            Orchestrator::new(policy_by_name(PolicyName::Copus, &s, rule).unwrap(), s)
        })
    }

    fn connect(addr: SocketAddr) -> anyhow::Result<Client> {
        Client::connect(addr, TOKEN, "test", fingerprint(), "copus")
    }

    fn obs(step: u64, phi: f64) -> StepObservation {
        let cur = Candidate::new(ParallelDims { dp: 1, tp: 2, pp: 1 }, 2, 1).unwrap();
        StepObservation {
            step,
            current: cur,
            noise: Some(NoiseEstimate { grad_sq: 1.0, trace: phi, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }),
        }
    }

    fn no_state() -> Arc<OrchestratorState> {
        Arc::new(OrchestratorState::default())
    }

    /// Sends raw bytes and reads the answer frame, if one comes.
    fn raw_answer(addr: SocketAddr, bytes: &[u8]) -> Option<Response> {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(bytes).unwrap();
        let mut header = [0u8; 4];
        s.read_exact(&mut header).ok()?;
        let mut body = vec![0u8; frame_len_within(header, MAX_FRAME).unwrap()];
        s.read_exact(&mut body).unwrap();
        Some(decode::<Response>(&body).unwrap())
    }

    #[test]
    fn the_service_decides_like_the_embedded_orchestrator() {
        let service = spawn("127.0.0.1:0".parse().unwrap(), config(), make()).unwrap();
        let mut client = connect(service.addr).unwrap();
        let mut embedded = make()();
        for (step, phi) in [(1, 0.5), (2, 4.0), (3, 64.0)] {
            client.observe(obs(step, phi), 10.0, no_state());
            let remote = client.wait_for(step, Duration::from_secs(10)).expect("a decision");
            assert_eq!(remote, embedded.on_step_measured(&obs(step, phi), 10.0), "step {step}");
        }
        // With a large noise scale Copus moves to the big batch on the other layout.
        assert!(matches!(embedded.on_step(&obs(4, 64.0)), Decision::ChangeLayout(c) if c.global_batch == 8));
        drop(service);
    }

    /// Short real runs through the driver on a modelled clock: decided by the service on
    /// 127.0.0.1, by the service killed after step 3 and started again after step 5 (the
    /// embedded orchestrator decides meanwhile and hands its state over on reconnecting), and
    /// in process. All give the same decisions at the same steps and the same losses.
    #[test]
    fn a_run_decided_by_the_service_equals_one_decided_in_process_also_across_a_killed_service() {
        use copus_burn::{Clock, DataSource, Driver, Engine, EngineConfig, OptimConfig};
        use copus_models::{LlamaConfig, full_params};

        struct Tokens(usize);
        impl DataSource for Tokens {
            fn sequences(&self, first: u64, count: usize) -> Vec<i64> {
                // Every sequence counts up by 3 from a start that varies: a shared, learnable rule.
                (first..first + count as u64).flat_map(|i| (0..33u64).map(move |j| ((i % 5 + 3 * j) % self.0 as u64) as i64)).collect()
            }
        }
        let mut spec = ModelSpec::tiny_1m();
        spec.seq_len = 32;
        let cfg = LlamaConfig::from_spec(&spec);
        let device = burn::tensor::Device::flex().autodiff();
        let full = crate::run::seeded(&device, 3, || full_params(&cfg.init(&device)));
        let space = CandidateSpace::new(2, vec![2, 4], vec![1, 2], ScheduleKind::OneFOneB, MemoryModel::fp32(), 64.0 * GIB).unwrap();
        let enumeration = space.enumerate(&spec);
        let fp = RunFingerprint::new(&spec, &space);
        // A made-up profile on a modelled clock, so decisions do not depend on this machine.
        let entries: Vec<ProfileEntry> = enumeration
            .feasible
            .iter()
            .map(|c| ProfileEntry {
                dp: c.dims.dp,
                tp: c.dims.tp,
                pp: c.dims.pp,
                global_batch: c.global_batch,
                micro_batch: c.micro_batch,
                samples_per_sec: if c.dims.tp == 2 { 40.0 } else { 10.0 } * c.global_batch as f64 / (1.0 + c.micro_batch as f64),
            })
            .collect();
        let profile = ThroughputProfile::new("t".into(), "tiny-1m".into(), entries).unwrap();
        let scorer = Scorer::plain(&enumeration.feasible, &profile, 2.0).unwrap();
        let rule = SwitchRule { layout_cost: 0.0, min_dwell_steps: 1, confirm_steps: 1, ..SwitchRule::default() };
        let orchestrator = {
            let s = scorer.clone();
            move || Orchestrator::new(policy_by_name(PolicyName::Copus, &s, rule).unwrap(), s.clone())
        };
        const STEPS: usize = 8;
        let run = |source: &mut dyn copus_burn::DecisionSource, between: &mut dyn FnMut(usize)| {
            let start = Candidate::new(ParallelDims { dp: 2, tp: 1, pp: 1 }, 2, 1).unwrap();
            let ec = EngineConfig::new(start.dims, 2, 1, 32, OptimConfig::new().with_b0(2).with_warmup_steps(1));
            let engine = Engine::new(Arc::new(cfg.clone()), &full, ec).unwrap();
            let p = profile.clone();
            let clock = Clock::Modelled {
                step_secs: Box::new(move |c: &Candidate| {
                    c.global_batch as f64 / copus_core::throughput::ThroughputModel::samples_per_sec(&p, c).unwrap_or(1.0)
                }),
                batch_switch_secs: 0.1,
                layout_switch_secs: 1.0,
            };
            let mut driver = Driver::new(engine, enumeration.clone(), clock).unwrap();
            let mut out = Vec::new();
            for i in 0..STEPS {
                let s = driver.step(&Tokens(spec.vocab_size), source).unwrap();
                out.push((s.step.metrics.loss, s.step.metrics.b_simple, s.decision));
                between(i + 1);
            }
            out
        };
        let make: MakeOrchestrator = Arc::new(orchestrator.clone());
        let cfg_of = || ServiceConfig::new(TOKEN.into(), fp.clone());
        let in_process = run(&mut orchestrator(), &mut |_| {});
        assert!(
            in_process.iter().any(|(_, _, d)| d.as_ref().is_some_and(|d| d.applied)),
            "the policy switched at least once: {in_process:?}"
        );

        let service = spawn("127.0.0.1:0".parse().unwrap(), cfg_of(), make.clone()).unwrap();
        let addr = service.addr;
        let client = Client::connect(addr, TOKEN, "test", fp.clone(), "copus").unwrap();
        let mut remote = RemoteSource::synchronous(client, orchestrator(), Duration::from_secs(10));
        let by_service = run(&mut remote, &mut |_| {});
        assert_eq!(by_service, in_process);
        assert!(remote.unavailable().is_none());
        assert_eq!(remote.fallback_steps(), 0);

        let client = Client::connect(addr, TOKEN, "test", fp.clone(), "copus").unwrap();
        let mut remote = RemoteSource::synchronous(client, orchestrator(), Duration::from_secs(10));
        let mut service = Some(service);
        let mut restarted = None;
        let across = run(&mut remote, &mut |done| {
            if done == 3 {
                drop(service.take().expect("running"));
            }
            if done == 5 {
                restarted = Some(spawn(addr, cfg_of(), make.clone()).expect("the port is free again"));
                // Past the first reconnection backoff, so step 6 reconnects.
                std::thread::sleep(BACKOFF.0 * 2);
            }
        });
        assert_eq!(across, in_process, "decisions across the outage");
        assert!(remote.unavailable().is_some());
        // Steps 4 (connection lost) and 5 (nobody listening) were decided in process; from step 6
        // on the restarted service, handed the run's state, decides.
        assert_eq!(remote.fallback_steps(), 2, "{:?}", remote.unavailable());
        drop(restarted.expect("restarted"));
    }

    #[test]
    fn wrong_tokens_versions_runs_and_bad_frames_are_refused() {
        let service = spawn("127.0.0.1:0".parse().unwrap(), config(), make()).unwrap();
        let addr = service.addr;
        let e = Client::connect(addr, "0123456789abcdef-guess", "test", fingerprint(), "copus").err().unwrap().to_string();
        assert!(e.contains("refused") && e.contains("wrong token"), "{e}");
        // Another run: another world size.
        let other = RunFingerprint { world_size: 8, ..fingerprint() };
        let e = Client::connect(addr, TOKEN, "test", other, "copus").err().unwrap().to_string();
        assert!(e.contains("refused") && e.contains("8 ranks") && e.contains("2 ranks"), "{e}");
        // Another policy.
        let e = Client::connect(addr, TOKEN, "test", fingerprint(), "dp-only").err().unwrap().to_string();
        assert!(e.contains("runs policy `copus`") && e.contains("`dp-only`"), "{e}");
        // Another protocol version.
        let old = Request::Hello { version: 1, token: TOKEN.into(), run: "r".into(), fingerprint: fingerprint() };
        let answer = raw_answer(addr, &encode(&old).unwrap());
        assert!(matches!(&answer, Some(Response::Error(e)) if e.contains("protocol version 1")), "{answer:?}");
        // Before the hello, a frame over MAX_HELLO is refused unread.
        let answer = raw_answer(addr, &((MAX_HELLO as u32) + 1).to_be_bytes());
        assert!(matches!(&answer, Some(Response::Error(e)) if e.contains("exceeds")), "{answer:?}");
        // Garbage after a valid hello.
        let mut s = TcpStream::connect(addr).unwrap();
        let hello = Request::Hello { version: PROTOCOL_VERSION, token: TOKEN.into(), run: "r".into(), fingerprint: fingerprint() };
        assert!(matches!(exchange(&mut s, &hello).unwrap(), Response::Welcome { .. }));
        let junk = b"{not json";
        s.write_all(&(junk.len() as u32).to_be_bytes()).unwrap();
        s.write_all(junk).unwrap();
        let mut header = [0u8; 4];
        s.read_exact(&mut header).unwrap();
        let mut body = vec![0u8; frame_len_within(header, MAX_FRAME).unwrap()];
        s.read_exact(&mut body).unwrap();
        assert!(matches!(decode::<Response>(&body).unwrap(), Response::Error(e) if e.contains("malformed")));
        // A short token is refused at start.
        let e = spawn("127.0.0.1:0".parse().unwrap(), ServiceConfig::new("short".into(), fingerprint()), make()).err().unwrap();
        assert!(e.to_string().contains("at least 16"), "{e}");
        drop(service);
    }

    /// An observation with an infinite samples/s is never sent: that step is decided in
    /// process, and the next one reconnects, handing the state over.
    #[test]
    fn a_non_finite_observation_is_not_sent_and_the_session_recovers() {
        let service = spawn("127.0.0.1:0".parse().unwrap(), config(), make()).unwrap();
        let mut remote = RemoteSource::synchronous(connect(service.addr).unwrap(), make()(), Duration::from_secs(10));
        let mut embedded = make()();
        use copus_burn::DecisionSource;
        for (step, sps) in [(1, 10.0), (2, f64::INFINITY), (3, 10.0), (4, 10.0)] {
            let d = remote.on_step(&obs(step, 8.0), sps);
            assert_eq!(d, embedded.on_step_measured(&obs(step, 8.0), sps), "step {step}");
        }
        let why = remote.unavailable().expect("the bad step fell back").to_string();
        assert!(why.contains("Step.samples_per_sec") && why.contains("not a finite number"), "{why}");
        assert_eq!(remote.fallback_steps(), 1, "step 2 (not sent); step 3 reconnects and is decided by the service");
        drop(service);
    }

    #[test]
    fn a_vanished_service_leaves_the_embedded_orchestrator_deciding() {
        // A listener that accepts the hello and then drops the connection.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut header = [0u8; 4];
            s.read_exact(&mut header).unwrap();
            let mut body = vec![0u8; frame_len_within(header, MAX_FRAME).unwrap()];
            s.read_exact(&mut body).unwrap();
            s.write_all(&encode(&Response::Welcome { policy: "copus".into() }).unwrap()).unwrap();
            drop(s);
            drop(listener);
        });
        let mut remote = RemoteSource::synchronous(connect(addr).unwrap(), make()(), Duration::from_secs(10));
        let mut embedded = make()();
        use copus_burn::DecisionSource;
        let started = Instant::now();
        for (step, phi) in [(1, 0.5), (2, 64.0), (3, 64.0)] {
            assert_eq!(remote.on_step(&obs(step, phi), 10.0), embedded.on_step_measured(&obs(step, phi), 10.0), "step {step}");
        }
        assert!(started.elapsed() < Duration::from_secs(5), "no step waited for the lost service");
        assert!(remote.unavailable().is_some());
        assert_eq!(remote.fallback_steps(), 3);
    }

    /// 200 idle, slow or junk-sending connections at once, while a real client gets every
    /// decision within 1 s; the test stops itself.
    #[test]
    fn hostile_connections_do_not_delay_a_real_client() {
        let service = spawn("127.0.0.1:0".parse().unwrap(), config(), make()).unwrap();
        let addr = service.addr;
        let mut hostile = Vec::new();
        for i in 0..200 {
            let mut s = TcpStream::connect(addr).unwrap();
            match i % 4 {
                // Idle: connects and says nothing.
                0 => {}
                // Slow: half a header, then nothing.
                1 => s.write_all(&[0, 0]).unwrap(),
                // Half a hello body, then nothing.
                2 => s.write_all(&[0, 0, 1, 0, b'{']).unwrap(),
                // Junk frames.
                _ => {
                    let _ = s.write_all(&[0, 0, 0, 5, 1, 2, 3, 4, 5, 0, 0, 0, 5, 9, 9, 9, 9, 9]);
                }
            }
            hostile.push(s);
        }
        let mut client = connect(addr).unwrap();
        let mut worst = Duration::ZERO;
        for step in 1..=20 {
            let t = Instant::now();
            client.observe(obs(step, 4.0), 10.0, no_state());
            client.wait_for(step, Duration::from_secs(5)).expect("a decision");
            worst = worst.max(t.elapsed());
        }
        assert!(worst < Duration::from_secs(1), "slowest decision took {worst:?}");
        drop(hostile);
        drop(service);
    }

    /// Silent connections cannot keep a real client out: beyond `max_unauthenticated` a new
    /// connection closes the oldest silent one, whatever the handshake timeout.
    #[test]
    fn silent_connections_make_room_for_new_ones() {
        let cfg = ServiceConfig { max_unauthenticated: 4, handshake_timeout: Duration::from_secs(60), ..config() };
        let service = spawn("127.0.0.1:0".parse().unwrap(), cfg, make()).unwrap();
        let addr = service.addr;
        let mut silent: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let mut client = connect(addr).unwrap();
        client.observe(obs(1, 4.0), 10.0, no_state());
        assert!(client.wait_for(1, Duration::from_secs(5)).is_some());
        assert!(t.elapsed() < Duration::from_secs(2));
        // The oldest silent connection was closed to make room; the newest is still open.
        let mut buf = [0u8; 1];
        silent[0].set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        assert!(matches!(silent[0].read(&mut buf), Ok(0)), "the oldest silent connection is closed");
        silent[3].set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        assert!(silent[3].read(&mut buf).is_err(), "the newest waits on (read timed out)");
        drop(service);
    }

    /// Connections beyond the cap are closed on arrival; silent ones are closed after the
    /// handshake timeout, which frees their slots.
    #[test]
    fn the_connection_cap_and_handshake_timeout_hold() {
        let cfg = ServiceConfig { max_connections: 4, handshake_timeout: Duration::from_millis(300), ..config() };
        let service = spawn("127.0.0.1:0".parse().unwrap(), cfg, make()).unwrap();
        let addr = service.addr;
        let idle: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(50));
        // Closed means end of stream (or a reset), within `within`; a read timeout is not.
        let closed_within = |s: &mut TcpStream, within: Duration| {
            let t = Instant::now();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut buf = [0u8; 1];
            let closed = match s.read(&mut buf) {
                Ok(0) => true,
                Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
                Ok(_) => false,
            };
            closed && t.elapsed() < within
        };
        let mut extra = TcpStream::connect(addr).unwrap();
        assert!(closed_within(&mut extra, Duration::from_secs(1)), "the fifth connection is closed at once");
        // The idle ones are closed by the handshake timeout (300 ms).
        let started = Instant::now();
        for mut s in idle {
            assert!(closed_within(&mut s, Duration::from_secs(3)));
        }
        assert!(started.elapsed() < Duration::from_secs(3));
        let mut client = connect(addr).unwrap();
        client.observe(obs(1, 4.0), 10.0, no_state());
        assert!(client.wait_for(1, Duration::from_secs(5)).is_some());
        drop(service);
    }
}
