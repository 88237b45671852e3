//! Singleton keys (docs/PROTOCOL.md §2, "Singleton keys"): at most one task of a key in a
//! queue waits or runs at a time, and a submit that collides with it does what its
//! `on_collision` says — `cancel_new` (refused: `running`, naming the task that holds the
//! key) or `cancel_in_progress` (the holder is cancelled, its handler told, and the new task
//! takes the key).
//!
//! The key is an entry of `AX_IDEMPOTENCY`, `<queue>.=singleton.<key in hex>`, naming the
//! task that holds it; a submit creates it before it stores its task. The entry is a hint,
//! the task's state the truth: a key whose task has ended (or was never stored, and the
//! entry is older than [`GRACE`]) is taken over by a compare-and-set on its revision, so no
//! task has to release it and a submit that died half-way blocks nothing for long.

use crate::error::WireError;
use crate::names;
use crate::protocol::SingletonRequest;
use std::time::Duration;

/// Longest singleton key: its hex form is part of a KV key.
pub const MAX_KEY: usize = 64;
/// How long a key naming a task that is not found yet still holds: the submit that wrote it
/// may be storing its task right now.
pub const GRACE: Duration = Duration::from_secs(10);

/// What a submit does when its singleton key is held by a task that has not ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collision {
    /// Refuse the new task (`running`, with the holder's id in `task_id`).
    CancelNew,
    /// Cancel the holder (its handler is told, as by `ax task cancel`) and accept the new
    /// task.
    CancelInProgress,
}

impl Collision {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Collision::CancelNew => "cancel_new",
            Collision::CancelInProgress => "cancel_in_progress",
        }
    }
}

/// A validated `singleton` object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Singleton {
    /// The key (1..=64 of `A-Z a-z 0-9 _ - . : @`).
    pub key: String,
    /// What a colliding submit does.
    pub on_collision: Collision,
}

impl Singleton {
    /// Checks a request's `singleton` object.
    pub fn from_request(req: &SingletonRequest) -> Result<Singleton, WireError> {
        if req.key.len() > MAX_KEY || !crate::task::valid_limit_key(&req.key) {
            return Err(WireError::field(
                "singleton.key",
                "must be 1..=64 of A-Z a-z 0-9 _ - . : @",
            ));
        }
        let on_collision = match req.on_collision.as_str() {
            "cancel_new" => Collision::CancelNew,
            "cancel_in_progress" => Collision::CancelInProgress,
            _ => {
                return Err(WireError::field(
                    "singleton.on_collision",
                    "must be cancel_new or cancel_in_progress (to queue behind the running \
                     task, give a limit of concurrency 1 on a limit_key instead)",
                ))
            }
        };
        Ok(Singleton {
            key: req.key.clone(),
            on_collision,
        })
    }

    /// The key's entry in `AX_IDEMPOTENCY`: `<queue>.=singleton.<key's bytes in hex>`
    /// (three tokens: never an idempotency key's, which has two).
    pub fn kv_key(&self, queue: &str) -> String {
        format!("{queue}.=singleton.{}", names::hex_token(&self.key))
    }
}

/// Who holds a key, as its entry's value says: the task's id, then a space and the
/// idempotency key of the submit that claimed it, if it had one (task ids hold no space).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The task that holds the key.
    pub task_id: String,
    /// The idempotency key of the submit that claimed it for that task.
    pub idempotency_key: Option<String>,
}

impl Holder {
    /// The entry's value.
    pub fn encode(&self) -> bytes::Bytes {
        match &self.idempotency_key {
            Some(k) => format!("{} {k}", self.task_id).into(),
            None => self.task_id.clone().into(),
        }
    }

    /// Reads an entry's value.
    pub fn decode(value: &[u8]) -> Holder {
        let value = String::from_utf8_lossy(value);
        match value.split_once(' ') {
            Some((id, key)) => Holder {
                task_id: id.to_string(),
                idempotency_key: Some(key.to_string()),
            },
            None => Holder {
                task_id: value.into_owned(),
                idempotency_key: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_reads_back_as_written() {
        for h in [
            Holder {
                task_id: "q.abc".into(),
                idempotency_key: Some("order 42: paid".into()),
            },
            Holder {
                task_id: "q.abc".into(),
                idempotency_key: None,
            },
        ] {
            assert_eq!(Holder::decode(&h.encode()), h);
        }
    }

    fn req(key: &str, on: &str) -> SingletonRequest {
        SingletonRequest {
            key: key.into(),
            on_collision: on.into(),
        }
    }

    #[test]
    fn checks_the_key_and_the_strategy() {
        let s = Singleton::from_request(&req("sync:acme", "cancel_new")).unwrap();
        assert_eq!(s.on_collision, Collision::CancelNew);
        assert_eq!(
            s.kv_key("q"),
            format!("q.=singleton.{}", names::hex_token("sync:acme"))
        );
        let s = Singleton::from_request(&req("a", "cancel_in_progress")).unwrap();
        assert_eq!(s.on_collision.as_str(), "cancel_in_progress");
        for (bad, field) in [
            (req("", "cancel_new"), "singleton.key"),
            (req("a b", "cancel_new"), "singleton.key"),
            (req(&"k".repeat(65), "cancel_new"), "singleton.key"),
            (req("a", "queue"), "singleton.on_collision"),
            (req("a", ""), "singleton.on_collision"),
        ] {
            let e = Singleton::from_request(&bad).unwrap_err();
            assert_eq!(e.field.as_deref(), Some(field), "{bad:?}");
        }
    }
}
