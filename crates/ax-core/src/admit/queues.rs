//! The declared queues a server knows: looked up on the broker (a queue exists when its
//! consumers do) and cached once seen.

use crate::names;
use crate::protocol::{ErrorCode, WireError};
use async_nats::jetstream;
use std::collections::HashSet;
use std::sync::RwLock;

/// Declared queues, looked up on the broker (a queue exists when its consumers do) and
/// cached once seen.
#[derive(Debug)]
pub struct Queues {
    known: RwLock<HashSet<String>>,
}

impl Queues {
    /// Queues known at start (declared by this process), then looked up.
    pub fn new(initial: &[String]) -> Queues {
        Queues {
            known: RwLock::new(initial.iter().cloned().collect()),
        }
    }

    /// The queue as a metric label if it is declared (seen by this server), else
    /// `_unknown`: requests to made-up queues must not create metric series.
    pub fn label(&self, queue: &str) -> String {
        if self.known.read().expect("not poisoned").contains(queue) {
            queue.to_string()
        } else {
            "_unknown".to_string()
        }
    }

    /// `Ok` if `queue` is declared; `unknown_queue` only when the broker says its consumer
    /// or stream does not exist, `unavailable` when it could not be asked (retry).
    pub async fn check(&self, js: &jetstream::Context, queue: &str) -> Result<(), WireError> {
        if !names::valid_queue(queue) {
            return Err(WireError::new(
                ErrorCode::UnknownQueue,
                format!("{queue:?} is not a valid queue name"),
            ));
        }
        if self.known.read().expect("not poisoned").contains(queue) {
            return Ok(());
        }
        // Boxed: a look-up happens once per queue, and inline it would make every
        // submit's future larger by its size.
        Box::pin(self.look_up(js, queue)).await
    }

    /// Asks the broker whether `queue` is declared, and remembers it if it is.
    async fn look_up(&self, js: &jetstream::Context, queue: &str) -> Result<(), WireError> {
        let undeclared = || {
            WireError::new(
                ErrorCode::UnknownQueue,
                format!("queue {queue:?} is not declared (ax streams apply --queue {queue})"),
            )
        };
        let unavailable = |e: String| {
            WireError::new(
                ErrorCode::Unavailable,
                format!("cannot look up queue {queue:?}: {e}"),
            )
        };
        let stream = names::Priority::Normal.ready_stream();
        let consumer = names::consumer_name(queue, names::Priority::Normal);
        let stream = match js.get_stream(&stream).await {
            Ok(stream) => stream,
            Err(e) => {
                return Err(match e.kind() {
                    jetstream::context::GetStreamErrorKind::JetStream(js)
                        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                    {
                        undeclared()
                    }
                    _ => unavailable(e.to_string()),
                })
            }
        };
        match stream.consumer_info(&consumer).await {
            Ok(_) => {
                self.known
                    .write()
                    .expect("not poisoned")
                    .insert(queue.to_string());
                Ok(())
            }
            Err(e) => Err(match e.kind() {
                jetstream::context::ConsumerInfoErrorKind::NotFound
                | jetstream::context::ConsumerInfoErrorKind::StreamNotFound => undeclared(),
                _ => unavailable(e.to_string()),
            }),
        }
    }
}
