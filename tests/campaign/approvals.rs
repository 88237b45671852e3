//! The approvals in the flow load: the `gate` flow (`a`, an approval `g` of 8 s that goes
//! on with `null` when no one answers, then `b`). The campaign follows the announcements
//! (`ax.events.approval.requested`, core NATS: one sent while the broker restarts can be
//! missed, and its run then times out), and within 2 s of one either approves it twice
//! at once (a double click), rejects and approves it at once (two approvers), or leaves
//! it. Each answered completion is noted: the checker (`checker_approvals`) holds the
//! approval's end to it.

use crate::flows::{note, FlowLog};
use ax_core::time::now_ms;
use ax_sdk::flow::{ApprovalCompletion, Decision};
use ax_sdk::{Client, ClientError};
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long the `gate` flow's `g` step waits for its approval.
pub const GATE_TIMEOUT_MS: u64 = 8000;

/// The `gate` flow, its tasks `step` on queue `x`.
pub fn def() -> Value {
    let step = |name: &str, needs: &[&str]| {
        json!({"name": name, "needs": needs,
               "task": {"name": "step", "queue": "x", "max_attempts": 6,
                        "backoff": {"base_ms": 100, "max_ms": 1000}}})
    };
    json!({"name": "gate", "steps": [
        step("a", &[]),
        {"name": "g", "needs": ["a"], "approval": {"message": "go on?",
            "timeout_ms": GATE_TIMEOUT_MS, "on_timeout": "continue"}},
        step("b", &["g"])]})
}

/// The tokens announced so far, by run.
#[derive(Clone, Default)]
pub struct Tokens(Arc<Mutex<HashMap<String, String>>>);

impl Tokens {
    /// Follows the announcements until the connection ends.
    pub async fn listen(nats: async_nats::Client) -> Tokens {
        let tokens = Tokens::default();
        let mut sub = nats
            .subscribe("ax.events.approval.requested")
            .await
            .expect("subscribe to the approvals' announcements");
        let map = tokens.0.clone();
        tokio::spawn(async move {
            while let Some(msg) = sub.next().await {
                let Ok(a) = serde_json::from_slice::<Value>(&msg.payload) else {
                    continue;
                };
                if let (Some(run), Some(token)) = (a["run"].as_str(), a["token"].as_str()) {
                    map.lock()
                        .unwrap()
                        .insert(run.to_string(), token.to_string());
                }
            }
        });
        tokens
    }

    async fn of(&self, run: &str, within: Duration) -> Option<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(t) = self.0.lock().unwrap().get(run) {
                return Some(t.clone());
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Approves twice, rejects and approves, or leaves `run`'s approval, within 2 s of its
/// announcement; notes each answered completion.
pub async fn decide(ax: Client, log: Arc<Mutex<FlowLog>>, tokens: Tokens, run: String, seed: u64) {
    let mut rng: StdRng = rand::SeedableRng::seed_from_u64(seed);
    let plan = match rng.random_range(0..3) {
        0 => [Decision::Approve, Decision::Approve],
        1 => [Decision::Reject, Decision::Approve],
        _ => return,
    };
    let pause = Duration::from_millis(rng.random_range(0..2000));
    let Some(token) = tokens.of(&run, Duration::from_secs(4)).await else {
        return; // not announced in time (or missed): its run times out
    };
    tokio::time::sleep(pause).await;
    let answers = futures::future::join_all(plan.map(|decision| {
        let completion = ApprovalCompletion {
            token: Some(token.clone()),
            task: None,
            decision,
            payload: (decision == Decision::Approve).then(|| json!({"by": "campaign"})),
            reason: (decision == Decision::Reject).then(|| "no".to_string()),
        };
        let ax = ax.clone();
        async move { ax.complete_approval(&completion).await }
    }))
    .await;
    for answer in answers {
        match answer {
            Ok(v) => {
                let decided = v["decision"].as_str().unwrap_or_default().to_string();
                note(&log, &run, |n| n.decided.push((decided, now_ms())));
            }
            // Refused: the other one won (conflict), or it came after the timeout.
            Err(ClientError::Refused(_)) => {}
            Err(_) => note(&log, &run, |n| n.unanswered += 1),
        }
    }
}
