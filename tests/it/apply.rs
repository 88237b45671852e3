//! `Client::apply_triggers` (`ax apply -f`) with a file larger than the server's max
//! payload: sent in parts, every part checked before any is stored, then the stored
//! triggers the file does not name deleted (their names read a page at a time).

use crate::support::Env;
use crate::triggers::interval;
use ax_sdk::trigger::{Applied, ApplyStage};
use ax_sdk::ClientError;
use serde_json::Value;

/// `n` hourly triggers `t-<i>`, each padded to about 500 bytes.
fn file(n: usize, every_ms: u64) -> Vec<Value> {
    (0..n)
        .map(|i| {
            let mut def = interval(&format!("t-{i:05}"), every_ms);
            def["tasks"][0]["payload"] = "x".repeat(450).into();
            def
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_over_the_max_payload_is_applied_in_parts_all_or_nothing() {
    let faults = ax_core::faults::Faults::armed();
    let env = Env::start(Env::server().faults(faults.clone())).await;
    let max = env.client.server_info().max_payload;
    let defs = file(3000, 3_600_000);
    let bytes: usize = defs.iter().map(|d| d.to_string().len()).sum();
    assert!(
        bytes > max,
        "the file ({bytes} B) must not fit in one request ({max} B)"
    );
    for old in ["old", "zz-old"] {
        env.ax
            .put_trigger(&serde_json::from_value(interval(old, 3_600_000)).unwrap())
            .await
            .unwrap();
    }
    // Names pages of 2 KiB: the 3,002 stored names take many, and "zz-old" is on the last.
    faults.names_page_bytes(2048);

    let mut seen: Vec<(ApplyStage, usize, usize)> = Vec::new();
    let report = env
        .ax
        .apply_triggers(&defs, true, |s, d, t| seen.push((s, d, t)))
        .await
        .unwrap();
    let created = report.iter().filter(|a| a.outcome == "created").count();
    assert_eq!(created, 3000, "{:?}", &report[..3]);
    let deleted: Vec<&Applied> = report.iter().filter(|a| a.outcome == "deleted").collect();
    let old = |name: &str| Applied {
        name: name.into(),
        outcome: "deleted".into(),
    };
    assert_eq!(deleted, [&old("old"), &old("zz-old")]);
    // Checked part by part to the end before anything was stored, then stored.
    let checks: Vec<_> = seen
        .iter()
        .filter(|s| s.0 == ApplyStage::Checking)
        .collect();
    assert!(checks.len() >= 2, "{seen:?}");
    let first_store = seen
        .iter()
        .position(|s| s.0 == ApplyStage::Storing)
        .unwrap();
    assert_eq!(seen[first_store - 1], (ApplyStage::Checking, 3000, 3000));
    assert_eq!(
        seen.iter().rev().find(|s| s.0 == ApplyStage::Storing),
        Some(&(ApplyStage::Storing, 3000, 3000))
    );
    assert_eq!(env.ax.list_triggers().await.unwrap().len(), 3000);

    // The same file with t-00000 changed and the last definition invalid: refused with
    // the field of the whole file, and nothing changes, not even in the first part.
    let mut bad = file(3000, 3_600_000);
    bad[0]["every_ms"] = 7_200_000.into();
    bad[2999]["every_ms"] = 10.into();
    let e = env
        .ax
        .apply_triggers(&bad, true, |_, _, _| {})
        .await
        .unwrap_err();
    let ClientError::Refused(wire) = e else {
        panic!("{e:?}")
    };
    assert_eq!(wire.field.as_deref(), Some("triggers[2999].every_ms"));
    let kept = env.ax.get_trigger("t-00000").await.unwrap().unwrap();
    let kept = serde_json::to_value(&kept.definition).unwrap();
    assert_eq!(kept["every_ms"], 3_600_000);

    // Applied again with nothing changed: every one unchanged, none deleted.
    let again = env
        .ax
        .apply_triggers(&defs, true, |_, _, _| {})
        .await
        .unwrap();
    assert_eq!(again.len(), 3000);
    assert!(again.iter().all(|a| a.outcome == "unchanged"));
}
