//! The reconnect detector every follower checks beside its feed (`ax_core::follow`).

use ax_core::follow::Reconnects;
use ax_testkit::LocalNats;
use std::time::Duration;
use tokio::time::timeout;

/// A restarted nats-server is noticed once the client connects again, and only once:
/// quiet before it, quiet again after `mark`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_is_noticed_once_until_marked() {
    let mut nats = LocalNats::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let mut reconnects = Reconnects::new(&client);
    let quiet = Duration::from_secs(1); // four checks
    assert!(
        timeout(quiet, reconnects.changed()).await.is_err(),
        "noticed a reconnect that did not happen"
    );
    nats.restart().unwrap();
    timeout(Duration::from_secs(30), reconnects.changed())
        .await
        .expect("the reconnect noticed");
    // Until marked, it keeps answering that the connection changed.
    timeout(quiet, reconnects.changed())
        .await
        .expect("still changed until marked");
    reconnects.mark();
    assert!(
        timeout(quiet, reconnects.changed()).await.is_err(),
        "marked: quiet until the next reconnect"
    );
    client
        .flush()
        .await
        .expect("the client works on the new connection");
}
