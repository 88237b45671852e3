//! Keeps the task index current: an ordered consumer over `KV_AX_TASKS` (the last value
//! of every key, then every change) and one over `AX_DEAD` (headers only: task id →
//! its latest dead letter's sequence, which `retry` and `replay` read the payload from).
//! A feed that breaks is followed again from the start; the index ignores revisions older
//! than the ones it holds, so reading again is harmless.

use super::index::{Index, Indexed};
use crate::metrics as m;
use crate::names::{DEAD_STREAM, TASKS_BUCKET};
use crate::state::TaskState;
use crate::task::header;
use async_nats::jetstream::{self, consumer};
use futures::StreamExt;
use std::collections::HashMap;
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// A task that just changed state (after the initial load): what alerts see.
#[derive(Debug, Clone)]
pub(crate) struct Change {
    pub(crate) id: String,
    /// The record's revision (its sequence in `KV_AX_TASKS`).
    pub(crate) revision: u64,
    pub(crate) record: serde_json::Value,
}

/// The index and the dead-letter map, shared by the API handlers.
pub(crate) struct TaskIndex {
    pub(crate) index: RwLock<Index>,
    dead: Mutex<HashMap<String, u64>>,
    /// Failed attempts in a row per (queue, task name).
    streaks: Mutex<HashMap<(String, String), u64>>,
    /// True once the feed has read every record stored when it started.
    loaded: tokio::sync::watch::Sender<bool>,
}

const FEED_EXPIRES: Duration = Duration::from_secs(2);

impl TaskIndex {
    /// Starts following the feeds; `changes` receives every state change seen after the
    /// initial load (dropped, not waited for, if the receiver lags).
    pub(crate) fn start(
        js: jetstream::Context,
        changes: Option<mpsc::Sender<Change>>,
        shutdown: CancellationToken,
    ) -> std::sync::Arc<TaskIndex> {
        let ix = std::sync::Arc::new(TaskIndex {
            index: RwLock::new(Index::default()),
            dead: Mutex::new(HashMap::new()),
            streaks: Mutex::new(HashMap::new()),
            loaded: tokio::sync::watch::channel(false).0,
        });
        tokio::spawn(
            ix.clone()
                .follow_tasks(js.clone(), changes, shutdown.clone()),
        );
        tokio::spawn(ix.clone().follow_dead(js, shutdown));
        ix
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

    /// The sequence in `AX_DEAD` of task `id`'s latest dead letter.
    pub(crate) fn dead_letter(&self, id: &str) -> Option<u64> {
        self.dead.lock().expect("not poisoned").get(id).copied()
    }

    async fn follow_tasks(
        self: std::sync::Arc<Self>,
        js: jetstream::Context,
        changes: Option<mpsc::Sender<Change>>,
        shutdown: CancellationToken,
    ) {
        let prefix = format!("$KV.{TASKS_BUCKET}.");
        loop {
            let opened =
                crate::retry::until_ok("the task-state feed (KV_AX_TASKS)", &shutdown, || {
                    let js = js.clone();
                    async move {
                        let stream = js
                            .get_stream(format!("KV_{TASKS_BUCKET}"))
                            .await
                            .map_err(|e| e.to_string())?;
                        let total = stream.cached_info().state.subjects_count;
                        let messages = stream
                            .create_consumer(consumer::pull::OrderedConfig {
                                deliver_policy: consumer::DeliverPolicy::LastPerSubject,
                                filter_subject: format!("$KV.{TASKS_BUCKET}.>"),
                                max_expires: FEED_EXPIRES,
                                ..Default::default()
                            })
                            .await
                            .map_err(|e| e.to_string())?
                            .messages()
                            .await
                            .map_err(|e| e.to_string())?;
                        Ok::<_, String>((messages, total))
                    }
                })
                .await;
            let Some((mut messages, total)) = opened else {
                return;
            };
            let started = Instant::now();
            let mut last_log = started;
            let mut seen = 0u64;
            if total == 0 {
                self.mark_loaded(0, started);
            }
            loop {
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    msg = messages.next() => msg,
                };
                let msg = match msg {
                    Some(Ok(msg)) => msg,
                    Some(Err(e)) => {
                        warn!(cause = %e, "task-state feed broke; following it again");
                        break;
                    }
                    None => break,
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
                } else if let Ok(parsed) = serde_json::from_slice::<Indexed<'_>>(&msg.payload) {
                    let before = {
                        let mut ix = self.index.write().expect("not poisoned");
                        let before = ix.state_of(id);
                        ix.put(id, revision, &parsed);
                        before
                    };
                    let state = parsed.state();
                    if loaded && before != Some(state) {
                        self.count_streak(&parsed);
                        if let (TaskState::Dead, Some(tx)) = (state, &changes) {
                            if let Ok(record) = serde_json::from_slice(&msg.payload) {
                                let _ = tx.try_send(Change {
                                    id: id.to_string(),
                                    revision,
                                    record,
                                });
                            }
                        }
                    }
                }
                seen += 1;
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

    /// `ax_task_consecutive_failures{queue, task}`: failed attempts of a name in a row
    /// (`retrying` or `dead`), reset by a success.
    fn count_streak(&self, rec: &Indexed<'_>) {
        let streak = match rec.state() {
            TaskState::Retrying | TaskState::Dead => {
                let mut streaks = self.streaks.lock().expect("not poisoned");
                let n = streaks
                    .entry((rec.queue().to_string(), rec.name().to_string()))
                    .or_default();
                *n += 1;
                *n
            }
            TaskState::Succeeded => {
                let mut streaks = self.streaks.lock().expect("not poisoned");
                match streaks.get_mut(&(rec.queue().to_string(), rec.name().to_string())) {
                    Some(n) if *n > 0 => {
                        *n = 0;
                        0
                    }
                    _ => return,
                }
            }
            _ => return,
        };
        metrics::gauge!(m::CONSECUTIVE_FAILURES, "queue" => rec.queue().to_string(),
            "task" => rec.name().to_string())
        .set(streak as f64);
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

    async fn follow_dead(
        self: std::sync::Arc<Self>,
        js: jetstream::Context,
        shutdown: CancellationToken,
    ) {
        loop {
            let opened =
                crate::retry::until_ok("the dead-letter feed (AX_DEAD)", &shutdown, || {
                    let js = js.clone();
                    async move {
                        js.get_stream(DEAD_STREAM)
                            .await
                            .map_err(|e| e.to_string())?
                            .create_consumer(consumer::pull::OrderedConfig {
                                deliver_policy: consumer::DeliverPolicy::All,
                                headers_only: true,
                                max_expires: FEED_EXPIRES,
                                ..Default::default()
                            })
                            .await
                            .map_err(|e| e.to_string())?
                            .messages()
                            .await
                            .map_err(|e| e.to_string())
                    }
                })
                .await;
            let Some(mut messages) = opened else { return };
            loop {
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    msg = messages.next() => msg,
                };
                let Some(Ok(msg)) = msg else {
                    warn!("dead-letter feed broke; following it again");
                    break;
                };
                let Ok(info) = msg.info() else { continue };
                let seq = info.stream_sequence;
                if let Some(id) = msg.headers.as_ref().and_then(|h| h.get(header::ID)) {
                    self.dead
                        .lock()
                        .expect("not poisoned")
                        .insert(id.to_string(), seq);
                }
            }
        }
    }
}
