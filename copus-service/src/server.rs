//! The service side: a TCP listener on its own runtime, one session per connection, each with
//! its own orchestrator, behind a connection cap, a handshake deadline and idle and frame
//! timeouts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

use copus_core::orchestrator::{
    MAX_FRAME, MAX_HELLO, Orchestrator, ProtocolError, Request, Response, RunFingerprint, SessionMac, Side, check_hello, check_token,
    client_proof, decode, encode, frame_len_within, nonce, proof_matches, service_proof,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::error::ServiceError;

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

/// The connections whose hello is not whole yet, oldest first: when there are
/// [`ServiceConfig::max_unauthenticated`] of them, a new one closes the oldest (one whose hello
/// is under way gets [`EVICTION_GRACE`] to finish it), so silent or stalling connections can
/// never keep a real client out. A connection leaves the queue once its whole hello is in.
#[derive(Default)]
struct Waiting {
    next: u64,
    queue: std::collections::VecDeque<(u64, Arc<tokio::sync::Notify>)>,
}

/// A connection's place among the [`Waiting`]; it leaves once its whole hello is in, or when the
/// session ends.
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

/// Failed handshakes, logged at the 1st, 2nd, 4th, 8th, ... so a flood of bad hellos cannot
/// flood the log.
#[derive(Default)]
struct FailedHellos(std::sync::atomic::AtomicU64);

impl FailedHellos {
    fn note(&self, peer: SocketAddr, why: &str) {
        let n = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            tracing::warn!("{n} failed handshake(s) so far; latest from {peer}: {why}");
        }
    }
}

/// How long a connection told to make room may still take to complete a hello it has begun.
const EVICTION_GRACE: Duration = Duration::from_secs(1);

/// Reads the hello frame by `until`. Until it is whole, newer connections may evict this one:
/// at once if it has sent nothing, after [`EVICTION_GRACE`] if its hello is under way, so a
/// real client whose hello is in flight is not cut off and a byte a connection does not keep
/// one alive. Reads are cancel-safe, so nothing received is lost to the eviction's wait.
async fn read_hello(
    stream: &mut tokio::net::TcpStream,
    until: tokio::time::Instant,
    pending: &Unauthenticated,
) -> Result<Vec<u8>, ReadEnd> {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 1024];
    let mut grace: Option<tokio::time::Instant> = None;
    loop {
        if buf.len() >= 4 {
            let n = frame_len_within([buf[0], buf[1], buf[2], buf[3]], MAX_HELLO).map_err(ReadEnd::Bad)?;
            if buf.len() >= 4 + n {
                return Ok(buf[4..4 + n].to_vec());
            }
        }
        let end = grace.map_or(until, |g| g.min(until));
        tokio::select! {
            biased;
            got = stream.read(&mut chunk) => match got {
                Ok(0) => return Err(ReadEnd::Closed),
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) => return Err(ReadEnd::Bad(ProtocolError::Malformed(e.to_string()))),
            },
            _ = pending.evicted.notified(), if grace.is_none() => {
                if buf.is_empty() {
                    return Err(ReadEnd::Timeout);
                }
                grace = Some(tokio::time::Instant::now() + EVICTION_GRACE);
            }
            _ = tokio::time::sleep_until(end) => return Err(ReadEnd::Timeout),
        }
    }
}

/// Sends `r` as one frame (sealed with `mac` after the handshake); false when the connection
/// is gone.
async fn send(stream: &mut tokio::net::TcpStream, mac: Option<&mut SessionMac>, r: &Response) -> bool {
    match mac.map_or_else(|| encode(r), |m| m.seal(r)) {
        Ok(frame) => stream.write_all(&frame).await.is_ok(),
        Err(_) => false,
    }
}

/// The handshake, each side proving it knows the token without sending it: the client's
/// `Hello` (version, fingerprint, nonce), the service's `Challenge` (its nonce and proof), the
/// client's `Prove`. Returns the session's orchestrator and the sealing of its later frames, or
/// the error to answer.
async fn handshake(
    stream: &mut tokio::net::TcpStream,
    cfg: &ServiceConfig,
    make: &MakeOrchestrator,
    pending: Unauthenticated,
) -> Result<(Orchestrator, SessionMac), String> {
    let until = tokio::time::Instant::now() + cfg.handshake_timeout;
    let hello = match read_hello(stream, until, &pending).await {
        Ok(body) => decode::<Request>(&body).map_err(|e| e.to_string())?,
        Err(ReadEnd::Bad(e)) => return Err(e.to_string()),
        Err(_) => return Err(String::new()),
    };
    // The whole hello is in: no newer connection may close this one now.
    drop(pending);
    let client_nonce = check_hello(&hello, &cfg.fingerprint).map_err(|e| e.to_string())?;
    let service_nonce = nonce();
    let proof = service_proof(&cfg.token, &client_nonce, &service_nonce, &cfg.fingerprint);
    if !send(stream, None, &Response::Challenge { nonce: service_nonce.clone(), proof }).await {
        return Err(String::new());
    }
    let left = until.saturating_duration_since(tokio::time::Instant::now());
    let prove = match read_frame(stream, MAX_HELLO, left, left).await {
        Ok(body) => decode::<Request>(&body).map_err(|e| e.to_string())?,
        Err(ReadEnd::Bad(e)) => return Err(e.to_string()),
        Err(_) => return Err(String::new()),
    };
    match prove {
        Request::Prove { proof } if proof_matches(&client_proof(&cfg.token, &client_nonce, &service_nonce, &cfg.fingerprint), &proof) => {
            Ok((make(), SessionMac::new(&cfg.token, &client_nonce, &service_nonce, &cfg.fingerprint, Side::Service)))
        }
        _ => Err(ProtocolError::Unauthorized.to_string()),
    }
}

async fn session(
    mut stream: tokio::net::TcpStream,
    peer: SocketAddr,
    cfg: Arc<ServiceConfig>,
    make: MakeOrchestrator,
    pending: Unauthenticated,
    failed: Arc<FailedHellos>,
) {
    let (mut orch, mut mac) = match handshake(&mut stream, &cfg, &make, pending).await {
        Ok(o) => o,
        Err(why) => {
            if !why.is_empty() {
                failed.note(peer, &why);
                let _ = send(&mut stream, None, &Response::Error(why)).await;
            } else {
                failed.note(peer, "no whole handshake in time");
            }
            return;
        }
    };
    if !send(&mut stream, Some(&mut mac), &Response::Welcome { policy: orch.policy_name() }).await {
        return;
    }
    loop {
        // Full frames, each whole within the frame timeout once it has started.
        let reply = match read_frame(&mut stream, MAX_FRAME, cfg.idle_timeout, cfg.frame_timeout).await {
            Err(ReadEnd::Closed) | Err(ReadEnd::Timeout) => return,
            Err(ReadEnd::Bad(e)) => Err(e.to_string()),
            // A frame whose seal fails is refused, and the connection dropped.
            Ok(body) => match mac.open::<Request>(&body) {
                Ok(req) => match orch.handle(req) {
                    Response::Error(e) => Err(e),
                    r => Ok(r),
                },
                Err(e) => Err(e.to_string()),
            },
        };
        let (r, last) = match reply {
            Ok(r) => (r, false),
            Err(e) => (Response::Error(e), true),
        };
        if !send(&mut stream, Some(&mut mac), &r).await || last {
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
    let failed = Arc::new(FailedHellos::default());
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
                    let (cfg, make, failed) = (cfg.clone(), make.clone(), failed.clone());
                    tokio::spawn(async move {
                        session(stream, peer, cfg, make, pending, failed).await;
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
    pub fn join(mut self) -> Result<(), ServiceError> {
        let t = self.thread.take().expect("joined once");
        t.join().map_err(|_| ServiceError::Stopped("thread panicked".into()))?.map_err(|e| ServiceError::Stopped(format!("failed: {e}")))
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
pub fn spawn(addr: SocketAddr, cfg: ServiceConfig, make: MakeOrchestrator) -> Result<ServiceHandle, ServiceError> {
    check_token(&cfg.token).map_err(ServiceError::Token)?;
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
    let bound = rx.recv().map_err(|_| ServiceError::Stopped("thread ended before listening".into()))?.map_err(ServiceError::Start)?;
    Ok(ServiceHandle { addr: bound, stop: Some(stop_tx), thread: Some(thread) })
}
