//! The rules of a key's lifecycle: Claim, Complete, Release, ExtendLease, Get.
//!
//! A Claim that carries the caller's own lease token is retry-safe: when the
//! key's live lease already has that token, the Claim answers with that lease
//! (it was this caller's earlier attempt, whose answer was lost). Checkpoints
//! saved under a lease travel to the next holder with the Claim that takes
//! the key over.
//!
//! A completed key stays remembered past its result's retention, until its
//! namespace's horizon: a late retry of it is re-executed with the next
//! fencing token, or refused, as the Claim or its namespace says.
//!
//! Each call is built from the store's atomic operations. The store's guarded
//! statements decide every race; this module decides what a caller is told
//! when a guarded statement did not apply (was the key gone, or held by
//! someone else?), and serves the common duplicate (a completed key) with a
//! read instead of a write. No tonic, no SQL.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::domain::{
    ClaimOutcome, Fingerprint, Key, LateRetry, Lease, LeaseToken, Limits, Marker, Namespace,
    NewLease, Purged, Record, RecordState, Remembering, Snapshot,
};
use crate::error::{Error, Reason};
use crate::metrics;
use crate::store::{Announces, FirstClaim, Store};
use crate::waiters::{POLL_EVERY, Waiters, Waiting};
use tokio::time::Instant;

/// How many read-then-guarded-write rounds a Claim makes before it gives up
/// with ABORTED. Each lost round means the key changed in between (claimed,
/// released, expired); two rounds settle every race seen in practice.
const CLAIM_ROUNDS: usize = 8;

/// A validated Claim, before defaults are applied.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    pub namespace: Namespace,
    pub key: Key,
    pub fingerprint: Option<Fingerprint>,
    pub lease_ttl: Option<Duration>,
    pub retention: Option<Duration>,
    /// The caller's own token for the lease (a retry-safe Claim); `None`: the
    /// server makes one.
    pub lease_token: Option<LeaseToken>,
    /// What to do if the key is remembered; `None`: the namespace's policy.
    pub late_retry: Option<LateRetry>,
}

/// Settings per namespace (the policy file's `[[namespace]]` entries): how
/// its keys are remembered, given the server's default.
pub trait NamespaceSettings: Send + Sync {
    fn remembering(&self, namespace: &Namespace, default: Remembering) -> Remembering;
}

/// What Get found.
#[derive(Debug)]
pub enum Inspection {
    /// An unexpired record.
    Live(Record),
    /// A remembered key: its result expired, its marker is kept.
    Remembered(Marker),
    Absent,
}

/// A validated Complete.
pub use crate::domain::Completion as CompleteRequest;

/// The lifecycle over one store, with the server's limits and this
/// process's waiting Claims.
#[derive(Clone)]
pub struct Lifecycle<S> {
    store: S,
    limits: Limits,
    waiters: Waiters,
    namespaces: Option<Arc<dyn NamespaceSettings>>,
}

/// What a Claim that asked to wait answers, and how long it waited.
#[derive(Debug)]
pub struct Waited {
    pub outcome: ClaimOutcome,
    pub waited: Duration,
}

/// How long after the database's `lease_expires_at` a waiter reads the key
/// again: enough for the database's clock to have passed it.
const EXPIRY_MARGIN: Duration = Duration::from_millis(5);

/// What a Claim should do after reading the key.
enum Verdict {
    Answer(ClaimOutcome),
    /// Try the guarded statement that takes the key this way.
    Take(Take),
}

/// How a Claim takes a key.
#[derive(Debug, Clone, Copy)]
enum Take {
    /// Absent, expired or released: the guarded claim.
    Free,
    /// Held under a lease that ran out: the guarded claim, a takeover.
    Over,
    /// Remembered, and re-executed: the guarded re-claim of the marker (the
    /// key completed at this time).
    Late(SystemTime),
}

impl Take {
    /// The answer of a Claim that took the key this way.
    fn claimed(self, lease: Lease) -> ClaimOutcome {
        ClaimOutcome::Claimed {
            lease,
            took_over: matches!(self, Take::Over),
            retried: false,
            completed_before: match self {
                Take::Late(completed_at) => Some(completed_at),
                _ => None,
            },
        }
    }
}

impl<S: Store> Lifecycle<S> {
    pub fn new(store: S, limits: Limits) -> Self {
        let waiters = Waiters::new(limits.max_waiters);
        Self {
            store,
            limits,
            waiters,
            namespaces: None,
        }
    }

    /// The same lifecycle with settings per namespace.
    pub fn with_namespaces(mut self, namespaces: Arc<dyn NamespaceSettings>) -> Self {
        self.namespaces = Some(namespaces);
        self
    }

    /// How a namespace's keys are remembered: its own settings, else the
    /// server's.
    fn remembering(&self, namespace: &Namespace) -> Remembering {
        let default = self.limits.remembering;
        match &self.namespaces {
            Some(settings) => settings.remembering(namespace, default),
            None => default,
        }
    }

    /// The server's limits.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// This process's waiting Claims (the server feeds them the store's
    /// purge feed and ends them at shutdown).
    pub fn waiters(&self) -> &Waiters {
        &self.waiters
    }

    /// The store's new lease for a Claim, with the limits applied.
    fn new_lease(&self, request: ClaimRequest) -> Result<NewLease, Error> {
        let late_retry = request
            .late_retry
            .unwrap_or_else(|| self.remembering(&request.namespace).late_retry);
        Ok(NewLease {
            lease_ttl: self.limits.lease_ttl(request.lease_ttl)?,
            retention: self.limits.claim_retention(request.retention)?,
            namespace: request.namespace,
            key: request.key,
            fingerprint: request.fingerprint,
            lease_token: request.lease_token.unwrap_or_else(LeaseToken::generate),
            late_retry,
        })
    }

    /// The guarded statement that takes the key the way the read said.
    async fn take(&self, lease: &NewLease, take: Take) -> Result<Option<Lease>, Error> {
        match take {
            Take::Late(_) => self.store.reclaim(lease).await,
            Take::Free | Take::Over => self.store.try_claim(lease).await,
        }
    }

    /// A Claim that may wait up to `wait` (already within the server's
    /// maximum) for another holder's live lease to
    /// end. It answers as a Claim would, except that OUTCOME_IN_PROGRESS
    /// becomes: the stored result once the holder completes (a mismatch when
    /// the fingerprints differ), the lease once the holder released, its
    /// lease ran out or the key was purged and this Claim won the guarded
    /// claim, or OUTCOME_IN_PROGRESS when the wait ran out, the server is
    /// shutting down, or too many Claims wait already (then at once).
    ///
    /// `wait` counts from when the Claim starts to wait; `answer_by` (the
    /// call's deadline less a margin, fixed when the call arrived) bounds it
    /// whatever the first step took: a first step slowed by a starved pool
    /// shortens the wait rather than pushing its end past the deadline.
    pub async fn claim_waiting(
        &self,
        request: ClaimRequest,
        wait: Duration,
        answer_by: Option<Instant>,
    ) -> Result<Waited, Error> {
        let new_lease = self.new_lease(request)?;
        let outcome = self.claim_lease(&new_lease).await?;
        if wait.is_zero()
            || answer_by.is_some_and(|by| Instant::now() >= by)
            || !matches!(outcome, ClaimOutcome::InProgress { .. })
        {
            return Ok(Waited {
                outcome,
                waited: Duration::ZERO,
            });
        }
        let Some(waiting) = self.waiters.join(&new_lease.namespace, &new_lease.key) else {
            metrics::record_wait("over_cap", Duration::ZERO);
            return Ok(Waited {
                outcome,
                waited: Duration::ZERO,
            });
        };
        let started = Instant::now();
        let until = answer_by.map_or(started + wait, |by| by.min(started + wait));
        let outcome = self.wait_on(&waiting, &new_lease, until).await;
        let waited = started.elapsed();
        let name = match &outcome {
            Ok(ClaimOutcome::Completed { .. }) => "completed",
            Ok(ClaimOutcome::Claimed { .. }) => "claimed",
            Ok(ClaimOutcome::FingerprintMismatch) => "fingerprint_mismatch",
            Ok(ClaimOutcome::Expired { .. }) => "expired",
            Ok(ClaimOutcome::InProgress { .. }) if self.waiters.is_stopping() => "shutdown",
            Ok(ClaimOutcome::InProgress { .. }) => "timed_out",
            Err(_) => "error",
        };
        metrics::record_wait(name, waited);
        Ok(Waited {
            outcome: outcome?,
            waited,
        })
    }

    /// The waiting itself: read the key (shared with this process's other
    /// waiters on it), answer when the read decides, take a turn at the
    /// guarded claim when the key is free, else sleep until woken, until the
    /// holder's lease runs out, until the next poll when changes may go
    /// unannounced, or until the deadline.
    async fn wait_on(
        &self,
        waiting: &Waiting,
        lease: &NewLease,
        deadline: Instant,
    ) -> Result<ClaimOutcome, Error> {
        let slot = &waiting.slot;
        // A first read by another waiter here serves this one too, even one
        // that started before this Claim's own: it marked the row, so any
        // change since it was made has woken the slot (and invalidated it),
        // and a change before it was seen by it. Later reads must be newer
        // than what woke the waiter.
        let mut not_before = None;
        let mut cause = "joined";
        loop {
            let mut woken = slot.woken();
            let (read_at, snapshot) = slot
                .read(not_before, || {
                    metrics::record_wait_read(cause);
                    self.store.watch(&lease.namespace, &lease.key)
                })
                .await?;
            let now = snapshot.now;
            match judge(snapshot, lease) {
                Verdict::Answer(ClaimOutcome::InProgress {
                    lease_expires_at,
                    expires_at,
                    ..
                }) => {
                    let left = lease_expires_at.duration_since(now).unwrap_or_default();
                    let expiry = read_at + left + EXPIRY_MARGIN;
                    let answer = || still_in_progress(lease_expires_at, now, read_at, expires_at);
                    // Asleep until something calls for a read; woken early
                    // only to see whether the feed is still caught up.
                    loop {
                        let announces = self.store.announces();
                        let poll = self
                            .waiters
                            .must_poll(announces)
                            .then(|| (read_at + POLL_EVERY).max(Instant::now()));
                        let recheck = match (announces, poll) {
                            (Announces::Feed, None) => self.waiters.feed_fresh_until(),
                            _ => None,
                        };
                        let read_at_wake = poll.map_or(expiry, |poll| poll.min(expiry));
                        let wake_at = recheck.map_or(read_at_wake, |r| r.min(read_at_wake));
                        tokio::select! {
                            () = self.waiters.stopping() => return Ok(answer()),
                            () = tokio::time::sleep_until(deadline) => return Ok(answer()),
                            () = &mut woken => {
                                not_before = Some(slot.woken_at());
                                cause = "woken";
                                break;
                            }
                            () = tokio::time::sleep_until(wake_at) => {
                                if wake_at < read_at_wake {
                                    continue;
                                }
                                not_before = Some(wake_at);
                                cause = if wake_at < expiry { "poll" } else { "lease_expired" };
                                break;
                            }
                        }
                    }
                }
                Verdict::Answer(outcome) => return Ok(outcome),
                Verdict::Take(take) => {
                    let turn = slot.turn().await;
                    // Another waiter here took its turn meanwhile: read again.
                    if slot.woken_at() > read_at {
                        not_before = Some(slot.woken_at());
                        cause = "woken";
                        continue;
                    }
                    let won = self.take(lease, take).await;
                    slot.changed();
                    drop(turn);
                    if let Some(lease) = won? {
                        return Ok(take.claimed(lease));
                    }
                    not_before = Some(slot.woken_at());
                    cause = "lost";
                }
            }
        }
    }

    /// Claim, for a lease already made: insert the key if it has no record,
    /// else read it (one step), answer from the read when it is decided
    /// (replay, in progress, mismatch), else try the guarded claim. A lost
    /// race is read again, so the loser learns who won.
    async fn claim_lease(&self, new_lease: &NewLease) -> Result<ClaimOutcome, Error> {
        let new_lease = new_lease.clone();
        let mut first = Some(self.store.claim_or_fetch(&new_lease).await?);
        for _ in 0..CLAIM_ROUNDS {
            let snapshot = match first.take() {
                Some(FirstClaim::Inserted(lease)) => return Ok(Take::Free.claimed(lease)),
                Some(FirstClaim::Found(snapshot)) => snapshot,
                Some(FirstClaim::Raced) | None => {
                    self.store
                        .fetch(&new_lease.namespace, &new_lease.key)
                        .await?
                }
            };
            match judge(snapshot, &new_lease) {
                Verdict::Answer(outcome) => return Ok(outcome),
                Verdict::Take(take) => {
                    if let Some(lease) = self.take(&new_lease, take).await? {
                        return Ok(take.claimed(lease));
                    }
                }
            }
        }
        Err(Error::Contended)
    }

    /// Complete: store the response under the current lease. A retried
    /// Complete (same token, already completed) answers OK with the stored
    /// expiry and keeps the first response.
    pub async fn complete(&self, request: CompleteRequest) -> Result<SystemTime, Error> {
        let request = self.validate_completion(request)?;
        self.complete_validated(&request).await
    }

    /// `complete` for a request already validated.
    async fn complete_validated(&self, request: &CompleteRequest) -> Result<SystemTime, Error> {
        if let Some(expires_at) = self
            .store
            .complete(
                &request.namespace,
                &request.key,
                &request.lease_token,
                &request.response,
                request.retention,
                request.remember_for,
            )
            .await?
        {
            self.waiters.wake(&request.namespace, &request.key);
            return Ok(expires_at);
        }
        let snapshot = self.store.fetch(&request.namespace, &request.key).await?;
        why_not_completed(snapshot, request.lease_token)
    }

    /// Checks what the limits say about a Complete (its retention, its size).
    /// The namespace's `remember_for` is set here.
    fn validate_completion(&self, mut request: CompleteRequest) -> Result<CompleteRequest, Error> {
        request.retention = self.limits.complete_retention(request.retention)?;
        request.response = self.limits.response(request.response)?;
        let remember_for = self.remembering(&request.namespace).remember_for;
        request.remember_for = (!remember_for.is_zero()).then_some(remember_for);
        Ok(request)
    }

    /// Claims for many keys at once (a ClaimBatch, or calls coalesced): each
    /// answered as its own Claim would be, in order, with set-based statements.
    /// The same key twice is one lease: the first wins it, the second is told
    /// it is in progress. A failure of the store fails the whole batch.
    pub async fn claim_many(
        &self,
        requests: Vec<ClaimRequest>,
    ) -> Result<Vec<ClaimOutcome>, Error> {
        let leases = self.new_leases(requests)?;
        self.claim_leases(&leases).await
    }

    /// `claim_many`, with each item's own error where the store can fail for
    /// some keys and not others (Citus, a worker down): after the batch
    /// fails UNAVAILABLE, each item is claimed on its own with the lease it
    /// was given, so the keys that can be reached are answered (a lease the
    /// batch took before it failed comes back as a retried Claim's). The call
    /// still fails as a whole when every item failed, or for the call's own
    /// reasons (an invalid item).
    pub async fn claim_each(
        &self,
        requests: Vec<ClaimRequest>,
    ) -> Result<Vec<Result<ClaimOutcome, Error>>, Error> {
        let leases = self.new_leases(requests)?;
        match self.claim_leases(&leases).await {
            Ok(outcomes) => Ok(outcomes.into_iter().map(Ok).collect()),
            Err(Error::Unavailable(_)) if self.store.fails_in_parts() => {
                metrics::batch_split("claim");
                all_failed_or_each(
                    one_key_at_a_time(
                        &leases,
                        |l| (&l.namespace, &l.key),
                        |lease| self.claim_lease(lease),
                    )
                    .await,
                )
            }
            Err(error) => Err(error),
        }
    }

    /// The leases of a batch's Claims; an invalid item fails them all.
    fn new_leases(&self, requests: Vec<ClaimRequest>) -> Result<Vec<NewLease>, Error> {
        requests
            .into_iter()
            .enumerate()
            .map(|(i, request)| self.new_lease(request).map_err(|e| e.at_item(i)))
            .collect()
    }

    /// `claim_many` for leases already made.
    async fn claim_leases(&self, leases: &[NewLease]) -> Result<Vec<ClaimOutcome>, Error> {
        let mut outcomes: Vec<Option<ClaimOutcome>> = vec![None; leases.len()];
        // Round one: one step inserts every absent key and reads the others.
        // A key named again waits for the next round, which reads the lease
        // its first occurrence took.
        let mut seen = HashSet::with_capacity(leases.len());
        let (firsts, mut again): (Vec<usize>, Vec<usize>) =
            (0..leases.len()).partition(|&i| seen.insert((&leases[i].namespace, &leases[i].key)));
        drop(seen);
        let first = if again.is_empty() {
            self.store.claim_or_fetch_many(leases).await?
        } else {
            let tried: Vec<NewLease> = firsts.iter().map(|&i| leases[i].clone()).collect();
            self.store.claim_or_fetch_many(&tried).await?
        };
        let mut read = Vec::new();
        for (&i, result) in firsts.iter().zip(first) {
            match result {
                FirstClaim::Inserted(lease) => outcomes[i] = Some(Take::Free.claimed(lease)),
                FirstClaim::Found(snapshot) => read.push((i, snapshot)),
                FirstClaim::Raced => again.push(i),
            }
        }
        again.extend(self.settle(leases, read, &mut outcomes).await?);
        for _ in 1..CLAIM_ROUNDS {
            if again.is_empty() {
                break;
            }
            again.sort_unstable();
            let keys: Vec<(Namespace, Key)> = again
                .iter()
                .map(|&i| (leases[i].namespace.clone(), leases[i].key.clone()))
                .collect();
            let snapshots = self.store.fetch_many(&keys).await?;
            let read = again.iter().copied().zip(snapshots).collect();
            again = self.settle(leases, read, &mut outcomes).await?;
        }
        outcomes
            .into_iter()
            .map(|outcome| outcome.ok_or(Error::Contended))
            .collect()
    }

    /// One round of `claim_many` after its read: answers the items the read
    /// decides, tries the guarded claim for the others (one item per key), and
    /// returns the items to read again.
    async fn settle(
        &self,
        leases: &[NewLease],
        read: Vec<(usize, Snapshot)>,
        outcomes: &mut [Option<ClaimOutcome>],
    ) -> Result<Vec<usize>, Error> {
        let mut attempts = Vec::new();
        let mut late = Vec::new();
        let mut again = Vec::new();
        let mut trying = HashSet::new();
        for (i, snapshot) in read {
            match judge(snapshot, &leases[i]) {
                Verdict::Answer(outcome) => outcomes[i] = Some(outcome),
                Verdict::Take(take) => {
                    if !trying.insert((&leases[i].namespace, &leases[i].key)) {
                        again.push(i);
                    } else if matches!(take, Take::Late(_)) {
                        late.push((i, take));
                    } else {
                        attempts.push((i, take));
                    }
                }
            }
        }
        // Late retries are rare: each is re-claimed on its own.
        for (i, take) in late {
            match self.take(&leases[i], take).await? {
                Some(lease) => outcomes[i] = Some(take.claimed(lease)),
                None => again.push(i),
            }
        }
        if attempts.is_empty() {
            return Ok(again);
        }
        let tried: Vec<NewLease> = attempts.iter().map(|&(i, _)| leases[i].clone()).collect();
        let won = self.store.try_claim_many(&tried).await?;
        for ((i, take), lease) in attempts.into_iter().zip(won) {
            match lease {
                Some(lease) => outcomes[i] = Some(take.claimed(lease)),
                None => again.push(i),
            }
        }
        Ok(again)
    }

    /// Completes many keys at once (a CompleteBatch, or calls coalesced).
    /// Invalid items fail the whole call; each valid item gets the answer its
    /// own Complete would get.
    pub async fn complete_many(
        &self,
        requests: Vec<CompleteRequest>,
    ) -> Result<Vec<Result<SystemTime, Error>>, Error> {
        let requests = self.validate_completions(requests)?;
        self.complete_validated_many(&requests).await
    }

    /// `complete_many`, with each item's own error where the store can fail
    /// for some keys and not others (Citus, a worker down): after the batch
    /// fails UNAVAILABLE, each item is completed on its own (a Complete the
    /// batch made before it failed answers OK again, as a retried Complete
    /// does). The call still fails as a whole when every item failed.
    pub async fn complete_each(
        &self,
        requests: Vec<CompleteRequest>,
    ) -> Result<Vec<Result<SystemTime, Error>>, Error> {
        let requests = self.validate_completions(requests)?;
        match self.complete_validated_many(&requests).await {
            Err(Error::Unavailable(_)) if self.store.fails_in_parts() => {
                metrics::batch_split("complete");
                all_failed_or_each(
                    one_key_at_a_time(
                        &requests,
                        |r| (&r.namespace, &r.key),
                        |request| self.complete_validated(request),
                    )
                    .await,
                )
            }
            answered => answered,
        }
    }

    /// The batch's Completes, validated; an invalid item fails them all.
    fn validate_completions(
        &self,
        requests: Vec<CompleteRequest>,
    ) -> Result<Vec<CompleteRequest>, Error> {
        requests
            .into_iter()
            .enumerate()
            .map(|(i, r)| self.validate_completion(r).map_err(|e| e.at_item(i)))
            .collect()
    }

    /// `complete_many` for requests already validated.
    async fn complete_validated_many(
        &self,
        requests: &[CompleteRequest],
    ) -> Result<Vec<Result<SystemTime, Error>>, Error> {
        let done = self.store.complete_many(requests).await?;
        for (request, done) in requests.iter().zip(&done) {
            if done.is_some() {
                self.waiters.wake(&request.namespace, &request.key);
            }
        }
        let missed: Vec<usize> = (0..requests.len()).filter(|&i| done[i].is_none()).collect();
        let keys: Vec<(Namespace, Key)> = missed
            .iter()
            .map(|&i| (requests[i].namespace.clone(), requests[i].key.clone()))
            .collect();
        let mut snapshots = if keys.is_empty() {
            Vec::new()
        } else {
            self.store.fetch_many(&keys).await?
        }
        .into_iter();
        Ok(done
            .into_iter()
            .zip(requests)
            .map(|(done, request)| match done {
                Some(expires_at) => Ok(expires_at),
                None => match snapshots.next() {
                    Some(snapshot) => why_not_completed(snapshot, request.lease_token),
                    None => Err(Error::Internal("a batch lost track of an item".into())),
                },
            })
            .collect())
    }

    /// Release: give a failed attempt back, saving its checkpoint when it
    /// sends one. Repeating it with the same token while nobody claimed since
    /// is OK.
    pub async fn release(
        &self,
        namespace: Namespace,
        key: Key,
        token: LeaseToken,
        checkpoint: Option<Vec<u8>>,
    ) -> Result<(), Error> {
        let checkpoint = self.limits.checkpoint(checkpoint)?;
        if self
            .store
            .release(&namespace, &key, &token, checkpoint.as_deref())
            .await?
        {
            self.waiters.wake(&namespace, &key);
            return Ok(());
        }
        let record = self.live_record(&namespace, &key).await?;
        match record.state {
            RecordState::Released if record.lease_token == Some(token) => Ok(()),
            RecordState::Completed => Err(Error::LeaseMismatch(
                Reason::KeyCompleted,
                "the key is completed; a completed key cannot be released",
            )),
            _ => Err(Error::lease_lost()),
        }
    }

    /// ExtendLease: move the lease's expiry to now + ttl, and save the
    /// checkpoint when there is one.
    pub async fn extend_lease(
        &self,
        namespace: Namespace,
        key: Key,
        token: LeaseToken,
        lease_ttl: Option<Duration>,
        checkpoint: Option<Vec<u8>>,
    ) -> Result<std::time::SystemTime, Error> {
        let lease_ttl = self.limits.lease_ttl(lease_ttl)?;
        let checkpoint = self.limits.checkpoint(checkpoint)?;
        if let Some(lease_expires_at) = self
            .store
            .extend_lease(&namespace, &key, &token, lease_ttl, checkpoint.as_deref())
            .await?
        {
            return Ok(lease_expires_at);
        }
        let record = self.live_record(&namespace, &key).await?;
        Err(match record.state {
            RecordState::InProgress => Error::lease_lost(),
            RecordState::Completed => Error::LeaseMismatch(
                Reason::KeyCompleted,
                "the key is completed; its lease cannot be extended",
            ),
            RecordState::Released => Error::LeaseMismatch(
                Reason::LeaseReleased,
                "the lease was released; claim the key again",
            ),
        })
    }

    /// Purge: make the key claimable again at once (an operator's action),
    /// a remembered one too, whatever its late-retry policy. Returns what
    /// there was, `None` when there was nothing.
    pub async fn purge(&self, namespace: Namespace, key: Key) -> Result<Option<Purged>, Error> {
        let purged = self.store.purge(&namespace, &key).await?;
        if purged.is_some() {
            self.waiters.wake(&namespace, &key);
        }
        Ok(purged)
    }

    /// Get: the record if it is unexpired, the marker if it is remembered.
    pub async fn get(&self, namespace: Namespace, key: Key) -> Result<Inspection, Error> {
        let snapshot = self.store.fetch(&namespace, &key).await?;
        if let Some(marker) = snapshot.remembered() {
            return Ok(Inspection::Remembered(marker));
        }
        Ok(snapshot.live().map_or(Inspection::Absent, Inspection::Live))
    }

    async fn live_record(&self, namespace: &Namespace, key: &Key) -> Result<Record, Error> {
        live_or_gone(self.store.fetch(namespace, key).await?)
    }
}

/// The answer of a wait that ran out: the holder's lease as last read, with
/// the time left on it now (the database's clock, moved on by this
/// machine's since the read).
fn still_in_progress(
    lease_expires_at: SystemTime,
    read_now: SystemTime,
    read_at: Instant,
    expires_at: SystemTime,
) -> ClaimOutcome {
    let now = read_now + read_at.elapsed();
    ClaimOutcome::InProgress {
        lease_expires_at,
        retry_after: lease_expires_at.duration_since(now).unwrap_or_default(),
        expires_at,
    }
}

/// Why a guarded Complete did not apply, from a read made after it: a retried
/// Complete of the same lease is OK (with the stored expiry); anything else is
/// an error naming what happened to the lease.
fn why_not_completed(snapshot: Snapshot, token: LeaseToken) -> Result<SystemTime, Error> {
    let record = live_or_gone(snapshot)?;
    match record.state {
        RecordState::Completed if record.lease_token == Some(token) => Ok(record.expires_at),
        RecordState::Completed => Err(Error::LeaseMismatch(
            Reason::KeyCompleted,
            "the key was completed under another lease",
        )),
        RecordState::Released if record.lease_token == Some(token) => Err(Error::LeaseMismatch(
            Reason::LeaseReleased,
            "the lease was released; claim the key again",
        )),
        _ => Err(Error::lease_lost()),
    }
}

/// The unexpired record, else why there is none: NOT_FOUND, or KEY_EXPIRED
/// for a remembered key.
fn live_or_gone(snapshot: Snapshot) -> Result<Record, Error> {
    if let Some(marker) = snapshot.remembered() {
        return Err(Error::KeyExpired {
            completed_at: marker.completed_at,
            remembered_until: marker.remembered_until,
        });
    }
    snapshot.live().ok_or(Error::NotFound)
}

/// Decides a Claim from a read of the key. Anything that would change the
/// record goes to the guarded statement, which re-checks it atomically. A
/// live lease whose token is the one offered is the caller's own (a retried
/// Claim) and is answered as it stands: nothing needs writing.
fn judge(snapshot: Snapshot, offered: &NewLease) -> Verdict {
    let now = snapshot.now;
    if let Some(marker) = snapshot.remembered() {
        return match offered.late_retry {
            LateRetry::Reexecute => Verdict::Take(Take::Late(marker.completed_at)),
            LateRetry::Refuse
                if Fingerprint::conflicts(
                    marker.fingerprint.as_ref(),
                    offered.fingerprint.as_ref(),
                ) =>
            {
                Verdict::Answer(ClaimOutcome::FingerprintMismatch)
            }
            LateRetry::Refuse => Verdict::Answer(ClaimOutcome::Expired {
                completed_at: marker.completed_at,
                fencing_token: marker.fencing_token,
            }),
        };
    }
    let Some(record) = snapshot.live() else {
        return Verdict::Take(Take::Free);
    };
    if Fingerprint::conflicts(record.fingerprint.as_ref(), offered.fingerprint.as_ref()) {
        return Verdict::Answer(ClaimOutcome::FingerprintMismatch);
    }
    match record.state {
        RecordState::Completed => Verdict::Answer(ClaimOutcome::Completed {
            response: record.response.unwrap_or_default(),
            expires_at: record.expires_at,
        }),
        RecordState::InProgress => match record.lease_expires_at {
            Some(lease_expires_at)
                if lease_expires_at > now && record.lease_token == Some(offered.lease_token) =>
            {
                Verdict::Answer(ClaimOutcome::Claimed {
                    lease: Lease {
                        lease_token: offered.lease_token,
                        fencing_token: record.fencing_token,
                        lease_expires_at,
                        expires_at: record.expires_at,
                        checkpoint: record.checkpoint,
                    },
                    took_over: false,
                    retried: true,
                    completed_before: None,
                })
            }
            Some(lease_expires_at) if lease_expires_at > now => {
                Verdict::Answer(ClaimOutcome::InProgress {
                    lease_expires_at,
                    retry_after: lease_expires_at.duration_since(now).unwrap_or_default(),
                    expires_at: record.expires_at,
                })
            }
            _ => Verdict::Take(Take::Over),
        },
        RecordState::Released => Verdict::Take(Take::Free),
    }
}

/// Runs `call` for every item: the items of one key one after another, in
/// their order (so that the first of a key named twice goes first, as in a
/// batch), different keys side by side. Each item's own result, in order.
async fn one_key_at_a_time<'a, T, R, Fut>(
    items: &'a [T],
    key_of: impl Fn(&'a T) -> (&'a Namespace, &'a Key),
    call: impl Fn(&'a T) -> Fut,
) -> Vec<Result<R, Error>>
where
    Fut: Future<Output = Result<R, Error>>,
{
    let mut runs: Vec<Vec<usize>> = Vec::new();
    let mut run_of = HashMap::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let run = *run_of.entry(key_of(item)).or_insert_with(|| {
            runs.push(Vec::new());
            runs.len() - 1
        });
        runs[run].push(i);
    }
    let call = &call;
    let done = futures_util::future::join_all(runs.into_iter().map(|run| async move {
        let mut results = Vec::with_capacity(run.len());
        for i in run {
            results.push((i, call(&items[i]).await));
        }
        results
    }))
    .await;
    let mut results: Vec<Option<Result<R, Error>>> = (0..items.len()).map(|_| None).collect();
    for (i, result) in done.into_iter().flatten() {
        results[i] = Some(result);
    }
    results
        .into_iter()
        .map(|result| {
            result.unwrap_or_else(|| Err(Error::Internal("a batch lost track of an item".into())))
        })
        .collect()
}

/// A batch's items tried one by one: their own results, unless none could
/// reach the store, which is then the call's own UNAVAILABLE.
fn all_failed_or_each<R>(results: Vec<Result<R, Error>>) -> Result<Vec<Result<R, Error>>, Error> {
    if results
        .iter()
        .all(|r| matches!(r, Err(Error::Unavailable(_))))
    {
        // Every item failed (or there was none).
        return match results.into_iter().next() {
            Some(Err(error)) => Err(error),
            _ => Ok(Vec::new()),
        };
    }
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn record(state: RecordState, fingerprint: Option<&[u8]>, lease_left: i64) -> Record {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let lease = if lease_left >= 0 {
            now + Duration::from_secs(lease_left as u64)
        } else {
            now - Duration::from_secs((-lease_left) as u64)
        };
        Record {
            state,
            fencing_token: 3,
            lease_token: Some(LeaseToken::generate()),
            fingerprint: fingerprint.map(|f| Fingerprint::from_stored(f.to_vec()).unwrap()),
            response: Some(b"stored".to_vec()),
            retention: Duration::from_secs(60),
            lease_expires_at: Some(lease),
            expires_at: now + Duration::from_secs(100),
            created_at: now,
            updated_at: now,
            checkpoint: None,
            remember_until: None,
        }
    }

    fn snapshot(record: Record) -> Snapshot {
        Snapshot {
            now: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000),
            record: Some(record),
        }
    }

    fn fp(bytes: &[u8]) -> Option<Fingerprint> {
        Fingerprint::from_stored(bytes.to_vec())
    }

    /// A Claim offering `fingerprint` and a fresh token of its own.
    fn offer(fingerprint: Option<Fingerprint>) -> NewLease {
        NewLease {
            namespace: Namespace::parse("ns".into()).unwrap(),
            key: Key::parse("k".into()).unwrap(),
            fingerprint,
            lease_token: LeaseToken::generate(),
            lease_ttl: Duration::from_secs(30),
            retention: Duration::from_secs(60),
            late_retry: LateRetry::Reexecute,
        }
    }

    #[test]
    fn a_live_lease_answers_in_progress_with_the_time_left() {
        let verdict = judge(
            snapshot(record(RecordState::InProgress, None, 7)),
            &offer(None),
        );
        match verdict {
            Verdict::Answer(ClaimOutcome::InProgress { retry_after, .. }) => {
                assert_eq!(retry_after, Duration::from_secs(7))
            }
            _ => panic!("expected in progress"),
        }
    }

    #[test]
    fn an_expired_lease_or_a_release_is_claimable() {
        assert!(matches!(
            judge(
                snapshot(record(RecordState::InProgress, None, -1)),
                &offer(None)
            ),
            Verdict::Take(Take::Over)
        ));
        assert!(matches!(
            judge(
                snapshot(record(RecordState::Released, None, 0)),
                &offer(None)
            ),
            Verdict::Take(Take::Free)
        ));
    }

    #[test]
    fn a_different_fingerprint_wins_over_every_state() {
        for state in [
            RecordState::InProgress,
            RecordState::Completed,
            RecordState::Released,
        ] {
            let verdict = judge(snapshot(record(state, Some(b"a"), 5)), &offer(fp(b"b")));
            assert!(matches!(
                verdict,
                Verdict::Answer(ClaimOutcome::FingerprintMismatch)
            ));
        }
    }

    #[test]
    fn an_expired_record_is_absent() {
        let mut expired = record(RecordState::Completed, Some(b"a"), 0);
        expired.expires_at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        assert!(matches!(
            judge(snapshot(expired), &offer(fp(b"b"))),
            Verdict::Take(Take::Free)
        ));
    }

    #[test]
    fn the_live_leases_own_token_gets_that_lease_back_unchanged() {
        let mut held = record(RecordState::InProgress, None, 7);
        let retry = offer(None);
        held.lease_token = Some(retry.lease_token);
        match judge(snapshot(held.clone()), &retry) {
            Verdict::Answer(ClaimOutcome::Claimed {
                lease,
                took_over: false,
                retried: true,
                completed_before: None,
            }) => {
                assert_eq!(lease.fencing_token, 3);
                assert_eq!(Some(lease.lease_expires_at), held.lease_expires_at);
                assert_eq!(lease.expires_at, held.expires_at);
            }
            _ => panic!("expected the same lease back"),
        }
        // Once that lease has run out, the token is just another Claim's.
        let mut expired = record(RecordState::InProgress, None, -1);
        expired.lease_token = Some(retry.lease_token);
        assert!(matches!(
            judge(snapshot(expired), &retry),
            Verdict::Take(Take::Over)
        ));
    }

    /// A completed record whose result expired a second ago, remembered
    /// for `left` seconds more (none when `left` is `None`).
    fn expired_completed(fingerprint: Option<&[u8]>, left: Option<u64>) -> Snapshot {
        let mut late = record(RecordState::Completed, fingerprint, 0);
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        late.expires_at = now - Duration::from_secs(1);
        late.updated_at = now - Duration::from_secs(61);
        late.remember_until = left.map(|left| now + Duration::from_secs(left));
        snapshot(late)
    }

    #[test]
    fn a_remembered_key_is_re_executed_or_refused_as_the_claim_says() {
        let completed_at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000 - 61);
        match judge(expired_completed(Some(b"a"), Some(10)), &offer(fp(b"a"))) {
            Verdict::Take(Take::Late(at)) => assert_eq!(at, completed_at),
            _ => panic!("expected a re-execution"),
        }
        let mut refuse = offer(fp(b"a"));
        refuse.late_retry = LateRetry::Refuse;
        match judge(expired_completed(Some(b"a"), Some(10)), &refuse) {
            Verdict::Answer(ClaimOutcome::Expired {
                completed_at: at,
                fencing_token: 3,
            }) => assert_eq!(at, completed_at),
            _ => panic!("expected expired"),
        }
        // Refused with another payload: the mismatch says more.
        refuse.fingerprint = fp(b"b");
        assert!(matches!(
            judge(expired_completed(Some(b"a"), Some(10)), &refuse),
            Verdict::Answer(ClaimOutcome::FingerprintMismatch)
        ));
        // Past the horizon, or never remembered: absent.
        for left in [None, Some(0)] {
            assert!(matches!(
                judge(expired_completed(Some(b"a"), left), &refuse),
                Verdict::Take(Take::Free)
            ));
        }
    }

    #[test]
    fn a_call_on_a_remembered_key_says_key_expired() {
        let error = live_or_gone(expired_completed(None, Some(10))).unwrap_err();
        assert_eq!(error.reason(), Reason::KeyExpired);
        let error = live_or_gone(expired_completed(None, None)).unwrap_err();
        assert_eq!(error.reason(), Reason::NotFound);
    }
}
