//! The raw JetStream baseline the benches compare ax with: a work-queue stream `RAW`
//! (`raw.>`) with one durable pull consumer `raw`, and a pipelined publisher.

use async_nats::jetstream::{self, consumer, stream};
use futures::stream::{FuturesUnordered, StreamExt};
use std::future::IntoFuture;
use std::time::{Duration, Instant};

/// The baseline's stream.
pub const STREAM: &str = "RAW";
/// The baseline's durable consumer.
pub const CONSUMER: &str = "raw";

/// Creates the stream (after deleting one left over) with `replicas`, retried for up to
/// 60 s (a new cluster accepts an R3 stream only once its meta leader is elected), and its
/// consumer (explicit acks, 10,000 pending at most).
pub async fn create(js: &jetstream::Context, replicas: usize) -> consumer::PullConsumer {
    let _ = js.delete_stream(STREAM).await;
    let config = stream::Config {
        name: STREAM.into(),
        subjects: vec!["raw.>".into()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        num_replicas: replicas,
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let stream = loop {
        match js.create_stream(config.clone()).await {
            Ok(stream) => break stream,
            Err(e) if Instant::now() < deadline => {
                eprintln!("  ... raw stream not created yet ({e}); retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("the raw stream: {e}"),
        }
    };
    stream
        .create_consumer(consumer::pull::Config {
            durable_name: Some(CONSUMER.into()),
            ack_policy: consumer::AckPolicy::Explicit,
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .unwrap()
}

/// Publishes `n` copies of `body` to `raw.x`, at most 2,048 unacknowledged; returns once
/// every one is acknowledged.
pub async fn publish(js: &jetstream::Context, n: usize, body: bytes::Bytes) {
    let mut inflight = FuturesUnordered::new();
    for _ in 0..n {
        inflight.push(
            js.publish("raw.x", body.clone())
                .await
                .unwrap()
                .into_future(),
        );
        if inflight.len() >= 2048 {
            inflight.next().await.unwrap().unwrap();
        }
    }
    while let Some(ack) = inflight.next().await {
        ack.unwrap();
    }
}
