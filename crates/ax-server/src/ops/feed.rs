//! Keeps the task index current: an ordered consumer over `KV_AX_TASKS` (the last value
//! of every key, then every change), and one over `AX_DELAYED`'s headers for the delayed
//! tasks that have no record yet. A feed that breaks is followed again from the start; the index ignores revisions older
//! than the ones it holds, so reading again is harmless.

use super::index::{Index, Indexed};
use async_nats::jetstream::{self, consumer};
use ax_core::names::TASKS_BUCKET;
use futures::StreamExt;
use std::sync::RwLock;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The index, shared by the API handlers.
pub(crate) struct TaskIndex {
    pub(crate) index: RwLock<Index>,
    /// Changes applied so far (the console's live updates watch it).
    version: std::sync::atomic::AtomicU64,
    /// True once the feed has read every record stored when it started.
    loaded: tokio::sync::watch::Sender<bool>,
}

/// Records the index could not read: each counted (`ax_index_unreadable_records_total`)
/// and logged with its key, at most one line per [`UNREADABLE_LOG_EVERY`] (the lines in
/// between are counted in the next).
#[derive(Default)]
struct Unreadable {
    last_log: Option<Instant>,
    not_logged: u64,
}

const UNREADABLE_LOG_EVERY: Duration = Duration::from_secs(10);

impl Unreadable {
    fn note(&mut self, id: &str, revision: u64, e: &serde_json::Error) {
        metrics::counter!(ax_core::metrics::INDEX_UNREADABLE).increment(1);
        if self
            .last_log
            .is_some_and(|t| t.elapsed() < UNREADABLE_LOG_EVERY)
        {
            self.not_logged += 1;
            return;
        }
        warn!(
            task_id = id,
            revision,
            cause = %e,
            more_not_logged = self.not_logged,
            "task index: record unreadable, left out of the index"
        );
        self.last_log = Some(Instant::now());
        self.not_logged = 0;
    }
}

/// Why a feed gave no message.
pub(crate) enum Stop {
    /// The feed broke or ended (logged): follow it again.
    Broke,
    Shutdown,
}

/// The next message of a feed, or why there is none (a broken feed is logged as `broke`).
pub(crate) async fn next(
    messages: &mut consumer::pull::Ordered,
    shutdown: &CancellationToken,
    broke: &str,
) -> Result<jetstream::Message, Stop> {
    let msg = tokio::select! {
        _ = shutdown.cancelled() => return Err(Stop::Shutdown),
        msg = messages.next() => msg,
    };
    match msg {
        Some(Ok(msg)) => Ok(msg),
        Some(Err(e)) => {
            warn!(cause = %e, "{broke}");
            Err(Stop::Broke)
        }
        None => Err(Stop::Broke),
    }
}

impl TaskIndex {
    /// Starts following the task-state feed (a supervised service, `task-index`: one that
    /// stops is started again and reads the feed anew into the same index).
    pub(crate) fn start(
        js: jetstream::Context,
        services: &mut ax_core::supervisor::Supervisor,
    ) -> std::sync::Arc<TaskIndex> {
        let ix = std::sync::Arc::new(TaskIndex {
            index: RwLock::new(Index::default()),
            version: Default::default(),
            loaded: tokio::sync::watch::channel(false).0,
        });
        let feed = ix.clone();
        let tasks_js = js.clone();
        services.spawn("task-index", move |token| {
            use futures::FutureExt;
            feed.clone()
                .follow_tasks(tasks_js.clone(), token)
                .map(Ok::<(), std::convert::Infallible>)
        });
        let feed = ix.clone();
        services.spawn("task-index-delayed", move |token| {
            use futures::FutureExt;
            feed.clone()
                .follow_delayed(js.clone(), token)
                .map(Ok::<(), std::convert::Infallible>)
        });
        ix
    }

    /// How many changes the index has applied (moves whenever a task changes).
    pub(crate) fn version(&self) -> u64 {
        self.version.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// True once the records stored at start are all indexed.
    pub(crate) fn loaded(&self) -> bool {
        *self.loaded.borrow()
    }

    /// Waits up to `limit` for the initial load.
    pub(crate) async fn wait_loaded(&self, limit: Duration) -> bool {
        let mut rx = self.loaded.subscribe();
        let loaded = matches!(
            tokio::time::timeout(limit, rx.wait_for(|l| *l)).await,
            Ok(Ok(_))
        );
        loaded
    }

    async fn follow_tasks(
        self: std::sync::Arc<Self>,
        js: jetstream::Context,
        shutdown: CancellationToken,
    ) {
        let prefix = format!("$KV.{TASKS_BUCKET}.");
        loop {
            let opened =
                ax_core::retry::until_ok("the task-state feed (KV_AX_TASKS)", &shutdown, || {
                    let js = js.clone();
                    async move {
                        let stream = js.get_stream(format!("KV_{TASKS_BUCKET}")).await?;
                        let total = stream.cached_info().state.subjects_count;
                        let messages = stream
                            .create_consumer(consumer::pull::OrderedConfig {
                                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                                filter_subject: format!("$KV.{TASKS_BUCKET}.>"),
                                max_expires: ax_core::follow::PULL_EXPIRES,
                                ..Default::default()
                            })
                            .await?
                            .messages()
                            .await?;
                        Ok::<_, async_nats::Error>((messages, total))
                    }
                })
                .await;
            let Some((mut messages, total)) = opened else {
                return;
            };
            let started = Instant::now();
            let mut last_log = started;
            let mut seen = 0u64;
            let mut unreadable = Unreadable::default();
            if total == 0 {
                self.mark_loaded(0, started);
            }
            loop {
                let msg = match next(
                    &mut messages,
                    &shutdown,
                    "task-state feed broke; following it again",
                )
                .await
                {
                    Ok(msg) => msg,
                    Err(Stop::Broke) => break,
                    Err(Stop::Shutdown) => return,
                };
                let Ok(info) = msg.info() else { continue };
                let (revision, pending) = (info.stream_sequence, info.pending);
                let Some(id) = msg.subject.strip_prefix(prefix.as_str()) else {
                    continue;
                };
                let deleted = msg
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("KV-Operation"))
                    .is_some_and(|op| op.as_str() == "DEL" || op.as_str() == "PURGE");
                let loaded = self.loaded();
                if deleted {
                    self.index.write().expect("not poisoned").remove(id);
                } else {
                    match serde_json::from_slice::<Indexed<'_>>(&msg.payload) {
                        Ok(parsed) => {
                            self.index
                                .write()
                                .expect("not poisoned")
                                .put(id, revision, &parsed);
                        }
                        Err(e) => {
                            // What the index held of it is older than this: not kept.
                            self.index
                                .write()
                                .expect("not poisoned")
                                .forget_older(id, revision);
                            unreadable.note(id, revision, &e);
                        }
                    }
                }
                seen += 1;
                self.version
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if !loaded {
                    if pending == 0 {
                        self.mark_loaded(seen, started);
                    } else if last_log.elapsed() > Duration::from_secs(5) {
                        last_log = Instant::now();
                        info!(read = seen, of = total, "task index: loading");
                    }
                }
            }
        }
    }

    /// Indexes the delayed tasks whose submit stored no record, from their messages in
    /// `AX_DELAYED` (headers only): each as `scheduled` at revision 0, so any record a
    /// worker or an operation writes replaces it. A task the dispatcher has moved to its
    /// ready subject stays `scheduled` here until a worker claims it (its record then
    /// says what it is); a restarted feed no longer sees it (docs/ARCHITECTURE.md).
    async fn follow_delayed(
        self: std::sync::Arc<Self>,
        js: jetstream::Context,
        shutdown: CancellationToken,
    ) {
        loop {
            let opened =
                ax_core::retry::until_ok("the delayed-task feed (AX_DELAYED)", &shutdown, || {
                    let config = consumer::pull::OrderedConfig {
                        deliver_policy: consumer::DeliverPolicy::All,
                        headers_only: true,
                        ..Default::default()
                    };
                    let js = js.clone();
                    async move {
                        ax_core::follow::ordered(&js, ax_core::names::DELAYED_STREAM, config).await
                    }
                })
                .await;
            let Some(mut messages) = opened else {
                return;
            };
            loop {
                let msg = match next(
                    &mut messages,
                    &shutdown,
                    "delayed-task feed broke; following it again",
                )
                .await
                {
                    Ok(msg) => msg,
                    Err(Stop::Broke) => break,
                    Err(Stop::Shutdown) => return,
                };
                let meta = msg
                    .headers
                    .as_ref()
                    .and_then(|h| ax_core::task::TaskMeta::from_headers(h).ok());
                // Recorded tasks are indexed from their records.
                let Some(meta) = meta.filter(|m| m.unrecorded) else {
                    continue;
                };
                self.index.write().expect("not poisoned").put(
                    &meta.id,
                    0,
                    &Indexed::scheduled(&meta),
                );
                self.version
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    fn mark_loaded(&self, n: u64, started: Instant) {
        let tasks = self.index.read().expect("not poisoned").len();
        info!(
            records = n,
            tasks,
            took_ms = started.elapsed().as_millis() as u64,
            "task index loaded"
        );
        self.loaded.send_replace(true);
    }
}
