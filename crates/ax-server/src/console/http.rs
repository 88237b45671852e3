//! The console's HTTP side: bounded connections with timeouts, the guard, static assets,
//! the API bridge, login and logout, live updates.

use super::config::{read_only, ConsoleConfig, Role};
use super::conns::{Admitted, Busy, Conns};
use super::guard::{harden, Guard};
use super::session::{same, Sessions};
use crate::ops::feed::TaskIndex;
use crate::server::handle::Apis;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::warn;

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const CHART_JS: &str = include_str!("assets/chart.js");
const APP_CSS: &str = include_str!("assets/app.css");
/// Largest API request body.
const MAX_BODY: usize = 1 << 20;

pub(crate) struct State {
    pub(crate) config: ConsoleConfig,
    pub(crate) guard: Guard,
    pub(crate) sessions: Sessions,
    pub(crate) apis: Arc<Apis>,
    pub(crate) index: Arc<TaskIndex>,
    /// Flow runs', waits', triggers' and limits' changes (live updates).
    pub(crate) changes: Arc<super::Changes>,
    /// The server's services, as its supervisor sees them.
    pub(crate) health: ax_core::supervisor::Health,
}

type Body = BoxBody<Bytes, Infallible>;

fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).boxed()
}

fn respond(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn json_reply(status: StatusCode, value: &Value) -> Response<Body> {
    respond(status, "application/json", value.to_string())
}

fn error(status: StatusCode, code: &str, message: &str) -> Response<Body> {
    json_reply(
        status,
        &json!({"error": {"code": code, "message": message}}),
    )
}

/// An answer's body holding its request's [`Busy`] until the body is sent to its end (or
/// dropped): a streamed answer (live updates) keeps its connection busy, not evictable.
fn held(body: Body, busy: Busy) -> Body {
    Held { body, _busy: busy }.boxed()
}

struct Held {
    body: Body,
    _busy: Busy,
}

impl hyper::body::Body for Held {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

fn with_cookie(mut r: Response<Body>, cookie: String) -> Response<Body> {
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        r.headers_mut().insert(header::SET_COOKIE, v);
    }
    r
}

pub(crate) async fn serve(
    listener: &tokio::net::TcpListener,
    state: Arc<State>,
    shutdown: CancellationToken,
) {
    let connections = tokio_util::task::TaskTracker::new();
    let open = Arc::new(Conns::new(state.config.max_connections));
    let mut refused_logged = Instant::now() - Duration::from_secs(60);
    loop {
        let (stream, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(cause = %e, "console: accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        // Bounded (conns.rs): slow or idle clients cannot take every file descriptor of the
        // process (the metrics endpoint and NATS need theirs), and at the bound the
        // connection that has waited longest between requests is closed for the newcomer;
        // only when every one is in a request is the newcomer refused.
        let conn = match open.admit() {
            Admitted::Room(conn) => conn,
            Admitted::Evicted(conn) => {
                metrics::counter!(ax_core::metrics::CONSOLE_CONNECTIONS_REFUSED, "which" => "idle")
                    .increment(1);
                conn
            }
            Admitted::Full => {
                metrics::counter!(ax_core::metrics::CONSOLE_CONNECTIONS_REFUSED, "which" => "new")
                    .increment(1);
                if refused_logged.elapsed() > Duration::from_secs(10) {
                    refused_logged = Instant::now();
                    warn!(
                        max = state.config.max_connections,
                        "console: every connection is in a request; closing new ones"
                    );
                }
                drop(stream);
                continue;
            }
        };
        let (state, stop, open) = (state.clone(), shutdown.clone(), open.clone());
        let timeout = state.config.request_timeout;
        connections.spawn(async move {
            let service = hyper::service::service_fn({
                let (open, conn) = (open.clone(), conn.clone());
                move |req| {
                    let (state, stop) = (state.clone(), stop.clone());
                    let busy = open.busy(&conn);
                    async move {
                        let answer = answer(&state, req, peer, stop).await;
                        Ok::<_, Infallible>(answer.map(|body| held(body, busy)))
                    }
                }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(timeout)
                .max_buf_size(64 * 1024);
            let served = builder.serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                _ = served => {}
                _ = conn.close.cancelled() => {} // made room for a newer connection
            }
            open.closed(&conn);
        });
    }
    connections.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), connections.wait()).await;
}

/// Answers one request: the guard first, then the route; every answer hardened. A
/// handler that panics (a bug) answers 500 instead of dropping the connection.
async fn answer(
    state: &State,
    req: Request<Incoming>,
    peer: SocketAddr,
    stop: CancellationToken,
) -> Response<Body> {
    let mut response = match state.guard.check(&req) {
        Err(refusal) => error(refusal.status(), refusal.code(), refusal.message()),
        Ok(()) => std::panic::AssertUnwindSafe(route(state, req, peer, stop))
            .catch_unwind()
            .await
            .unwrap_or_else(|_| {
                warn!("console: a request handler panicked");
                error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "internal error",
                )
            }),
    };
    harden(response.headers_mut());
    response
}

/// True when the browser reached the console over TLS (directly or through a proxy
/// that says so): the session cookie is then `Secure`.
fn secure(state: &State, req: &Request<Incoming>) -> bool {
    state
        .config
        .url
        .as_deref()
        .is_some_and(|u| u.starts_with("https://"))
        || req
            .headers()
            .get("x-forwarded-proto")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"))
}

fn cookies(req: &Request<Incoming>) -> impl Iterator<Item = &str> {
    req.headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
}

/// A token's role, compared in constant time.
fn token_role(state: &State, given: &str) -> Option<Role> {
    let admin = state.config.token.as_deref()?;
    if same(given, admin) {
        Some(Role::Admin)
    } else if state
        .config
        .readonly_token
        .as_deref()
        .is_some_and(|t| same(given, t))
    {
        Some(Role::ReadOnly)
    } else {
        None
    }
}

/// The role a request carries: a live session's, or a bearer token's; everyone is admin
/// on a console without a token (loopback only).
fn role(state: &State, req: &Request<Incoming>) -> Option<Role> {
    if state.config.token.is_none() {
        return Some(Role::Admin);
    }
    if let Some(bearer) = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    {
        return token_role(state, bearer);
    }
    state.sessions.role(cookies(req))
}

async fn route(
    state: &State,
    req: Request<Incoming>,
    peer: SocketAddr,
    stop: CancellationToken,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/" | "/index.html") => {
            respond(StatusCode::OK, "text/html; charset=utf-8", INDEX_HTML)
        }
        (&Method::GET, "/app.js") => {
            respond(StatusCode::OK, "text/javascript; charset=utf-8", APP_JS)
        }
        (&Method::GET, "/chart.js") => {
            respond(StatusCode::OK, "text/javascript; charset=utf-8", CHART_JS)
        }
        (&Method::GET, "/app.css") => respond(StatusCode::OK, "text/css; charset=utf-8", APP_CSS),
        (&Method::GET, "/healthz") => healthz(state, &req),
        (&Method::POST, "/api/login") => login(state, req, peer).await,
        (&Method::POST, "/api/logout") => {
            let cleared = state.sessions.end(cookies(&req), secure(state, &req));
            with_cookie(json_reply(StatusCode::OK, &json!({"ok": true})), cleared)
        }
        (&Method::GET, "/api/whoami") => match role(state, &req) {
            Some(r) => json_reply(
                StatusCode::OK,
                &json!({"role": role_name(r), "login": state.config.token.is_some()}),
            ),
            None => error(StatusCode::UNAUTHORIZED, "login", "log in"),
        },
        (&Method::GET, "/api/live") => match role(state, &req) {
            Some(_) => live(state, stop),
            None => error(StatusCode::UNAUTHORIZED, "login", "log in"),
        },
        (&Method::POST, p) if p.starts_with("/api/") => api(state, req).await,
        (&Method::POST, p) if p.starts_with(super::hook::PREFIX) => {
            approval_hook(state, req, peer).await
        }
        _ => respond(StatusCode::NOT_FOUND, "text/plain", "not found"),
    }
}

/// `GET /healthz`: 200 while every service of the server runs, 503 while one waits to be
/// started again; each service's `up` and `restarts`, and with a login why it last
/// stopped.
fn healthz(state: &State, req: &Request<Incoming>) -> Response<Body> {
    let services = state.health.services();
    let ok = services.values().all(|s| s.up);
    let detail = role(state, req).is_some();
    let services: serde_json::Map<String, serde_json::Value> = services
        .into_iter()
        .map(|(name, mut s)| {
            if !detail {
                s.last_stop = None;
            }
            (name.to_string(), json!(s))
        })
        .collect();
    let status = match ok {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    };
    json_reply(status, &json!({"ok": ok, "services": services}))
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Admin => "admin",
        Role::ReadOnly => "read-only",
    }
}

/// The request's body: at most 1 MiB, each part within the request timeout.
async fn body(state: &State, req: Request<Incoming>) -> Result<Bytes, Response<Body>> {
    let timeout = state.config.request_timeout;
    let mut body = Limited::new(req.into_body(), MAX_BODY);
    let mut out = bytes::BytesMut::new();
    loop {
        match tokio::time::timeout(timeout, body.frame()).await {
            Err(_) => {
                return Err(error(
                    StatusCode::REQUEST_TIMEOUT,
                    "timeout",
                    "the request body stalled",
                ))
            }
            Ok(None) => return Ok(out.freeze()),
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    out.extend_from_slice(&data);
                }
            }
            Ok(Some(Err(_))) => {
                return Err(error(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    "at most 1 MiB",
                ))
            }
        }
    }
}

/// 429 with `Retry-After`: the caller's address failed too often.
fn throttled(wait: Duration, message: &str) -> Response<Body> {
    let mut r = error(StatusCode::TOO_MANY_REQUESTS, "throttled", message);
    r.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(wait.as_secs().max(1)),
    );
    r
}

/// `POST /hooks/approvals/<token>/approve|reject` (`hook.rs`): no session, the token is
/// the credential; wrong tokens count as failed logins of the caller's address.
async fn approval_hook(state: &State, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
    if let Err(wait) = state.sessions.may_try(peer.ip()) {
        return throttled(wait, "too many wrong tokens: wait");
    }
    let path = req.uri().path().to_string();
    let bytes = match body(state, req).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let (status, value) =
        super::hook::approval(&state.sessions, &state.apis, &path, &bytes, peer.ip()).await;
    json_reply(status, &value)
}

async fn login(state: &State, req: Request<Incoming>, peer: SocketAddr) -> Response<Body> {
    if let Err(wait) = state.sessions.may_try(peer.ip()) {
        return throttled(wait, "too many failed logins: wait");
    }
    let secure = secure(state, &req);
    let bytes = match body(state, req).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let token = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["token"].as_str().map(str::to_string))
        .unwrap_or_default();
    let role = match &state.config.token {
        None => Some(Role::Admin),
        Some(_) => token_role(state, &token),
    };
    match role {
        Some(r) => {
            state.sessions.succeeded(peer.ip());
            let cookie = state.sessions.start(r, secure);
            with_cookie(
                json_reply(StatusCode::OK, &json!({"role": role_name(r)})),
                cookie,
            )
        }
        None => {
            state.sessions.failed(peer.ip());
            warn!(client = %peer.ip(), "console: a login with a wrong token");
            error(StatusCode::UNAUTHORIZED, "wrong_token", "wrong token")
        }
    }
}

/// `POST /api/<api>/<op>`: the request API `ax.<api>.<op>`, run in this server.
async fn api(state: &State, req: Request<Incoming>) -> Response<Body> {
    let Some(role) = role(state, &req) else {
        return error(StatusCode::UNAUTHORIZED, "login", "log in");
    };
    let path = req.uri().path().trim_start_matches("/api/").to_string();
    let Some((api, op)) = path.split_once('/') else {
        return respond(StatusCode::NOT_FOUND, "text/plain", "not found");
    };
    if role == Role::ReadOnly && !read_only(api, op) {
        return error(StatusCode::FORBIDDEN, "forbidden", "read-only access");
    }
    let bytes = match body(state, req).await {
        Ok(b) if b.is_empty() => Bytes::from_static(b"{}"),
        Ok(b) => b,
        Err(r) => return r,
    };
    let reply = match state.apis.call(api, op, bytes).await {
        Some(Ok(value)) => json!({ "ok": value }),
        Some(Err(error)) => json!({ "error": error }),
        None => return respond(StatusCode::NOT_FOUND, "text/plain", "no such API"),
    };
    json_reply(StatusCode::OK, &reply)
}

/// Server-sent events: `change` with a version whenever the task index, a flow run, a
/// wait, a trigger or a limit moved (checked every 300 ms), a comment every 15 s to keep
/// the connection open.
fn live(state: &State, stop: CancellationToken) -> Response<Body> {
    let (index, changes) = (state.index.clone(), state.changes.clone());
    let stream = futures::stream::unfold((0u64, 0u32), move |(seen, idle)| {
        let (index, changes, stop) = (index.clone(), changes.clone(), stop.clone());
        async move {
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
            let now = index.version().wrapping_add(changes.version());
            let frame = if now != seen {
                Some(format!("event: change\ndata: {now}\n\n"))
            } else if idle >= 50 {
                Some(": keepalive\n\n".to_string())
            } else {
                None
            };
            let idle = if frame.is_some() { 0 } else { idle + 1 };
            Some((frame, (now, idle)))
        }
    })
    .filter_map(|f| async move {
        f.map(|text| Ok::<_, Infallible>(Frame::data(Bytes::from(text))))
    });
    // A first comment at once, so the browser sees the stream open.
    let stream = futures::stream::once(async {
        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b": open\n\n")))
    })
    .chain(stream);
    let mut r = Response::new(BodyExt::boxed(StreamBody::new(stream)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    r
}
