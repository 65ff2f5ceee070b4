//! Coalescing: concurrent single calls sent to the database as one statement
//! per kind. A store decorator: `Coalesced<S>` answers `claim_or_fetch`,
//! `fetch`, `try_claim` and `complete` by queueing the call, and worker tasks
//! turn whatever is queued into one `claim_or_fetch_many`, `fetch_many`,
//! `try_claim_many` or `complete_many`.
//!
//! Each call keeps its own semantics: the set-based statements apply the same
//! guard row by row, and a key named twice in one batch is tried once (the
//! other call reads again and learns who won). A lone call is not delayed: a
//! worker takes what is already queued and goes; batches form only when calls
//! arrive faster than statements complete. A failed statement fails the calls
//! of its batch, and only those.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::{Mutex, mpsc, oneshot};
use tracing::Instrument;

use super::{FirstClaim, PoolStatus, Store, StoreStats};
use crate::domain::{
    Completion, Key, Lease, LeaseToken, Namespace, NewLease, RecordState, Snapshot,
};
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
}

type Reply<R> = oneshot::Sender<Result<R, Error>>;

/// A queue of calls of one kind, and the workers that drain it.
struct Batcher<T, R> {
    queue: mpsc::UnboundedSender<(T, Reply<R>)>,
}

impl<T: Send + 'static, R: Send + 'static> Batcher<T, R> {
    fn spawn<F, Fut>(options: CoalesceOptions, run: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<R>, Error>> + Send,
    {
        let (queue, receiver) = mpsc::unbounded_channel();
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..options.workers.max(1) {
            let receiver = receiver.clone();
            let run = run.clone();
            tokio::spawn(async move {
                while let Some(batch) = next_batch(&receiver, options).await {
                    let (items, replies): (Vec<T>, Vec<Reply<R>>) = batch.into_iter().unzip();
                    match run(items).await {
                        Ok(results) => {
                            for (reply, result) in replies.into_iter().zip(results) {
                                let _ = reply.send(Ok(result));
                            }
                        }
                        Err(error) => {
                            for reply in replies {
                                let _ = reply.send(Err(error.replicate()));
                            }
                        }
                    }
                }
            });
        }
        Self { queue }
    }

    async fn call(&self, item: T) -> Result<R, Error> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send((item, reply))
            .map_err(|_| Error::Internal("the coalescer has stopped".into()))?;
        answer
            .await
            .map_err(|_| Error::Internal("a coalesced statement was dropped".into()))?
    }
}

/// Waits for one call, then takes what else is queued (up to the batch size,
/// waiting up to the window for more when one is set). `None` once the queue
/// is closed.
async fn next_batch<T>(
    receiver: &Mutex<mpsc::UnboundedReceiver<T>>,
    options: CoalesceOptions,
) -> Option<Vec<T>> {
    let mut receiver = receiver.lock().await;
    let first = receiver.recv().await?;
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
    Some(batch)
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
            async move { store.fetch_many(&keys).await }
        });
        let store = inner.clone();
        let firsts = Batcher::spawn(options, move |leases: Vec<NewLease>| {
            let store = store.clone();
            async move { store.claim_or_fetch_many(&leases).await }
        });
        let store = inner.clone();
        let claims = Batcher::spawn(options, move |leases: Vec<NewLease>| {
            let store = store.clone();
            async move { store.try_claim_many(&leases).await }
        });
        let store = inner.clone();
        let completions = Batcher::spawn(options, move |completions: Vec<Completion>| {
            let store = store.clone();
            async move { store.complete_many(&completions).await }
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
    ) -> Result<Option<SystemTime>, Error> {
        let completion = Completion {
            namespace: namespace.clone(),
            key: key.clone(),
            lease_token: *token,
            response: response.to_vec(),
            retention,
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
    ) -> Result<bool, Error> {
        self.inner.release(namespace, key, token).await
    }

    async fn extend_lease(
        &self,
        namespace: &Namespace,
        key: &Key,
        token: &LeaseToken,
        lease_ttl: Duration,
    ) -> Result<Option<SystemTime>, Error> {
        self.inner
            .extend_lease(namespace, key, token, lease_ttl)
            .await
    }

    async fn reap_expired(&self, batch: u32) -> Result<u64, Error> {
        self.inner.reap_expired(batch).await
    }

    async fn purge(&self, namespace: &Namespace, key: &Key) -> Result<Option<RecordState>, Error> {
        self.inner.purge(namespace, key).await
    }

    async fn stats(&self) -> Result<StoreStats, Error> {
        self.inner.stats().await
    }

    fn pool_status(&self) -> PoolStatus {
        self.inner.pool_status()
    }

    async fn ping(&self) -> Result<(), Error> {
        self.inner.ping().await
    }

    async fn close(&self) {
        self.inner.close().await;
    }
}
