//! Coalescing: concurrent single calls sent to the database as one statement
//! per kind. A store decorator: `Coalesced<S>` answers `claim_or_fetch`,
//! `fetch`, `try_claim` and `complete` by queueing the call, and worker tasks
//! turn whatever is queued into one `claim_or_fetch_many`, `fetch_many`,
//! `try_claim_many` or `complete_many`.
//!
//! Each call keeps its own semantics: the set-based statements apply the same
//! guard row by row, and a key named twice in one batch is tried once (the
//! other call reads again and learns who won). A lone call is not delayed:
//! with nothing of its kind queued or in flight it goes at once from its own
//! task, and a worker takes what is already queued and goes; batches form only
//! when calls arrive faster than statements complete. A failed statement fails
//! the calls of its batch, and only those; on Citus (`split_failed`) they are
//! first sent again one by one, so that a worker that is down fails only the
//! calls of its own keys.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime};

use tokio::sync::{Mutex, OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tracing::Instrument;

use super::{FirstClaim, Operations, PoolStatus, Reaped, Store, StoreStats};
use crate::domain::{Completion, Key, Lease, LeaseToken, Namespace, NewLease, Purged, Snapshot};
use crate::error::Error;

/// How batches are formed.
#[derive(Debug, Clone, Copy)]
pub struct CoalesceOptions {
    /// The most calls in one statement.
    pub max_batch: usize,
    /// How long a worker waits for more calls when its batch is not full.
    /// Zero (the default) never waits: batch only what is already queued.
    pub window: Duration,
    /// Statements of one kind in flight at once.
    pub workers: usize,
    /// The store's timeout (IDEMPOTENCY_DB_TIMEOUT): a queued call waits at
    /// most this long for its answer, its wait for a batch included, then
    /// fails with UNAVAILABLE, as a call of its own would. Without it a call
    /// queued behind a statement that hangs (the database unreachable) would
    /// wait for that statement's timeout and then its own.
    pub timeout: Duration,
    /// When a batch fails, send each of its calls again on its own, so that
    /// each fails only for its own key (Citus: a batch spans workers, and
    /// one that is down must not fail the other workers' keys). Safe for
    /// the same reason as a statement resent after a lost connection
    /// (`held!` in store/postgres): the lifecycle reads what a repeat finds.
    pub split_failed: bool,
}

type Reply<R> = oneshot::Sender<Result<R, Error>>;

/// Sends one batch to the store; a failed batch hands its items back.
type Run<T, R> = Arc<
    dyn Fn(Vec<T>) -> Pin<Box<dyn Future<Output = Result<Vec<R>, Failed<T>>> + Send>> + Send + Sync,
>;

/// A batch's error, with the batch's items.
type Failed<T> = (Error, Vec<T>);

/// A queue of calls of one kind, and the workers that drain it.
struct Batcher<T, R> {
    queue: mpsc::UnboundedSender<(T, Reply<R>)>,
    /// Calls queued and not yet taken by a worker.
    queued: Arc<AtomicUsize>,
    /// One permit per statement of this kind in flight, whoever sends it.
    slots: Arc<Semaphore>,
    /// A lone call may skip the queue (no window to wait for company).
    alone: bool,
    workers: usize,
    timeout: Duration,
    run: Run<T, R>,
}

impl<T: Send + 'static, R: Send + 'static> Batcher<T, R> {
    fn spawn<F, Fut>(options: CoalesceOptions, run: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<R>, Failed<T>>> + Send + 'static,
    {
        let run: Run<T, R> = Arc::new(move |items| Box::pin(run(items)));
        let (queue, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(Mutex::new(receiver));
        let queued = Arc::new(AtomicUsize::new(0));
        let workers = options.workers.max(1);
        let slots = Arc::new(Semaphore::new(workers));
        for _ in 0..workers {
            let receiver = receiver.clone();
            let queued = queued.clone();
            let slots = slots.clone();
            let run = run.clone();
            tokio::spawn(async move {
                while let Some((batch, _slot)) =
                    next_batch(&receiver, &queued, &slots, options).await
                {
                    let (items, replies): (Vec<T>, Vec<Reply<R>>) = batch.into_iter().unzip();
                    match run(items).await {
                        Ok(results) => {
                            for (reply, result) in replies.into_iter().zip(results) {
                                let _ = reply.send(Ok(result));
                            }
                        }
                        Err((_, items)) if options.split_failed && items.len() > 1 => {
                            let alone = items.into_iter().map(|item| {
                                let run = run.clone();
                                async move { run(vec![item]).await }
                            });
                            let answers = futures_util::future::join_all(alone).await;
                            for (reply, answer) in replies.into_iter().zip(answers) {
                                let answer = match answer {
                                    Ok(mut results) => results.pop().ok_or_else(|| {
                                        Error::Internal("a statement answered no call".into())
                                    }),
                                    Err((alone, _)) => Err(alone),
                                };
                                let _ = reply.send(answer);
                            }
                        }
                        Err((error, _)) => {
                            for reply in replies {
                                let _ = reply.send(Err(error.replicate()));
                            }
                        }
                    }
                }
            });
        }
        Self {
            queue,
            queued,
            slots,
            alone: options.window.is_zero(),
            workers,
            timeout: options.timeout,
            run,
        }
    }

    /// Nothing of this kind queued or in flight: the call goes at once from
    /// the caller's own task, without the hand-over to a worker and back.
    /// Otherwise it queues, and a worker sends it with whatever else queued
    /// (under load a lone statement would take a slot a batch could use).
    async fn call(&self, item: T) -> Result<R, Error> {
        if self.alone
            && self.queued.load(Ordering::Acquire) == 0
            && self.slots.available_permits() == self.workers
            && let Ok(_slot) = self.slots.try_acquire()
        {
            return (self.run)(vec![item])
                .await
                .map_err(|(error, _)| error)?
                .pop()
                .ok_or_else(|| Error::Internal("a statement answered no call".into()));
        }
        let (reply, answer) = oneshot::channel();
        self.queued.fetch_add(1, Ordering::AcqRel);
        if self.queue.send((item, reply)).is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::Internal("the coalescer has stopped".into()));
        }
        match tokio::time::timeout(self.timeout, answer).await {
            Ok(answer) => {
                answer.map_err(|_| Error::Internal("a coalesced statement was dropped".into()))?
            }
            Err(elapsed) => Err(Error::Unavailable(Box::new(elapsed))),
        }
    }
}

/// Waits for one call and a statement slot, then takes what else is queued
/// (up to the batch size, waiting up to the window for more when one is
/// set). `None` once the queue is closed.
async fn next_batch<T>(
    receiver: &Mutex<mpsc::UnboundedReceiver<T>>,
    queued: &AtomicUsize,
    slots: &Arc<Semaphore>,
    options: CoalesceOptions,
) -> Option<(Vec<T>, OwnedSemaphorePermit)> {
    let mut receiver = receiver.lock().await;
    let first = receiver.recv().await?;
    let slot = slots.clone().acquire_owned().await.ok()?;
    let mut batch = Vec::with_capacity(options.max_batch.min(64));
    batch.push(first);
    while batch.len() < options.max_batch {
        match receiver.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
    if !options.window.is_zero() && batch.len() < options.max_batch {
        let deadline = tokio::time::Instant::now() + options.window;
        while batch.len() < options.max_batch {
            match tokio::time::timeout_at(deadline, receiver.recv()).await {
                Ok(Some(item)) => batch.push(item),
                _ => break,
            }
        }
    }
    queued.fetch_sub(batch.len(), Ordering::AcqRel);
    Some((batch, slot))
}

/// A store whose single fetches, claims and completes are coalesced.
#[derive(Clone)]
pub struct Coalesced<S> {
    inner: S,
    fetches: Arc<Batcher<(Namespace, Key), Snapshot>>,
    firsts: Arc<Batcher<NewLease, FirstClaim>>,
    claims: Arc<Batcher<NewLease, Option<Lease>>>,
    completions: Arc<Batcher<Completion, Option<SystemTime>>>,
}

impl<S: Store> Coalesced<S> {
    /// Starts the workers; call inside the Tokio runtime.
    pub fn new(inner: S, options: CoalesceOptions) -> Self {
        let store = inner.clone();
        let fetches = Batcher::spawn(options, move |keys: Vec<(Namespace, Key)>| {
            let store = store.clone();
            async move { store.fetch_many(&keys).await.map_err(|e| (e, keys)) }
        });
        let store = inner.clone();
        let firsts = Batcher::spawn(options, move |leases: Vec<NewLease>| {
            let store = store.clone();
            async move {
                store
                    .claim_or_fetch_many(&leases)
                    .await
                    .map_err(|e| (e, leases))
            }
        });
        let store = inner.clone();
        let claims = Batcher::spawn(options, move |leases: Vec<NewLease>| {
            let store = store.clone();
            async move { store.try_claim_many(&leases).await.map_err(|e| (e, leases)) }
        });
        let store = inner.clone();
        let completions = Batcher::spawn(options, move |completions: Vec<Completion>| {
            let store = store.clone();
            async move {
                store
                    .complete_many(&completions)
                    .await
                    .map_err(|e| (e, completions))
            }
        });
        Self {
            inner,
            fetches: Arc::new(fetches),
            firsts: Arc::new(firsts),
            claims: Arc::new(claims),
            completions: Arc::new(completions),
        }
    }
}

/// The caller's side of a coalesced statement, so a call's trace shows the
/// wait for its batch.
fn queued(operation: &'static str) -> tracing::Span {
    tracing::debug_span!(
        "db",
        otel.name = operation,
        otel.kind = "client",
        db.coalesced = true
    )
}

impl<S: Store> Store for Coalesced<S> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn fetch(&self, namespace: &Namespace, key: &Key) -> Result<Snapshot, Error> {
        self.fetches
            .call((namespace.clone(), key.clone()))
            .instrument(queued("fetch"))
            .await
    }

    /// Not coalesced: rare, and a statement of its own.
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
        self.firsts
            .call(lease.clone())
            .instrument(queued("claim_or_fetch"))
            .await
    }

    async fn claim_or_fetch_many(&self, leases: &[NewLease]) -> Result<Vec<FirstClaim>, Error> {
        self.inner.claim_or_fetch_many(leases).await
    }

    async fn try_claim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        self.claims
            .call(lease.clone())
            .instrument(queued("try_claim"))
            .await
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
        let completion = Completion {
            namespace: namespace.clone(),
            key: key.clone(),
            lease_token: *token,
            response: response.to_vec(),
            retention,
            remember_for,
        };
        self.completions
            .call(completion)
            .instrument(queued("complete"))
            .await
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

    /// Late retries are rare: not coalesced.
    async fn reclaim(&self, lease: &NewLease) -> Result<Option<Lease>, Error> {
        self.inner.reclaim(lease).await
    }

    async fn reap_expired(&self, batch: u32) -> Result<Reaped, Error> {
        self.inner.reap_expired(batch).await
    }

    async fn purge(&self, namespace: &Namespace, key: &Key) -> Result<Option<Purged>, Error> {
        self.inner.purge(namespace, key).await
    }

    async fn close(&self) {
        self.inner.close().await;
    }
}

impl<S: Store + Operations> Operations for Coalesced<S> {
    async fn stats(&self) -> Result<StoreStats, Error> {
        self.inner.stats().await
    }

    async fn stats_estimate(&self) -> Result<StoreStats, Error> {
        self.inner.stats_estimate().await
    }

    fn pool_status(&self) -> PoolStatus {
        self.inner.pool_status()
    }

    fn purge_feed(&self) -> Option<mpsc::Receiver<super::PurgeEvent>> {
        self.inner.purge_feed()
    }

    fn cache_stats(&self) -> Option<super::cache::CacheStats> {
        self.inner.cache_stats()
    }

    async fn ping(&self) -> Result<(), Error> {
        self.inner.ping().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;
    use tokio::sync::Notify;

    /// Every batch a statement was sent, in order.
    type Batches = Arc<StdMutex<Vec<Vec<u32>>>>;

    /// A batcher over a statement that records each batch it is sent and, for
    /// the batch holding `block_on`, waits until `gate` opens.
    fn batcher(workers: usize, block_on: u32, gate: Arc<Notify>) -> (Batcher<u32, u32>, Batches) {
        batcher_timing_out(workers, block_on, gate, Duration::from_secs(30))
    }

    fn batcher_timing_out(
        workers: usize,
        block_on: u32,
        gate: Arc<Notify>,
        timeout: Duration,
    ) -> (Batcher<u32, u32>, Batches) {
        let batches = Arc::new(StdMutex::new(Vec::new()));
        let seen = batches.clone();
        let options = CoalesceOptions {
            max_batch: 128,
            window: Duration::ZERO,
            workers,
            timeout,
            split_failed: false,
        };
        let batcher = Batcher::spawn(options, move |items: Vec<u32>| {
            let seen = seen.clone();
            let gate = gate.clone();
            async move {
                seen.lock().unwrap().push(items.clone());
                if items.contains(&block_on) {
                    gate.notified().await;
                }
                Ok(items.iter().map(|i| i * 10).collect())
            }
        });
        (batcher, batches)
    }

    #[tokio::test]
    async fn a_lone_call_goes_at_once_and_calls_behind_a_busy_slot_go_together() {
        let gate = Arc::new(Notify::new());
        let (batcher, batches) = batcher(1, 0, gate.clone());
        let batcher = Arc::new(batcher);
        assert_eq!(batcher.call(7).await.unwrap(), 70);
        assert_eq!(*batches.lock().unwrap(), [vec![7]]);

        // Call 0 holds the only slot until the gate opens; calls 1..=10 queue.
        let first = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.call(0).await }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while batches.lock().unwrap().len() < 2 {
            assert!(tokio::time::Instant::now() < deadline, "call 0 never ran");
            tokio::task::yield_now().await;
        }
        let queued: Vec<_> = (1..=10)
            .map(|i| {
                let batcher = batcher.clone();
                tokio::spawn(async move { batcher.call(i).await })
            })
            .collect();
        while batcher.queued.load(Ordering::Acquire) < 10 {
            assert!(tokio::time::Instant::now() < deadline, "calls never queued");
            tokio::task::yield_now().await;
        }
        gate.notify_one();
        assert_eq!(first.await.unwrap().unwrap(), 0);
        for (i, call) in (1..=10).zip(queued) {
            assert_eq!(call.await.unwrap().unwrap(), i * 10);
        }
        assert_eq!(
            *batches.lock().unwrap(),
            [vec![7], vec![0], (1..=10).collect::<Vec<_>>()]
        );
    }

    #[tokio::test]
    async fn a_failed_statement_fails_only_the_calls_it_carried() {
        let options = CoalesceOptions {
            max_batch: 128,
            window: Duration::ZERO,
            workers: 1,
            timeout: Duration::from_secs(30),
            split_failed: false,
        };
        let batcher = Batcher::spawn(options, |items: Vec<u32>| async move {
            if items.contains(&13) {
                Err((Error::Unavailable("the database went away".into()), items))
            } else {
                Ok(items)
            }
        });
        assert!(matches!(batcher.call(13).await, Err(Error::Unavailable(_))));
        assert_eq!(batcher.call(14).await.unwrap(), 14);
    }

    /// With `split_failed` (Citus), a batch that failed because of one key
    /// (a worker down) is sent again call by call: the others succeed, the
    /// key's own call fails, and without it the batch fails whole.
    #[tokio::test]
    async fn a_failed_batch_split_fails_only_the_call_whose_key_failed() {
        for split_failed in [true, false] {
            let options = CoalesceOptions {
                max_batch: 128,
                window: Duration::ZERO,
                workers: 1,
                timeout: Duration::from_secs(30),
                split_failed,
            };
            let gate = Arc::new(Notify::new());
            let opened = gate.clone();
            let sent = Arc::new(StdMutex::new(Vec::new()));
            let seen = sent.clone();
            let batcher = Arc::new(Batcher::spawn(options, move |items: Vec<u32>| {
                let gate = opened.clone();
                let seen = seen.clone();
                async move {
                    seen.lock().unwrap().push(items.clone());
                    if items == [0] {
                        gate.notified().await;
                    }
                    if items.contains(&13) {
                        Err((Error::Unavailable("worker 2 is down".into()), items))
                    } else {
                        Ok(items)
                    }
                }
            }));
            // Call 0 holds the only slot, so 12, 13 and 14 queue as one batch.
            let first = tokio::spawn({
                let batcher = batcher.clone();
                async move { batcher.call(0).await }
            });
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while sent.lock().unwrap().is_empty() {
                assert!(tokio::time::Instant::now() < deadline, "call 0 never ran");
                tokio::task::yield_now().await;
            }
            let calls: Vec<_> = [12, 13, 14]
                .into_iter()
                .map(|i| {
                    let batcher = batcher.clone();
                    tokio::spawn(async move { batcher.call(i).await })
                })
                .collect();
            while batcher.queued.load(Ordering::Acquire) < 3 {
                assert!(tokio::time::Instant::now() < deadline, "calls never queued");
                tokio::task::yield_now().await;
            }
            gate.notify_one();
            assert_eq!(first.await.unwrap().unwrap(), 0);
            let mut answers = Vec::new();
            for call in calls {
                answers.push(call.await.unwrap().map_err(|e| e.to_string()));
            }
            if split_failed {
                assert_eq!(answers[0], Ok(12));
                assert!(answers[1].is_err());
                assert_eq!(answers[2], Ok(14));
                assert_eq!(
                    *sent.lock().unwrap(),
                    [vec![0], vec![12, 13, 14], vec![12], vec![13], vec![14]]
                );
            } else {
                assert!(answers.iter().all(Result::is_err), "{answers:?}");
                assert_eq!(*sent.lock().unwrap(), [vec![0], vec![12, 13, 14]]);
            }
        }
    }

    #[tokio::test]
    async fn a_call_queued_behind_a_hung_statement_is_unavailable_within_the_timeout() {
        let gate = Arc::new(Notify::new());
        let timeout = Duration::from_millis(300);
        let (batcher, batches) = batcher_timing_out(1, 0, gate.clone(), timeout);
        let batcher = Arc::new(batcher);
        // Call 0 hangs in the only slot (the database stopped answering).
        let hung = tokio::spawn({
            let batcher = batcher.clone();
            async move { batcher.call(0).await }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while batches.lock().unwrap().is_empty() {
            assert!(tokio::time::Instant::now() < deadline, "call 0 never ran");
            tokio::task::yield_now().await;
        }
        let started = tokio::time::Instant::now();
        let queued = batcher.call(1).await;
        assert!(matches!(queued, Err(Error::Unavailable(_))), "{queued:?}");
        let waited = started.elapsed();
        assert!(
            waited >= timeout && waited < timeout * 3,
            "answered after {waited:?}"
        );
        gate.notify_one();
        assert_eq!(hung.await.unwrap().unwrap(), 0);
    }
}
