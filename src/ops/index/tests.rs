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
        2 + 2 * n as usize,
        "q, charge, runs, classes"
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
