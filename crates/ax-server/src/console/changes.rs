//! What the console's live updates watch besides the task index: flow runs and waits. A
//! run's end, a step that starts to wait (an approval, a sleep, a child flow) or a wait
//! that is met is written to `KV_AX_FLOW_RUNS` or `KV_AX_WAITS`, often after the last
//! task change it follows: a page refreshed only on task changes went on showing a run
//! as running after it had ended (seen under load: the run's end was written after the
//! refresh its last task's end caused).
//!
//! Each bucket is followed by an ordered consumer of new messages, headers only; every
//! message moves [`Changes::version`]. A feed that breaks is followed again from the new
//! messages, and moves the version once (what it missed meanwhile is shown again).

use crate::ops::feed::{next, Stop};
use async_nats::jetstream::{self, consumer};
use ax_core::names::{FLOW_RUNS_BUCKET, WAITS_BUCKET};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Changes seen in the flow-run and wait buckets.
#[derive(Default)]
pub(crate) struct Changes {
    version: AtomicU64,
}

impl Changes {
    /// Starts following both buckets, each a supervised service (`console-flow-runs`,
    /// `console-waits`).
    pub(crate) fn start(
        js: &jetstream::Context,
        services: &mut ax_core::supervisor::Supervisor,
    ) -> Arc<Changes> {
        let changes = Arc::new(Changes::default());
        for (service, bucket) in [
            ("console-flow-runs", FLOW_RUNS_BUCKET),
            ("console-waits", WAITS_BUCKET),
        ] {
            let (changes, js) = (changes.clone(), js.clone());
            services.spawn(service, move |token| {
                use futures::FutureExt;
                changes
                    .clone()
                    .follow(js.clone(), bucket, token)
                    .map(Ok::<(), std::convert::Infallible>)
            });
        }
        changes
    }

    /// How many changes were seen (moves whenever a flow run or a wait changed).
    pub(crate) fn version(&self) -> u64 {
        self.version.load(Ordering::Relaxed)
    }

    async fn follow(
        self: Arc<Self>,
        js: jetstream::Context,
        bucket: &str,
        shutdown: CancellationToken,
    ) {
        let stream = format!("KV_{bucket}");
        let what = format!("the console's feed of {stream}");
        loop {
            let opened = ax_core::retry::until_ok(&what, &shutdown, || {
                let config = consumer::pull::OrderedConfig {
                    deliver_policy: consumer::DeliverPolicy::New,
                    headers_only: true,
                    ..Default::default()
                };
                let js = js.clone();
                let stream = stream.clone();
                async move { ax_core::follow::ordered(&js, &stream, config).await }
            })
            .await;
            let Some(mut messages) = opened else {
                return;
            };
            // Whatever changed while no feed was open.
            self.version.fetch_add(1, Ordering::Relaxed);
            let broke = format!("the console's feed of {stream} broke; following it again");
            loop {
                match next(&mut messages, &shutdown, &broke).await {
                    Ok(_) => {
                        self.version.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(Stop::Broke) => break,
                    Err(Stop::Shutdown) => return,
                }
            }
        }
    }
}
