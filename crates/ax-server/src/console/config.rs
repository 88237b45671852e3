//! A console's settings, checked before it starts, and who a request is.

use std::net::SocketAddr;
use std::time::Duration;

/// Console settings of a server.
///
/// ```
/// let console = ax_server::console::ConsoleConfig::new("127.0.0.1:8080".parse().unwrap())
///     .token("a-long-random-admin-token")
///     .url("https://ax.example.com");
/// assert!(console.check().is_ok());
/// ```
#[derive(Debug, Clone)]
pub struct ConsoleConfig {
    /// Where to listen. A non-loopback address needs a token.
    pub addr: SocketAddr,
    /// The admin token; none: no login (allowed on loopback only).
    pub token: Option<String>,
    /// A token that may only read (needs an admin token).
    pub readonly_token: Option<String>,
    /// The console's public base URL (`--console-url`, default none): its host is
    /// accepted in `Host` and `Origin`, and an `https` URL marks the session cookie
    /// `Secure`.
    pub url: Option<String>,
    /// Most connections open at once (default 256); more are closed at once, so slow
    /// clients cannot take the process's file descriptors.
    pub max_connections: usize,
    /// Time a client has to send a request's headers, and to send each part of its body
    /// (default 10 s).
    pub request_timeout: Duration,
    /// Lifetime of a login session (default 12 h).
    pub session_ttl: Duration,
}

/// Why a console could not start.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// A console reachable from other hosts without a token.
    #[error("the console on {0} is reachable from other hosts: give it --console-token")]
    Unprotected(SocketAddr),
    /// A token that is empty, too short to be one, or holds characters a header cannot.
    #[error("{which}: {why}")]
    BadToken {
        /// Which setting.
        which: &'static str,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A read-only token without an admin token would leave everyone admin.
    #[error("--console-readonly-token needs --console-token (without one everyone is admin)")]
    ReadOnlyWithoutAdmin,
    /// The two tokens are the same.
    #[error("--console-readonly-token must differ from --console-token")]
    SameTokens,
    /// `--console-url` is not an http(s) URL with a host.
    #[error("--console-url {0:?}: expected http(s)://host[:port][/path]")]
    BadUrl(String),
    /// The address could not be bound.
    #[error("console address {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// Shortest token accepted.
const MIN_TOKEN: usize = 8;

fn check_token(which: &'static str, token: &str) -> Result<(), ConsoleError> {
    let why = if token.trim().is_empty() {
        "empty"
    } else if token.chars().any(|c| c.is_control() || c.is_whitespace()) {
        "no spaces or control characters"
    } else if token.len() < MIN_TOKEN {
        "at least 8 characters"
    } else {
        return Ok(());
    };
    Err(ConsoleError::BadToken { which, why })
}

impl ConsoleConfig {
    /// A console on `addr` with no token and the documented defaults.
    pub fn new(addr: SocketAddr) -> ConsoleConfig {
        ConsoleConfig {
            addr,
            token: None,
            readonly_token: None,
            url: None,
            max_connections: 256,
            request_timeout: Duration::from_secs(10),
            session_ttl: Duration::from_secs(12 * 3600),
        }
    }

    /// Sets the admin token.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Sets the read-only token.
    pub fn readonly_token(mut self, token: impl Into<String>) -> Self {
        self.readonly_token = Some(token.into());
        self
    }

    /// Sets the public base URL.
    pub fn url(mut self, url: impl Into<String>) -> Self {
        self.url = Some(url.into());
        self
    }

    /// Sets the most connections open at once.
    pub fn max_connections(mut self, n: usize) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Sets the time allowed for a request's headers and for each part of its body.
    pub fn request_timeout(mut self, t: Duration) -> Self {
        self.request_timeout = t;
        self
    }

    /// Sets the lifetime of a login session.
    pub fn session_ttl(mut self, t: Duration) -> Self {
        self.session_ttl = t;
        self
    }

    /// Checks the settings: tokens that are tokens, a token off loopback, a read-only
    /// token only beside an admin one, a URL with a host.
    pub fn check(&self) -> Result<(), ConsoleError> {
        if let Some(t) = &self.token {
            check_token("--console-token", t)?;
        }
        if let Some(t) = &self.readonly_token {
            check_token("--console-readonly-token", t)?;
            match &self.token {
                None => return Err(ConsoleError::ReadOnlyWithoutAdmin),
                Some(admin) if admin == t => return Err(ConsoleError::SameTokens),
                Some(_) => {}
            }
        }
        if let Some(url) = &self.url {
            url_host(url).ok_or_else(|| ConsoleError::BadUrl(url.clone()))?;
        }
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

/// Operations a read-only user may call: those the API registry marks read-only.
pub(super) fn read_only(api: &str, op: &str) -> bool {
    ax_sdk::api::Api::from_name(api)
        .and_then(|api| ax_sdk::api::operation(api, op))
        .is_some_and(|o| o.read_only)
}

/// The host of an `http(s)://host[:port][/path]` URL, lowercased.
pub(crate) fn url_host(url: &str) -> Option<String> {
    let uri: http::Uri = url.parse().ok()?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return None;
    }
    let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then(|| host.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(addr: &str) -> ConsoleConfig {
        ConsoleConfig::new(addr.parse().unwrap())
    }

    #[test]
    fn settings_that_leave_the_console_open_are_refused() {
        assert!(on("127.0.0.1:1").check().is_ok());
        assert!(matches!(
            on("0.0.0.0:1").check(),
            Err(ConsoleError::Unprotected(_))
        ));
        for bad in ["", "   ", "short", "has space in it", "ctl\u{1}character"] {
            assert!(
                matches!(
                    on("0.0.0.0:1").token(bad).check(),
                    Err(ConsoleError::BadToken { .. })
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            on("127.0.0.1:1").readonly_token("viewer-token").check(),
            Err(ConsoleError::ReadOnlyWithoutAdmin)
        ));
        assert!(matches!(
            on("127.0.0.1:1")
                .token("same-token")
                .readonly_token("same-token")
                .check(),
            Err(ConsoleError::SameTokens)
        ));
        assert!(matches!(
            on("127.0.0.1:1").url("not a url").check(),
            Err(ConsoleError::BadUrl(_))
        ));
        assert!(on("0.0.0.0:1")
            .token("admin-token")
            .readonly_token("viewer-token")
            .url("https://ax.example.com/console")
            .check()
            .is_ok());
    }
}
