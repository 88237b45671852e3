//! The console's HTTP side: static assets, the API bridge, login, live updates.

use super::{read_only, ConsoleConfig, Role};
use crate::ops::feed::TaskIndex;
use crate::server::handle::Apis;
use bytes::Bytes;
use futures::StreamExt;
use http::{header, Method, Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::warn;

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");
/// Largest API request body.
const MAX_BODY: usize = 1 << 20;
const COOKIE: &str = "ax_token";

pub(crate) struct State {
    pub(crate) config: ConsoleConfig,
    pub(crate) apis: Arc<Apis>,
    pub(crate) index: Arc<TaskIndex>,
}

type Body = BoxBody<Bytes, Infallible>;

fn full(body: impl Into<Bytes>) -> Body {
    Full::new(body.into()).boxed()
}

fn respond(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .header(header::CACHE_CONTROL, "no-store")
        .header("x-content-type-options", "nosniff")
        .body(full(body))
        .expect("a valid response")
}

fn json_reply(status: StatusCode, value: &Value) -> Response<Body> {
    respond(status, "application/json", value.to_string())
}

pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<State>,
    shutdown: CancellationToken,
) {
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let (stream, _) = tokio::select! {
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
        let (state, stop) = (state.clone(), shutdown.clone());
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let (state, stop) = (state.clone(), stop.clone());
                async move { Ok::<_, Infallible>(route(&state, req, stop).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service);
            let _ = conn.await;
        });
    }
    connections.close();
    let _ = tokio::time::timeout(Duration::from_secs(5), connections.wait()).await;
}

/// The role a request carries: from the cookie or a bearer token; `None` if it has none
/// that is valid.
fn role(state: &State, req: &Request<Incoming>) -> Option<Role> {
    let Some(admin) = &state.config.token else {
        return Some(Role::Admin);
    };
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let cookie = req
        .headers()
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| {
            c.trim()
                .strip_prefix(&format!("{COOKIE}="))
                .map(str::to_string)
        })
        .next();
    let given = bearer.or(cookie)?;
    if given == *admin {
        Some(Role::Admin)
    } else if state.config.readonly_token.as_deref() == Some(given.as_str()) {
        Some(Role::ReadOnly)
    } else {
        None
    }
}

async fn route(state: &State, req: Request<Incoming>, stop: CancellationToken) -> Response<Body> {
    let path = req.uri().path().to_string();
    match (req.method(), path.as_str()) {
        (&Method::GET, "/" | "/index.html") => {
            respond(StatusCode::OK, "text/html; charset=utf-8", INDEX_HTML)
        }
        (&Method::GET, "/app.js") => {
            respond(StatusCode::OK, "text/javascript; charset=utf-8", APP_JS)
        }
        (&Method::GET, "/app.css") => respond(StatusCode::OK, "text/css; charset=utf-8", APP_CSS),
        (&Method::POST, "/api/login") => login(state, req).await,
        (&Method::GET, "/api/whoami") => match role(state, &req) {
            Some(r) => json_reply(
                StatusCode::OK,
                &json!({"role": role_name(r), "login": state.config.token.is_some()}),
            ),
            None => json_reply(StatusCode::UNAUTHORIZED, &json!({"error": "log in"})),
        },
        (&Method::GET, "/api/live") => match role(state, &req) {
            Some(_) => live(state, stop),
            None => json_reply(StatusCode::UNAUTHORIZED, &json!({"error": "log in"})),
        },
        (&Method::POST, p) if p.starts_with("/api/") => api(state, req).await,
        _ => respond(StatusCode::NOT_FOUND, "text/plain", "not found"),
    }
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Admin => "admin",
        Role::ReadOnly => "read-only",
    }
}

async fn body(req: Request<Incoming>) -> Result<Bytes, Response<Body>> {
    match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(_) => Err(json_reply(
            StatusCode::PAYLOAD_TOO_LARGE,
            &json!({"error": {"code": "payload_too_large", "message": "at most 1 MiB"}}),
        )),
    }
}

async fn login(state: &State, req: Request<Incoming>) -> Response<Body> {
    let bytes = match body(req).await {
        Ok(b) => b,
        Err(r) => return r,
    };
    let token = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["token"].as_str().map(str::to_string))
        .unwrap_or_default();
    let role = match &state.config.token {
        None => Some(Role::Admin),
        Some(admin) if *admin == token => Some(Role::Admin),
        Some(_) if state.config.readonly_token.as_deref() == Some(token.as_str()) => {
            Some(Role::ReadOnly)
        }
        Some(_) => None,
    };
    match role {
        Some(r) => Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .header(
                header::SET_COOKIE,
                format!("{COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"),
            )
            .body(full(json!({"role": role_name(r)}).to_string()))
            .expect("a valid response"),
        None => json_reply(StatusCode::UNAUTHORIZED, &json!({"error": "wrong token"})),
    }
}

/// `POST /api/<api>/<op>`: the request API `ax.<api>.<op>`, run in this server.
async fn api(state: &State, req: Request<Incoming>) -> Response<Body> {
    let Some(role) = role(state, &req) else {
        return json_reply(StatusCode::UNAUTHORIZED, &json!({"error": "log in"}));
    };
    let path = req.uri().path().trim_start_matches("/api/").to_string();
    let Some((api, op)) = path.split_once('/') else {
        return respond(StatusCode::NOT_FOUND, "text/plain", "not found");
    };
    if role == Role::ReadOnly && !read_only(api, op) {
        return json_reply(
            StatusCode::FORBIDDEN,
            &json!({"error": {"code": "forbidden", "message": "read-only access"}}),
        );
    }
    let bytes = match body(req).await {
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

/// Server-sent events: `change` with the index's version whenever it moved (checked every
/// 300 ms), a comment every 15 s to keep the connection open.
fn live(state: &State, stop: CancellationToken) -> Response<Body> {
    let index = state.index.clone();
    let stream = futures::stream::unfold((0u64, 0u32), move |(seen, idle)| {
        let (index, stop) = (index.clone(), stop.clone());
        async move {
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep(Duration::from_millis(300)) => {}
            }
            let now = index.version();
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
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-store")
        .body(BodyExt::boxed(StreamBody::new(stream)))
        .expect("a valid response")
}
