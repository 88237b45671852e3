//! The `limits:` and `fair:` parts of `ax apply -f runtime.yaml` (docs/guides/limits.md,
//! "In the settings file"):
//!
//! ```yaml
//! limits:                     # each as `ax.limit.put` takes it (PROTOCOL.md §7)
//!   - {name: per-customer, queue: emails, per_key: true, rate: 20, concurrency: 3}
//!   - {name: quota, queue: api, rate: 10, burst: 20, excess: drop}
//! fair:                       # per queue, as `ax.limit.fair_put` takes it
//!   reports: {weights: {acme: 2}, default_weight: 1, depth: 256}
//! ```
//!
//! Every definition is checked by the server before any is stored (a put per limit; the
//! file's limits are read whole first, so one that does not decode changes nothing). With
//! pruning (the default), a stored limit of a queue the file's `limits:` names that the
//! file does not list is deleted, as `tasks:` prunes; a queue under `fair:` gets exactly
//! the file's weights.

use anyhow::{bail, Context, Result};
use ax_sdk::client::Client;
use ax_sdk::limits::fair::FairDef;
use ax_sdk::limits::LimitDef;
use serde_json::{json, Value};
use std::collections::BTreeSet;

/// The file's `limits:`, decoded (not yet checked by a server).
fn read_limits(doc: &Value) -> Result<Option<Vec<LimitDef>>> {
    let Some(list) = doc.get("limits") else {
        return Ok(None);
    };
    let Some(list) = list.as_array() else {
        bail!("limits: a list of limit definitions (PROTOCOL.md §7)");
    };
    let mut defs = Vec::new();
    for (i, item) in list.iter().enumerate() {
        let def: LimitDef = serde_json::from_value(item.clone())
            .with_context(|| format!("limits[{i}]: not a limit definition"))?;
        defs.push(def);
    }
    Ok(Some(defs))
}

/// The file's `fair:`, decoded.
fn read_fair(doc: &Value) -> Result<Option<Vec<FairDef>>> {
    let Some(map) = doc.get("fair") else {
        return Ok(None);
    };
    let Some(map) = map.as_object() else {
        bail!("fair: a map of queue -> {{weights, default_weight, depth}}");
    };
    let mut defs = Vec::new();
    for (queue, def) in map {
        let mut def = def.clone();
        if !def.is_object() {
            bail!("fair.{queue}: an object {{weights, default_weight, depth}}");
        }
        def["queue"] = json!(queue);
        let def: FairDef = serde_json::from_value(def)
            .with_context(|| format!("fair.{queue}: not a fair-share definition"))?;
        defs.push(def);
    }
    Ok(Some(defs))
}

/// Checks that the file's `limits:` and `fair:` decode; nothing is sent.
pub(crate) fn check(doc: &Value) -> Result<bool> {
    Ok(read_limits(doc)?.is_some() | read_fair(doc)?.is_some())
}

/// Applies `limits:` then `fair:`; false if the file has neither.
pub(crate) async fn apply(doc: &Value, prune: bool, client: &Client) -> Result<bool> {
    let limits = read_limits(doc)?;
    let fair = read_fair(doc)?;
    if let Some(defs) = &limits {
        apply_limits(defs, prune, client).await?;
    }
    if let Some(defs) = &fair {
        for def in defs {
            client
                .limits("fair_put", &serde_json::to_value(def)?)
                .await
                .with_context(|| format!("fair.{}", def.queue))?;
            println!("{:<10} fair shares on {}", "applied", def.queue);
        }
    }
    Ok(limits.is_some() || fair.is_some())
}

async fn apply_limits(defs: &[LimitDef], prune: bool, client: &Client) -> Result<()> {
    let queues: BTreeSet<&str> = defs
        .iter()
        .flat_map(|d| std::iter::once(d.queue.as_str()).chain(d.queues.iter().map(String::as_str)))
        .filter(|q| !q.is_empty())
        .collect();
    let mut stored: Vec<LimitDef> = Vec::new();
    for q in &queues {
        let list = client.limits("list", &json!({ "queue": q })).await?;
        stored.extend(serde_json::from_value::<Vec<LimitDef>>(list)?);
    }
    for (i, def) in defs.iter().enumerate() {
        let before = stored.iter().find(|s| {
            s.name == def.name && (s.queue == def.queue || def.queues.contains(&s.queue))
        });
        let outcome = match before {
            Some(s) if same(s, def) => "unchanged",
            Some(_) => "updated",
            None => "created",
        };
        if outcome != "unchanged" {
            client
                .limits("put", &serde_json::to_value(def)?)
                .await
                .with_context(|| format!("limits[{i}] ({})", def.name))?;
        }
        println!("{outcome:<10} limit {} on {}", def.name, shown_queue(def));
    }
    if prune {
        for s in &stored {
            let listed = defs
                .iter()
                .any(|d| d.name == s.name && (d.queue == s.queue || d.queues.contains(&s.queue)));
            if !listed {
                client
                    .limits("delete", &json!({"queue": s.queue, "name": s.name}))
                    .await?;
                println!("{:<10} limit {} on {}", "deleted", s.name, s.queue);
            }
        }
    }
    Ok(())
}

/// True if a stored limit is what the file says (the server fills in a shared limit's
/// queue).
fn same(stored: &LimitDef, file: &LimitDef) -> bool {
    let mut file = file.clone();
    if file.queue.is_empty() {
        file.queue = stored.queue.clone();
    }
    *stored == file
}

fn shown_queue(def: &LimitDef) -> String {
    match def.queues.is_empty() {
        true => def.queue.clone(),
        false => def.queues.join(","),
    }
}
