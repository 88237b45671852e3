//! A task name's own concurrency limit in one worker, resizable while attempts hold it:
//! a stored setting may change `concurrency` at any time. Growing lets waiting attempts
//! start at once; shrinking lets none start until the holders are below the new size
//! (running attempts are never stopped).

use std::sync::{Arc, Mutex};
use tokio::sync::Notify;

/// Held / allowed, and the wake-up of waiting attempts.
#[derive(Debug)]
pub(crate) struct Slots {
    state: Mutex<(usize, usize)>,
    changed: Notify,
}

/// One slot, given back on drop.
#[derive(Debug)]
pub(crate) struct SlotPermit(Arc<Slots>);

impl Slots {
    pub(crate) fn new(size: usize) -> Arc<Slots> {
        Arc::new(Slots {
            state: Mutex::new((0, size.max(1))),
            changed: Notify::new(),
        })
    }

    /// The allowed number of holders.
    pub(crate) fn size(&self) -> usize {
        self.state.lock().expect("not poisoned").1
    }

    /// Sets the allowed number of holders (at least 1).
    pub(crate) fn resize(&self, size: usize) {
        let size = size.max(1);
        let mut s = self.state.lock().expect("not poisoned");
        if s.1 != size {
            s.1 = size;
            drop(s);
            self.changed.notify_waiters();
        }
    }

    /// Waits for a slot.
    pub(crate) async fn acquire(self: &Arc<Self>) -> SlotPermit {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the check, so a release between the check and the wait
            // is not missed.
            changed.as_mut().enable();
            {
                let mut s = self.state.lock().expect("not poisoned");
                if s.0 < s.1 {
                    s.0 += 1;
                    return SlotPermit(self.clone());
                }
            }
            changed.await;
        }
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.state.lock().expect("not poisoned").0
    }
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        self.0.state.lock().expect("not poisoned").0 -= 1;
        // Every waiter checks again (a waiter that gave up must not swallow the wake-up).
        self.0.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn try_acquire(s: &Arc<Slots>) -> Option<SlotPermit> {
        tokio::time::timeout(Duration::from_millis(20), s.acquire())
            .await
            .ok()
    }

    #[tokio::test]
    async fn resize_applies_to_the_next_acquire_without_stopping_holders() {
        let s = Slots::new(2);
        let a = s.acquire().await;
        let b = s.acquire().await;
        assert!(try_acquire(&s).await.is_none(), "two of two held");
        // A waiter starts as soon as the size grows.
        let waiter = tokio::spawn({
            let s = s.clone();
            async move { s.acquire().await }
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        s.resize(3);
        let c = tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("woken by the resize")
            .unwrap();
        assert_eq!(s.held(), 3);
        // Shrinking keeps the holders; none starts until they are below the new size.
        s.resize(1);
        drop(a);
        assert!(try_acquire(&s).await.is_none(), "2 held, size 1");
        drop(b);
        assert!(try_acquire(&s).await.is_none(), "1 held, size 1");
        drop(c);
        let d = try_acquire(&s).await;
        assert!(d.is_some(), "0 held, size 1");
        assert_eq!(s.size(), 1);
        drop(d);
        assert_eq!(s.held(), 0);
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_does_not_swallow_a_release() {
        let s = Slots::new(1);
        let held = s.acquire().await;
        let first = tokio::spawn({
            let s = s.clone();
            async move {
                tokio::time::timeout(Duration::from_millis(30), s.acquire())
                    .await
                    .is_ok()
            }
        });
        let second = tokio::spawn({
            let s = s.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(2), s.acquire())
                    .await
                    .is_ok()
            }
        });
        assert!(!first.await.unwrap(), "gave up while the slot was held");
        drop(held);
        assert!(
            second.await.unwrap(),
            "the release reached the waiter still waiting"
        );
    }
}
