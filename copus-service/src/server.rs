//! The service side: a TCP listener on its own runtime, one session per connection, each with
//! its own orchestrator, behind a connection cap, a handshake deadline and idle and frame
//! timeouts.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::mpsc::channel;
use std::time::Duration;

use copus_core::orchestrator::{
    MAX_FRAME, MAX_HELLO, Orchestrator, ProtocolError, Request, Response, RunFingerprint, authenticate, check_token, decode, encode,
    frame_len_within,
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
