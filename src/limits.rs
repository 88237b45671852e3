//! `ax limits …`: rate limits and concurrency caps shared by every worker. Every
//! subcommand prints a table by default and JSON with `-o json`.

use crate::conn::Conn;
use crate::out::{self, Output};
use anyhow::{bail, Result};
use ax_sdk::limits::model::{check_rate, MAX_BURST, MAX_CONCURRENCY};
use ax_sdk::Client;
use clap::Subcommand;
use serde_json::{json, Value};

#[derive(Subcommand)]
pub(crate) enum LimitsCommand {
    /// Create or replace a limit (applies within a second on every worker, to queued tasks
    /// too; a task already handed back by a rate returns within one interval of the old
    /// rate). Give --rate, --concurrency, or both.
    #[command(group(clap::ArgGroup::new("limit").required(true).multiple(true)
        .args(["rate", "concurrency"])))]
    Set {
        /// Limit name (unique in its queue).
        name: String,
        /// The queue it limits.
        #[arg(long)]
        queue: String,
        /// Share the limit with this queue too (repeat for more, up to 16 queues in all):
        /// the tasks of every queue named draw from one rate bucket and one set of slots.
        #[arg(long = "shared-with")]
        shared_with: Vec<String>,
        /// Only tasks of this name (default: every task of the queue).
        #[arg(long)]
        task: Option<String>,
        /// One limit per task `limit_key` (a customer, a tenant) instead of one for all.
        #[arg(long)]
        per_key: bool,
        /// Only tasks with this limit key.
        #[arg(long)]
        key: Option<String>,
        /// Starts per second: a number from 0.000001 (one per 11.6 days) to 100000.
        #[arg(long, value_parser = rate, allow_negative_numbers = true)]
        rate: Option<f64>,
        /// Starts allowed at once above the rate, 1..=1000000 (default: the rate rounded
        /// up).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_BURST)),
              allow_negative_numbers = true, requires = "rate")]
        burst: Option<u32>,
        /// Attempts running at once, 1..=1000 (1: a singleton).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_CONCURRENCY)),
              allow_negative_numbers = true)]
        concurrency: Option<u32>,
        /// Make the rate adaptive: lowered on pressure down to this many starts per
        /// second, raised back while calm up to --rate.
        #[arg(long, value_parser = rate, allow_negative_numbers = true, requires = "rate")]
        adaptive_min: Option<f64>,
        /// Adaptive: starts per second added back per calm second (default: --rate / 20).
        #[arg(long, value_parser = rate, allow_negative_numbers = true, requires = "adaptive_min")]
        increase: Option<f64>,
        /// Adaptive: the factor a report of pressure multiplies the rate by, 0.05–0.95
        /// (default 0.7; once per overload).
        #[arg(long, value_parser = factor, allow_negative_numbers = true, requires = "adaptive_min")]
        decrease: Option<f64>,
        /// Adaptive: an error class that reports pressure (repeat for more; default
        /// `pressure`). A handler reports pressure by failing with it.
        #[arg(long = "pressure-class", requires = "adaptive_min")]
        pressure_classes: Vec<String>,
        /// What happens to tasks over the rate: throttle (default: they wait their turn)
        /// or drop (a submit over it is refused with rate_limited; not adaptive).
        #[arg(long, requires = "rate", conflicts_with = "adaptive_min",
              value_parser = ["throttle", "drop"])]
        excess: Option<String>,
    },
    /// Print one limit.
    Get {
        /// Limit name.
        name: String,
        /// Its queue.
        #[arg(long)]
        queue: String,
    },
    /// All limits (of one queue).
    List {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
    },
    /// Each limit with what it holds now: tokens left in a queue- or name-wide rate bucket
    /// (per-key buckets are not listed), concurrency slots held and by whom.
    Status {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
    },
    /// The debounce windows and batches waiting now (at most 1,000 listed): key, task id,
    /// due time, items of a batch. `ax limits status` shows them too.
    Windows {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
    },
    /// A queue's fair shares between tenants (tasks submitted with a fair key): shows the
    /// weights and each tenant's tasks held and released; `--weight`, `--default-weight`
    /// and `--depth` change them, live.
    Fair(crate::fair::FairArgs),
    /// Remove a limit (an error if there is none of that name on the queue).
    Delete {
        /// Limit name.
        name: String,
        /// Its queue.
        #[arg(long)]
        queue: String,
    },
}

/// `--rate`: a finite number in the range a limit accepts (NaN, inf, `1e999` and values
/// ≤ 0 are refused here, named by clap as `--rate`, rather than sent as JSON `null`).
fn rate(text: &str) -> Result<f64, String> {
    let rate: f64 = text
        .trim()
        .parse()
        .map_err(|_| "not a number".to_string())?;
    check_rate(rate)
}

/// `--decrease`: a finite factor from 0.05 to 0.95.
fn factor(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(f) if (0.05..=0.95).contains(&f) => Ok(f),
        _ => Err("must be a factor from 0.05 to 0.95".to_string()),
    }
}

/// A definition's optional field as a table cell.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn def_row(d: &Value) -> Vec<String> {
    let queue = match d["queues"].as_array() {
        Some(all) => format!(
            "{} (shared: {})",
            cell(&d["queue"]),
            all.iter().map(cell).collect::<Vec<_>>().join(",")
        ),
        None => cell(&d["queue"]),
    };
    vec![
        queue,
        cell(&d["name"]),
        d["task"].as_str().unwrap_or("*").to_string(),
        match (d["per_key"].as_bool(), d["key"].as_str()) {
            (Some(true), _) => "per key".to_string(),
            (_, Some(k)) => k.to_string(),
            _ => "*".to_string(),
        },
        match (d["adaptive"]["min"].as_f64(), d["excess"].as_str()) {
            (Some(min), _) => format!("{} (adaptive ≥ {min})", cell(&d["rate"])),
            (None, Some("drop")) => format!("{} (excess dropped)", cell(&d["rate"])),
            _ => cell(&d["rate"]),
        },
        cell(&d["burst"]),
        cell(&d["concurrency"]),
    ]
}

const DEF_HEADER: [&str; 7] = [
    "QUEUE",
    "NAME",
    "TASK",
    "KEY",
    "RATE/S",
    "BURST",
    "CONCURRENCY",
];

fn print_defs(defs: &[Value], output: Output, one: bool) -> Result<()> {
    if output == Output::Json {
        return if one {
            out::json(&defs[0])
        } else {
            out::json(&defs)
        };
    }
    let rows: Vec<Vec<String>> = defs.iter().map(def_row).collect();
    out::table(&DEF_HEADER, &rows);
    Ok(())
}

fn print_status(all: &Value, output: Output) -> Result<()> {
    if output == Output::Json {
        return out::json(all);
    }
    let rows: Vec<Vec<String>> = all
        .as_array()
        .into_iter()
        .flatten()
        .map(|s| {
            let d = &s["limit"];
            let held = s["slots_held"].as_array().cloned().unwrap_or_default();
            let mut holders: Vec<String> = held.iter().map(|h| cell(&h["holder"])).collect();
            holders.sort();
            holders.dedup();
            let mut row = def_row(d);
            row.truncate(5); // QUEUE NAME TASK KEY RATE/S
            if let Some(now) = s["rate_now"].as_f64() {
                row[4] = format!("{} (now {now:.1})", cell(&d["rate"]));
            }
            row.push(match s["tokens"].as_f64() {
                Some(t) => format!("{t:.1}"),
                None if d["rate"].is_null() => "-".to_string(),
                None => "(per key)".to_string(),
            });
            row.push(match d["concurrency"].as_u64() {
                Some(c) if d["per_key"].as_bool() == Some(true) => {
                    format!("{} (cap {c} per key)", held.len())
                }
                Some(c) => format!("{}/{c}", held.len()),
                None => "-".to_string(),
            });
            row.push(if holders.is_empty() {
                "-".to_string()
            } else {
                holders.join(",")
            });
            row
        })
        .collect();
    out::table(
        &[
            "QUEUE",
            "NAME",
            "TASK",
            "KEY",
            "RATE/S",
            "TOKENS",
            "SLOTS HELD",
            "HOLDERS",
        ],
        &rows,
    );
    Ok(())
}

fn print_windows(answer: &Value, output: Output) -> Result<()> {
    if output == Output::Json {
        return out::json(answer);
    }
    let now = ax_core::time::now_ms();
    let rows: Vec<Vec<String>> = answer["windows"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| {
            let due = match w["due_ms"].as_u64() {
                _ if w["closed"].as_bool() == Some(true) => "closed: due now".to_string(),
                Some(at) if at > now => format!("in {:.1} s", (at - now) as f64 / 1000.0),
                Some(_) => "due now".to_string(),
                None => "-".to_string(),
            };
            vec![
                cell(&w["queue"]),
                cell(&w["kind"]),
                cell(&w["key"]),
                w["items"]
                    .as_u64()
                    .map_or("-".to_string(), |n| n.to_string()),
                due,
                cell(&w["id"]),
            ]
        })
        .collect();
    out::table(
        &["QUEUE", "WAITING", "KEY", "ITEMS", "RUNS", "TASK ID"],
        &rows,
    );
    if let Some(more) = answer["more"].as_u64().filter(|m| *m > 0) {
        println!("… and {more} more not listed");
    }
    Ok(())
}

pub(crate) async fn run(command: LimitsCommand, conn: &Conn, output: Output) -> Result<()> {
    let client = Client::new(conn.connect().await?);
    match command {
        LimitsCommand::Set {
            name,
            queue,
            shared_with,
            task,
            per_key,
            key,
            rate,
            burst,
            concurrency,
            adaptive_min,
            increase,
            decrease,
            pressure_classes,
            excess,
        } => {
            let mut def = json!({"name": name, "queue": queue, "task": task, "per_key": per_key, "key": key,
                             "rate": rate, "burst": burst, "concurrency": concurrency});
            if !shared_with.is_empty() {
                let queues: Vec<&String> = std::iter::once(&queue).chain(&shared_with).collect();
                def["queues"] = json!(queues);
            }
            if let Some(excess) = excess {
                def["excess"] = json!(excess);
            }
            if let Some(min) = adaptive_min {
                def["adaptive"] = json!({"min": min, "increase": increase, "decrease": decrease,
                                         "on": pressure_classes});
            }
            let stored = client.limits("put", &def).await?;
            print_defs(&[stored], output, true)?;
        }
        LimitsCommand::Get { name, queue } => {
            let def = client
                .limits("get", &json!({"queue": queue, "name": name}))
                .await?;
            print_defs(&[def], output, true)?;
        }
        LimitsCommand::List { queue } => {
            let all = client.limits("list", &json!({ "queue": queue })).await?;
            let defs = all.as_array().cloned().unwrap_or_default();
            print_defs(&defs, output, false)?;
        }
        LimitsCommand::Status { queue } => {
            let all = client.limits("status", &json!({ "queue": queue })).await?;
            print_status(&all, output)?;
            if output != Output::Json {
                let windows = client.limits("windows", &json!({ "queue": queue })).await?;
                if windows["windows"].as_array().is_some_and(|w| !w.is_empty()) {
                    println!();
                    print_windows(&windows, output)?;
                }
                if let Some(queue) = &queue {
                    crate::fair::print_if_held(&client, queue).await?;
                }
            }
        }
        LimitsCommand::Windows { queue } => {
            let windows = client.limits("windows", &json!({ "queue": queue })).await?;
            print_windows(&windows, output)?;
        }
        LimitsCommand::Fair(args) => crate::fair::run(args, &client, output).await?,
        LimitsCommand::Delete { name, queue } => {
            let reply = client
                .limits("delete", &json!({"queue": queue, "name": name}))
                .await?;
            let deleted = reply["deleted"].as_bool() == Some(true);
            if output == Output::Json {
                out::json(&reply)?;
            } else if deleted {
                println!("deleted limit {name} of queue {queue}");
            }
            if !deleted {
                bail!("no limit {name:?} on queue {queue:?}: nothing deleted");
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_that_are_not_finite_or_not_positive_are_refused_naming_the_range() {
        for bad in [
            "NaN", "nan", "inf", "-inf", "1e999", "-5", "0", "-0", "1e-20", "x", "",
        ] {
            let e = rate(bad).unwrap_err();
            assert!(
                e.contains("from 0.000001") || e == "not a number",
                "{bad}: {e}"
            );
        }
        assert_eq!(rate("2.5"), Ok(2.5));
        assert_eq!(rate("100000"), Ok(100_000.0));
    }
}
