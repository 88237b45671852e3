//! Where an accepted task without a record, or whose record never became final, is: every
//! message of the delayed, ready, fair and dead streams that carries its id (or, for a
//! debounce window or a batch, its window's subject), and what the ready streams'
//! consumers hold, printed when the checker finds one, so a rare loss can be read from the
//! run that met it instead of from a replay that may not.

use async_nats::jetstream;
use ax_core::names::{self, Priority};
use futures::StreamExt;
use std::time::Duration;

/// One line per stored message naming one of `ids` (at most 20 ids traced).
pub async fn messages(js: &jetstream::Context, ids: &[String]) -> Vec<String> {
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

/// One line per consumer of the ready streams: what it delivered, its ack floor and what
/// it holds. A task message left in a work queue at a sequence the consumer delivered,
/// above its ack floor and not pending an ack, is one the consumer lost track of.
pub async fn ready_consumers(js: &jetstream::Context) -> Vec<String> {
    let mut lines = Vec::new();
    for p in Priority::ALL {
        let name = p.ready_stream();
        let stream = match js.get_stream(&name).await {
            Ok(stream) => stream,
            Err(e) => {
                lines.push(format!("{name}: not read ({e})"));
                continue;
            }
        };
        let mut consumers = stream.consumers();
        while let Some(info) = consumers.next().await {
            match info {
                Ok(c) => lines.push(format!(
                    "{name} consumer {}: delivered stream seq {} (consumer seq {}), ack floor stream seq {}, \
                     ack pending {}, redelivered {}, pending {}, waiting pulls {}, leader {:?}",
                    c.name,
                    c.delivered.stream_sequence,
                    c.delivered.consumer_sequence,
                    c.ack_floor.stream_sequence,
                    c.num_ack_pending,
                    c.num_redelivered,
                    c.num_pending,
                    c.num_waiting,
                    c.cluster.as_ref().and_then(|cl| cl.leader.clone()),
                )),
                Err(e) => {
                    lines.push(format!("{name}: consumers not listed ({e})"));
                    break;
                }
            }
        }
    }
    lines
}
