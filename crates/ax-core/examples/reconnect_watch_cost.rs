//! What waiting beside a reconnect watch ([`ax_core::follow::across_reconnects`]) adds to
//! one request, against the same future awaited plainly (docs/PERFORMANCE.md, "What
//! asking again on reconnect costs"). The request is a stand-in that answers on its
//! second poll, so what is timed is the watch: its `Interval` made, its timer registered
//! and removed.
//!
//! `AX_NATS_URL=127.0.0.1:4222 cargo run --release -p ax-core --example reconnect_watch_cost`
//! (any nats-server; the client only counts its connections).

use std::time::Instant;

const REQUESTS: u32 = 200_000;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), async_nats::ConnectError> {
    let url = std::env::var("AX_NATS_URL").unwrap_or_else(|_| "127.0.0.1:4222".into());
    let client = async_nats::connect(url).await?;
    let request = || async {
        tokio::task::yield_now().await;
        1u32
    };
    for round in 1..=3 {
        let started = Instant::now();
        for _ in 0..REQUESTS {
            std::hint::black_box(request().await);
        }
        let plain = started.elapsed();
        let started = Instant::now();
        for _ in 0..REQUESTS {
            let answer = ax_core::follow::across_reconnects(&client, request).await;
            std::hint::black_box(answer);
        }
        let watched = started.elapsed();
        let per = |d: std::time::Duration| d.as_nanos() as f64 / f64::from(REQUESTS);
        println!(
            "round {round}: plain {:.0} ns, beside the watch {:.0} ns a request",
            per(plain),
            per(watched)
        );
    }
    Ok(())
}
