//! The web console (issue 11): served by `ax server --console-addr`, assets embedded in
//! the binary, no separate process. The page calls the same APIs as the CLI and the SDK
//! (`POST /api/<api>/<op>` runs `ax.<api>.<op>` in this server), and listens to
//! `GET /api/live` (server-sent events: a tick whenever the task index moved) to refresh
//! what it shows without a reload.
//!
//! Access: loopback only unless told otherwise; with a token (`--console-token`) every API
//! call needs it (a cookie set by the login form, or `Authorization: Bearer`); a second,
//! read-only token (`--console-readonly-token`) allows only reads.

mod http;

use crate::ops::feed::TaskIndex;
use crate::server::handle::Apis;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Console settings of a server.
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// Where to listen (default none: no console). A non-loopback address needs a token.
    pub addr: SocketAddr,
    /// The admin token; none: no login (allowed on loopback only).
    pub token: Option<String>,
    /// A token that may only read.
    pub readonly_token: Option<String>,
}

/// Why a console could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// A console reachable from other hosts without a token.
    #[error("the console on {0} is reachable from other hosts: give it --console-token")]
    Unprotected(SocketAddr),
    /// The address could not be bound.
    #[error("console address {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

impl ConsoleConfig {
    /// Checks the settings: a token is needed off loopback.
    pub fn check(&self) -> Result<(), ConsoleError> {
        if !self.addr.ip().is_loopback() && self.token.is_none() {
            return Err(ConsoleError::Unprotected(self.addr));
        }
        Ok(())
    }
}

/// Who a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Admin,
    ReadOnly,
}

/// Operations a read-only user may call, by API.
fn read_only(api: &str, op: &str) -> bool {
    matches!(
        (api, op),
        ("task", "get" | "list" | "events" | "queues")
            | ("flow", "get" | "list" | "def" | "defs")
            | ("trigger", "list" | "get" | "leader")
            | ("limit", "get" | "list" | "status")
    )
}

/// Binds the console and serves it until `shutdown`.
pub(crate) async fn start(
    config: ConsoleConfig,
    apis: Arc<Apis>,
    index: Arc<TaskIndex>,
    shutdown: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>, ConsoleError> {
    config.check()?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|source| ConsoleError::Bind {
            addr: config.addr,
            source,
        })?;
    tracing::info!(addr = %listener.local_addr().map_or(config.addr, |a| a), login = config.token.is_some(), "console listening");
    let state = Arc::new(http::State {
        config,
        apis,
        index,
    });
    Ok(tokio::spawn(http::serve(listener, state, shutdown)))
}
