//! The console's open connections, bounded: at the bound a new connection takes the place
//! of the one that has waited longest *between requests* (its headers not sent or not
//! finished, or idle after a request), never of one in the middle of a request or
//! streaming an answer (the live updates). Only when every connection is busy is the
//! newcomer refused.
//!
//! Closing the newcomer instead let one client lock every operator out: 1,100 connections
//! sending a request line and one header, then nothing, held the 256 slots until their
//! header timeout (10 s) while every fresh request was reset, and a client reopening ~26
//! connections a second kept it so (issue 44). Now such a client only ever closes its own
//! stalled connections, the oldest first, and a real request is answered at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio_util::sync::CancellationToken;

/// One connection as the bound sees it.
#[derive(Debug)]
pub(crate) struct Conn {
    id: u64,
    /// Requests in progress (headers read, answer not sent to its end).
    busy: AtomicUsize,
    /// Microseconds since the registry began, when it last became idle (or opened).
    idle_since: AtomicU64,
    /// Cancelled to close it.
    pub(crate) close: CancellationToken,
}

/// The open connections.
#[derive(Debug)]
pub(crate) struct Conns {
    max: usize,
    epoch: Instant,
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
}

/// What [`Conns::admit`] did with a new connection.
#[derive(Debug)]
pub(crate) enum Admitted {
    /// Room for it.
    Room(Arc<Conn>),
    /// In the place of a connection waiting between requests, which is being closed.
    Evicted(Arc<Conn>),
    /// Every connection is in a request: the newcomer is refused.
    Full,
}

impl Conns {
    pub(crate) fn new(max: usize) -> Conns {
        Conns {
            max: max.max(1),
            epoch: Instant::now(),
            next: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        }
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    /// Admits a new connection, closing the one idle the longest if at the bound.
    pub(crate) fn admit(&self) -> Admitted {
        let mut open = self.open.lock().expect("not poisoned");
        let mut evicted = false;
        if open.len() >= self.max {
            let victim = open
                .values()
                .filter(|c| c.busy.load(Ordering::Acquire) == 0)
                .min_by_key(|c| (c.idle_since.load(Ordering::Acquire), c.id))
                .cloned();
            let Some(victim) = victim else {
                return Admitted::Full;
            };
            open.remove(&victim.id);
            victim.close.cancel();
            evicted = true;
        }
        let conn = Arc::new(Conn {
            id: self.next.fetch_add(1, Ordering::Relaxed),
            busy: AtomicUsize::new(0),
            idle_since: AtomicU64::new(self.now_us()),
            close: CancellationToken::new(),
        });
        open.insert(conn.id, conn.clone());
        if evicted {
            Admitted::Evicted(conn)
        } else {
            Admitted::Room(conn)
        }
    }

    /// The connection has closed.
    pub(crate) fn closed(&self, conn: &Conn) {
        self.open.lock().expect("not poisoned").remove(&conn.id);
    }

    /// A request began on `conn`; it is busy until the guard (kept with its answer) drops.
    pub(crate) fn busy(self: &Arc<Self>, conn: &Arc<Conn>) -> Busy {
        conn.busy.fetch_add(1, Ordering::AcqRel);
        Busy {
            conns: self.clone(),
            conn: conn.clone(),
        }
    }

    /// Connections open now.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.open.lock().expect("not poisoned").len()
    }
}

/// A request in progress: held by its answer's body, so a streamed answer counts to its
/// end.
#[derive(Debug)]
pub(crate) struct Busy {
    conns: Arc<Conns>,
    conn: Arc<Conn>,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.conn
            .idle_since
            .store(self.conns.now_us(), Ordering::Release);
        self.conn.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(a: Admitted) -> Arc<Conn> {
        match a {
            Admitted::Room(c) | Admitted::Evicted(c) => c,
            Admitted::Full => panic!("refused"),
        }
    }

    #[test]
    fn at_the_bound_the_longest_idle_makes_room_and_busy_ones_are_kept() {
        let conns = Arc::new(Conns::new(3));
        let a = conn(conns.admit());
        let b = conn(conns.admit());
        let c = conn(conns.admit());
        let _serving_a = conns.busy(&a);
        // b opened before c, both idle since: b goes.
        let d = conns.admit();
        assert!(matches!(d, Admitted::Evicted(_)));
        assert!(b.close.is_cancelled() && !a.close.is_cancelled() && !c.close.is_cancelled());
        assert_eq!(conns.len(), 3);
        // c finishes a request now: it was idle less long than d.
        std::thread::sleep(std::time::Duration::from_millis(2));
        drop(conns.busy(&c));
        let d = conn(d);
        let _e = conn(conns.admit());
        assert!(d.close.is_cancelled() && !c.close.is_cancelled());
        // Every one busy: the newcomer is refused and nobody is closed.
        let all = Arc::new(Conns::new(2));
        let (x, y) = (conn(all.admit()), conn(all.admit()));
        let (_bx, _by) = (all.busy(&x), all.busy(&y));
        assert!(matches!(all.admit(), Admitted::Full));
        assert!(!x.close.is_cancelled() && !y.close.is_cancelled());
        all.closed(&x);
        assert!(matches!(all.admit(), Admitted::Room(_)));
    }
}
