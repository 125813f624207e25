//! copus-service: the orchestrator as a separate service (`recipes orchestrator` runs one), the
//! client a training loop uses to reach it, and the policies it can run by name. Any Burn
//! program that trains through copus-burn's `Driver` can take its decisions from a service with
//! [`RemoteSource`].
//!
//! The service listens on TCP (127.0.0.1 by default), one session per connection, at most
//! [`ServiceConfig::max_connections`] at once (more are closed on arrival). Each side proves it
//! knows the shared token without sending it: the client's `Hello` carries the protocol
//! version, the fingerprint of the run's candidate space and a nonce; the service answers a
//! `Challenge` with its nonce and an HMAC-SHA256 proof over both nonces and the fingerprint,
//! which the client checks before it sends its own proof (`Prove`). So an impostor listening on
//! the address learns nothing of the token (only the run's name and fingerprint) and gives no
//! decisions. Every frame after the handshake is sealed with a key both sides derive from the
//! token and the two nonces, and carries its sequence number and an HMAC over its bytes
//! ([`SessionMac`](copus_core::orchestrator::SessionMac)): an altered, replayed, reordered or
//! reflected frame is refused and the connection dropped (the run's embedded orchestrator then
//! decides, as for a lost service). Each handshake frame must come whole
//! within [`ServiceConfig::handshake_timeout`] and in at most
//! [`MAX_HELLO`](copus_core::orchestrator::MAX_HELLO) bytes; only after it may frames grow to
//! [`MAX_FRAME`](copus_core::orchestrator::MAX_FRAME). Connections without a whole hello are
//! evicted oldest first beyond [`ServiceConfig::max_unauthenticated`] (one whose hello is under
//! way gets a second to finish it). Failed handshakes are logged at the 1st, 2nd, 4th, ... An authenticated session
//! that stays silent for [`ServiceConfig::idle_timeout`], or sends half a frame and stalls for
//! [`ServiceConfig::frame_timeout`], is closed. Each session gets its own policy, built from the
//! service's candidate space and throughput profile; the decision logic is copus-core's
//! `Orchestrator`, the same as embedded, so decisions outside the feasible candidates are never
//! passed on. A failing `accept` (out of file descriptors, say) is logged and survived.
//!
//! The client runs on a background thread: the training loop hands it observations without
//! waiting and picks up decisions when they have arrived, applying each at the next
//! optimizer-step boundary. The training side keeps an embedded orchestrator that sees every
//! observation too. When the service goes away, or takes longer than [`ANSWER_DEADLINE`] for a
//! whole answer (however it trickles in), the embedded one decides (and the log says so) while
//! the client reconnects with exponential backoff; on reconnecting it hands the
//! service the embedded orchestrator's state, so the service continues exactly where the run
//! is.
//!
//! Files: `server` (listener and sessions), `client` (`Client`, `RemoteSource`), `registry`
//! (`PolicyName`), `error` (`ServiceError`).

#![forbid(unsafe_code)]

mod client;
mod error;
mod registry;
mod server;
#[cfg(test)]
mod tests;

pub use client::{ANSWER_DEADLINE, BACKOFF, Client, RemoteSource};
pub use error::ServiceError;
pub use registry::{PolicyName, UnknownPolicy, policy_by_name};
pub use server::{MakeOrchestrator, ServiceConfig, ServiceHandle, serve, spawn};
