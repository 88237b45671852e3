use super::*;

fn rec(queue: &str, name: &str, state: &str, updated: u64, class: Option<&str>) -> String {
    let err = class.map_or(String::new(), |c| {
        format!(r#","last_error":{{"class":"{c}","message":"m"}}"#)
    });
    format!(
        r#"{{"id":"x","queue":"{queue}","name":"{name}","priority":"normal","state":"{state}","attempt":1,"max_attempts":3,"created_at_ms":1,"updated_at_ms":{updated}{err}}}"#
    )
}

fn put(ix: &mut Index, id: &str, rev: u64, json: &str) {
    let parsed: Indexed<'_> = serde_json::from_str(json).unwrap();
    ix.put(id, rev, &parsed);
}

fn ids(rows: &[TaskRow]) -> Vec<&str> {
    rows.iter().map(|r| r.id.as_str()).collect()
}

#[test]
fn finds_the_few_dead_of_one_class_among_many_newest_first() {
    let mut ix = Index::default();
    for i in 0..10_000u64 {
        put(
            &mut ix,
            &format!("q.t{i}"),
            i + 1,
            &rec("q", "work", "succeeded", i, None),
        );
    }
    put(
        &mut ix,
        "q.d1",
        20_001,
        &rec("q", "work", "dead", 50, Some("timeout")),
    );
    put(
        &mut ix,
        "q.d2",
        20_002,
        &rec("q", "work", "dead", 70, Some("timeout")),
    );
    put(
        &mut ix,
        "q.d3",
        20_003,
        &rec("q", "work", "dead", 60, Some("io")),
    );
    let q = TaskQuery {
        state: Some(TaskState::Dead),
        error_class: Some("timeout".into()),
        ..Default::default()
    };
    let (rows, total) = ix.find(&q, 10, None, 1000);
    assert_eq!(ids(&rows), ["q.d2", "q.d1"]);
    assert_eq!(total, Some(2));
    assert_eq!(rows[0].error_class.as_deref(), Some("timeout"));
    let unknown = TaskQuery {
        error_class: Some("nope".into()),
        ..Default::default()
    };
    assert_eq!(ix.find(&unknown, 10, None, 1000), (vec![], Some(0)));
    assert_eq!(
        ix.counts(),
        vec![("q".to_string(), [0, 0, 0, 0, 10_000, 3, 0])]
    );
}

#[test]
fn a_change_moves_the_task_and_an_older_revision_is_ignored() {
    let mut ix = Index::default();
    put(
        &mut ix,
        "q.a",
        5,
        &rec("q", "n", "retrying", 10, Some("io")),
    );
    put(&mut ix, "q.a", 7, &rec("q", "n", "succeeded", 20, None));
    put(&mut ix, "q.a", 6, &rec("q", "n", "dead", 15, Some("io")));
    let dead = TaskQuery {
        state: Some(TaskState::Dead),
        ..Default::default()
    };
    assert_eq!(ix.find(&dead, 10, None, 100).1, Some(0));
    let io = TaskQuery {
        error_class: Some("io".into()),
        ..Default::default()
    };
    assert_eq!(
        ix.find(&io, 10, None, 100).1,
        Some(0),
        "the class left with the error"
    );
    assert_eq!(ix.state_of("q.a"), Some(TaskState::Succeeded));
    ix.remove("q.a");
    assert_eq!(ix.len(), 0);
    assert_eq!(ix.find(&TaskQuery::default(), 10, None, 100).1, Some(0));
}

#[test]
fn pages_follow_the_cursor_and_time_ranges_bound_the_walk() {
    let mut ix = Index::default();
    for i in 0..25u64 {
        let state = if i % 2 == 0 { "pending" } else { "succeeded" };
        put(
            &mut ix,
            &format!("q.t{i:02}"),
            i + 1,
            &rec("q", "n", state, 100 + i, None),
        );
    }
    let all = TaskQuery::default();
    let (first, total) = ix.find(&all, 10, None, 1000);
    assert_eq!(total, Some(25));
    assert_eq!(first[0].id, "q.t24", "newest first across states");
    let last = first.last().unwrap();
    let (second, _) = ix.find(&all, 10, Some(&(last.updated_at_ms, last.id.clone())), 1000);
    assert_eq!(second[0].id, "q.t14");
    let window = TaskQuery {
        from_ms: Some(105),
        to_ms: Some(110),
        ..Default::default()
    };
    let (rows, total) = ix.find(&window, 100, None, 1000);
    assert_eq!(ids(&rows), ["q.t09", "q.t08", "q.t07", "q.t06", "q.t05"]);
    assert_eq!(total, Some(5));
    let (_, capped) = ix.find(&all, 3, None, 5);
    assert_eq!(capped, None, "a count past the cap is not claimed");
}

#[test]
fn flow_runs_triggers_and_keys_are_searchable() {
    let mut ix = Index::default();
    put(
        &mut ix,
        "q.fl.run1.a.0.0",
        1,
        &rec("q", "n", "succeeded", 1, None),
    );
    put(
        &mut ix,
        "q.fl.run1.b.0.0",
        2,
        &rec("q", "n", "running", 2, None),
    );
    put(
        &mut ix,
        "q.fl.run2.a.0.0",
        3,
        &rec("q", "n", "running", 3, None),
    );
    let json = r#"{"queue":"q","name":"n","state":"pending","created_at_ms":1,"updated_at_ms":4,"trigger":"nightly","idempotency_key":"order-7"}"#;
    put(&mut ix, "q.tr.nightly.x.0", 4, json);
    let run = TaskQuery {
        flow_run: Some("run1".into()),
        ..Default::default()
    };
    assert_eq!(
        ids(&ix.find(&run, 10, None, 100).0),
        ["q.fl.run1.b.0.0", "q.fl.run1.a.0.0"]
    );
    let trig = TaskQuery {
        trigger: Some("nightly".into()),
        ..Default::default()
    };
    assert_eq!(ids(&ix.find(&trig, 10, None, 100).0), ["q.tr.nightly.x.0"]);
    let key = TaskQuery {
        idempotency_key: Some("order-7".into()),
        queue: Some("q".into()),
        ..Default::default()
    };
    assert_eq!(ix.find(&key, 10, None, 100).1, Some(1));
}

#[test]
fn a_record_with_json_escapes_is_indexed() {
    let mut ix = Index::default();
    // A name, trigger and class written with escapes (`\"`, `\n`, `\u00e9`): a JSON
    // writer may escape any character, so the index must not need the text verbatim.
    let json = r#"{"queue":"q","name":"na\"me\n","state":"dead","attempt":2,"created_at_ms":1,"updated_at_ms":9,"trigger":"caf\u00e9","last_error":{"class":"t\u0069meout","message":"line\none \"quoted\""}}"#;
    put(&mut ix, "q.esc", 3, json);
    assert_eq!(ix.state_of("q.esc"), Some(TaskState::Dead));
    let q = TaskQuery {
        name: Some("na\"me\n".into()),
        trigger: Some("café".into()),
        error_class: Some("timeout".into()),
        ..Default::default()
    };
    let (rows, total) = ix.find(&q, 10, None, 100);
    assert_eq!((ids(&rows), total), (vec!["q.esc"], Some(1)));
    assert_eq!(rows[0].name, "na\"me\n");
    assert_eq!(rows[0].trigger.as_deref(), Some("café"));
}

#[test]
fn plain_text_is_borrowed_and_an_unreadable_newer_record_drops_the_stale_entry() {
    let json = rec("q", "work", "running", 5, None)
        .replace(r#""state""#, r#""trigger":"nightly","state""#);
    let parsed: Indexed<'_> = serde_json::from_str(&json).unwrap();
    assert!(matches!(parsed.queue, Cow::Borrowed(_)));
    assert!(matches!(parsed.name, Cow::Borrowed(_)));
    assert!(matches!(parsed.trigger, Some(Text(Cow::Borrowed(_)))));
    let mut ix = Index::default();
    ix.put("q.a", 5, &parsed);
    ix.forget_older("q.a", 4);
    assert_eq!(ix.state_of("q.a"), Some(TaskState::Running), "older: kept");
    ix.forget_older("q.a", 6);
    assert_eq!(
        ix.state_of("q.a"),
        None,
        "a newer unreadable record: not running"
    );
}

#[test]
fn symbols_no_task_uses_any_more_are_released_and_their_slots_reused() {
    let mut ix = Index::default();
    let n = 10_000u64;
    let step = |i: u64, gen: u64| format!("q.fl.run{gen}x{i}.charge.0.0");
    for i in 0..n {
        let class = format!("class{i}");
        put(
            &mut ix,
            &step(i, 0),
            i + 1,
            &rec("q", "charge", "retrying", i, Some(&class)),
        );
    }
    assert_eq!(
        ix.symbols_live(),
        2 + 3 * n as usize,
        "q, charge, runs, classes, error texts"
    );
    // Overwritten without an error: the classes go, the runs stay (their tasks do).
    for i in 0..n {
        put(
            &mut ix,
            &step(i, 0),
            n + i + 1,
            &rec("q", "charge", "succeeded", n + i, None),
        );
    }
    assert_eq!(ix.symbols_live(), 2 + n as usize);
    let class0 = TaskQuery {
        error_class: Some("class0".into()),
        ..Default::default()
    };
    assert_eq!(ix.find(&class0, 10, None, 100).1, Some(0));
    // The tasks removed: nothing is left, not even the queue's counts.
    for i in 0..n {
        ix.remove(&step(i, 0));
    }
    assert_eq!(ix.symbols_live(), 0);
    assert_eq!(ix.counts(), vec![]);
    let slots = ix.symbol_slots();
    // Runs of a new generation reuse the freed slots.
    for i in 0..n {
        put(
            &mut ix,
            &step(i, 1),
            3 * n + i,
            &rec("q", "charge", "succeeded", i, None),
        );
    }
    assert_eq!(ix.symbols_live(), 2 + n as usize);
    assert_eq!(ix.symbol_slots(), slots, "freed slots reused");
    let run = TaskQuery {
        flow_run: Some(format!("run1x{}", n - 1)),
        ..Default::default()
    };
    assert_eq!(ids(&ix.find(&run, 10, None, 100).0), [step(n - 1, 1)]);
    assert_eq!(ix.counts(), vec![("q".to_string(), [0, 0, 0, 0, n, 0, 0])]);
}

fn rec_err(state: &str, updated: u64, class: &str, message: &str) -> String {
    format!(
        r#"{{"queue":"q","name":"n","state":"{state}","attempt":1,"created_at_ms":1,"updated_at_ms":{updated},"last_error":{{"class":"{class}","message":"{message}"}}}}"#
    )
}

#[test]
fn an_id_filter_finds_one_task_with_the_other_filters() {
    let mut ix = Index::default();
    for i in 0..100u64 {
        put(
            &mut ix,
            &format!("q.t{i:03}"),
            i + 1,
            &rec("q", "n", "succeeded", i, None),
        );
    }
    let one = |id: &str, state| TaskQuery {
        id: Some(id.into()),
        state,
        ..Default::default()
    };
    let (rows, total) = ix.find(&one("q.t042", None), 10, None, 100);
    assert_eq!((ids(&rows), total), (vec!["q.t042"], Some(1)));
    let (rows, total) = ix.find(&one("q.t042", Some(TaskState::Dead)), 10, None, 100);
    assert_eq!((rows.len(), total), (0, Some(0)), "every filter must match");
    assert_eq!(
        ix.find(&one("q.t04", None), 10, None, 100).1,
        Some(0),
        "exact"
    );
    assert_eq!(ix.find(&one("q.nope", None), 10, None, 100).1, Some(0));
    // A page past the one row is empty.
    let after = (rows_at(&ix, "q.t042"), "q.t042".to_string());
    assert_eq!(
        ix.find(&one("q.t042", None), 10, Some(&after), 100).1,
        Some(0)
    );
}

fn rows_at(ix: &Index, id: &str) -> u64 {
    let q = TaskQuery {
        id: Some(id.into()),
        ..Default::default()
    };
    ix.find(&q, 1, None, 1).0[0].updated_at_ms
}

#[test]
fn error_text_matches_class_or_message_ignoring_case_with_the_other_filters_and_pages() {
    let mut ix = Index::default();
    for i in 0..1000u64 {
        put(
            &mut ix,
            &format!("q.ok{i:04}"),
            i + 1,
            &rec("q", "n", "succeeded", i, None),
        );
    }
    put(
        &mut ix,
        "q.a",
        2001,
        &rec_err("dead", 10, "timeout", "upstream slow"),
    );
    put(
        &mut ix,
        "q.b",
        2002,
        &rec_err("retrying", 20, "io", "Connection RESET by peer"),
    );
    put(
        &mut ix,
        "q.c",
        2003,
        &rec_err("dead", 30, "io", "connection reset"),
    );
    put(
        &mut ix,
        "q.d",
        2004,
        &rec_err("dead", 40, "Timeout_Budget", "x"),
    );
    put(
        &mut ix,
        "q.e",
        2005,
        &rec_err("dead", 50, "e", "Ünïcode Straße"),
    );
    let text = |t: &str| TaskQuery {
        error_text: Some(t.into()),
        ..Default::default()
    };
    let found = |ix: &Index, q: &TaskQuery| ids(&ix.find(q, 10, None, 100).0).join(" ");
    assert_eq!(found(&ix, &text("connection reset")), "q.c q.b");
    assert_eq!(found(&ix, &text("TIMEOUT")), "q.d q.a", "class or message");
    assert_eq!(
        found(&ix, &text("straSSE")),
        "",
        "no case folding beyond lowercase"
    );
    assert_eq!(found(&ix, &text("ünï")), "q.e");
    assert_eq!(found(&ix, &text("ÜNÏ")), "q.e");
    let dead_reset = TaskQuery {
        state: Some(TaskState::Dead),
        ..text("reset")
    };
    assert_eq!(found(&ix, &dead_reset), "q.c");
    let (rows, total) = ix.find(&text(""), 2, None, 100);
    assert_eq!(
        (ids(&rows), total),
        (vec!["q.e", "q.d"], Some(5)),
        "any error"
    );
    let last = &rows[1];
    let (rows, _) = ix.find(
        &text(""),
        2,
        Some(&(last.updated_at_ms, last.id.clone())),
        100,
    );
    assert_eq!(ids(&rows), ["q.c", "q.b"]);
    assert_eq!(rows[1].error_class.as_deref(), Some("io"));
    // The message goes with the error.
    put(&mut ix, "q.b", 3000, &rec("q", "n", "succeeded", 60, None));
    assert_eq!(found(&ix, &text("connection reset")), "q.c");
    // `class: message` is kept to its first 256 bytes (at a character boundary).
    put(
        &mut ix,
        "q.f",
        3001,
        &rec_err("dead", 70, "big", &"é".repeat(200)),
    );
    assert_eq!(
        found(&ix, &text(&format!("big: {}", "É".repeat(125)))),
        "q.f"
    );
    assert_eq!(
        found(&ix, &text(&"é".repeat(126))),
        "",
        "past the kept bytes"
    );
    // Tasks that failed alike share the text; it goes when the last of them does.
    let live = ix.symbols_live();
    put(
        &mut ix,
        "q.g",
        3002,
        &rec_err("dead", 80, "io", "connection reset"),
    );
    assert_eq!(ix.symbols_live(), live);
    for id in ["q.c", "q.g"] {
        ix.remove(id);
    }
    assert_eq!(
        ix.symbols_live(),
        live - 2,
        "`io: connection reset` and `io`"
    );
    assert_eq!(found(&ix, &text("connection reset")), "");
}

#[test]
fn an_entry_is_88_bytes() {
    // Part of the per-record cost the docs state (docs/PERFORMANCE.md "Finding tasks").
    assert_eq!(std::mem::size_of::<Option<Entry>>(), 88);
}

fn put_at(ix: &mut Index, id: &str, rev: u64, json: &str, now: u64) {
    let parsed: Indexed<'_> = serde_json::from_str(json).unwrap();
    ix.put_at(id, rev, &parsed, now);
}

/// A record of queue `queue` in `state` at `updated`, its attempt started at `started`
/// (created 1 s before it).
fn timed(queue: &str, state: &str, attempt: u32, started: u64, updated: u64) -> String {
    format!(
        r#"{{"queue":"{queue}","name":"n","state":"{state}","attempt":{attempt},"created_at_ms":{},"updated_at_ms":{updated},"started_at_ms":{started}}}"#,
        started.saturating_sub(1_000)
    )
}

#[test]
fn the_series_counts_each_move_into_an_end_state_once_in_its_minute() {
    const MIN: u64 = 60_000;
    let now = 1_000 * 3_600_000 + 30_000; // 30 s into a minute
    let this = now / MIN * MIN;
    let mut ix = Index::default();
    // A task that runs 200 ms and succeeds this minute; the same record read again (a
    // feed read anew) and a later revision in the same state are not counted again.
    put_at(
        &mut ix,
        "a.1",
        1,
        &timed("a", "running", 1, this, this),
        now,
    );
    put_at(
        &mut ix,
        "a.1",
        2,
        &timed("a", "succeeded", 1, this, this + 200),
        now,
    );
    put_at(
        &mut ix,
        "a.1",
        2,
        &timed("a", "succeeded", 1, this, this + 200),
        now,
    );
    put_at(
        &mut ix,
        "a.1",
        3,
        &timed("a", "succeeded", 1, this, this + 200),
        now,
    );
    // Two failures of one task a minute ago, the `running` between not seen: two retries.
    let prev = this - MIN;
    put_at(
        &mut ix,
        "a.2",
        1,
        &timed("a", "retrying", 1, prev, prev + 10),
        now,
    );
    put_at(
        &mut ix,
        "a.2",
        2,
        &timed("a", "retrying", 2, prev + 20, prev + 30),
        now,
    );
    // Read for the first time (a server start): counted in its own minute; older than
    // the hour: not counted.
    put_at(
        &mut ix,
        "a.3",
        9,
        &timed("a", "dead", 3, prev, prev + 5),
        now,
    );
    put_at(&mut ix, "a.4", 9, &timed("a", "dead", 1, 1, 2), now);
    put_at(
        &mut ix,
        "b.1",
        1,
        &timed("b", "succeeded", 1, this, this + 1),
        now,
    );

    let all = ix.series.answer(None, now);
    assert_eq!(
        (&all["now_ms"], &all["minute_ms"]),
        (&serde_json::json!(now), &serde_json::json!(MIN))
    );
    let a = all["queues"]["a"].as_array().unwrap();
    assert_eq!(a.len(), 60);
    assert_eq!(a[0]["t"], this - 59 * MIN, "oldest first");
    let (last, before) = (&a[59], &a[58]);
    assert_eq!(last["t"], this);
    let n = |p: &serde_json::Value, f: &str| p[f].as_u64().unwrap();
    assert_eq!(
        [n(last, "succeeded"), n(last, "retried"), n(last, "dead")],
        [1, 0, 0]
    );
    assert_eq!(
        [
            n(before, "succeeded"),
            n(before, "retried"),
            n(before, "dead")
        ],
        [0, 2, 1]
    );
    let run = last["run_p50_ms"].as_f64().unwrap();
    assert!((200.0..=283.0).contains(&run), "200 ms within √2: {run}");
    let wait = last["wait_p95_ms"].as_f64().unwrap();
    assert!((1_000.0..=1_415.0).contains(&wait), "1 s within √2: {wait}");
    assert!(a[57]["run_p50_ms"].is_null() && a[57]["wait_p50_ms"].is_null());
    let total: u64 = a.iter().map(|p| n(p, "dead")).sum();
    assert_eq!(total, 1, "the record from long ago is not in the hour");
    // One queue asked for: only it.
    let b = ix.series.answer(Some("b"), now);
    assert_eq!(b["queues"].as_object().unwrap().len(), 1);
    assert_eq!(b["queues"]["b"][59]["succeeded"], 1);
    // An hour on, everything has rolled off.
    let later = ix.series.answer(Some("a"), now + 60 * MIN);
    let sum: u64 = later["queues"]["a"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| n(p, "succeeded") + n(p, "retried") + n(p, "dead"))
        .sum();
    assert_eq!(sum, 0);
}

/// Issue 44: a worker may escape any character of the queue too (`"\u0071"` is `q`).
#[test]
fn a_record_whose_queue_is_escaped_is_indexed_under_its_queue() {
    let mut ix = Index::default();
    let json = r#"{"queue":"\u0071","name":"work","state":"pending","attempt":0,"created_at_ms":1,"updated_at_ms":2}"#;
    put(&mut ix, "q.escq", 3, json);
    assert_eq!(ix.state_of("q.escq"), Some(TaskState::Pending));
    let q = TaskQuery {
        queue: Some("q".into()),
        ..Default::default()
    };
    let (rows, total) = ix.find(&q, 10, None, 100);
    assert_eq!((ids(&rows), total), (vec!["q.escq"], Some(1)));
}

/// Every string of a full record — keys and values, the queue among them — written as
/// `\uXXXX` escapes (what a worker's JSON encoder is free to do): the protocol's own reader
/// takes it, and so does the index, with the same values.
#[test]
fn a_record_written_wholly_in_escapes_is_indexed_as_the_protocol_reads_it() {
    fn escape_all(v: &serde_json::Value, out: &mut String) {
        let text = |s: &str, out: &mut String| {
            out.push('"');
            for unit in s.encode_utf16() {
                out.push_str(&format!("\\u{unit:04x}"));
            }
            out.push('"');
        };
        match v {
            serde_json::Value::String(s) => text(s, out),
            serde_json::Value::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    escape_all(item, out);
                }
                out.push(']');
            }
            serde_json::Value::Object(fields) => {
                out.push('{');
                for (i, (k, item)) in fields.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    text(k, out);
                    out.push(':');
                    escape_all(item, out);
                }
                out.push('}');
            }
            other => out.push_str(&other.to_string()),
        }
    }
    let plain = serde_json::json!({
        "id": "orders-eu.T1", "queue": "orders-eu", "name": "charge_card", "priority": "high",
        "state": "dead", "attempt": 3, "max_attempts": 3, "created_at_ms": 1, "updated_at_ms": 9,
        "finished_at_ms": 9, "started_at_ms": 5, "run_at_ms": 2, "worker": "w-1",
        "idempotency_key": "order:42", "trigger": "nightly", "trigger_source": "schedule",
        "scheduled_at_ms": 2, "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "business_id": "order-42", "op": {"op": "retry", "by": "ops@example.com", "at_ms": 3},
        "last_error": {"class": "card_declined", "message": "déclinée \"twice\"\n", "detail": "trace"}
    });
    let mut escaped = String::new();
    escape_all(&plain, &mut escaped);
    assert!(
        escaped.contains(r#""\u0071\u0075\u0065\u0075\u0065":"\u006f"#),
        "{escaped}"
    );
    let record: ax_sdk::TaskRecord = serde_json::from_str(&escaped).expect("the protocol reads it");
    assert_eq!(record.queue, "orders-eu");
    let mut ix = Index::default();
    put(&mut ix, "orders-eu.T1", 7, &escaped);
    let q = TaskQuery {
        queue: Some("orders-eu".into()),
        name: Some("charge_card".into()),
        state: Some(TaskState::Dead),
        error_class: Some("card_declined".into()),
        trigger: Some("nightly".into()),
        idempotency_key: Some("order:42".into()),
        ..Default::default()
    };
    let (rows, total) = ix.find(&q, 10, None, 100);
    assert_eq!((ids(&rows), total), (vec!["orders-eu.T1"], Some(1)));
}
