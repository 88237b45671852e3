//! Following a stream or a bucket (an ordered consumer, a KV watch) across broker
//! restarts: one pull expiry and one reconnect detector for every follower of the server
//! and the worker.
//!
//! An ordered consumer or a KV watch notices a restarted nats-server only after two
//! missed idle heartbeats (seconds); the client knows at once that it connected again.
//! A follower checks [`Reconnects::changed`](crate::follow::Reconnects::changed) beside its feed and follows again from where
//! it was when it fires.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

/// How long one pull request of a follower waits (its idle heartbeat is half of it).
pub const PULL_EXPIRES: Duration = Duration::from_secs(2);

/// How often [`Reconnects`] looks at the client's connection count.
pub const RECONNECT_CHECK: Duration = Duration::from_millis(250);

/// Notices the client connecting again (a restarted or replaced nats-server).
pub struct Reconnects {
    stats: Arc<async_nats::Statistics>,
    seen: u64,
    tick: tokio::time::Interval,
}

impl Reconnects {
    /// Counts from the client's connections now.
    pub fn new(client: &async_nats::Client) -> Reconnects {
        let stats = client.statistics();
        let seen = stats.connects.load(Ordering::Relaxed);
        let mut tick = tokio::time::interval(RECONNECT_CHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Reconnects { stats, seen, tick }
    }

    /// Resolves at the first check (every [`RECONNECT_CHECK`]) that finds a connection
    /// made since this was created or last [`marked`](Reconnects::mark). Cancel-safe.
    pub async fn changed(&mut self) {
        loop {
            self.tick.tick().await;
            if self.stats.connects.load(Ordering::Relaxed) != self.seen {
                return;
            }
        }
    }

    /// True if a connection was made since this was created or last marked; marks it.
    /// For a loop that checks between its own waits instead of awaiting [`changed`](Reconnects::changed).
    pub fn take(&mut self) -> bool {
        let now = self.stats.connects.load(Ordering::Relaxed);
        std::mem::replace(&mut self.seen, now) != now
    }

    /// Takes the connections made so far as seen (after following again).
    pub fn mark(&mut self) {
        self.seen = self.stats.connects.load(Ordering::Relaxed);
    }
}

/// Runs `op`, a request to the broker that may be sent again (a read), and sends it again
/// if the client connects anew while it waits: a request the broker had when it stopped is
/// never answered, and would hold its caller for the client's whole request timeout (10 s;
/// the fault campaign saw a worker's two slots held that long by their record reads).
pub async fn across_reconnects<T, Fut>(
    client: &async_nats::Client,
    mut op: impl FnMut() -> Fut,
) -> T
where
    Fut: std::future::Future<Output = T>,
{
    loop {
        let mut reconnects = Reconnects::new(client);
        tokio::select! {
            out = op() => return out,
            _ = reconnects.changed() => {
                tracing::debug!("connected again while waiting for an answer; asking again");
            }
        }
    }
}

/// Opens an ordered consumer on `stream` with `config` (its pull expiry set to
/// [`PULL_EXPIRES`]) and its message feed.
pub async fn ordered(
    js: &async_nats::jetstream::Context,
    stream: &str,
    config: async_nats::jetstream::consumer::pull::OrderedConfig,
) -> Result<async_nats::jetstream::consumer::pull::Ordered, async_nats::Error> {
    js.get_stream(stream)
        .await?
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            max_expires: PULL_EXPIRES,
            ..config
        })
        .await?
        .messages()
        .await
        .map_err(Into::into)
}

/// An ordered consumer over the subjects `filters` of `stream` from sequence `start` (0:
/// its first message), its pull expiry [`PULL_EXPIRES`]: its message feed, and how many
/// stored messages it has to deliver (what an index replays before it is caught up).
pub async fn ordered_from(
    stream: &async_nats::jetstream::stream::Stream,
    filters: Vec<String>,
    start: u64,
) -> Result<(async_nats::jetstream::consumer::pull::Ordered, u64), async_nats::Error> {
    use async_nats::jetstream::consumer::DeliverPolicy;
    let deliver_policy = match start {
        0 => DeliverPolicy::All,
        start_sequence => DeliverPolicy::ByStartSequence { start_sequence },
    };
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
            deliver_policy,
            filter_subjects: filters,
            max_expires: PULL_EXPIRES,
            ..Default::default()
        })
        .await?;
    let pending = consumer.cached_info().num_pending;
    Ok((consumer.messages().await?, pending))
}
