//! What the console's live updates watch besides the task index: flow runs, waits,
//! triggers and limits. A run's end, a step that starts to wait (an approval, a sleep, a
//! child flow) or a wait that is met is written to `KV_AX_FLOW_RUNS` or `KV_AX_WAITS`,
//! often after the last task change it follows: a page refreshed only on task changes
//! went on showing a run as running after it had ended (seen under load: the run's end
//! was written after the refresh its last task's end caused). A trigger added, paused or
//! fired (`KV_AX_TRIGGERS`, `KV_AX_TRIGGER_STATE`) and a limit set or removed
//! (`KV_AX_LIMITS`) showed only once some task moved. A limit's tokens
//! (`KV_AX_LIMIT_STATE`) are not followed: they change with every task a limit admits,
//! and the page reads them as it is shown.
//!
//! Each bucket is followed by an ordered consumer of new messages, headers only; every
//! message moves [`Changes::version`]. A feed that breaks is followed again from the new
//! messages, and moves the version once (what it missed meanwhile is shown again).

use crate::ops::feed::{next, Stop};
use async_nats::jetstream::{self, consumer};
use ax_core::names::{
    FLOW_RUNS_BUCKET, LIMITS_BUCKET, TRIGGERS_BUCKET, TRIGGER_STATE_BUCKET, WAITS_BUCKET,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Each followed bucket and the supervised service that follows it.
const FOLLOWED: [(&str, &str); 5] = [
    ("console-flow-runs", FLOW_RUNS_BUCKET),
    ("console-waits", WAITS_BUCKET),
    ("console-triggers", TRIGGERS_BUCKET),
    ("console-trigger-state", TRIGGER_STATE_BUCKET),
    ("console-limits", LIMITS_BUCKET),
];

/// Changes seen in the flow-run, wait, trigger and limit buckets.
#[derive(Default)]
pub(crate) struct Changes {
    version: AtomicU64,
}

impl Changes {
    /// Starts following the buckets of [`FOLLOWED`], each a supervised service.
    pub(crate) fn start(
        js: &jetstream::Context,
        services: &mut ax_core::supervisor::Supervisor,
    ) -> Arc<Changes> {
        let changes = Arc::new(Changes::default());
        for (service, bucket) in FOLLOWED {
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

    /// How many changes were seen (moves whenever a followed bucket changed).
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
