//! A TCP proxy in front of a nats-server (feature `env`), for tests that lose the broker's
//! answers: what a client sends through it reaches the server, but while it is
//! [muted](AnswerDropper::mute) what the server sends back is dropped, and
//! [`cut`](AnswerDropper::cut) closes every connection through it, so the client connects
//! again (through it, answered again). That is a broker that stored a write and died before
//! answering, with the client's retry reaching the same store.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The proxy; stops listening when dropped.
pub struct AnswerDropper {
    port: u16,
    muted: Arc<AtomicBool>,
    /// Cancelled to close the connections made so far; replaced by a fresh one at each cut.
    cut: Arc<Mutex<CancellationToken>>,
    accept: tokio::task::JoinHandle<()>,
}

impl AnswerDropper {
    /// Listens on a free local port, forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> std::io::Result<AnswerDropper> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let muted = Arc::new(AtomicBool::new(false));
        let cut = Arc::new(Mutex::new(CancellationToken::new()));
        let upstream = upstream.to_string();
        let (m, c) = (muted.clone(), cut.clone());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let closed = c.lock().expect("not poisoned").clone();
                tokio::spawn(forward(client, server, m.clone(), closed));
            }
        });
        Ok(AnswerDropper {
            port,
            muted,
            cut,
            accept,
        })
    }

    /// The URL a client connects to.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// From now on, what the server sends is dropped (until [`cut`](AnswerDropper::cut)).
    pub fn mute(&self) {
        self.muted.store(true, Ordering::SeqCst);
    }

    /// Closes every connection through the proxy and answers again from now on.
    pub fn cut(&self) {
        let mut current = self.cut.lock().expect("not poisoned");
        current.cancel();
        *current = CancellationToken::new();
        self.muted.store(false, Ordering::SeqCst);
    }
}

impl Drop for AnswerDropper {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut.lock().expect("not poisoned").cancel();
    }
}

async fn forward(
    client: TcpStream,
    server: TcpStream,
    muted: Arc<AtomicBool>,
    closed: CancellationToken,
) {
    let (mut client_in, mut client_out) = client.into_split();
    let (mut server_in, mut server_out) = server.into_split();
    let up = tokio::io::copy(&mut client_in, &mut server_out);
    let down = async {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match server_in.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if !muted.load(Ordering::SeqCst) && client_out.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    tokio::select! {
        _ = up => {}
        _ = down => {}
        _ = closed.cancelled() => {}
    }
}
