//! Where an accepted task without a record is: every message of the delayed, ready, fair
//! and dead streams that carries its id (or, for a debounce window or a batch, its
//! window's subject), printed when the checker finds one, so a rare loss can be read from
//! the run that met it instead of from a replay that may not.

use async_nats::jetstream;
use ax_core::names::{self, Priority};
use futures::StreamExt;
use std::time::Duration;

/// One line per stored message naming one of `ids` (at most 20 ids traced).
pub async fn missing(js: &jetstream::Context, ids: &[String]) -> Vec<String> {
    let ids: Vec<&String> = ids.iter().take(20).collect();
    let windows: Vec<String> = ids
        .iter()
        .filter_map(|id| ax_core::debounce::window_subject_of(id))
        .collect();
    let mut streams = vec![names::DELAYED_STREAM.to_string(), names::FAIR_STREAM.into()];
    streams.extend(Priority::ALL.iter().map(|p| p.ready_stream()));
    streams.push(names::DEAD_STREAM.into());
    let mut lines = Vec::new();
    for name in streams {
        match scan(js, &name, &ids, &windows).await {
            Ok(found) => lines.extend(found),
            Err(e) => lines.push(format!("{name}: not scanned ({e})")),
        }
    }
    if lines.is_empty() {
        lines.push("no stream holds a message of theirs".into());
    }
    lines
}

async fn scan(
    js: &jetstream::Context,
    name: &str,
    ids: &[&String],
    windows: &[String],
) -> Result<Vec<String>, async_nats::Error> {
    let mut stream = js.get_stream(name).await?;
    let info = stream.info().await?;
    if info.config.retention == jetstream::stream::RetentionPolicy::WorkQueue {
        // No ordered consumer on a work queue: read what is left by sequence.
        let (first, last) = (info.state.first_sequence, info.state.last_sequence);
        let mut lines = Vec::new();
        for seq in first..=last.min(first + 50_000) {
            let Ok(msg) = stream.direct_get(seq).await else {
                continue;
            };
            let id = msg
                .headers
                .get(ax_core::task::header::ID)
                .map(|v| v.as_str().to_string())
                .unwrap_or_default();
            if ids.iter().any(|i| **i == id) {
                lines.push(format!(
                    "{name} seq {seq} {} (left unconsumed)",
                    msg.subject
                ));
            }
        }
        return Ok(lines);
    }
    let (mut feed, mut pending) = ax_core::follow::ordered_from(&stream, vec![], 0).await?;
    let mut lines = Vec::new();
    while pending > 0 {
        let Ok(Some(msg)) = tokio::time::timeout(Duration::from_secs(5), feed.next()).await else {
            lines.push(format!("{name}: scan stopped with {pending} messages left"));
            break;
        };
        let msg = msg?;
        let info = msg.info()?;
        pending = info.pending;
        let id = msg
            .headers
            .as_ref()
            .and_then(|h| h.get(ax_core::task::header::ID))
            .map(|v| v.as_str().to_string())
            .unwrap_or_default();
        let subject = msg.subject.to_string();
        if ids.iter().any(|i| **i == id) || windows.contains(&subject) {
            let headers: Vec<String> = msg
                .headers
                .iter()
                .flat_map(|h| h.iter())
                .map(|(k, v)| {
                    format!(
                        "{k}={}",
                        v.iter().map(|v| v.as_str()).collect::<Vec<_>>().join("|")
                    )
                })
                .collect();
            lines.push(format!(
                "{name} seq {} {subject} published {} ({} B): {}",
                info.stream_sequence,
                info.published,
                msg.payload.len(),
                headers.join(" ")
            ));
        }
    }
    Ok(lines)
}
