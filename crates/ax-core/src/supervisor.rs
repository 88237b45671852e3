//! One supervisor for the long-running parts of a process: the server's engines and
//! followers, a worker's limit watchers and cancel listener.
//!
//! Each part is a named *service*: a function that starts it (given a cancellation token)
//! and a future that runs until the token is cancelled. A service that ends on its own,
//! fails or panics while the process runs is logged with its name and cause, counted in
//! `ax_service_restarts_total{service, reason}` and started again after a backoff (100 ms
//! doubling to 5 s; back to 100 ms once it ran a minute). `ax_service_up{service}` is 1
//! while it runs, 0 while it waits to be started again. A service is written as if it
//! could end at any line: its state lives in the broker, what it holds is a cache.

use crate::metrics as m;
use std::collections::BTreeMap;
use std::fmt::Display;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// A service that ran this long is taken as healthy: its next restart pauses from the
/// shortest backoff again.
const STABLE: Duration = Duration::from_secs(60);

/// Why a service stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// It returned `Ok` before the process shut down.
    Returned,
    /// It returned an error.
    Failed,
    /// It panicked.
    Panicked,
}

impl Ended {
    fn as_str(self) -> &'static str {
        match self {
            Ended::Returned => "ended",
            Ended::Failed => "error",
            Ended::Panicked => "panic",
        }
    }
}

/// The services of one process (a server or a worker), stopped together.
pub struct Supervisor {
    /// Names this process in its logs.
    scope: String,
    /// Faults a test armed: services that panic or fail to start.
    faults: crate::faults::Faults,
    set: JoinSet<()>,
    shutdown: CancellationToken,
    health: Health,
}

/// How one service is doing.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ServiceHealth {
    /// Running now (false while it waits to be started again).
    pub up: bool,
    /// Times it ended, failed or panicked while the process ran.
    pub restarts: u64,
    /// Why it last stopped: `ended`, `error: <cause>` or `panic: <cause>`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_stop: Option<String>,
}

/// The health of a supervisor's services, by name; cheap to clone and read.
#[derive(Debug, Clone, Default)]
pub struct Health(Arc<Mutex<BTreeMap<&'static str, ServiceHealth>>>);

impl Health {
    /// Every service, by name.
    pub fn services(&self) -> BTreeMap<&'static str, ServiceHealth> {
        self.0.lock().expect("not poisoned").clone()
    }

    fn update(&self, name: &'static str, f: impl FnOnce(&mut ServiceHealth)) {
        f(self
            .0
            .lock()
            .expect("not poisoned")
            .entry(name)
            .or_default());
    }
}

impl Supervisor {
    /// Services stop when `shutdown` is cancelled (or [`Supervisor::stop`] is called).
    pub fn new(scope: impl Into<String>, shutdown: CancellationToken) -> Supervisor {
        Supervisor {
            scope: scope.into(),
            faults: crate::faults::Faults::default(),
            set: JoinSet::new(),
            shutdown: shutdown.child_token(),
            health: Health::default(),
        }
    }

    /// Services started from now on with the faults of `faults` (tests).
    #[doc(hidden)]
    pub fn faults(mut self, faults: crate::faults::Faults) -> Supervisor {
        self.faults = faults;
        self
    }

    /// The health of this supervisor's services (updated as they stop and start).
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Runs service `name`, started by `start` now and again after each end (see the
    /// module's documentation).
    pub fn spawn<F, Fut, E>(&mut self, name: &'static str, start: F)
    where
        F: FnMut(CancellationToken) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Display + Send + 'static,
    {
        let (scope, shutdown) = (self.scope.clone(), self.shutdown.clone());
        let (health, faults) = (self.health.clone(), self.faults.clone());
        self.set
            .spawn(supervise(scope, name, start, shutdown, health, faults));
    }

    /// Stops every service and waits until each has returned.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        while self.set.join_next().await.is_some() {}
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn supervise<F, Fut, E>(
    scope: String,
    name: &'static str,
    mut start: F,
    shutdown: CancellationToken,
    health: Health,
    faults: crate::faults::Faults,
) where
    F: FnMut(CancellationToken) -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Display + Send + 'static,
{
    let mut restarts = 0u32;
    loop {
        metrics::gauge!(m::SERVICE_UP, "service" => name).set(1.0);
        health.update(name, |h| h.up = true);
        let began = Instant::now();
        let run = start(shutdown.child_token());
        let fail = faults.start_fails(name);
        let (faults, scope_of) = (faults.clone(), scope.clone());
        let run = async move {
            if fail {
                return Err("injected fault: failed at start".to_string());
            }
            tokio::select! {
                r = run => r.map_err(|e| e.to_string()),
                () = faults.service_panic(name) => {
                    panic!("injected fault: service {name} of {scope_of} made to panic")
                }
            }
        };
        // Its own task: a panic ends that task, not the supervisor.
        let ended = tokio::spawn(run).await;
        metrics::gauge!(m::SERVICE_UP, "service" => name).set(0.0);
        let (how, cause) = match ended {
            Ok(Ok(())) => (Ended::Returned, String::new()),
            Ok(Err(e)) => (Ended::Failed, e),
            Err(join) => (Ended::Panicked, panic_text(join)),
        };
        if shutdown.is_cancelled() {
            if how != Ended::Returned {
                warn!(
                    service = name,
                    reason = how.as_str(),
                    cause,
                    "service stopped badly at shutdown"
                );
            }
            return;
        }
        metrics::counter!(m::SERVICE_RESTARTS, "service" => name, "reason" => how.as_str())
            .increment(1);
        health.update(name, |h| {
            h.up = false;
            h.restarts += 1;
            h.last_stop = Some(match cause.is_empty() {
                true => how.as_str().to_string(),
                false => format!("{}: {cause}", how.as_str()),
            });
        });
        if began.elapsed() >= STABLE {
            restarts = 0;
        }
        let pause = crate::retry::pause(restarts);
        restarts = restarts.saturating_add(1);
        match how {
            Ended::Panicked => error!(service = name, %scope, cause, ?pause,
                "service panicked (a bug); starting it again"),
            _ => warn!(service = name, %scope, reason = how.as_str(), cause, ?pause,
                "service stopped while the process runs; starting it again"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        info!(service = name, %scope, "service starting again");
    }
}

/// The message of a panic, or what the join error says.
fn panic_text(join: tokio::task::JoinError) -> String {
    if !join.is_panic() {
        return join.to_string();
    }
    let payload = join.into_panic();
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    #[tokio::test(start_paused = true)]
    async fn a_service_that_fails_or_panics_is_started_again_until_shutdown() {
        let starts = Arc::new(AtomicU32::new(0));
        let shutdown = CancellationToken::new();
        let mut sup = Supervisor::new("unit", shutdown.clone());
        let counted = starts.clone();
        sup.spawn("flaky", move |token: CancellationToken| {
            let n = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                match n {
                    0 => Err("cannot open a bucket".to_string()),
                    1 => panic!("a bug"),
                    2 => Ok(()), // ended on its own
                    _ => {
                        token.cancelled().await;
                        Ok(())
                    }
                }
            }
        });
        // Three ends, each followed by a backoff of at most 100 ms, 200 ms, 400 ms.
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(
            starts.load(Ordering::SeqCst),
            4,
            "started again after each end"
        );
        let health = sup.health().services()["flaky"].clone();
        assert_eq!((health.up, health.restarts), (true, 3));
        assert_eq!(health.last_stop.as_deref(), Some("ended"));
        sup.stop().await;
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(starts.load(Ordering::SeqCst), 4, "not after shutdown");
    }
}
