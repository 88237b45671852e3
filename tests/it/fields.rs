//! The submit request's fields, in one list for the property and fuzz tests
//! (`decoders.rs`, `wire.rs`), checked against the table of PROTOCOL.md §2 so that a
//! field added to the protocol reaches the tests that throw odd values at it.

/// Every field of a submit request (the `backoff` object's too), and one that is not.
pub const SUBMIT_FIELDS: [&str; 24] = [
    "name",
    "queue",
    "payload",
    "payload_base64",
    "priority",
    "delay_ms",
    "run_at",
    "idempotency_key",
    "limit_key",
    "fair_key",
    "traceparent",
    "business_id",
    "max_attempts",
    "timeout_ms",
    "backoff",
    "base_ms",
    "max_ms",
    "jitter",
    "retry_on",
    "no_retry_on",
    "debounce",
    "singleton",
    // Inside `backoff` only, and a field no request has.
    "unknown",
    "unknown_too",
];

/// The field names of PROTOCOL.md §2's submit table (`backoff.base_ms` as `base_ms`).
fn protocol_fields() -> Vec<String> {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/PROTOCOL.md"))
        .expect("docs/PROTOCOL.md");
    let section = doc
        .split("## 2. Submitting a task")
        .nth(1)
        .expect("PROTOCOL.md has its §2");
    section
        .lines()
        .skip_while(|l| !l.starts_with("| field |"))
        .skip(2)
        .take_while(|l| l.starts_with("| `"))
        .filter_map(|l| l.split('`').nth(1))
        .map(|name| name.rsplit('.').next().unwrap_or(name).to_string())
        .collect()
}

#[test]
fn the_fuzzed_submit_fields_are_the_protocol_s() {
    let doc = protocol_fields();
    assert!(doc.len() >= 15, "read the table: {doc:?}");
    let listed: Vec<&str> = SUBMIT_FIELDS
        .iter()
        .copied()
        .filter(|f| !f.starts_with("unknown"))
        .collect();
    for f in &doc {
        assert!(
            listed.contains(&f.as_str()),
            "{f} is in PROTOCOL.md §2 but not fuzzed"
        );
    }
    for f in &listed {
        assert!(
            doc.iter().any(|d| d == f),
            "{f} is fuzzed but not in PROTOCOL.md §2"
        );
    }
}
