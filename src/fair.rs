//! `ax limits fair`: a queue's fair shares between tenants — show them, or change the
//! weights, the default weight and the depth (docs/guides/limits.md, "Fair shares").

use crate::out::{self, Output};
use anyhow::{bail, Result};
use ax_sdk::client::Client;
use serde_json::{json, Value};

/// The flags of `ax limits fair`.
#[derive(Debug, clap::Args)]
pub(crate) struct FairArgs {
    /// The queue.
    queue: String,
    /// A tenant's weight, `<fair key>=<1..1000>` (repeat the flag; `<key>=default` removes
    /// a tenant's own weight).
    #[arg(long = "weight", value_name = "KEY=WEIGHT")]
    weights: Vec<String>,
    /// The weight of every tenant not named.
    #[arg(long)]
    default_weight: Option<u32>,
    /// Most tasks of the queue waiting on a ready subject undelivered (default 64).
    #[arg(long)]
    depth: Option<u32>,
}

pub(crate) async fn run(args: FairArgs, client: &Client, output: Output) -> Result<()> {
    let current = client
        .limits("fair_get", &json!({ "queue": args.queue }))
        .await?;
    let changing =
        !args.weights.is_empty() || args.default_weight.is_some() || args.depth.is_some();
    if !changing {
        return print(&current, output);
    }
    let mut def = current["fair"].clone();
    for pair in &args.weights {
        let Some((key, weight)) = pair.split_once('=') else {
            bail!("--weight {pair:?}: give <fair key>=<weight>");
        };
        if weight == "default" {
            if let Some(w) = def["weights"].as_object_mut() {
                w.remove(key);
            }
            continue;
        }
        let Ok(weight) = weight.parse::<u32>() else {
            bail!("--weight {pair:?}: the weight must be a whole number 1..=1000");
        };
        if !def["weights"].is_object() {
            def["weights"] = json!({});
        }
        def["weights"][key] = json!(weight);
    }
    if let Some(w) = args.default_weight {
        def["default_weight"] = json!(w);
    }
    if let Some(d) = args.depth {
        def["depth"] = json!(d);
    }
    client.limits("fair_put", &def).await?;
    let stored = client
        .limits("fair_get", &json!({ "queue": args.queue }))
        .await?;
    print(&stored, output)
}

/// Under `ax limits status --queue <queue>`: the queue's fair shares, if a tenant has
/// tasks held.
pub(crate) async fn print_if_held(client: &Client, queue: &str) -> Result<()> {
    let answer = client
        .limits("fair_get", &json!({ "queue": queue }))
        .await?;
    let held = answer["status"]["tenants"]
        .as_array()
        .is_some_and(|t| t.iter().any(|t| t["held"].as_u64().unwrap_or(0) > 0));
    if held {
        println!();
        print(&answer, Output::Table)?;
    }
    Ok(())
}

fn print(answer: &Value, output: Output) -> Result<()> {
    if output == Output::Json {
        return out::json(answer);
    }
    let def = &answer["fair"];
    let weights: Vec<String> = def["weights"]
        .as_object()
        .into_iter()
        .flatten()
        .map(|(k, w)| format!("{k}={w}"))
        .collect();
    println!(
        "queue {}: default weight {}, depth {}, weights {}",
        def["queue"].as_str().unwrap_or("-"),
        def["default_weight"],
        def["depth"],
        if weights.is_empty() {
            "-".to_string()
        } else {
            weights.join(" ")
        }
    );
    let status = &answer["status"];
    let Some(tenants) = status["tenants"].as_array().filter(|t| !t.is_empty()) else {
        println!("no tenant has tasks held");
        return Ok(());
    };
    let age = ax_core::time::now_ms().saturating_sub(status["at_ms"].as_u64().unwrap_or(0));
    println!(
        "reported by {} {:.1} s ago:",
        status["leader"].as_str().unwrap_or("-"),
        age as f64 / 1000.0
    );
    let rows: Vec<Vec<String>> = tenants
        .iter()
        .map(|t| {
            vec![
                t["key"].as_str().unwrap_or("-").to_string(),
                t["priority"].as_str().unwrap_or("-").to_string(),
                t["weight"].to_string(),
                t["held"].to_string(),
                t["released"].to_string(),
            ]
        })
        .collect();
    out::table(
        &[
            "TENANT",
            "PRIORITY",
            "WEIGHT",
            "HELD",
            "RELEASED (LAST SECOND)",
        ],
        &rows,
    );
    Ok(())
}
