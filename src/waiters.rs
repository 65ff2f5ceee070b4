//! Claims that wait: the registry of this process's waiting Claims, keyed by
//! namespace and key, and what wakes them.
//!
//! A waiting Claim joins its key's [`Slot`] and sleeps until the slot is
//! woken, its holder's lease runs out, or its wait ends. Wake-ups come from
//! this process's own Complete, Release and Purge (always), and from the
//! store's purge feed, which on PostgreSQL carries every replica's Complete
//! and Release of a watched key and every purge ([`Store::announces`]). Where
//! the feed is not known to be caught up (not yet heard, or lost), or the
//! store announces nothing (Citus), waiters read the key again every
//! [`POLL_EVERY`] instead.
//!
//! However many Claims wait on one key here, one read answers them all:
//! the slot keeps its last read with the instant it started, and a waiter
//! reads only when what it needs is newer than that (a wake-up after the
//! read, a lease expiry, a poll interval). Claims of a released or expired
//! key go one at a time through the slot's turn, so one waiter here tries
//! the guarded claim while the others wait for its result.
//!
//! A waiter holds no database connection while it sleeps, counts against
//! [`Waiters`]' cap while it waits, and leaves nothing behind when its call
//! is dropped (client gone, deadline): its [`Waiting`] guard unregisters it.
//!
//! [`Store::announces`]: crate::store::Store::announces

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::domain::{Key, Namespace, Snapshot};
use crate::error::Error;
use crate::metrics;
use crate::store::{Announces, PurgeEvent};

/// How often a waiter reads its key again while wake-ups cannot be trusted
/// (the feed not caught up, or a store that announces nothing).
pub const POLL_EVERY: Duration = Duration::from_millis(500);

/// How long after its last heartbeat came back the feed counts as caught up
/// (heartbeats go every second).
const FEED_FRESH_FOR: Duration = Duration::from_secs(3);

/// The registry: shared by every Claim of the process.
#[derive(Clone)]
pub struct Waiters {
    inner: Arc<Inner>,
}

struct Inner {
    slots: Mutex<HashMap<(Namespace, Key), Arc<Slot>>>,
    waiting: AtomicUsize,
    cap: usize,
    /// When the feed last vouched that every notification before it arrived.
    feed_heard: Mutex<Option<Instant>>,
    shutdown: CancellationToken,
}

/// The waiters of one key in this process.
pub struct Slot {
    woken: Notify,
    /// When the slot was last woken.
    woken_at: Mutex<Instant>,
    /// The last read of the key, with the instant it started.
    read: tokio::sync::Mutex<Option<(Instant, Result<Snapshot, Error>)>>,
    /// Held by the one waiter here that tries to take the key.
    turn: tokio::sync::Mutex<()>,
    /// The waiters on the key, changed under the registry's lock.
    waiting: AtomicUsize,
}

/// One waiting Claim's place: unregisters it when dropped.
pub struct Waiting {
    inner: Arc<Inner>,
    name: (Namespace, Key),
    pub slot: Arc<Slot>,
}

impl Waiters {
    /// At most `cap` Claims wait at once in this process.
    pub fn new(cap: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                slots: Mutex::default(),
                waiting: AtomicUsize::new(0),
                cap,
                feed_heard: Mutex::new(None),
                shutdown: CancellationToken::new(),
            }),
        }
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<(Namespace, Key), Arc<Slot>>> {
        self.inner.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A place among the key's waiters, or `None` when the cap is reached.
    pub fn join(&self, namespace: &Namespace, key: &Key) -> Option<Waiting> {
        let taken = self.inner.waiting.fetch_add(1, Ordering::AcqRel);
        if taken >= self.inner.cap {
            self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let name = (namespace.clone(), key.clone());
        let slot = {
            let mut slots = self.slots();
            let slot = slots
                .entry(name.clone())
                .or_insert_with(|| Arc::new(Slot::new()));
            slot.waiting.fetch_add(1, Ordering::AcqRel);
            slot.clone()
        };
        metrics::record_waiters(taken + 1);
        Some(Waiting {
            inner: self.inner.clone(),
            name,
            slot,
        })
    }

    /// Wakes the key's waiters here, if any.
    pub fn wake(&self, namespace: &Namespace, key: &Key) {
        let slot = self.slots().get(&(namespace.clone(), key.clone())).cloned();
        if let Some(slot) = slot {
            slot.wake();
        }
    }

    /// Wakes every waiter here (the feed may have missed something).
    pub fn wake_all(&self) {
        let slots: Vec<Arc<Slot>> = self.slots().values().cloned().collect();
        for slot in slots {
            slot.wake();
        }
    }

    /// How many Claims wait here now.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::Acquire)
    }

    /// Whether waiters must read again every [`POLL_EVERY`], because a
    /// change may go unannounced.
    pub fn must_poll(&self, announces: Announces) -> bool {
        match announces {
            Announces::InProcess => false,
            Announces::Feed => !self.feed_fresh(),
        }
    }

    fn feed_fresh(&self) -> bool {
        self.feed_fresh_until()
            .is_some_and(|until| Instant::now() < until)
    }

    /// Until when the feed counts as caught up, from what it has said so
    /// far: a waiter that relies on it looks again then.
    pub fn feed_fresh_until(&self) -> Option<Instant> {
        let heard = *self
            .inner
            .feed_heard
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        heard.map(|at| at + FEED_FRESH_FOR)
    }

    /// Resolves when the server begins to shut down: waiters then answer at
    /// once.
    pub fn stopping(&self) -> tokio_util::sync::WaitForCancellationFuture<'_> {
        self.inner.shutdown.cancelled()
    }

    /// Whether the server is shutting down.
    pub fn is_stopping(&self) -> bool {
        self.inner.shutdown.is_cancelled()
    }

    /// Ends every wait now, and every wait begun from now on at once.
    pub fn shut_down(&self) {
        self.inner.shutdown.cancel();
    }

    /// Follows a store's purge feed until it ends: wakes the keys it names,
    /// and keeps track of whether it is caught up.
    pub async fn follow(self, mut feed: mpsc::Receiver<PurgeEvent>) {
        while let Some(event) = feed.recv().await {
            match event {
                PurgeEvent::Purged(namespace, key) => self.wake(&namespace, &key),
                PurgeEvent::CaughtUp(sent_at) => {
                    let mut heard = self
                        .inner
                        .feed_heard
                        .lock()
                        .unwrap_or_else(|e| e.into_inner());
                    let sent_at = Instant::from_std(sent_at);
                    if heard.is_none_or(|at| at < sent_at) {
                        *heard = Some(sent_at);
                    }
                }
                PurgeEvent::Lost => {
                    *self
                        .inner
                        .feed_heard
                        .lock()
                        .unwrap_or_else(|e| e.into_inner()) = None;
                    self.wake_all();
                }
                PurgeEvent::Applied(done) => done.notify_one(),
            }
            metrics::record_wait_feed(self.feed_fresh());
        }
    }
}

impl Slot {
    fn new() -> Self {
        Self {
            woken: Notify::new(),
            woken_at: Mutex::new(Instant::now()),
            read: tokio::sync::Mutex::new(None),
            turn: tokio::sync::Mutex::new(()),
            waiting: AtomicUsize::new(0),
        }
    }

    fn wake(&self) {
        *self.woken_at.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.woken.notify_waiters();
    }

    /// When the slot was last woken.
    pub fn woken_at(&self) -> Instant {
        *self.woken_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A future that resolves at the next wake-up; enabled at once, so a
    /// wake-up between this call and the await is not missed.
    pub fn woken(&self) -> std::pin::Pin<Box<tokio::sync::futures::Notified<'_>>> {
        let mut notified = Box::pin(self.woken.notified());
        notified.as_mut().enable();
        notified
    }

    /// A read of the key that started after the slot was last woken (and at
    /// or after `not_before`, when given): the slot's last one when it is
    /// recent enough, else a new one by `read` (one
    /// waiter reads, the others wait for it and share it). A failed read is
    /// shared too: the waiters of a key behind an unreachable database fail
    /// together, instead of each waiting its turn for a timeout.
    pub async fn read<F, Fut>(
        &self,
        not_before: Option<Instant>,
        read: F,
    ) -> Result<(Instant, Snapshot), Error>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Snapshot, Error>>,
    {
        let mut last = self.read.lock().await;
        // Nothing announced since the read started: a change committed after
        // it would have woken the slot later than that.
        // A failure is shared only with waiters that needed a read made then
        // (not with one that joins later, after the database is back).
        let shares_failure = not_before.is_some();
        let not_before = not_before.map_or(self.woken_at(), |at| at.max(self.woken_at()));
        if let Some((started, result)) = last.as_ref()
            && *started >= not_before
            && (result.is_ok() || shares_failure)
        {
            return match result {
                Ok(snapshot) => Ok((*started, snapshot.clone())),
                Err(error) => Err(error.replicate()),
            };
        }
        let started = Instant::now();
        let result = read().await;
        let answer = match &result {
            Ok(snapshot) => Ok((started, snapshot.clone())),
            Err(error) => Err(error.replicate()),
        };
        *last = Some((started, result));
        answer
    }

    /// The turn to try the guarded claim, one waiter here at a time.
    pub async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.turn.lock().await
    }

    /// Wakes the slot's other waiters after a guarded claim here (won or
    /// lost): the key changed or someone else has it, so they read again.
    pub fn changed(&self) {
        self.wake();
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let left = self.inner.waiting.fetch_sub(1, Ordering::AcqRel) - 1;
        metrics::record_waiters(left);
        let mut slots = self.inner.slots.lock().unwrap_or_else(|e| e.into_inner());
        if self.slot.waiting.fetch_sub(1, Ordering::AcqRel) == 1 {
            slots.remove(&self.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(key: &str) -> (Namespace, Key) {
        (
            Namespace::parse("ns".to_owned()).unwrap(),
            Key::parse(key.to_owned()).unwrap(),
        )
    }

    #[tokio::test]
    async fn the_cap_counts_waiters_and_a_dropped_waiter_leaves_nothing() {
        let waiters = Waiters::new(2);
        let (ns, a) = name("a");
        let first = waiters.join(&ns, &a).unwrap();
        let second = waiters.join(&ns, &a).unwrap();
        assert!(waiters.join(&ns, &a).is_none());
        assert_eq!(waiters.waiting(), 2);
        drop(first);
        assert_eq!(waiters.slots().len(), 1);
        drop(second);
        assert_eq!(waiters.waiting(), 0);
        assert!(waiters.slots().is_empty());
    }

    #[tokio::test]
    async fn a_wake_up_between_enabling_and_awaiting_is_not_missed() {
        let waiters = Waiters::new(10);
        let (ns, a) = name("a");
        let waiting = waiters.join(&ns, &a).unwrap();
        let woken = waiting.slot.woken();
        waiters.wake(&ns, &a);
        tokio::time::timeout(Duration::from_secs(5), woken)
            .await
            .expect("woken");
    }

    #[tokio::test]
    async fn one_read_serves_every_waiter_that_needs_nothing_newer() {
        let waiters = Waiters::new(10);
        let (ns, a) = name("a");
        let waiting = waiters.join(&ns, &a).unwrap();
        let reads = AtomicUsize::new(0);
        let read = || async {
            reads.fetch_add(1, Ordering::SeqCst);
            Ok(Snapshot {
                now: std::time::SystemTime::UNIX_EPOCH,
                record: None,
            })
        };
        let joined = Instant::now();
        waiting.slot.read(Some(joined), read).await.unwrap();
        waiting.slot.read(Some(joined), read).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 1);
        waiting.slot.read(Some(Instant::now()), read).await.unwrap();
        assert_eq!(reads.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_failed_read_fails_every_waiter_that_needs_nothing_newer() {
        let waiters = Waiters::new(10);
        let (ns, a) = name("a");
        let waiting = waiters.join(&ns, &a).unwrap();
        let reads = AtomicUsize::new(0);
        let read = || async {
            reads.fetch_add(1, Ordering::SeqCst);
            Err(Error::Unavailable("down".into()))
        };
        let joined = Instant::now();
        assert!(waiting.slot.read(Some(joined), read).await.is_err());
        let shared = waiting.slot.read(Some(joined), read).await;
        assert!(matches!(shared, Err(Error::Unavailable(_))));
        assert_eq!(reads.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn shutting_down_ends_waits() {
        let waiters = Waiters::new(10);
        waiters.shut_down();
        tokio::time::timeout(Duration::from_secs(5), waiters.stopping())
            .await
            .expect("stopping");
    }
}
