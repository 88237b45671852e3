//! The server's context: what `ax server` opens once at start (the JetStream context, the
//! task store, the idempotency and flow buckets, the declared queues and the limits of a
//! task) and hands to every request handler and service. The submit path, the trigger
//! fires, the flow engine, the APIs and the console all work over one `Context`.

use async_nats::jetstream::{self, kv};
use ax_core::admit::Queues;
use ax_core::names::IDEMPOTENCY_BUCKET;
use ax_core::state::{StateError, TaskStore};
use ax_core::task::Limits;

/// Every store and handle a server opens once at start, shared by its request handlers
/// and its services. Admission (`submit`) is a set of functions over it, in `submit`.
#[derive(Debug)]
pub(crate) struct Context {
    pub(crate) js: jetstream::Context,
    pub(crate) tasks: TaskStore,
    pub(crate) idempotency: kv::Store,
    pub(crate) limits: Limits,
    pub(crate) queues: Queues,
    /// Flow buckets: trigger fires start flow runs.
    pub(crate) flows: crate::flow::store::FlowStore,
    /// Group commit of unrecorded submits (one per ready stream and one for
    /// `AX_DELAYED`); `None` when turned off.
    pub(crate) ready: Option<ax_core::admit::Groups>,
    /// Faults a test armed (`ax_core::faults`); none by default.
    pub(crate) faults: ax_core::faults::Faults,
    /// The batch keys this server is writing items to (`submit::batching`).
    pub(crate) lanes: crate::submit::lanes::Lanes,
    /// The rate limits whose excess a submit drops (`limits::drops`).
    pub(crate) drops: crate::limits::drops::Drops,
    /// The flows' pending waits for events (a wait's submit registers it first).
    pub(crate) waits: ax_core::waits::Waits,
    /// The console's public URL (`--console-url`), if this server serves one: an
    /// approval's announcement gives its hook's URL under it.
    pub(crate) console_url: Option<String>,
}

impl Context {
    pub(crate) async fn open(
        js: jetstream::Context,
        limits: Limits,
        queues: &[String],
        group_commit: ax_core::atomic::GroupCommit,
        faults: ax_core::faults::Faults,
    ) -> Result<Context, StateError> {
        let tasks = TaskStore::open(&js).await?;
        let idempotency =
            js.get_key_value(IDEMPOTENCY_BUCKET)
                .await
                .map_err(|e| StateError::Broker {
                    id: "*".into(),
                    op: "open idempotency bucket",
                    source: e.into(),
                })?;
        let flows = crate::flow::store::FlowStore::open(&js)
            .await
            .map_err(|e| StateError::Broker {
                id: "*".into(),
                op: "open flow buckets",
                source: e.into(),
            })?;
        let ready = (group_commit != ax_core::atomic::GroupCommit::Never)
            .then(|| ax_core::admit::Groups::start(&js, group_commit, &faults));
        Ok(Context {
            ready,
            waits: ax_core::waits::Waits::new(js.clone()),
            js,
            tasks,
            idempotency,
            limits,
            queues: Queues::new(queues),
            flows,
            faults,
            lanes: Default::default(),
            drops: Default::default(),
            console_url: None,
        })
    }
}
