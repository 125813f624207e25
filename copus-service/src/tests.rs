//! The service and its client together on 127.0.0.1.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use copus_core::orchestrator::{
    MAX_FRAME, MAX_HELLO, Orchestrator, OrchestratorState, PROTOCOL_VERSION, Request, Response, RunFingerprint, SessionMac, Side,
    client_proof, decode, encode, frame_len_within, nonce, proof_matches, service_proof,
};
use copus_core::policy::{CopusRule, Decision, Scorer, StepObservation, SwitchRule};

use crate::client::{Client, RemoteSource, exchange};
use crate::error::ServiceError;
use crate::registry::{PolicyName, policy_by_name};
use crate::server::{MakeOrchestrator, ServiceConfig, spawn};
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
        Orchestrator::new(policy_by_name(PolicyName::Copus, &s, CopusRule::Switch(rule), 2).unwrap(), s)
    })
}

fn connect(addr: SocketAddr) -> Result<Client, ServiceError> {
    Client::connect(addr, TOKEN, "test", fingerprint(), "copus")
}

fn obs(step: u64, phi: f64) -> StepObservation {
    let cur = Candidate::new(ParallelDims { dp: 1, tp: 2, pp: 1 }, 2, 1).unwrap();
    StepObservation {
        step,
        current: cur,
        noise: Some(NoiseEstimate { grad_sq: 1.0, trace: phi, biased: false, grad_sq_se: 0.0, trace_se: 0.0 }),
        remaining_secs: None,
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

/// Reads one frame (blocking).
fn read_frame(s: &mut TcpStream) -> Vec<u8> {
    let mut header = [0u8; 4];
    s.read_exact(&mut header).unwrap();
    let mut body = vec![0u8; frame_len_within(header, MAX_FRAME).unwrap()];
    s.read_exact(&mut body).unwrap();
    body
}

/// The client's side of the handshake by hand, proving with `token`: the service's last answer
/// (a sealed welcome, or an unsealed refusal) and the session's seal.
fn handshake_as_client(s: &mut TcpStream, token: &str) -> (Response, SessionMac) {
    let n = nonce();
    let hello = Request::Hello { version: PROTOCOL_VERSION, run: "r".into(), fingerprint: fingerprint(), nonce: n.clone() };
    let Response::Challenge { nonce: theirs, proof } = exchange(s, &hello, Duration::from_secs(10)).unwrap() else {
        panic!("no challenge")
    };
    assert!(proof_matches(&service_proof(TOKEN, &n, &theirs, &fingerprint()), &proof), "the real service proves the token");
    s.write_all(&encode(&Request::Prove { proof: client_proof(token, &n, &theirs, &fingerprint()) }).unwrap()).unwrap();
    let body = read_frame(s);
    let mut mac = SessionMac::new(token, &n, &theirs, &fingerprint(), Side::Client);
    let answer = mac.open::<Response>(&body).unwrap_or_else(|_| decode::<Response>(&body).unwrap());
    (answer, mac)
}

/// The service's side of the handshake by hand, knowing `token`; then welcomes the client,
/// sealed. Returns the session's seal.
fn handshake_as_service(s: &mut TcpStream, token: &str) -> SessionMac {
    let Request::Hello { nonce: theirs, .. } = decode::<Request>(&read_frame(s)).unwrap() else { panic!("no hello") };
    let n = nonce();
    s.write_all(&encode(&Response::Challenge { nonce: n.clone(), proof: service_proof(token, &theirs, &n, &fingerprint()) }).unwrap())
        .unwrap();
    let Request::Prove { proof } = decode::<Request>(&read_frame(s)).unwrap() else { panic!("no proof") };
    assert!(proof_matches(&client_proof(token, &theirs, &n, &fingerprint()), &proof));
    let mut mac = SessionMac::new(token, &theirs, &n, &fingerprint(), Side::Service);
    s.write_all(&mac.seal(&Response::Welcome { policy: "copus".into() }).unwrap()).unwrap();
    mac
}

/// A listener that is not the service: it answers the hello with a challenge whose proof is
/// made without the token. The client refuses it, and the token never reaches it.
#[test]
fn an_impostor_service_is_refused_and_learns_nothing() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let impostor = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut heard = read_frame(&mut s);
        let Request::Hello { nonce: theirs, .. } = decode::<Request>(&heard).unwrap() else { panic!("no hello") };
        let n = nonce();
        let guess = service_proof("not-the-token-0123456789", &theirs, &n, &fingerprint());
        s.write_all(&encode(&Response::Challenge { nonce: n, proof: guess }).unwrap()).unwrap();
        // Whatever else the client sends before it hangs up.
        let _ = s.read_to_end(&mut heard);
        heard
    });
    let e = Client::connect(addr, TOKEN, "test", fingerprint(), "copus").err().expect("the impostor is refused").to_string();
    assert!(e.contains("could not prove it knows the shared token"), "{e}");
    let heard = String::from_utf8_lossy(&impostor.join().unwrap()).into_owned();
    assert!(!heard.contains(TOKEN), "the token crossed the wire: {heard}");
    assert!(!heard.contains("Prove"), "the client proved itself to an impostor: {heard}");
    // An impostor that skips the challenge and welcomes the client at once is refused too.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let _ = read_frame(&mut s);
        let _ = s.write_all(&encode(&Response::Welcome { policy: "copus".into() }).unwrap());
        let _ = s.read_to_end(&mut Vec::new());
    });
    let e =
        Client::connect(addr, TOKEN, "test", fingerprint(), "copus").err().expect("a welcome without a challenge is refused").to_string();
    assert!(e.contains("unexpected answer"), "{e}");
}

/// A service that knows the token, takes a step and answers it a byte every 300 ms.
fn trickling_service() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut mac = handshake_as_service(&mut s, TOKEN);
        let _step = read_frame(&mut s);
        let frame = mac.seal(&Response::Decision { step: 1, decision: Decision::Keep }).unwrap();
        for b in frame {
            if s.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(300));
        }
    });
    addr
}

/// A service that answers a byte at a time (each well within any read timeout) cannot hold the
/// run: its answer misses the deadline, the connection counts as lost, and the embedded
/// orchestrator decides, saying so.
#[test]
fn a_trickling_service_misses_the_deadline_and_the_run_decides_in_process() {
    let addr = trickling_service();
    let deadline = Duration::from_secs(1);
    let client = Client::connect_with_deadline(addr, TOKEN, "test", fingerprint(), "copus", deadline).unwrap();
    let mut remote = RemoteSource::synchronous(client, make()(), Duration::from_secs(20));
    let mut embedded = make()();
    use copus_core::decision::DecisionSource;
    let started = Instant::now();
    assert_eq!(remote.on_step(&obs(1, 8.0), 10.0), embedded.on_step_measured(&obs(1, 8.0), 10.0));
    assert!(started.elapsed() < Duration::from_secs(5), "the step waited {:?}", started.elapsed());
    assert_eq!(remote.fallback_steps(), 1);
    let why = remote.unavailable().expect("lost").to_string();
    assert!(why.contains("no whole answer within"), "{why}");
}

/// The same trickling service for a run that never waits for decisions: once a step has
/// waited longer than the deadline, the embedded orchestrator decides, and the run says so.
#[test]
fn a_trickling_service_is_overdue_for_a_run_that_never_waits() {
    let addr = trickling_service();
    let client = Client::connect_with_deadline(addr, TOKEN, "test", fingerprint(), "copus", Duration::from_millis(800)).unwrap();
    let mut remote = RemoteSource::new(client, make()());
    let mut embedded = make()();
    use copus_core::decision::DecisionSource;
    let mut step = 0;
    let started = Instant::now();
    while remote.fallback_steps() == 0 {
        step += 1;
        let local = embedded.on_step_measured(&obs(step, 8.0), 10.0);
        let d = remote.on_step(&obs(step, 8.0), 10.0);
        if remote.fallback_steps() > 0 {
            assert_eq!(d, local, "the embedded orchestrator decided step {step}");
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never fell back");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(started.elapsed() >= Duration::from_millis(800), "not before the deadline");
    let why = remote.unavailable().unwrap().to_string();
    assert!(why.contains("no decision within") || why.contains("no whole answer within"), "{why}");
}

/// A connection whose hello is under way survives a burst of newer silent ones when the rest
/// of its hello comes within the grace; connections that sent one byte and stall are evicted.
#[test]
fn a_burst_of_connections_does_not_evict_one_that_has_said_hello() {
    let cfg = ServiceConfig { max_unauthenticated: 4, ..config() };
    let service = spawn("127.0.0.1:0".parse().unwrap(), cfg, make()).unwrap();
    let addr = service.addr;
    let mut first = TcpStream::connect(addr).unwrap();
    first.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let n = nonce();
    let hello = Request::Hello { version: PROTOCOL_VERSION, run: "r".into(), fingerprint: fingerprint(), nonce: n };
    let frame = encode(&hello).unwrap();
    first.write_all(&frame[..3]).unwrap();
    // Let the service see the hello's first bytes, flood it with silent connections, then send
    // the rest.
    std::thread::sleep(Duration::from_millis(200));
    let burst: Vec<TcpStream> = (0..40).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    first.write_all(&frame[3..]).unwrap();
    let answer = decode::<Response>(&read_frame(&mut first)).unwrap();
    assert!(matches!(answer, Response::Challenge { .. }), "{answer:?}");
    drop(burst);
    // One byte each, then nothing: the oldest of these is closed to make room (after the grace).
    let mut stalled: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(&[0]).unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(100));
    let _newer: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(addr).unwrap()).collect();
    stalled[0].set_read_timeout(Some(Duration::from_secs(4))).unwrap();
    let mut b = [0u8; 1];
    assert!(matches!(stalled[0].read(&mut b), Ok(0)), "a one-byte connection does not hold its place");
    drop(service);
}

#[test]
fn wrong_tokens_versions_runs_and_bad_frames_are_refused() {
    let service = spawn("127.0.0.1:0".parse().unwrap(), config(), make()).unwrap();
    let addr = service.addr;
    // A wrong token here: the service's proof does not check out, and this side proves nothing.
    let e = Client::connect(addr, "0123456789abcdef-guess", "test", fingerprint(), "copus").err().unwrap().to_string();
    assert!(e.contains("could not prove it knows the shared token"), "{e}");
    // Another run: another world size.
    let other = RunFingerprint { world_size: 8, ..fingerprint() };
    let e = Client::connect(addr, TOKEN, "test", other, "copus").err().unwrap().to_string();
    assert!(e.contains("refused") && e.contains("8 ranks") && e.contains("2 ranks"), "{e}");
    // Another policy.
    let e = Client::connect(addr, TOKEN, "test", fingerprint(), "dp-only").err().unwrap().to_string();
    assert!(e.contains("runs policy `copus`") && e.contains("`dp-only`"), "{e}");
    // Another protocol version.
    let old = Request::Hello { version: 1, run: "r".into(), fingerprint: fingerprint(), nonce: nonce() };
    let answer = raw_answer(addr, &encode(&old).unwrap());
    assert!(matches!(&answer, Some(Response::Error(e)) if e.contains("protocol version 1")), "{answer:?}");
    // Before the hello, a frame over MAX_HELLO is refused unread.
    let answer = raw_answer(addr, &((MAX_HELLO as u32) + 1).to_be_bytes());
    assert!(matches!(&answer, Some(Response::Error(e)) if e.contains("exceeds")), "{answer:?}");
    // Garbage after a valid hello.
    let mut s = TcpStream::connect(addr).unwrap();
    let (welcome, mut mac) = handshake_as_client(&mut s, TOKEN);
    assert!(matches!(welcome, Response::Welcome { .. }));
    // A proof made with another token is refused.
    let mut wrong = TcpStream::connect(addr).unwrap();
    assert!(matches!(handshake_as_client(&mut wrong, "0123456789abcdef-guess").0, Response::Error(e) if e.contains("wrong token")));
    // Unsealed junk after the handshake fails its seal.
    let junk = b"{not json";
    s.write_all(&(junk.len() as u32).to_be_bytes()).unwrap();
    s.write_all(junk).unwrap();
    let body = read_frame(&mut s);
    assert!(matches!(mac.open::<Response>(&body).unwrap(), Response::Error(e) if e.contains("failed its authentication")));
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
    use copus_core::decision::DecisionSource;
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
        let _ = handshake_as_service(&mut s, TOKEN);
        drop(s);
        drop(listener);
    });
    let mut remote = RemoteSource::synchronous(connect(addr).unwrap(), make()(), Duration::from_secs(10));
    let mut embedded = make()();
    use copus_core::decision::DecisionSource;
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

/// After the handshake every frame is sealed: the service refuses a step whose bytes were
/// changed on the way, or one sent again, and drops the connection; a run whose service
/// answers with a changed or replayed decision falls back to its embedded orchestrator.
#[test]
fn a_tampered_or_replayed_frame_is_refused_and_the_connection_dropped() {
    let service = spawn("127.0.0.1:0".parse().unwrap(), config(), make()).unwrap();
    let step = |k| Request::Step { observation: obs(k, 4.0), samples_per_sec: 10.0 };
    let refused = |s: &mut TcpStream, mac: &mut SessionMac| {
        let answer = mac.open::<Response>(&read_frame(s)).unwrap();
        assert!(matches!(&answer, Response::Error(e) if e.contains("failed its authentication")), "{answer:?}");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(s.read(&mut [0u8; 1]).unwrap(), 0, "the connection is dropped");
    };
    // A changed byte (a digit of the observation's numbers).
    let mut s = TcpStream::connect(service.addr).unwrap();
    let (_, mut mac) = handshake_as_client(&mut s, TOKEN);
    let mut frame = mac.seal(&step(1)).unwrap();
    let at = frame.windows(4).position(|w| w == b"10.0").expect("the samples/s in the JSON") + 1;
    frame[at] = b'9';
    s.write_all(&frame).unwrap();
    refused(&mut s, &mut mac);
    // The same sealed step twice: the first is answered, the replay refused.
    let mut s = TcpStream::connect(service.addr).unwrap();
    let (_, mut mac) = handshake_as_client(&mut s, TOKEN);
    let frame = mac.seal(&step(1)).unwrap();
    s.write_all(&frame).unwrap();
    assert!(matches!(mac.open::<Response>(&read_frame(&mut s)).unwrap(), Response::Decision { step: 1, .. }));
    s.write_all(&frame).unwrap();
    refused(&mut s, &mut mac);
    // A frame sealed in another session (another key) is refused too.
    let mut other = TcpStream::connect(service.addr).unwrap();
    let (_, mut other_mac) = handshake_as_client(&mut other, TOKEN);
    let mut s = TcpStream::connect(service.addr).unwrap();
    let (_, mut mac) = handshake_as_client(&mut s, TOKEN);
    s.write_all(&other_mac.seal(&step(1)).unwrap()).unwrap();
    refused(&mut s, &mut mac);
    drop(service);

    // The client's side: a service whose first decision is altered on the way, then one that
    // replays its first decision for the second step.
    for replay in [false, true] {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut mac = handshake_as_service(&mut s, TOKEN);
            let _ = read_frame(&mut s);
            let mut first = mac.seal(&Response::Decision { step: 1, decision: Decision::Keep }).unwrap();
            if !replay {
                let at = first.windows(4).position(|w| w == b"Keep").unwrap();
                first[at] = b'k';
            }
            let _ = s.write_all(&first);
            // The second step (when the first decision was accepted), answered with the first
            // decision's frame again.
            let mut header = [0u8; 4];
            if s.read_exact(&mut header).is_ok() {
                let mut body = vec![0u8; u32::from_be_bytes(header) as usize];
                let _ = s.read_exact(&mut body);
                let _ = s.write_all(&first);
            }
            let _ = s.read_to_end(&mut Vec::new());
        });
        let mut remote = RemoteSource::synchronous(connect(addr).unwrap(), make()(), Duration::from_secs(10));
        use copus_core::decision::DecisionSource;
        let mut embedded = make()();
        // The altered decision is refused at step 1; the replayed one at step 2.
        let refused_at = if replay { 2 } else { 1 };
        for k in 1..=refused_at {
            let (theirs, ours) = (remote.on_step(&obs(k, 4.0), 10.0), embedded.on_step_measured(&obs(k, 4.0), 10.0));
            if k == refused_at {
                assert_eq!(theirs, ours, "the refused step is decided in process");
            }
        }
        let why = remote.unavailable().expect("the run fell back").to_string();
        assert!(why.contains("failed its authentication"), "replay {replay}: {why}");
        assert_eq!(remote.fallback_steps(), 1, "replay {replay}: the refused step was decided in process");
    }
}
