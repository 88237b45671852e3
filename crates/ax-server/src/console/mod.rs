//! The web console: served by `ax server --console-addr`, assets embedded in
//! the binary, no separate process. The page calls the same APIs as the CLI and the SDK
//! (`POST /api/<api>/<op>` runs `ax.<api>.<op>` in this server), and listens to
//! `GET /api/live` (server-sent events: a tick whenever the task index, a flow run or a
//! wait moved) to refresh what it shows without a reload.
//!
//! Access: loopback only unless a token is given; with a token (`--console-token`) every
//! API call needs a session (made by logging in with the token) or `Authorization: Bearer
//! <token>`; a second, read-only token (`--console-readonly-token`) allows only reads.
//! Every request is checked before it is routed (`guard.rs`): its `Host` must name this
//! console (DNS rebinding), a state-changing request must come from the console's own
//! origin with a JSON body (cross-site request forgery). The threat model is in
//! docs/ARCHITECTURE.md, "The console".

mod changes;
mod config;
mod conns;
mod guard;
mod hook;
mod http;
mod session;

use crate::ops::feed::TaskIndex;
use crate::server::handle::Apis;
pub(crate) use changes::Changes;
pub use config::{ConsoleConfig, ConsoleError};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Binds the console and serves it until `shutdown`.
pub(crate) async fn start(
    config: ConsoleConfig,
    apis: Arc<Apis>,
    index: Arc<TaskIndex>,
    changes: Arc<Changes>,
    health: ax_core::supervisor::Health,
) -> Result<Console, ConsoleError> {
    config.check()?;
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|source| ConsoleError::Bind {
            addr: config.addr,
            source,
        })?;
    let bound = listener.local_addr().unwrap_or(config.addr);
    tracing::info!(addr = %bound, login = config.token.is_some(), "console listening");
    let state = Arc::new(http::State {
        guard: guard::Guard::new(&config, bound),
        sessions: session::Sessions::new(bound.port(), config.session_ttl),
        config,
        apis,
        index,
        changes,
        health,
    });
    Ok(Console {
        listener: Arc::new(listener),
        state,
    })
}

/// A console bound to its address: [`Console::serve`] accepts connections until its token
/// is cancelled, and may be called again (the server's supervisor does when it ends).
#[derive(Clone)]
pub(crate) struct Console {
    listener: Arc<tokio::net::TcpListener>,
    state: Arc<http::State>,
}

impl Console {
    /// Serves until `shutdown` is cancelled; connections open then get 5 s to finish.
    pub(crate) async fn serve(self, shutdown: CancellationToken) {
        http::serve(&self.listener, self.state, shutdown).await
    }
}
