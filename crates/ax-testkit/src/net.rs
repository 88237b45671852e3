//! Network helpers for tests that run `ax` processes (feature `env`): wait for a server to
//! answer, a free port, a `/metrics` scrape.

use crate::env::eventually;
use std::time::Duration;

/// Waits up to 20 s for an ax server to answer a submit probe.
pub async fn wait_ready(client: &async_nats::Client) {
    wait_ready_within(client, Duration::from_secs(20)).await;
}

/// Like [`wait_ready`], up to `timeout`: a server that creates the topology on a fresh R3
/// cluster first waits out the cluster's first leader elections (its retries back off up to
/// 5 s) and then creates every stream and bucket with three replicas, which on a loaded
/// 2-core machine has taken longer than 20 s.
pub async fn wait_ready_within(client: &async_nats::Client, timeout: Duration) {
    eventually(timeout, "ax server process to answer", || async {
        client
            .request("ax.submit.__probe", "{\"name\":\"x\"}".into())
            .await
            .ok()
    })
    .await;
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// GET /metrics over a plain TCP connection. A process just started may not listen yet
/// (a busy CI machine): the connect is retried for up to 10 s.
pub async fn scrape(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut conn = loop {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(conn) => break conn,
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Err(e) => panic!("metrics endpoint 127.0.0.1:{port} not listening after 10 s: {e}"),
        }
    };
    conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).await.unwrap();
    body
}
