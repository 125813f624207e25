//! What can go wrong between a training run and its orchestrator service, as one error type.

use std::net::SocketAddr;

use copus_core::orchestrator::ProtocolError;

/// A failure of the service or of its client.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    /// The shared token is unusable (too short).
    #[error("COPUS_ORCHESTRATOR_TOKEN: {0}")]
    Token(#[from] copus_core::orchestrator::WeakToken),
    /// The service could not listen or its runtime could not start.
    #[error("{0}")]
    Start(String),
    /// The service's thread ended abnormally.
    #[error("the service {0}")]
    Stopped(String),
    /// No connection to the service could be made.
    #[error("orchestrator at {addr}: {source}")]
    Connect {
        /// The service's address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The service answered, but refused the session or the handover, or runs another policy.
    #[error("orchestrator at {addr} {reason}")]
    Refused {
        /// The service's address.
        addr: SocketAddr,
        /// What it said, or why its answer was unusable.
        reason: String,
    },
    /// The connection broke mid-exchange.
    #[error("orchestrator connection lost: {0}")]
    Lost(#[source] std::io::Error),
    /// A frame could not be encoded or decoded.
    #[error("orchestrator protocol: {0}")]
    Protocol(#[from] ProtocolError),
    /// A local resource (a thread, a socket option) could not be set up.
    #[error("orchestrator client: {0}")]
    Io(#[from] std::io::Error),
}
