//! The Rust core's log lines, for Python's `logging`: a `tracing` layer turns each event
//! (with the fields of its spans: a task's id, name, queue, attempt) into a record and
//! puts it in a bounded queue; a Python thread takes records out with [`LogRelay::next`]
//! (waiting with the GIL released) and logs them. No Rust thread ever waits for the GIL,
//! and a Python side that falls behind loses records (counted), never stalls a worker.

use crate::errors::seconds;
use pyo3::prelude::*;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex, OnceLock};
use tracing::field::{Field, Visit};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// Records waiting for Python at most; beyond, new ones are dropped and counted.
const QUEUE: usize = 10_000;

/// One log record: `(level, target, message, fields)`; level as Python's numbers (10
/// debug … 40 error).
type Record = (u8, String, String, BTreeMap<String, String>);

struct Relay {
    tx: mpsc::SyncSender<Record>,
    rx: Mutex<mpsc::Receiver<Record>>,
    dropped: AtomicU64,
}

fn relay() -> &'static Relay {
    static RELAY: OnceLock<Relay> = OnceLock::new();
    RELAY.get_or_init(|| {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        Relay {
            tx,
            rx: Mutex::new(rx),
            dropped: AtomicU64::new(0),
        }
    })
}

/// A span's fields, kept in its extensions.
struct SpanFields(BTreeMap<String, String>);

#[derive(Default)]
struct Fields {
    message: String,
    fields: BTreeMap<String, String>,
}

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_string();
        } else {
            self.fields
                .insert(field.name().to_string(), value.to_string());
        }
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let mut text = String::new();
        let _ = write!(text, "{value:?}");
        if field.name() == "message" {
            self.message = text;
        } else {
            self.fields.insert(field.name().to_string(), text);
        }
    }
}

struct Layer;

impl<S> tracing_subscriber::Layer<S> for Layer
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: Context<'_, S>,
    ) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(SpanFields(fields.fields));
        }
    }

    fn on_record(
        &self,
        id: &tracing::span::Id,
        values: &tracing::span::Record<'_>,
        ctx: Context<'_, S>,
    ) {
        let mut fields = Fields::default();
        values.record(&mut fields);
        if let Some(span) = ctx.span(id) {
            let mut ext = span.extensions_mut();
            if let Some(SpanFields(known)) = ext.get_mut::<SpanFields>() {
                known.extend(fields.fields);
            }
        }
    }

    fn on_event(&self, event: &tracing::Event<'_>, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let mut all = BTreeMap::new();
        if let Some(scope) = ctx.event_scope(event) {
            for span in scope.from_root() {
                if let Some(SpanFields(known)) = span.extensions().get::<SpanFields>() {
                    all.extend(known.clone());
                }
            }
        }
        all.extend(fields.fields);
        let meta = event.metadata();
        let level = match *meta.level() {
            tracing::Level::ERROR => 40,
            tracing::Level::WARN => 30,
            tracing::Level::INFO => 20,
            _ => 10,
        };
        let record = (level, meta.target().to_string(), fields.message, all);
        let r = relay();
        if r.tx.try_send(record).is_err() {
            r.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Sends the core's `tracing` logs at `filter` (the `RUST_LOG` syntax, e.g. `warn` or
/// `info,ax_sdk=debug`) to the relay Python drains (`relay` True) or to stderr. Only the
/// first call in a process takes effect; it answers whether it was that one.
#[pyfunction]
#[pyo3(signature = (filter, relay = false))]
pub fn init_logging(filter: &str, relay: bool) -> bool {
    let filter = tracing_subscriber::EnvFilter::new(filter);
    if relay {
        tracing_subscriber::registry()
            .with(filter)
            .with(Layer)
            .try_init()
            .is_ok()
    } else {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            .try_init()
            .is_ok()
    }
}

/// Where Python takes the core's log records from.
#[pyclass(frozen, module = "ax_scheduler._core")]
pub struct LogRelay;

#[pymethods]
impl LogRelay {
    #[new]
    fn new() -> LogRelay {
        LogRelay
    }

    /// The next record `(level, target, message, fields)`, or None after `timeout`
    /// seconds. Waits with the GIL released. One thread should drain it.
    fn next(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Record>> {
        let limit = seconds(timeout, "timeout")?;
        Ok(py.detach(|| {
            let rx = relay().rx.lock().expect("not poisoned");
            rx.recv_timeout(limit).ok()
        }))
    }

    /// Records dropped because Python did not take them in time (the queue holds 10,000).
    fn dropped(&self) -> u64 {
        relay().dropped.load(Ordering::Relaxed)
    }
}
