//! The orchestrator as a separate service (`recipes orchestrator`), and the client the training
//! loop uses to reach it.
//!
//! The service listens on TCP (127.0.0.1 by default), one session per connection. A session's
//! first frame must be `Hello` with the shared token; each session gets its own policy, built
//! from the service's candidate space and throughput profile. Frames are length-prefixed JSON
//! of at most 64 KiB; oversized or malformed frames are answered with an error and the session
//! ends. The decision logic is copus-core's `Orchestrator`, the same as embedded, so decisions a
//! policy proposes outside the feasible candidates are never passed on.
//!
//! The client runs on a background thread: the training loop hands it observations without
//! waiting and picks up decisions when they have arrived, applying each at the next
//! optimizer-step boundary. If the service goes away, the client says so once and the loop
//! keeps training in its current configuration.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::mpsc::{Receiver, Sender, TryRecvError, channel};
use std::time::Duration;

use anyhow::anyhow;
use copus_core::orchestrator::{MAX_FRAME, Orchestrator, ProtocolError, Request, Response, authenticate, decode, encode, frame_len};
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

async fn read_frame(stream: &mut tokio::net::TcpStream) -> Result<Option<Vec<u8>>, ProtocolError> {
    let mut header = [0u8; 4];
    match stream.read_exact(&mut header).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(ProtocolError::Malformed(e.to_string())),
    }
    let n = frame_len(header)?;
    let mut body = vec![0u8; n];
    stream.read_exact(&mut body).await.map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    Ok(Some(body))
}

async fn session(mut stream: tokio::net::TcpStream, token: String, make: std::sync::Arc<dyn Fn() -> Orchestrator + Send + Sync>) {
    let mut orch: Option<Orchestrator> = None;
    loop {
        let reply = match read_frame(&mut stream).await {
            Ok(None) => return,
            Ok(Some(body)) => match decode::<Request>(&body) {
                Ok(req) => match orch.as_mut() {
                    None => match authenticate(&req, &token) {
                        Ok(()) => {
                            let o = make();
                            let welcome = Response::Welcome { policy: o.policy_name() };
                            orch = Some(o);
                            Ok(welcome)
                        }
                        Err(e) => Err(e.to_string()),
                    },
                    Some(o) => Ok(o.handle(req)),
                },
                Err(e) => Err(e.to_string()),
            },
            Err(e) => Err(e.to_string()),
        };
        let (frame, last) = match reply {
            Ok(r) => (encode(&r), false),
            Err(e) => (encode(&Response::Error(e)), true),
        };
        if stream.write_all(&frame).await.is_err() || last {
            return;
        }
    }
}

/// Serves sessions on `listener` until the process ends. `make` builds each session's
/// orchestrator.
pub async fn serve(
    listener: TcpListener,
    token: String,
    make: std::sync::Arc<dyn Fn() -> Orchestrator + Send + Sync>,
) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        tokio::spawn(session(stream, token.clone(), make.clone()));
    }
}

/// Starts the service on a background runtime; returns the bound address (port 0 picks one).
pub fn spawn(
    addr: SocketAddr,
    token: String,
    make: std::sync::Arc<dyn Fn() -> Orchestrator + Send + Sync>,
) -> anyhow::Result<(SocketAddr, std::thread::JoinHandle<()>)> {
    let (tx, rx) = channel();
    let handle = std::thread::spawn(move || {
        let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                let _ = tx.send(Err(e.to_string()));
                return;
            }
        };
        rt.block_on(async move {
            match TcpListener::bind(addr).await {
                Ok(l) => {
                    let _ = tx.send(l.local_addr().map_err(|e| e.to_string()));
                    let _ = serve(l, token, make).await;
                }
                Err(e) => {
                    let _ = tx.send(Err(format!("cannot listen on {addr}: {e}")));
                }
            }
        });
    });
    let bound = rx.recv().map_err(|_| anyhow!("the service thread ended"))?.map_err(anyhow::Error::msg)?;
    Ok((bound, handle))
}

/// The service as the driver's decision source. Decisions arrive asynchronously; one is applied
/// at the first step boundary after it arrives, unless it was made for a configuration that
/// has changed since. In synchronous mode each step waits (up to a timeout) for its own
/// decision, so a run decides exactly as with the embedded orchestrator.
pub struct RemoteSource {
    client: Client,
    /// The first step observed in the current configuration.
    since: u64,
    last_step: u64,
    /// Synchronous mode: how long a step waits for its decision.
    wait: Option<Duration>,
}

impl RemoteSource {
    /// Decisions from `client`, applied as they arrive (training never waits).
    pub fn new(client: Client) -> Self {
        Self { client, since: 0, last_step: 0, wait: None }
    }

    /// Decisions from `client`, each step waiting up to `timeout` for its own.
    pub fn synchronous(client: Client, timeout: Duration) -> Self {
        Self { wait: Some(timeout), ..Self::new(client) }
    }

    /// Why the service is unavailable, once it is.
    pub fn unavailable(&self) -> Option<&str> {
        self.client.unavailable()
    }
}

impl copus_burn::DecisionSource for RemoteSource {
    fn name(&self) -> String {
        "orchestrator service".into()
    }
    fn on_step(&mut self, obs: &StepObservation, samples_per_sec: f64) -> Decision {
        self.last_step = obs.step;
        self.client.observe(*obs, samples_per_sec);
        if let Some(timeout) = self.wait {
            return self.client.wait_for(obs.step, timeout).unwrap_or(Decision::Keep);
        }
        match self.client.poll() {
            Some((s, d)) if s >= self.since => d,
            _ => Decision::Keep,
        }
    }
    fn on_reconfigured(&mut self, seconds: f64, layout_changed: bool) {
        self.client.reconfigured(seconds, layout_changed);
        self.since = self.last_step + 1;
    }
}

/// Messages from the training loop to the client thread.
enum Outgoing {
    Step(StepObservation, f64),
    Reconfigured(f64, bool),
}

/// The training side of the service: never blocks the training loop.
pub struct Client {
    outgoing: Sender<Outgoing>,
    decisions: Receiver<(u64, Decision)>,
    lost: Receiver<String>,
    unavailable: Option<String>,
}

impl Client {
    /// Connects, authenticates and starts the background thread.
    pub fn connect(addr: SocketAddr, token: &str, run: &str) -> anyhow::Result<Self> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| anyhow!("orchestrator at {addr}: {e}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let hello = Request::Hello { token: token.into(), run: run.into() };
        match exchange(&mut stream, &hello)? {
            Response::Welcome { .. } => {}
            Response::Error(e) => return Err(anyhow!("orchestrator at {addr} refused the session: {e}")),
            other => return Err(anyhow!("orchestrator at {addr}: unexpected answer {other:?}")),
        }
        let (outgoing, rx) = channel::<Outgoing>();
        let (dtx, decisions) = channel();
        let (ltx, lost) = channel();
        std::thread::spawn(move || {
            for msg in rx {
                let req = match msg {
                    Outgoing::Step(observation, samples_per_sec) => Request::Step { observation, samples_per_sec },
                    Outgoing::Reconfigured(seconds, layout_changed) => Request::Reconfigured { seconds, layout_changed },
                };
                match exchange(&mut stream, &req) {
                    Ok(Response::Decision { step, decision }) => {
                        let _ = dtx.send((step, decision));
                    }
                    Ok(Response::Ack) | Ok(Response::Welcome { .. }) => {}
                    Ok(Response::Error(e)) => {
                        let _ = ltx.send(format!("the orchestrator refused a message: {e}"));
                        return;
                    }
                    Err(e) => {
                        let _ = ltx.send(e.to_string());
                        return;
                    }
                }
            }
            let _ = exchange(&mut stream, &Request::Bye);
        });
        Ok(Self { outgoing, decisions, lost, unavailable: None })
    }

    /// Hands an observation and the step's measured samples/s to the background thread (never
    /// waits).
    pub fn observe(&mut self, obs: StepObservation, samples_per_sec: f64) {
        if self.unavailable.is_none() && self.outgoing.send(Outgoing::Step(obs, samples_per_sec)).is_err() {
            self.mark_lost("the client thread ended".into());
        }
    }

    /// Reports a carried-out reconfiguration.
    pub fn reconfigured(&mut self, seconds: f64, layout_changed: bool) {
        if self.unavailable.is_none() {
            let _ = self.outgoing.send(Outgoing::Reconfigured(seconds, layout_changed));
        }
    }

    /// The newest decision that has arrived, if any (older ones are superseded).
    pub fn poll(&mut self) -> Option<(u64, Decision)> {
        if let Ok(e) = self.lost.try_recv() {
            self.mark_lost(e);
        }
        let mut last = None;
        loop {
            match self.decisions.try_recv() {
                Ok(d) => last = Some(d),
                Err(TryRecvError::Empty) | Err(TryRecvError::Disconnected) => return last,
            }
        }
    }

    /// Waits up to `timeout` for the decision about `step`.
    pub fn wait_for(&mut self, step: u64, timeout: Duration) -> Option<Decision> {
        let deadline = std::time::Instant::now() + timeout;
        while std::time::Instant::now() < deadline {
            match self.decisions.recv_timeout(Duration::from_millis(20)) {
                Ok((s, d)) if s == step => return Some(d),
                Ok(_) => {}
                Err(_) => {
                    if let Ok(e) = self.lost.try_recv() {
                        self.mark_lost(e);
                        return None;
                    }
                }
            }
        }
        None
    }

    /// Why the service is unavailable, once it is.
    pub fn unavailable(&self) -> Option<&str> {
        self.unavailable.as_deref()
    }

    fn mark_lost(&mut self, why: String) {
        if self.unavailable.is_none() {
            tracing::warn!("orchestrator unavailable ({why}); training continues in its current configuration");
            self.unavailable = Some(why);
        }
    }
}

fn exchange(stream: &mut TcpStream, req: &Request) -> anyhow::Result<Response> {
    stream.write_all(&encode(req)).map_err(|e| anyhow!("orchestrator connection lost: {e}"))?;
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).map_err(|e| anyhow!("orchestrator connection lost: {e}"))?;
    let n = frame_len(header)?;
    let mut body = vec![0u8; n.min(MAX_FRAME)];
    stream.read_exact(&mut body).map_err(|e| anyhow!("orchestrator connection lost: {e}"))?;
    Ok(decode::<Response>(&body)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use copus_core::candidates::Candidate;
    use copus_core::gns::NoiseEstimate;
    use copus_core::layout::ParallelDims;
    use copus_core::throughput::{ProfileEntry, ThroughputProfile};
    use std::sync::Arc;

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

    fn make() -> Arc<dyn Fn() -> Orchestrator + Send + Sync> {
        Arc::new(|| {
            let s = scorer();
            let rule = SwitchRule { layout_cost: 0.0, min_dwell_steps: 1, confirm_steps: 1, ..SwitchRule::default() };
            Orchestrator::new(policy_by_name(PolicyName::Copus, &s, rule).unwrap(), s)
        })
    }

    fn obs(step: u64, phi: f64) -> StepObservation {
        let cur = Candidate::new(ParallelDims { dp: 1, tp: 2, pp: 1 }, 2, 1).unwrap();
        StepObservation {
            step,
            current: cur,
            noise: Some(NoiseEstimate { grad_sq: 1.0, trace: phi, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }),
        }
    }

    #[test]
    fn the_service_decides_like_the_embedded_orchestrator() {
        let (addr, _h) = spawn("127.0.0.1:0".parse().unwrap(), "secret".into(), make()).unwrap();
        let mut client = Client::connect(addr, "secret", "test").unwrap();
        let mut embedded = make()();
        for (step, phi) in [(1, 0.5), (2, 4.0), (3, 64.0)] {
            client.observe(obs(step, phi), 10.0);
            let remote = client.wait_for(step, Duration::from_secs(10)).expect("a decision");
            assert_eq!(remote, embedded.on_step(&obs(step, phi)), "step {step}");
        }
        // With a large noise scale Copus moves to the big batch on the other layout.
        assert!(matches!(embedded.on_step(&obs(4, 64.0)), Decision::ChangeLayout(c) if c.global_batch == 8));
    }

    /// A short real run through the driver, decided by the service on 127.0.0.1 and by the
    /// embedded orchestrator: the same decisions at the same steps, the same losses.
    #[test]
    fn a_run_decided_by_the_service_equals_one_decided_in_process() {
        use copus_burn::{Clock, DataSource, Driver, Engine, EngineConfig, OptimConfig};
        use copus_core::candidates::CandidateSpace;
        use copus_core::memory::{GIB, MemoryModel};
        use copus_core::model::ModelSpec;
        use copus_core::schedule::ScheduleKind;
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
        let run = |source: &mut dyn copus_burn::DecisionSource| {
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
            (0..6)
                .map(|_| driver.step(&Tokens(spec.vocab_size), source).unwrap())
                .map(|s| (s.step.metrics.loss, s.step.metrics.b_simple, s.decision))
                .collect::<Vec<_>>()
        };
        let make: Arc<dyn Fn() -> Orchestrator + Send + Sync> = Arc::new(orchestrator.clone());
        let (addr, _h) = spawn("127.0.0.1:0".parse().unwrap(), "secret".into(), make).unwrap();
        let mut remote = RemoteSource::synchronous(Client::connect(addr, "secret", "test").unwrap(), Duration::from_secs(10));
        let by_service = run(&mut remote);
        let in_process = run(&mut orchestrator());
        assert!(
            in_process.iter().any(|(_, _, d)| d.as_ref().is_some_and(|d| d.applied)),
            "the policy switched at least once: {in_process:?}"
        );
        assert_eq!(by_service, in_process);
        assert!(remote.unavailable().is_none());
    }

    #[test]
    fn wrong_tokens_and_bad_frames_are_refused() {
        let (addr, _h) = spawn("127.0.0.1:0".parse().unwrap(), "secret".into(), make()).unwrap();
        let e = Client::connect(addr, "guess", "test").err().unwrap().to_string();
        assert!(e.contains("refused") && e.contains("wrong token"), "{e}");
        // An oversized frame header: error answer, connection closed.
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(&((MAX_FRAME as u32) + 1).to_be_bytes()).unwrap();
        let mut header = [0u8; 4];
        s.read_exact(&mut header).unwrap();
        let mut body = vec![0u8; frame_len(header).unwrap()];
        s.read_exact(&mut body).unwrap();
        assert!(matches!(decode::<Response>(&body).unwrap(), Response::Error(e) if e.contains("exceeds")));
        // Garbage after a valid hello.
        let mut s = TcpStream::connect(addr).unwrap();
        assert!(matches!(exchange(&mut s, &Request::Hello { token: "secret".into(), run: "r".into() }).unwrap(), Response::Welcome { .. }));
        let junk = b"{not json";
        s.write_all(&(junk.len() as u32).to_be_bytes()).unwrap();
        s.write_all(junk).unwrap();
        s.read_exact(&mut header).unwrap();
        let mut body = vec![0u8; frame_len(header).unwrap()];
        s.read_exact(&mut body).unwrap();
        assert!(matches!(decode::<Response>(&body).unwrap(), Response::Error(e) if e.contains("malformed")));
    }

    #[test]
    fn a_vanished_service_leaves_training_in_its_configuration() {
        // A listener that accepts the hello and then drops the connection.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut header = [0u8; 4];
            s.read_exact(&mut header).unwrap();
            let mut body = vec![0u8; frame_len(header).unwrap()];
            s.read_exact(&mut body).unwrap();
            s.write_all(&encode(&Response::Welcome { policy: "copus".into() })).unwrap();
            drop(s);
        });
        let mut client = Client::connect(addr, "t", "r").unwrap();
        client.observe(obs(1, 64.0), 10.0);
        assert_eq!(client.wait_for(1, Duration::from_secs(5)), None);
        assert!(client.unavailable().is_some());
        // Further observations are dropped quietly and no decision ever comes.
        client.observe(obs(2, 64.0), 10.0);
        assert_eq!(client.poll(), None);
    }
}
