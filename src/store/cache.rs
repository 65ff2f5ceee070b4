//! The replay cache: completed records kept in memory, so that a duplicate
//! Claim (the redelivery storm this service exists for) is answered without
//! a round trip to the database.
//!
//! A completed record cannot change until it expires or an operator purges
//! it, so a copy stays right until one of the two:
//! - **Expiry** is checked against the store's clock as this replica tracks
//!   it: an entry remembers the store's `now()` of the read that filled it
//!   and this machine's monotonic instant just before that read was sent, so
//!   its estimate of the store's clock is never behind the store's. An entry
//!   also lives at most [`MAX_ENTRY_AGE`], which bounds what a drift between
//!   the two clocks' rates could do.
//! - **Purges** and other changes reach every replica through the store's
//!   purge feed (for PostgreSQL, `LISTEN`/`NOTIFY` in the purge's own
//!   transaction, and triggers for changes made outside the service). The
//!   feed also vouches, by heartbeats, that nothing was missed; the cache
//!   answers only while the last heartbeat is at most [`FRESHNESS`] old, and
//!   starts empty again after any gap. A Purge returns only once every
//!   replica that could still answer from memory has acknowledged that it
//!   forgot the key, or [`FRESHNESS`] (and a margin) has passed since its
//!   commit: after a Purge answers, no replica replays what it purged (the
//!   README's replay-cache section says why). A change made outside the
//!   service is honoured as soon as its notification arrives, and at the
//!   latest [`FRESHNESS`] after its commit.
//!
//! Only Claims consult the cache, and only completed, unexpired records
//! enter it, from a Claim's own read. `Cached<S>` is the store decorator
//! that does this; everything else passes through to `S`. Memory is bounded
//! by a byte budget (the sizes of the response, fingerprint, namespace and
//! key, plus a fixed overhead per entry). The budget is split between the
//! cache's shards (for concurrency): an entry larger than 97% of one shard's
//! share is not kept, and is counted (`too_large`).

use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use quick_cache::{Equivalent, Weighter};
use tokio::sync::mpsc;

use super::{FirstClaim, Operations, PoolStatus, PurgeEvent, Reaped, Store, StoreStats};
use crate::domain::{
    Completion, Key, Lease, LeaseToken, Namespace, NewLease, Purged, Record, RecordState, Snapshot,
};
use crate::error::Error;

/// The longest an entry is used before the record is read again.
pub const MAX_ENTRY_AGE: Duration = Duration::from_secs(60);

/// How long after a heartbeat was sent the cache still answers without
/// another: the bound on how late a purge on another replica is honoured when
/// the feed's connection stalls. The store sends one every second.
pub const FRESHNESS: Duration = Duration::from_secs(3);

/// Bytes counted per entry beyond its variable parts: the record, the entry,
/// the key's two strings and the cache's own slot.
const ENTRY_OVERHEAD: u64 = 256;

/// Hits, misses and size, for the metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Claims answered from memory.
    pub hits: u64,
    /// Claims that had to ask the store (fresh keys included).
    pub misses: u64,
    pub entries: u64,
    pub bytes: u64,
    /// Records not kept because they are larger than one shard's share of
    /// the budget (see [`ReplayCache::largest_entry`]).
    pub too_large: u64,
    /// Whether the purge feed vouches for the cache right now.
    pub fresh: bool,
}

/// A completed record as read by a Claim, and how long it may be used.
struct Entry {
    record: Record,
    /// The store's clock at the read.
    store_now: SystemTime,
    /// This machine's monotonic clock just before the read was sent: the
    /// store's `now()` came later.
    sent_at: Instant,
    /// When the entry stops being used (before the record's expiry, by this
    /// machine's clock).
    use_until: Instant,
    weight: u64,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct Slot(Namespace, Key);

/// A lookup by reference, hashed as `Slot` is (field by field), so that a
/// hit allocates nothing.
#[derive(Hash)]
struct Lookup<'a>(&'a Namespace, &'a Key);

impl Equivalent<Slot> for Lookup<'_> {
    fn equivalent(&self, slot: &Slot) -> bool {
        *self.0 == slot.0 && *self.1 == slot.1
    }
}

#[derive(Clone)]
struct ByBytes;

impl Weighter<Slot, Arc<Entry>> for ByBytes {
    fn weight(&self, _: &Slot, entry: &Arc<Entry>) -> u64 {
        entry.weight
    }
}

/// What a read must show before its result may enter the cache: no
/// invalidation happened since it started.
#[derive(Debug, Clone, Copy)]
pub struct Ticket {
    generation: u64,
    sent_at: Instant,
}

/// The cache itself, shared by every call of one server.
pub struct ReplayCache {
    entries: quick_cache::sync::Cache<Slot, Arc<Entry>, ByBytes>,
    /// Bumped by every invalidation. A read that began before a bump may
    /// have seen what was just purged: it is not kept.
    generation: AtomicU64,
    /// Held while an entry is checked against the generation and inserted,
    /// and while an invalidation bumps it and removes: an entry is never
    /// visible, even for an instant, after the invalidation of a read that
    /// began before it. Only reads that fill the cache take it, never hits.
    invalidation: std::sync::Mutex<()>,
    /// The largest entry the cache's shards take.
    largest_entry: u64,
    too_large: AtomicU64,
    /// Microseconds after `base` until which the feed vouches for the cache;
    /// 0 when it does not.
    fresh_until_us: AtomicU64,
    base: Instant,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl ReplayCache {
    /// A cache of at most `budget` bytes, not yet vouched for.
    pub fn new(budget: u64) -> Self {
        let estimated = usize::try_from(budget / 512).unwrap_or(usize::MAX).max(16);
        let entries = quick_cache::sync::Cache::with_weighter(estimated, budget, ByBytes);
        // quick_cache refuses an entry heavier than its shard's hot section,
        // 97% of the shard (its default allocation).
        let largest_entry = (entries.shard_capacity() as f64 * 0.97) as u64;
        Self {
            entries,
            invalidation: std::sync::Mutex::new(()),
            largest_entry,
            too_large: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            fresh_until_us: AtomicU64::new(0),
            base: Instant::now(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// The largest entry (in the weight `remember` counts) that is kept:
    /// the budget is split evenly between the shards.
    pub fn largest_entry(&self) -> u64 {
        self.largest_entry
    }

    fn invalidating(&self) -> std::sync::MutexGuard<'_, ()> {
        self.invalidation.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn micros_since_base(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_micros()).unwrap_or(u64::MAX)
    }

    fn is_fresh(&self, now: Instant) -> bool {
        self.micros_since_base(now) < self.fresh_until_us.load(Ordering::Acquire)
    }

    /// The replay for a key, as the store would answer it now, if the cache
    /// holds it and may be used.
    pub fn replay(&self, namespace: &Namespace, key: &Key) -> Option<Snapshot> {
        let now = Instant::now();
        let hit = self
            .is_fresh(now)
            .then(|| self.entries.get(&Lookup(namespace, key)))
            .flatten()
            .filter(|entry| now < entry.use_until);
        let Some(entry) = hit else {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        self.hits.fetch_add(1, Ordering::Relaxed);
        Some(Snapshot {
            // Never behind the store's clock: the read's `now()` happened
            // after `sent_at`.
            now: entry.store_now + now.saturating_duration_since(entry.sent_at),
            record: Some(entry.record.clone()),
        })
    }

    /// Taken just before a read whose result may enter the cache; `None`
    /// when the cache is not vouched for now.
    pub fn ticket(&self) -> Option<Ticket> {
        let sent_at = Instant::now();
        self.is_fresh(sent_at).then(|| Ticket {
            generation: self.generation.load(Ordering::SeqCst),
            sent_at,
        })
    }

    /// Keeps what a Claim's read found, when it is a completed, unexpired
    /// record and nothing was invalidated since the ticket was taken.
    pub fn remember(&self, ticket: Ticket, namespace: &Namespace, key: &Key, snapshot: &Snapshot) {
        let Some(record) = &snapshot.record else {
            return;
        };
        if record.state != RecordState::Completed {
            return;
        }
        let Ok(left) = record.expires_at.duration_since(snapshot.now) else {
            return;
        };
        let use_until = ticket.sent_at + left.min(MAX_ENTRY_AGE);
        if !self.is_fresh(Instant::now()) || use_until <= Instant::now() {
            return;
        }
        let weight = ENTRY_OVERHEAD
            + record.response.as_ref().map_or(0, Vec::len) as u64
            + record
                .fingerprint
                .as_ref()
                .map_or(0, |f| f.as_bytes().len()) as u64
            + (namespace.as_str().len() + key.as_str().len()) as u64;
        if weight > self.largest_entry {
            self.too_large.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let entry = Arc::new(Entry {
            record: record.clone(),
            store_now: snapshot.now,
            sent_at: ticket.sent_at,
            use_until,
            weight,
        });
        // Under the lock an invalidation holds while it bumps and removes:
        // either it happened since the ticket (the generation says so, and
        // the read may have seen what it removed), or it comes after this
        // insert and removes the entry itself.
        let _invalidation = self.invalidating();
        if self.generation.load(Ordering::SeqCst) != ticket.generation {
            return;
        }
        self.entries
            .insert(Slot(namespace.clone(), key.clone()), entry);
    }

    /// A key was purged: drop it, and refuse inserts from reads begun before.
    pub fn forget(&self, namespace: &Namespace, key: &Key) {
        let _invalidation = self.invalidating();
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.entries.remove(&Lookup(namespace, key));
    }

    /// Purges may have been missed: drop everything, and answer nothing
    /// until the feed vouches again.
    pub fn forget_all(&self) {
        let _invalidation = self.invalidating();
        self.fresh_until_us.store(0, Ordering::Release);
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.entries.clear();
    }

    /// The feed delivered every purge committed before `sent_at`. After a
    /// gap the cache starts empty.
    pub fn vouched(&self, sent_at: Instant) {
        let now = Instant::now();
        if !self.is_fresh(now) {
            let _invalidation = self.invalidating();
            self.generation.fetch_add(1, Ordering::SeqCst);
            self.entries.clear();
        }
        let until = self.micros_since_base(sent_at + FRESHNESS);
        self.fresh_until_us.fetch_max(until, Ordering::AcqRel);
    }

    /// Applies the feed's events until it ends.
    pub async fn follow(self: Arc<Self>, mut feed: mpsc::Receiver<PurgeEvent>) {
        while let Some(event) = feed.recv().await {
            match event {
                PurgeEvent::Purged(namespace, key) => self.forget(&namespace, &key),
                PurgeEvent::CaughtUp(sent_at) => self.vouched(sent_at),
                PurgeEvent::Lost => self.forget_all(),
                // Everything before it was applied above, in order.
                PurgeEvent::Applied(done) => done.notify_one(),
            }
        }
        self.forget_all();
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            entries: self.entries.len() as u64,
            bytes: self.entries.weight(),
            too_large: self.too_large.load(Ordering::Relaxed),
            fresh: self.is_fresh(Instant::now()),
        }
    }
}

/// A store whose Claims are answered from the replay cache when they can be.
#[derive(Clone)]
pub struct Cached<S> {
    inner: S,
    cache: Arc<ReplayCache>,
}

impl<S: Store + Operations> Cached<S> {
    /// Wraps `inner` with a cache of `budget` bytes, kept current by the
    /// store's purge feed; call inside the Tokio runtime. `None` when the
    /// store has no feed (SQLite: its reads are local anyway).
    pub fn new(inner: S, budget: u64) -> Option<Self> {
        let feed = inner.purge_feed()?;
        let cache = Arc::new(ReplayCache::new(budget));
        tokio::spawn(cache.clone().follow(feed));
        Some(Self { inner, cache })
    }

    pub fn cache(&self) -> &Arc<ReplayCache> {
        &self.cache
    }
}

impl<S: Store> Store for Cached<S> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn fetch(&self, namespace: &Namespace, key: &Key) -> Result<Snapshot, Error> {
        self.inner.fetch(namespace, key).await
    }

    /// Never from memory: a waiter needs the row itself (and its mark).
    async fn watch(&self, namespace: &Namespace, key: &Key) -> Result<Snapshot, Error> {
        self.inner.watch(namespace, key).await
    }

    fn announces(&self) -> super::Announces {
        self.inner.announces()
    }

    fn fails_in_parts(&self) -> bool {
        self.inner.fails_in_parts()
    }

    async fn claim_or_fetch(&self, lease: &NewLease) -> Result<FirstClaim, Error> {
        if let Some(snapshot) = self.cache.replay(&lease.namespace, &lease.key) {
            return Ok(FirstClaim::Found(snapshot));
        }
        let ticket = self.cache.ticket();
        let first = self.inner.claim_or_fetch(lease).await?;
        if let (Some(ticket), FirstClaim::Found(snapshot)) = (ticket, &first) {
            self.cache
                .remember(ticket, &lease.namespace, &lease.key, snapshot);
        }
        Ok(first)
    }

    async fn claim_or_fetch_many(&self, leases: &[NewLease]) -> Result<Vec<FirstClaim>, Error> {
        let mut results: Vec<Option<FirstClaim>> = leases
            .iter()
            .map(|l| {
                self.cache
                    .replay(&l.namespace, &l.key)
                    .map(FirstClaim::Found)
            })
            .collect();
        let missed: Vec<usize> = (0..leases.len())
            .filter(|&i| results[i].is_none())
            .collect();
        if !missed.is_empty() {
            let ticket = self.cache.ticket();
            let asked: Vec<NewLease> = missed.iter().map(|&i| leases[i].clone()).collect();
            let answers = self.inner.claim_or_fetch_many(&asked).await?;
            for (&i, answer) in missed.iter().zip(answers) {
                if let (Some(ticket), FirstClaim::Found(snapshot)) = (ticket, &answer) {
                    self.cache
                        .remember(ticket, &leases[i].namespace, &leases[i].key, snapshot);
                }
                results[i] = Some(answer);
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or(FirstClaim::Raced))
            .collect())
    }

    async fn try_claim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        self.inner.try_claim(lease).await
    }

    async fn complete(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        response: &[u8],
        retention: Option<Duration>,
        remember_for: Option<Duration>,
    ) -> Result<Option<SystemTime>, Error> {
        self.inner
            .complete(namespace, key, token, response, retention, remember_for)
            .await
    }

    async fn reclaim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        self.inner.reclaim(lease).await
    }

    async fn fetch_many(&self, keys: &[(Namespace, Key)]) -> Result<Vec<Snapshot>, Error> {
        self.inner.fetch_many(keys).await
    }

    async fn try_claim_many(&self, leases: &[NewLease]) -> Result<Vec<Option<Lease>>, Error> {
        self.inner.try_claim_many(leases).await
    }

    async fn complete_many(
        &self,
        completions: &[Completion],
    ) -> Result<Vec<Option<SystemTime>>, Error> {
        self.inner.complete_many(completions).await
    }

    async fn release(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        checkpoint: Option<&[u8]>,
    ) -> Result<bool, Error> {
        self.inner.release(namespace, key, token, checkpoint).await
    }

    async fn extend_lease(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        lease_ttl: Duration,
        checkpoint: Option<&[u8]>,
    ) -> Result<Option<SystemTime>, Error> {
        self.inner
            .extend_lease(namespace, key, token, lease_ttl, checkpoint)
            .await
    }

    async fn reap_expired(&self, batch: u32) -> Result<Reaped, Error> {
        self.inner.reap_expired(batch).await
    }

    /// Forgets the key here before answering, whatever the statement did:
    /// this replica never replays a key it just purged. Other replicas hear
    /// of it through the feed.
    async fn purge(&self, namespace: &Namespace, key: &Key) -> Result<Option<Purged>, Error> {
        let result = self.inner.purge(namespace, key).await;
        self.cache.forget(namespace, key);
        result
    }

    async fn close(&self) {
        self.inner.close().await;
    }
}

impl<S: Store + Operations> Operations for Cached<S> {
    async fn stats(&self) -> Result<StoreStats, Error> {
        self.inner.stats().await
    }

    async fn stats_estimate(&self) -> Result<StoreStats, Error> {
        self.inner.stats_estimate().await
    }

    fn pool_status(&self) -> PoolStatus {
        self.inner.pool_status()
    }

    /// Another feed of the store's own (this cache follows the one it took
    /// when it was made).
    fn purge_feed(&self) -> Option<mpsc::Receiver<PurgeEvent>> {
        self.inner.purge_feed()
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        Some(self.cache.stats())
    }

    async fn ping(&self) -> Result<(), Error> {
        self.inner.ping().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(key: &str) -> (Namespace, Key) {
        (
            Namespace::parse("ns".into()).unwrap(),
            Key::parse(key.into()).unwrap(),
        )
    }

    fn completed(now: SystemTime, expires_in: Duration) -> Snapshot {
        Snapshot {
            now,
            record: Some(Record {
                state: RecordState::Completed,
                fencing_token: 1,
                lease_token: Some(LeaseToken::generate()),
                fingerprint: None,
                response: Some(b"receipt".to_vec()),
                retention: Duration::from_secs(60),
                lease_expires_at: None,
                expires_at: now + expires_in,
                created_at: now,
                updated_at: now,
                checkpoint: None,
                remember_until: None,
            }),
        }
    }

    fn vouched_cache() -> ReplayCache {
        let cache = ReplayCache::new(1 << 20);
        cache.vouched(Instant::now());
        cache
    }

    #[test]
    fn a_completed_record_is_replayed_with_a_clock_never_behind_the_stores() {
        let cache = vouched_cache();
        let (ns, key) = names("a");
        let store_now = SystemTime::now();
        let ticket = cache.ticket().unwrap();
        cache.remember(
            ticket,
            &ns,
            &key,
            &completed(store_now, Duration::from_secs(30)),
        );
        let replay = cache.replay(&ns, &key).expect("a hit");
        assert!(replay.now >= store_now);
        assert_eq!(
            replay.record.unwrap().response.as_deref(),
            Some(&b"receipt"[..])
        );
        assert_eq!(cache.stats().hits, 1);
    }

    #[test]
    fn nothing_is_kept_or_answered_while_the_feed_has_not_vouched() {
        let cache = ReplayCache::new(1 << 20);
        let (ns, key) = names("a");
        assert!(cache.ticket().is_none());
        assert!(cache.replay(&ns, &key).is_none());
        cache.vouched(Instant::now());
        let ticket = cache.ticket().unwrap();
        cache.remember(
            ticket,
            &ns,
            &key,
            &completed(SystemTime::now(), Duration::from_secs(30)),
        );
        cache.forget_all();
        assert!(cache.replay(&ns, &key).is_none());
        assert_eq!(cache.stats().entries, 0);
    }

    #[test]
    fn a_read_begun_before_a_purge_does_not_enter_the_cache() {
        let cache = vouched_cache();
        let (ns, key) = names("a");
        let ticket = cache.ticket().unwrap();
        // The purge's notification arrives while the read is on the wire.
        cache.forget(&ns, &key);
        cache.remember(
            ticket,
            &ns,
            &key,
            &completed(SystemTime::now(), Duration::from_secs(30)),
        );
        assert!(cache.replay(&ns, &key).is_none());
    }

    #[test]
    fn an_expired_or_unfinished_record_is_not_kept() {
        let cache = vouched_cache();
        let (ns, key) = names("a");
        let now = SystemTime::now();
        let mut expired = completed(now, Duration::ZERO);
        expired.now = now + Duration::from_secs(1);
        cache.remember(cache.ticket().unwrap(), &ns, &key, &expired);
        let mut in_progress = completed(now, Duration::from_secs(30));
        in_progress.record.as_mut().unwrap().state = RecordState::InProgress;
        cache.remember(cache.ticket().unwrap(), &ns, &key, &in_progress);
        assert!(cache.replay(&ns, &key).is_none());
    }

    #[test]
    fn an_entry_is_not_used_past_the_records_expiry() {
        let cache = vouched_cache();
        let (ns, key) = names("a");
        let ticket = cache.ticket().unwrap();
        cache.remember(
            ticket,
            &ns,
            &key,
            &completed(SystemTime::now(), Duration::from_millis(30)),
        );
        assert!(cache.replay(&ns, &key).is_some());
        std::thread::sleep(Duration::from_millis(40));
        assert!(cache.replay(&ns, &key).is_none());
    }

    #[test]
    fn after_a_gap_in_the_heartbeats_the_cache_starts_empty() {
        let cache = ReplayCache::new(1 << 20);
        let (ns, key) = names("a");
        // A heartbeat sent long ago vouches for nothing now.
        let stale = Instant::now();
        cache.vouched(Instant::now());
        cache.remember(
            cache.ticket().unwrap(),
            &ns,
            &key,
            &completed(SystemTime::now(), Duration::from_secs(30)),
        );
        cache
            .fresh_until_us
            .store(cache.micros_since_base(stale), Ordering::Release);
        assert!(cache.replay(&ns, &key).is_none());
        cache.vouched(Instant::now());
        assert!(
            cache.replay(&ns, &key).is_none(),
            "the gap emptied the cache"
        );
    }

    #[test]
    fn an_entry_larger_than_a_shards_share_is_counted_not_kept() {
        let cache = vouched_cache();
        let (ns, key) = names("big");
        let mut big = completed(SystemTime::now(), Duration::from_secs(30));
        let largest = usize::try_from(cache.largest_entry()).unwrap();
        big.record.as_mut().unwrap().response = Some(vec![0; largest]);
        cache.remember(cache.ticket().unwrap(), &ns, &key, &big);
        assert!(cache.replay(&ns, &key).is_none());
        assert_eq!(cache.stats().too_large, 1);
        let (ns, key) = names("fits");
        let mut fits = big.clone();
        fits.record.as_mut().unwrap().response = Some(vec![0; largest / 2]);
        cache.remember(cache.ticket().unwrap(), &ns, &key, &fits);
        assert!(cache.replay(&ns, &key).is_some());
        assert_eq!(cache.stats().too_large, 1);
    }

    #[test]
    fn the_byte_budget_bounds_the_cache() {
        let cache = ReplayCache::new(64 * 1024);
        cache.vouched(Instant::now());
        for i in 0..1000 {
            let (ns, key) = names(&format!("k{i}"));
            let ticket = cache.ticket().unwrap();
            cache.remember(
                ticket,
                &ns,
                &key,
                &completed(SystemTime::now(), Duration::from_secs(30)),
            );
        }
        let stats = cache.stats();
        assert!(stats.bytes <= 64 * 1024, "{stats:?}");
        assert!(stats.entries > 0 && stats.entries < 1000, "{stats:?}");
    }
}
