//! `ax_core::typed_kv`, the store the flow and trigger stores are built on, against a real
//! bucket: a create or a compare-and-set that lost its race is `Stale` (a conflict), a
//! value that does not decode is `Corrupt`, one over the server's max payload is
//! `TooLarge`, deletes read as absent, and a scan sees each key's latest value; `put_all`
//! stores every one of its writes or none.

use async_nats::jetstream::{self, kv};
use ax_core::error::ErrorKind;
use ax_core::typed_kv::{get, put, put_all, scan, KvError};
use ax_testkit::LocalNats;
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Thing {
    n: u32,
}

#[tokio::test]
async fn writes_are_creates_or_compare_and_sets_and_errors_are_typed() {
    let nats = LocalNats::start().unwrap();
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let store = js
        .create_key_value(kv::Config {
            bucket: "TYPED".into(),
            history: 5,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(get::<Thing>(&store, "a").await.unwrap(), None);
    let r1 = put(&store, "a", &Thing { n: 1 }, None).await.unwrap();
    assert_eq!(get(&store, "a").await.unwrap(), Some((Thing { n: 1 }, r1)));
    // A second create, and a compare-and-set against an old revision, lost their race.
    let again = put(&store, "a", &Thing { n: 9 }, None).await.unwrap_err();
    assert!(matches!(&again, KvError::Stale(k) if k == "a"), "{again:?}");
    assert_eq!(again.kind(), ErrorKind::Conflict);
    let r2 = put(&store, "a", &Thing { n: 2 }, Some(r1)).await.unwrap();
    let stale = put(&store, "a", &Thing { n: 3 }, Some(r1))
        .await
        .unwrap_err();
    assert!(matches!(stale, KvError::Stale(_)), "{stale:?}");
    assert_eq!(get(&store, "a").await.unwrap(), Some((Thing { n: 2 }, r2)));
    // A value that is not a Thing.
    store.put("b", "not json".into()).await.unwrap();
    let corrupt = get::<Thing>(&store, "b").await.unwrap_err();
    assert!(
        matches!(&corrupt, KvError::Corrupt { key, .. } if key == "b"),
        "{corrupt:?}"
    );
    assert_eq!(corrupt.kind(), ErrorKind::Invalid);
    // Over the server's max payload (1 MiB by default).
    let big = vec![7u8; 2 << 20];
    let too_large = put(&store, "c", &big, None).await.unwrap_err();
    assert!(
        matches!(too_large, KvError::TooLarge { .. }),
        "{too_large:?}"
    );
    assert_eq!(too_large.kind(), ErrorKind::Invalid);
    // Deleted reads as absent; a scan sees the latest value of each key, none deleted.
    put(&store, "d", &Thing { n: 4 }, None).await.unwrap();
    store.delete("b").await.unwrap();
    assert_eq!(get::<Thing>(&store, "b").await.unwrap(), None);
    let all: Vec<(String, Thing)> = scan(&store, ">").await.unwrap();
    assert_eq!(
        all,
        vec![
            ("a".to_string(), Thing { n: 2 }),
            ("d".to_string(), Thing { n: 4 })
        ]
    );
}

/// Several keys written as one atomic batch (a flow re-run: the run and its reset steps):
/// one stale revision among them and nothing is written, not even the writes before it.
#[tokio::test]
async fn put_all_stores_every_write_or_none() {
    let nats = LocalNats::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client.clone());
    let store = js
        .create_key_value(kv::Config {
            bucket: "ATOMIC".into(),
            history: 5,
            ..Default::default()
        })
        .await
        .unwrap();
    // Without allow_atomic the stream refuses the batch, typed, and stores nothing.
    let a = put(&store, "a", &Thing { n: 1 }, None).await.unwrap();
    let five = Thing { n: 5 };
    let refused = put_all(
        &client,
        &store,
        &[("z".into(), &five, None), ("a".into(), &five, Some(a))],
    )
    .await
    .unwrap_err();
    assert!(matches!(refused, KvError::Broker { .. }), "{refused:?}");
    assert_eq!(get(&store, "a").await.unwrap(), Some((Thing { n: 1 }, a)));
    assert_eq!(get::<Thing>(&store, "z").await.unwrap(), None);
    let mut config = js
        .get_stream("KV_ATOMIC")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    config.allow_atomic_publish = true;
    js.update_stream(&config).await.unwrap();

    let b = put(&store, "b", &Thing { n: 2 }, None).await.unwrap();
    // "a" and the new "c" are fine, "b" is stale: none of the three is written.
    let one = Thing { n: 10 };
    let stale = put_all(
        &client,
        &store,
        &[
            ("a".into(), &one, Some(a)),
            ("c".into(), &one, None),
            ("b".into(), &one, Some(a)),
        ],
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&stale, KvError::Stale(k) if k == "a, c, b"),
        "{stale:?}"
    );
    assert_eq!(stale.kind(), ErrorKind::Conflict);
    assert_eq!(get(&store, "a").await.unwrap(), Some((Thing { n: 1 }, a)));
    assert_eq!(get(&store, "b").await.unwrap(), Some((Thing { n: 2 }, b)));
    assert_eq!(get::<Thing>(&store, "c").await.unwrap(), None);
    // A create of a key that exists is stale too.
    let exists = put_all(&client, &store, &[("b".into(), &one, None)])
        .await
        .unwrap_err();
    assert!(matches!(exists, KvError::Stale(_)), "{exists:?}");
    // All current: all written, one after another, in order.
    put_all(
        &client,
        &store,
        &[
            ("a".into(), &Thing { n: 11 }, Some(a)),
            ("c".into(), &Thing { n: 13 }, None),
            ("b".into(), &Thing { n: 12 }, Some(b)),
        ],
    )
    .await
    .unwrap();
    let (ra, rc, rb) = (
        get::<Thing>(&store, "a").await.unwrap().unwrap(),
        get::<Thing>(&store, "c").await.unwrap().unwrap(),
        get::<Thing>(&store, "b").await.unwrap().unwrap(),
    );
    assert_eq!((ra.0.n, rc.0.n, rb.0.n), (11, 13, 12));
    assert_eq!((rc.1, rb.1), (ra.1 + 1, ra.1 + 2));
}
