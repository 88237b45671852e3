//! What every console request must pass before it is routed, and the headers every answer
//! carries. The checks follow what careful web frameworks do by default:
//!
//! - **Host** (DNS rebinding): the name in `Host` must be one this console answers to —
//!   an IP literal (the bound address, or any when bound to all interfaces), `localhost`,
//!   or `--console-url`'s host. A rebinding attack reaches the console through the
//!   attacker's own name, which is refused.
//! - **Cross-origin requests** (CSRF), as Go's `net/http.CrossOriginProtection` and
//!   Django's origin check do: a request that changes state is refused when the browser
//!   says it comes from another site or origin (`Sec-Fetch-Site` other than `same-origin`
//!   / `none`) or, for browsers that do not send it, when its `Origin` differs from the
//!   console's own. Ports count: a page on another port of the same host is another
//!   origin (cookies do not tell them apart, origins do). Requests with neither header do
//!   not come from a browser page and pass (the CLI, curl).
//! - **JSON only**: the API takes `application/json` bodies, which a cross-site form or a
//!   `no-cors` fetch cannot send without a CORS preflight (which is never granted).

use super::config::{url_host, ConsoleConfig};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Request};
use std::net::{IpAddr, SocketAddr};

/// Why a request was refused before routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// `Host` names no address of this console (DNS rebinding).
    Host,
    /// A state-changing request from another origin (CSRF).
    CrossOrigin,
    /// An API body that is not `application/json`.
    NotJson,
}

impl Refusal {
    pub(crate) fn status(self) -> http::StatusCode {
        match self {
            Refusal::Host | Refusal::CrossOrigin => http::StatusCode::FORBIDDEN,
            Refusal::NotJson => http::StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }

    pub(crate) fn code(self) -> &'static str {
        match self {
            Refusal::Host => "host_not_allowed",
            Refusal::CrossOrigin => "cross_origin",
            Refusal::NotJson => "json_only",
        }
    }

    pub(crate) fn message(self) -> &'static str {
        match self {
            Refusal::Host => "this console does not answer to that host name",
            Refusal::CrossOrigin => "requests from other origins are refused",
            Refusal::NotJson => "send a JSON body (content-type: application/json)",
        }
    }
}

/// The host names a console answers to.
#[derive(Debug, Clone)]
pub(crate) struct Guard {
    bound: IpAddr,
    url_host: Option<String>,
}

/// The host part of a `Host` value (`name`, `name:port`, `[v6]:port`), lowercased.
fn host_of(authority: &str) -> Option<String> {
    let a: http::uri::Authority = authority.parse().ok()?;
    if a.as_str().contains('@') {
        return None;
    }
    let host = a.host().trim_start_matches('[').trim_end_matches(']');
    Some(host.trim_end_matches('.').to_ascii_lowercase())
}

fn is_safe(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

impl Guard {
    pub(crate) fn new(config: &ConsoleConfig, bound: SocketAddr) -> Guard {
        Guard {
            bound: bound.ip(),
            url_host: config.url.as_deref().and_then(url_host),
        }
    }

    /// True if `host` (from `Host` or an `Origin`) names this console.
    fn host_allowed(&self, host: &str) -> bool {
        if let Ok(ip) = host.parse::<IpAddr>() {
            return self.bound.is_unspecified() || ip == self.bound || ip.is_loopback();
        }
        host == "localhost" || self.url_host.as_deref() == Some(host)
    }

    /// Checks a request before routing.
    pub(crate) fn check<B>(&self, req: &Request<B>) -> Result<(), Refusal> {
        let headers = req.headers();
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .and_then(host_of)
            .ok_or(Refusal::Host)?;
        if !self.host_allowed(&host) {
            return Err(Refusal::Host);
        }
        if is_safe(req.method()) {
            return Ok(());
        }
        self.same_origin(headers)?;
        if req.uri().path().starts_with("/api/") && !is_json(headers) {
            return Err(Refusal::NotJson);
        }
        Ok(())
    }

    fn same_origin(&self, headers: &HeaderMap) -> Result<(), Refusal> {
        if let Some(site) = headers.get("sec-fetch-site") {
            return match site.as_bytes() {
                b"same-origin" | b"none" => Ok(()),
                _ => Err(Refusal::CrossOrigin),
            };
        }
        let Some(origin) = headers.get(header::ORIGIN) else {
            return Ok(()); // not from a browser page
        };
        let origin = origin.to_str().map_err(|_| Refusal::CrossOrigin)?;
        let own = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let (_, authority) = origin.split_once("://").ok_or(Refusal::CrossOrigin)?;
        if authority.eq_ignore_ascii_case(own) {
            return Ok(());
        }
        // Behind a proxy the browser's origin is the console URL's, not the Host the proxy
        // forwards.
        match (&self.url_host, host_of(authority)) {
            (Some(url), Some(h)) if *url == h => Ok(()),
            _ => Err(Refusal::CrossOrigin),
        }
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// Headers on every answer: no framing, no inline or foreign scripts, no referrer, no
/// sniffing, no caching.
pub(crate) fn harden(headers: &mut HeaderMap) {
    const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
        img-src 'self' data:; connect-src 'self'; form-action 'self'; base-uri 'none'; \
        frame-ancestors 'none'";
    let set = [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::CACHE_CONTROL, "no-store"),
    ];
    for (name, value) in set {
        headers.insert(name, HeaderValue::from_static(value));
    }
    headers.insert(
        "cross-origin-opener-policy",
        HeaderValue::from_static("same-origin"),
    );
    headers.insert(
        "cross-origin-resource-policy",
        HeaderValue::from_static("same-origin"),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(bound: &str, url: Option<&str>) -> Guard {
        let bound: SocketAddr = bound.parse().unwrap();
        let mut c = ConsoleConfig::new(bound);
        c.url = url.map(str::to_string);
        Guard::new(&c, bound)
    }

    fn req(method: Method, path: &str, headers: &[(&str, &str)]) -> Request<()> {
        let mut b = Request::builder().method(method).uri(path);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    #[test]
    fn host_names_the_console_or_is_refused() {
        let g = guard("127.0.0.1:8080", Some("https://ax.example.com"));
        for ok in [
            "127.0.0.1:8080",
            "localhost:8080",
            "[::1]:8080",
            "AX.example.com",
        ] {
            assert_eq!(
                g.check(&req(Method::GET, "/", &[("host", ok)])),
                Ok(()),
                "{ok}"
            );
        }
        for bad in [
            "rebind.attacker.example",
            "10.0.0.9:8080",
            "localhost.evil",
            "",
            "a@b",
        ] {
            assert_eq!(
                g.check(&req(Method::GET, "/", &[("host", bad)])),
                Err(Refusal::Host),
                "{bad}"
            );
        }
        assert_eq!(g.check(&req(Method::GET, "/", &[])), Err(Refusal::Host));
        let any = guard("0.0.0.0:8080", None);
        assert_eq!(
            any.check(&req(Method::GET, "/", &[("host", "10.0.0.9:8080")])),
            Ok(())
        );
        assert_eq!(
            any.check(&req(Method::GET, "/", &[("host", "ax.attacker.example")])),
            Err(Refusal::Host)
        );
    }

    #[test]
    fn state_changes_come_from_the_console_s_own_origin_with_json() {
        let g = guard("127.0.0.1:8080", None);
        let host = ("host", "127.0.0.1:8080");
        let json = ("content-type", "application/json; charset=utf-8");
        let post = |h: &[(&str, &str)]| g.check(&req(Method::POST, "/api/task/pause", h));
        assert_eq!(post(&[host, json]), Ok(()), "no browser headers: the CLI");
        assert_eq!(
            post(&[host, json, ("origin", "http://127.0.0.1:8080")]),
            Ok(())
        );
        assert_eq!(
            post(&[host, json, ("sec-fetch-site", "same-origin")]),
            Ok(())
        );
        for (k, v) in [
            ("origin", "http://127.0.0.1:9999"),
            ("origin", "http://localhost:8080"),
            ("origin", "null"),
            ("sec-fetch-site", "same-site"),
            ("sec-fetch-site", "cross-site"),
        ] {
            assert_eq!(
                post(&[host, json, (k, v)]),
                Err(Refusal::CrossOrigin),
                "{k}: {v}"
            );
        }
        assert_eq!(
            post(&[host, ("content-type", "text/plain")]),
            Err(Refusal::NotJson)
        );
        assert_eq!(post(&[host]), Err(Refusal::NotJson));
        let proxied = guard("127.0.0.1:8080", Some("https://ax.example.com"));
        assert_eq!(
            proxied.check(&req(
                Method::POST,
                "/api/task/pause",
                &[host, json, ("origin", "https://ax.example.com")]
            )),
            Ok(())
        );
    }
}
