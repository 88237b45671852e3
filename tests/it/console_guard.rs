//! The console tried as an attacker would, over raw HTTP (what a hostile page makes a
//! browser send, and what a slow or hostile client sends itself): forged origins and
//! hosts, empty or odd credentials, stolen cookies, slow clients.

use crate::procs::free_port;
use crate::support::{within, Env};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const ADMIN: &str = "s3cret-admin";
const VIEWER: &str = "viewer-token";

/// An HTTP answer: status, headers (lowercased names) and body.
pub(crate) struct Answer {
    pub(crate) status: u16,
    headers: Vec<(String, String)>,
    pub(crate) body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends one request (`Connection: close`) with exactly the headers given and reads the
/// answer.
pub(crate) async fn send(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let mut text = format!("{method} {path} HTTP/1.1\r\nconnection: close\r\n");
    for (k, v) in headers {
        text.push_str(&format!("{k}: {v}\r\n"));
    }
    text.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    tcp.write_all(text.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut raw))
        .await
        .expect("an answer within 10 s")
        .expect("an answer, not a reset");
    let raw = String::from_utf8_lossy(&raw).to_string();
    let (head, body) = raw.split_once("\r\n\r\n").expect("a complete answer");
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Answer {
        status,
        headers,
        body: body.to_string(),
    }
}

/// A request as a same-origin page of the console sends it.
async fn api(port: u16, path: &str, extra: &[(&str, &str)], body: &str) -> Answer {
    let host = format!("127.0.0.1:{port}");
    let mut headers = vec![
        ("host", host.as_str()),
        ("content-type", "application/json"),
    ];
    headers.extend_from_slice(extra);
    send(port, "POST", path, &headers, body).await
}

async fn paused(port: u16, auth: &[(&str, &str)]) -> bool {
    let a = api(port, "/api/task/queues", auth, "{}").await;
    assert_eq!(a.status, 200, "{}", a.body);
    let v: serde_json::Value = serde_json::from_str(&a.body).unwrap();
    v["ok"]["queues"]
        .as_array()
        .unwrap()
        .iter()
        .any(|q| q["queue"] == "q" && q["paused"] == true)
}

pub(crate) fn console(port: u16) -> ax_server::console::ConsoleConfig {
    ax_server::console::ConsoleConfig::new(format!("127.0.0.1:{port}").parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_origin_and_rebinding_requests_change_nothing() {
    within(
        Duration::from_secs(60),
        "console: CSRF and rebinding",
        async {
            // The default console: loopback, no token.
            let port = free_port();
            let _env = Env::start(Env::server().console(console(port))).await;
            let pause = r#"{"queue":"q","by":"console"}"#;
            let other = format!("http://127.0.0.1:{}", free_port());
            let localhost = format!("http://localhost:{port}");
            // A page on another port of the same host, or on another name of this one.
            for (k, v) in [
                ("origin", other.as_str()),
                ("origin", localhost.as_str()),
                ("sec-fetch-site", "same-site"),
                ("sec-fetch-site", "cross-site"),
            ] {
                let a = api(port, "/api/task/pause", &[(k, v)], pause).await;
                assert_eq!(a.status, 403, "{k}: {v} → {}", a.body);
                assert!(a.body.contains("cross_origin"), "{}", a.body);
            }
            // A form or a no-cors fetch can only send text/plain (or form) bodies.
            let host = format!("127.0.0.1:{port}");
            for ct in ["text/plain", "application/x-www-form-urlencoded"] {
                let a = send(
                    port,
                    "POST",
                    "/api/task/pause",
                    &[("host", &host), ("content-type", ct)],
                    pause,
                )
                .await;
                assert_eq!(a.status, 415, "{ct}");
            }
            // DNS rebinding: the attacker's name in Host.
            for (method, path) in [
                ("POST", "/api/task/queues"),
                ("GET", "/"),
                ("GET", "/api/whoami"),
            ] {
                let a = send(
                    port,
                    method,
                    path,
                    &[
                        ("host", "rebind.attacker.example"),
                        ("content-type", "application/json"),
                    ],
                    "{}",
                )
                .await;
                assert_eq!(a.status, 403, "{method} {path}");
                assert!(a.body.contains("host_not_allowed"), "{}", a.body);
            }
            assert!(
                !paused(port, &[]).await,
                "a refused request paused the queue"
            );
            // The console's own page, and the CLI (no browser headers), may.
            let own = format!("http://127.0.0.1:{port}");
            let a = api(
                port,
                "/api/task/pause",
                &[("origin", &own), ("sec-fetch-site", "same-origin")],
                pause,
            )
            .await;
            assert_eq!(a.status, 200, "{}", a.body);
            assert!(paused(port, &[]).await);
            let a = api(port, "/api/task/resume", &[], r#"{"queue":"q"}"#).await;
            assert_eq!(a.status, 200, "{}", a.body);
            assert!(!paused(port, &[]).await);
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_makes_a_session_that_is_not_the_token_and_ends() {
    within(Duration::from_secs(60), "console: sessions", async {
        let port = free_port();
        let _env =
            Env::start(Env::server().console(console(port).token(ADMIN).readonly_token(VIEWER)))
                .await;
        let host = format!("127.0.0.1:{port}");
        // Every answer forbids framing and foreign scripts.
        let page = send(port, "GET", "/", &[("host", &host)], "").await;
        assert_eq!(page.status, 200);
        assert_eq!(page.header("x-frame-options"), Some("DENY"));
        let csp = page.header("content-security-policy").unwrap_or_default();
        assert!(
            csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"),
            "{csp}"
        );

        let login = api(
            port,
            "/api/login",
            &[],
            &format!(r#"{{"token":"{ADMIN}"}}"#),
        )
        .await;
        assert_eq!(login.status, 200, "{}", login.body);
        let set = login.header("set-cookie").unwrap().to_string();
        assert!(!set.contains(ADMIN), "the cookie is the token: {set}");
        for part in ["HttpOnly", "SameSite=Strict", "Max-Age=43200", "Path=/"] {
            assert!(set.contains(part), "{part} missing: {set}");
        }
        assert!(!set.contains("Secure"), "plain http: {set}");
        let session = set.split(';').next().unwrap().to_string();
        assert!(session.starts_with(&format!("ax_session_{port}=")));
        let with = [("cookie", session.as_str())];
        assert!(!paused(port, &with).await);

        // What is not a session is nobody.
        let empty = format!("ax_session_{port}=");
        let old_style = format!("ax_token={ADMIN}");
        for cookie in [empty.as_str(), old_style.as_str(), "ax_token="] {
            let a = api(port, "/api/task/queues", &[("cookie", cookie)], "{}").await;
            assert_eq!(a.status, 401, "{cookie}");
        }
        // A token with a control character is a wrong token, answered.
        let odd = api(
            port,
            "/api/login",
            &[],
            r#"{"token":"a\u0001b\r\nSet-Cookie: x=1"}"#,
        )
        .await;
        assert_eq!(odd.status, 401, "{}", odd.body);
        assert!(odd.header("set-cookie").is_none());

        // Logging out ends the session on the server, not only in the browser.
        let out = api(port, "/api/logout", &with, "{}").await;
        assert_eq!(out.status, 200);
        assert!(out.header("set-cookie").unwrap().contains("Max-Age=0"));
        let a = api(port, "/api/task/queues", &with, "{}").await;
        assert_eq!(a.status, 401, "a logged-out session still works");

        // Guessing is throttled: after five wrong tokens (the odd one above counts), the
        // next try waits.
        let mut statuses = Vec::new();
        for i in 0..7 {
            let a = api(
                port,
                "/api/login",
                &[],
                &format!(r#"{{"token":"guess-{i}"}}"#),
            )
            .await;
            statuses.push(a.status);
            if a.status == 429 {
                assert!(a.header("retry-after").is_some());
            }
        }
        assert_eq!(statuses, [401, 401, 401, 401, 429, 429, 429]);
        let right = api(
            port,
            "/api/login",
            &[],
            &format!(r#"{{"token":"{ADMIN}"}}"#),
        )
        .await;
        assert_eq!(right.status, 429, "the right token also waits");
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_tls_the_session_cookie_is_secure() {
    within(Duration::from_secs(60), "console: secure cookie", async {
        let port = free_port();
        let _env = Env::start(
            Env::server().console(console(port).token(ADMIN).url("https://ax.example.com")),
        )
        .await;
        // Through the proxy: the public host in Host and Origin.
        let a = send(
            port,
            "POST",
            "/api/login",
            &[
                ("host", "ax.example.com"),
                ("origin", "https://ax.example.com"),
                ("content-type", "application/json"),
            ],
            &format!(r#"{{"token":"{ADMIN}"}}"#),
        )
        .await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert!(a.header("set-cookie").unwrap().contains("Secure"));
    })
    .await
}

/// Reads from `tcp` until it is closed; `None` if still open after `limit`.
async fn closed_within(tcp: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at((started + limit).into(), tcp.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => {} // an error answer first (408): read on to the close
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_timed_out_and_bounded() {
    within(Duration::from_secs(60), "console: slow clients", async {
        let port = free_port();
        let _env = Env::start(
            Env::server().console(
                console(port)
                    .token(ADMIN)
                    .max_connections(16)
                    .request_timeout(Duration::from_secs(1)),
            ),
        )
        .await;
        let host = format!("127.0.0.1:{port}");
        // 40 half-sent requests: 16 are held (until their headers time out), the rest are
        // closed at once.
        let mut conns = Vec::new();
        for _ in 0..40 {
            let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            tcp.write_all(format!("GET / HTTP/1.1\r\nhost: {host}\r\nx-slow: ").as_bytes())
                .await
                .unwrap();
            conns.push(tcp);
        }
        // All at once: within 300 ms (the header timeout is 1 s) only the ones over the
        // bound are closed.
        let first = futures::future::join_all(
            conns
                .iter_mut()
                .map(|tcp| closed_within(tcp, Duration::from_millis(300))),
        )
        .await;
        let at_once = first.iter().filter(|c| c.is_some()).count();
        assert_eq!(at_once, 24, "connections closed at the bound of 16");
        let held = conns
            .iter_mut()
            .zip(&first)
            .filter(|(_, c)| c.is_none())
            .map(|(tcp, _)| closed_within(tcp, Duration::from_secs(5)));
        for t in futures::future::join_all(held).await {
            assert!(t.is_some(), "a half-sent request was kept open past its timeout");
        }
        // A body that stalls is answered 408 and closed.
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        tcp.write_all(
            format!(
                "POST /api/login HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{{\"tok"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut text = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_string(&mut text)).await;
        assert!(text.starts_with("HTTP/1.1 408"), "{text:?}");
        // An idle kept-alive connection is closed too.
        let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        tcp.write_all(format!("GET /app.css HTTP/1.1\r\nhost: {host}\r\n\r\n").as_bytes())
            .await
            .unwrap();
        assert!(
            closed_within(&mut tcp, Duration::from_secs(5)).await.is_some(),
            "an idle keep-alive connection stayed open"
        );
        // And the console still answers.
        let page = send(port, "GET", "/", &[("host", &host)], "").await;
        assert_eq!(page.status, 200);
    })
    .await
}

/// The status of `GET /` with this console's own `Host`, or `None` when nothing answers.
async fn page_status(port: u16) -> Option<u16> {
    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let text = format!("GET / HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n");
    tcp.write_all(text.as_bytes()).await.ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(2), tcp.read_to_end(&mut raw))
        .await
        .ok()?
        .ok()?;
    String::from_utf8_lossy(&raw)
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
}

/// The console is a supervised service of the server: made to panic mid-run, it serves
/// again on the same address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_that_panics_comes_back_and_serves() {
    let port = free_port();
    let faults = ax_core::faults::Faults::armed();
    let server = Env::server().faults(faults.clone()).console(console(port));
    let _env = Env::start(server).await;
    assert_eq!(page_status(port).await, Some(200));
    faults.panic_service("console");
    // The fault is polled every 50 ms; the restart waits 100 ms.
    tokio::time::sleep(Duration::from_millis(300)).await;
    crate::support::eventually(
        Duration::from_secs(10),
        "the console serves again",
        || async { (page_status(port).await == Some(200)).then_some(()) },
    )
    .await;
}

/// `GET /healthz` answers the server's services as its supervisor sees them: every one up
/// at start; one made to panic and then to fail twice at start is counted (three stops,
/// the last one's cause) and up again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_shows_each_service_and_its_restarts() {
    let port = free_port();
    let faults = ax_core::faults::Faults::armed();
    let server = Env::server().faults(faults.clone()).console(console(port));
    let _env = Env::start(server).await;
    let host = format!("127.0.0.1:{port}");
    let health = || async {
        let a = send(port, "GET", "/healthz", &[("host", &host)], "").await;
        (
            a.status,
            serde_json::from_str::<serde_json::Value>(&a.body).unwrap(),
        )
    };
    let all = [
        "alerts",
        "console",
        "console-flow-runs",
        "console-limits",
        "console-trigger-state",
        "console-triggers",
        "console-waits",
        "delayed-dispatch",
        "drop-limits",
        "event-router",
        "fair-dispatch",
        "flow-engine",
        "task-index",
        "task-index-delayed",
        "trigger-engine",
    ];
    crate::support::eventually(Duration::from_secs(10), "every service up", || async {
        let (status, v) = health().await;
        let up = all.iter().all(|s| v["services"][s]["up"] == true);
        (status == 200 && v["ok"] == true && up).then_some(())
    })
    .await;
    faults.fail_service_starts("alerts", 2);
    faults.panic_service("alerts");
    let v = crate::support::eventually(Duration::from_secs(15), "alerts restarted", || async {
        let (status, v) = health().await;
        let alerts = &v["services"]["alerts"];
        (status == 200 && alerts["up"] == true && alerts["restarts"] == 3).then_some(v)
    })
    .await;
    let last = v["services"]["alerts"]["last_stop"]
        .as_str()
        .unwrap_or_default();
    assert!(last.starts_with("error: "), "{v}");
}

/// `/healthz` as a stranger meets it: a forged `Host` is refused like every request; with
/// a token configured it needs no login but tells why a service stopped only with one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_tells_a_stranger_no_causes_and_refuses_a_forged_host() {
    let port = free_port();
    let faults = ax_core::faults::Faults::armed();
    let _env = Env::start(
        Env::server()
            .faults(faults.clone())
            .console(console(port).token(ADMIN).readonly_token(VIEWER)),
    )
    .await;
    let host = format!("127.0.0.1:{port}");
    let forged = send(port, "GET", "/healthz", &[("host", "evil.example")], "").await;
    assert_eq!(forged.status, 403, "{}", forged.body);
    faults.panic_service("alerts");
    let bearer = format!("Bearer {ADMIN}");
    for (auth, cause) in [
        (None, false),
        (Some(bearer.as_str()), true),
        (Some("Bearer wrong"), false),
    ] {
        let mut headers = vec![("host", host.as_str())];
        headers.extend(auth.map(|a| ("authorization", a)));
        let v = crate::support::eventually(Duration::from_secs(10), "alerts restarted", || async {
            let a = send(port, "GET", "/healthz", &headers, "").await;
            let v: serde_json::Value = serde_json::from_str(&a.body).ok()?;
            (a.status == 200 && v["services"]["alerts"]["restarts"] == 1).then_some(v)
        })
        .await;
        let shown = v["services"]["alerts"].get("last_stop").is_some();
        assert_eq!(shown, cause, "{auth:?}: {v}");
    }
}

/// Issue 44: connections that send a request line and one header, then nothing, must not
/// lock operators out. At the bound (256 by default) the connection that has waited
/// longest for the rest of its headers is closed for the newcomer, so a real request is
/// answered at once however many stalled ones an attacker keeps opening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_open_connections_cannot_lock_operators_out() {
    within(
        Duration::from_secs(90),
        "console: half-open connections",
        async {
            let port = free_port();
            let _env = Env::start(
                Env::server().console(
                    console(port)
                        .token(ADMIN)
                        .request_timeout(Duration::from_secs(10)),
                ),
            )
            .await;
            let host = format!("127.0.0.1:{port}");
            let mut stalled = Vec::new();
            for _ in 0..1_100 {
                let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
                // A refused connection may be closed before this write lands: never mind.
                let _ = tcp
                    .write_all(format!("GET / HTTP/1.1\r\nhost: {host}\r\n").as_bytes())
                    .await;
                stalled.push(tcp);
            }
            // Every fresh request is answered within a second, while the stalled ones are held.
            for _ in 0..5 {
                let started = Instant::now();
                let page = tokio::time::timeout(
                    Duration::from_secs(1),
                    send(port, "GET", "/", &[("host", &host)], ""),
                )
                .await
                .expect("a fresh request answered within 1 s");
                assert_eq!(page.status, 200);
                assert!(started.elapsed() < Duration::from_secs(1));
                // The attacker opens more meanwhile.
                for _ in 0..30 {
                    let mut tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
                    let _ = tcp
                        .write_all(format!("GET / HTTP/1.1\r\nhost: {host}\r\n").as_bytes())
                        .await;
                    stalled.push(tcp);
                }
            }
        },
    )
    .await
}
