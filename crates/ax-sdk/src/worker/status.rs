//! What a running worker knows of its queue, for a service's own health check.

use tokio::sync::watch;

/// The two flags a worker's gate keeps: shared with [`WorkerStatus`] handles.
#[derive(Debug)]
pub(crate) struct Flags {
    /// True once the queue's consumers were found and its limits and pause flag were read.
    pub(crate) ready: watch::Sender<bool>,
    /// True while the worker takes no new tasks because its queue is paused.
    pub(crate) paused: watch::Sender<bool>,
}

impl Default for Flags {
    fn default() -> Self {
        Flags {
            ready: watch::channel(false).0,
            paused: watch::channel(false).0,
        }
    }
}

impl Flags {
    pub(crate) fn status(&self) -> WorkerStatus {
        WorkerStatus {
            ready: self.ready.subscribe(),
            paused: self.paused.subscribe(),
        }
    }
}

/// A handle on a worker's view of its queue, from [`Worker::status`](super::Worker::status)
/// (cheap to clone; it outlives the worker and then keeps the last values).
///
/// ```no_run
/// # async fn demo(client: async_nats::Client, worker: ax_sdk::worker::Worker) {
/// let mut status = worker.status();
/// tokio::spawn(worker.run(client, Default::default()));
/// status.wait_ready().await;
/// assert!(!status.paused());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct WorkerStatus {
    ready: watch::Receiver<bool>,
    paused: watch::Receiver<bool>,
}

impl WorkerStatus {
    /// True once the worker found its queue's consumers and read the queue's limits and
    /// pause flag: from then on it takes tasks (unless paused).
    pub fn ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// True while the worker has seen its queue paused (`ax queue pause`): it fetches
    /// nothing new, and attempts already running go on.
    pub fn paused(&self) -> bool {
        *self.paused.borrow()
    }

    /// Returns once [`ready`](Self::ready) is true (or the worker is gone).
    pub async fn wait_ready(&mut self) {
        let _ = self.ready.wait_for(|r| *r).await;
    }

    /// Returns once [`paused`](Self::paused) equals `paused` (or the worker is gone).
    pub async fn wait_paused(&mut self, paused: bool) {
        let _ = self.paused.wait_for(|p| *p == paused).await;
    }
}
