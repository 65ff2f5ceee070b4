//! The purge feed: what tells every replica's replay cache that a completed
//! record changed, and what makes a Purge wait until they have heard.
//!
//! One channel per schema that holds the table (`CHANNEL`), on which:
//! - a Purge announces the key twice in its own transaction: plainly
//!   (`<n>:<namespace><key>`, n counting characters), and with its purger
//!   and sequence number (`p:<purger>:<seq>:<n>:<namespace><key>`), which
//!   every replica answers with an acknowledgement;
//! - the migrations' triggers announce an UPDATE or DELETE of a completed,
//!   unexpired row plainly, and a TRUNCATE as `*` (forget everything);
//! - every replica sends a heartbeat each second (`hb:<replica>:<sent>`),
//!   which vouches to its own cache that every notification committed before
//!   it has arrived (NOTIFY reaches each listener in commit order), and tells
//!   the others that it is alive and has a cache to wait for; a process with
//!   no cache (the command line, a replica with the cache off) sends `hq:`
//!   instead, only for its own listener's watchdog;
//! - a replica acknowledges a purge (`ack:<purger>:<seq>:<replica>`) once its
//!   cache has forgotten the key.
//!
//! The listener has a connection of its own, replaced when its own heartbeat
//! has not come back within [`WATCHDOG`]; heartbeats and acknowledgements
//! have another (the `notifier`), so that no job of the pool's can delay
//! them. Why a Purge that waits as [`Feed::settle`] does is never followed
//! by a replay of what it purged is written in the README (the replay cache).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use super::nodes::Home;
use crate::domain::{Key, Namespace};
use crate::error::Error;
use crate::store::cache::FRESHNESS;
use crate::store::{Budget, PurgeEvent};

/// The purges channel of the schema that holds the table (not the session's
/// `current_schema()`: an operator's session under another search_path
/// must reach the same listeners). One per schema, so that deployments (or
/// tests) sharing a database but not a table do not hear each other.
/// Channel names are at most 63 bytes, hence the digest. The triggers
/// compute the same name from `TG_TABLE_SCHEMA`.
pub(super) const CHANNEL: &str = "
SELECT 'idempotency_purges_' || left(md5(n.nspname), 16)
FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE c.oid = 'idempotency_records'::regclass";

/// Expires a record now: it is absent to every call from this statement on.
/// A remembered key (a completed record past its expiry, or a marker, before
/// its horizon) becomes released without fingerprint until its horizon, so
/// that any Claim takes it with the next fencing token; it answers 4.
/// The notifications go out with the purge's commit, and only then, to every
/// replica listening on the channel ($3): the key plainly, and the key with
/// the purge's name ($4, `p:<purger>:<seq>:`), which replicas acknowledge.
/// Lengths count characters, which conversion to the client's encoding
/// (UTF-8) keeps, where bytes would not. The statement names the table
/// once and notifies in the same transaction, so it announces itself on a
/// database where triggers cannot (Citus workers), and an identical
/// notification from the trigger in the same transaction is delivered once.
pub(super) const PURGE: &str = "
WITH purged AS (
    UPDATE idempotency_records AS r
    SET state = CASE WHEN r.expires_at > now() AND r.state <> 4 THEN r.state ELSE 3 END,
        fingerprint = CASE WHEN r.expires_at > now() AND r.state <> 4 THEN r.fingerprint END,
        response = CASE WHEN r.expires_at > now() AND r.state <> 4 THEN r.response END,
        checkpoint = CASE WHEN r.expires_at > now() AND r.state <> 4 THEN r.checkpoint END,
        checkpoint_fencing = CASE WHEN r.expires_at > now() AND r.state <> 4
                                  THEN r.checkpoint_fencing END,
        expires_at = CASE WHEN r.state = 4 THEN r.expires_at
                          WHEN r.expires_at > now() THEN now()
                          ELSE r.remember_until END,
        remember_until = NULL, lease_expires_at = NULL, updated_at = now()
    WHERE r.namespace = $1 AND r.key = $2
      AND (r.expires_at > now() OR (r.state = 2 AND r.remember_until > now()))
    RETURNING CASE WHEN r.expires_at > now() THEN 4::int2 ELSE r.state END AS state)
SELECT p.state
FROM purged AS p
CROSS JOIN LATERAL (
    SELECT pg_notify($3, length($1)::text || ':' || $1 || $2),
           pg_notify($3, $4 || length($1)::text || ':' || $1 || $2)) AS told";

/// A notification on the purges channel: a heartbeat or an acknowledgement.
pub(super) const NOTIFY: &str = "SELECT pg_notify($1, $2)";

/// How often a replica sends itself a heartbeat on the purges channel.
pub(super) const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// How long the listener waits for its own heartbeat before it takes its
/// connection for dead (a half-open socket says nothing) and opens another.
pub(super) const WATCHDOG: Duration = Duration::from_secs(5);

/// What is added to [`FRESHNESS`] for the clocks of two machines, which
/// count durations at slightly different rates, and for scheduling.
pub(super) const MARGIN: Duration = Duration::from_millis(250);

/// How far back a heartbeat heard makes its sender one to wait for, and for
/// how long a Purge waits at most after its commit.
pub(super) const BOUND: Duration = FRESHNESS.saturating_add(MARGIN);

/// One notification of the purges channel, read.
#[derive(Debug, PartialEq, Eq)]
enum Notice {
    /// A key changed (a purge, or a change the trigger saw).
    Changed(Namespace, Key),
    /// A key purged by `purger`'s purge number `seq`: to acknowledge.
    Purged {
        purger: u64,
        seq: u64,
        namespace: Namespace,
        key: Key,
    },
    /// The table was truncated: forget everything.
    Truncated,
    Heartbeat {
        from: u64,
        sent: Duration,
        /// Sent by a process with a cache (`hb:`): one a purge waits for,
        /// and the only kind that vouches for a cache.
        cached: bool,
    },
    Ack {
        purger: u64,
        seq: u64,
        from: u64,
    },
}

/// Splits `<n>:<namespace><key>`, n counting characters.
fn names(payload: &str) -> Option<(Namespace, Key)> {
    let (length, rest) = payload.split_once(':')?;
    let length: usize = length.parse().ok()?;
    let at = rest
        .char_indices()
        .map(|(i, _)| i)
        .chain(std::iter::once(rest.len()))
        .nth(length)?;
    let (namespace, key) = rest.split_at(at);
    Some((
        Namespace::parse(namespace.to_owned()).ok()?,
        Key::parse(key.to_owned()).ok()?,
    ))
}

fn hex(text: &str) -> Option<u64> {
    u64::from_str_radix(text, 16).ok()
}

/// Reads one notification (`None`: nothing this version sends).
fn notice(payload: &str) -> Option<Notice> {
    if payload == "*" {
        return Some(Notice::Truncated);
    }
    let heartbeat = payload
        .strip_prefix("hb:")
        .map(|h| (h, true))
        .or_else(|| payload.strip_prefix("hq:").map(|h| (h, false)));
    if let Some((heartbeat, cached)) = heartbeat {
        let (from, sent) = heartbeat.split_once(':')?;
        return Some(Notice::Heartbeat {
            from: hex(from)?,
            sent: Duration::from_micros(sent.parse().ok()?),
            cached,
        });
    }
    if let Some(ack) = payload.strip_prefix("ack:") {
        let mut parts = ack.splitn(3, ':');
        return Some(Notice::Ack {
            purger: hex(parts.next()?)?,
            seq: parts.next()?.parse().ok()?,
            from: hex(parts.next()?)?,
        });
    }
    if let Some(purge) = payload.strip_prefix("p:") {
        let mut parts = purge.splitn(3, ':');
        let purger = hex(parts.next()?)?;
        let seq = parts.next()?.parse().ok()?;
        let (namespace, key) = names(parts.next()?)?;
        return Some(Notice::Purged {
            purger,
            seq,
            namespace,
            key,
        });
    }
    let (namespace, key) = names(payload)?;
    Some(Notice::Changed(namespace, key))
}

/// A purge of this replica's, waiting for acknowledgements.
struct Waiting {
    /// The replicas to wait for, set when this replica's listener hears the
    /// purge; `None` until then, or when the listener may have missed a
    /// heartbeat in the window before it (then the purge waits the bound).
    roster: Option<HashSet<u64>>,
    acked: HashSet<u64>,
    done: Arc<Notify>,
}

impl Waiting {
    fn check(&self) {
        if let Some(roster) = &self.roster
            && roster.is_subset(&self.acked)
        {
            self.done.notify_one();
        }
    }
}

#[derive(Default)]
struct Heard {
    /// When the current listener's LISTEN took effect; `None` while there is
    /// none.
    listening_since: Option<Instant>,
    /// When each replica's latest heartbeat arrived here.
    replicas: HashMap<u64, Instant>,
    waiting: HashMap<u64, Waiting>,
}

/// One store's feed: started at the first purge or subscription, then
/// running until the store closes.
pub(super) struct Feed {
    replica: u64,
    /// The origin of the heartbeats' timestamps.
    base: Instant,
    /// The store's entry pool, which finds the home.
    entry: PgPool,
    /// Where the feed listens and notifies: the home node (the coordinator,
    /// on Citus, whichever node the entry is), so that every replica hears
    /// every other's heartbeats, purges and acknowledgements.
    home: Arc<Home>,
    /// The home's connection options, set once found, before the feed's
    /// tasks start.
    options: OnceLock<PgConnectOptions>,
    budget: Budget,
    stop: CancellationToken,
    channel: tokio::sync::OnceCell<String>,
    started: AtomicBool,
    next_purge: AtomicU64,
    heard: Mutex<Heard>,
    subscribers: Mutex<Vec<mpsc::Sender<PurgeEvent>>>,
}

/// Where a store keeps its feed, made when first needed.
pub(super) type Slot = Arc<OnceLock<Arc<Feed>>>;

/// The store's feed, made (not started) if it has none yet.
pub(super) fn feed<'a>(
    slot: &'a Slot,
    pool: &PgPool,
    home: &Arc<Home>,
    budget: &Budget,
    stop: &CancellationToken,
) -> &'a Arc<Feed> {
    slot.get_or_init(|| {
        Arc::new(Feed {
            replica: rand::random(),
            base: Instant::now(),
            entry: pool.clone(),
            home: home.clone(),
            options: OnceLock::new(),
            budget: budget.clone(),
            stop: stop.clone(),
            channel: tokio::sync::OnceCell::new(),
            started: AtomicBool::new(false),
            next_purge: AtomicU64::new(0),
            heard: Mutex::default(),
            subscribers: Mutex::default(),
        })
    })
}

/// A pool of one connection, outside the calls' pool.
fn own_pool(options: &PgConnectOptions, timeout: Duration) -> PgPool {
    PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(timeout)
        .connect_lazy_with(options.clone())
}

/// A purge of this replica's under way: forgotten when dropped.
pub(super) struct Purge<'a> {
    feed: &'a Feed,
    seq: u64,
    done: Arc<Notify>,
    /// The prefix of the purge's named notification.
    pub(super) name: String,
    pub(super) channel: String,
}

impl Drop for Purge<'_> {
    fn drop(&mut self) {
        self.feed.heard().waiting.remove(&self.seq);
    }
}

impl Purge<'_> {
    /// Returns once no replica can replay what this purge, committed before
    /// `committed`, removed: every replica that could has acknowledged, or
    /// [`BOUND`] has passed since (a replica that did not hear has stopped
    /// answering from memory by then).
    pub(super) async fn settle(self, committed: Instant) {
        let deadline = tokio::time::Instant::from_std(committed + BOUND);
        let _ = tokio::time::timeout_at(deadline, self.done.notified()).await;
    }
}

impl Feed {
    fn heard(&self) -> std::sync::MutexGuard<'_, Heard> {
        self.heard.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A feed of the events for one replay cache.
    pub(super) fn subscribe(self: &Arc<Self>) -> mpsc::Receiver<PurgeEvent> {
        let (events, feed) = mpsc::channel(1024);
        self.subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(events);
        self.start();
        feed
    }

    /// The channel's name, asked of the database once.
    async fn channel(&self, pool: &PgPool) -> Result<String, sqlx::Error> {
        self.channel
            .get_or_try_init(|| sqlx::query_scalar(CHANNEL).fetch_one(pool))
            .await
            .cloned()
    }

    /// Names a purge about to be sent, and waits for what it will hear of it.
    pub(super) async fn purge(self: &Arc<Self>, pool: &PgPool) -> Result<Purge<'_>, Error> {
        self.start();
        let channel = self.budget.run("purge", self.channel(pool)).await?;
        let seq = self.next_purge.fetch_add(1, Ordering::Relaxed);
        let done = Arc::new(Notify::new());
        self.heard().waiting.insert(
            seq,
            Waiting {
                roster: None,
                acked: HashSet::new(),
                done: done.clone(),
            },
        );
        Ok(Purge {
            feed: self,
            seq,
            done,
            name: format!("p:{:x}:{seq}:", self.replica),
            channel,
        })
    }

    /// Finds the home (asked again, with a growing pause, until the entry
    /// answers), then starts the listener, the heartbeats and the
    /// acknowledgements there.
    fn start(self: &Arc<Self>) {
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let feed = self.clone();
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(100);
            let options = loop {
                match feed.home.options(&feed.entry).await {
                    Ok(found) => {
                        break found
                            .unwrap_or_else(|| feed.entry.connect_options().as_ref().clone());
                    }
                    // A worker whose cluster names no coordinator: said
                    // plainly, it will not mend by itself.
                    Err(error @ sqlx::Error::Configuration(_)) => {
                        tracing::warn!(%error, "the purge feed has no node to run on")
                    }
                    Err(error) => {
                        tracing::debug!(%error, "cannot find the node the purge feed runs on yet")
                    }
                }
                tokio::select! {
                    () = feed.stop.cancelled() => return,
                    () = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            };
            let _ = feed.options.set(options);
            let (acks, queue) = mpsc::unbounded_channel();
            let notifier = Arc::new(Mutex::new(own_pool(feed.options(), feed.budget.timeout())));
            tokio::spawn(feed.clone().listen(acks));
            tokio::spawn(feed.clone().send_heartbeats(notifier.clone()));
            tokio::spawn(feed.send_acks(queue, notifier));
        });
    }

    /// The home's connection options (set before the tasks that use them
    /// start).
    fn options(&self) -> &PgConnectOptions {
        self.options
            .get()
            .expect("the feed's tasks start once its home is found")
    }

    /// Hands an event to every cache.
    async fn tell(&self, mut event: impl FnMut() -> PurgeEvent) {
        let subscribers = self
            .subscribers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for subscriber in subscribers {
            let _ = subscriber.send(event()).await;
        }
    }

    /// The listening side: keeps a LISTEN connection, applies what it hears,
    /// says `Lost` whenever the connection fails or goes quiet, then
    /// connects again with a growing pause.
    async fn listen(self: Arc<Self>, acks: mpsc::UnboundedSender<(Vec<Arc<Notify>>, String)>) {
        let mut pause = Duration::from_millis(100);
        loop {
            // A new pool each time: a dropped listener's connection may hang
            // in its UNLISTEN, and must not be the next listener's.
            let pool = own_pool(self.options(), self.budget.timeout());
            let connect = tokio::time::timeout(self.budget.timeout(), async {
                let mut listener = PgListener::connect_with(&pool).await?;
                listener.ignore_pool_close_event(true);
                let channel = self.channel(&pool).await?;
                listener.listen(&channel).await?;
                Ok::<_, sqlx::Error>(listener)
            });
            let listener = tokio::select! {
                () = self.stop.cancelled() => return,
                listener = connect => listener,
            };
            match listener {
                Ok(Ok(mut listener)) => {
                    pause = Duration::from_millis(100);
                    let since = Instant::now();
                    self.heard().listening_since = Some(since);
                    let mut own_heard = since;
                    loop {
                        let quiet = tokio::time::Instant::from_std(own_heard + WATCHDOG);
                        let received = tokio::select! {
                            () = self.stop.cancelled() => return,
                            received = tokio::time::timeout_at(quiet, listener.try_recv()) => received,
                        };
                        let payload = match received {
                            Ok(Ok(Some(notification))) => notification.payload().to_owned(),
                            Ok(Ok(None) | Err(_)) => {
                                tracing::warn!(
                                    "lost the connection that listens for purges; reconnecting"
                                );
                                break;
                            }
                            Err(_) => {
                                tracing::warn!(
                                    quiet_for = ?WATCHDOG,
                                    "the connection that listens for purges heard none of this replica's heartbeats; replacing it"
                                );
                                break;
                            }
                        };
                        if let Some(Notice::Heartbeat { from, .. }) = notice(&payload)
                            && from == self.replica
                        {
                            own_heard = Instant::now();
                        }
                        self.hear(&payload, &acks).await;
                    }
                }
                Ok(Err(error)) => tracing::debug!(%error, "cannot listen for purges yet"),
                Err(_) => tracing::debug!("cannot listen for purges yet: timed out"),
            }
            self.heard().listening_since = None;
            self.tell(|| PurgeEvent::Lost).await;
            drop(pool);
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }

    /// Applies one notification, in the order the channel delivered it.
    async fn hear(&self, payload: &str, acks: &mpsc::UnboundedSender<(Vec<Arc<Notify>>, String)>) {
        let Some(notice) = notice(payload) else {
            return;
        };
        match notice {
            Notice::Changed(namespace, key) => {
                self.tell(|| PurgeEvent::Purged(namespace.clone(), key.clone()))
                    .await;
            }
            Notice::Truncated => self.tell(|| PurgeEvent::Lost).await,
            Notice::Heartbeat { from, sent, cached } => {
                let now = Instant::now();
                {
                    let mut heard = self.heard();
                    if cached {
                        heard.replicas.insert(from, now);
                    }
                    if from == self.replica {
                        heard.replicas.retain(|_, at| *at + BOUND * 2 > now);
                    }
                }
                // A heartbeat sent before a cache subscribed vouches for
                // nothing: no purge waited for its sender.
                if from == self.replica && cached {
                    self.tell(|| PurgeEvent::CaughtUp(self.base + sent)).await;
                }
            }
            Notice::Purged {
                purger,
                seq,
                namespace,
                key,
            } => {
                if purger == self.replica {
                    self.roster(seq);
                }
                self.tell(|| PurgeEvent::Purged(namespace.clone(), key.clone()))
                    .await;
                let mut applied = Vec::new();
                self.tell(|| {
                    let notify = Arc::new(Notify::new());
                    applied.push(notify.clone());
                    PurgeEvent::Applied(notify)
                })
                .await;
                let ack = format!("ack:{purger:x}:{seq}:{:x}", self.replica);
                let _ = acks.send((applied, ack));
            }
            Notice::Ack { purger, seq, from } => {
                if purger == self.replica {
                    let mut heard = self.heard();
                    if let Some(waiting) = heard.waiting.get_mut(&seq) {
                        waiting.acked.insert(from);
                        waiting.check();
                    }
                }
            }
        }
    }

    /// This replica's purge `seq` has just been heard here: every
    /// notification committed before it has been too. The replicas heard
    /// within [`BOUND`] before now are the ones that may still answer from
    /// memory; if this listener was not listening through all of that
    /// window, it may have missed one, and the purge waits the bound.
    fn roster(&self, seq: u64) {
        let now = Instant::now();
        let mut heard = self.heard();
        let whole_window = heard
            .listening_since
            .is_some_and(|since| since + BOUND <= now);
        let roster: HashSet<u64> = heard
            .replicas
            .iter()
            .filter(|&(_, &at)| at + BOUND >= now)
            .map(|(&replica, _)| replica)
            .collect();
        if let Some(waiting) = heard.waiting.get_mut(&seq) {
            waiting.roster = whole_window.then_some(roster);
            waiting.check();
        }
    }

    /// Sends a notification through the notifier's connection; a failed one
    /// replaces that connection for the next.
    async fn notify(&self, notifier: &Mutex<PgPool>, operation: &'static str, payload: String) {
        let pool = notifier.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let sent = self
            .budget
            .run(operation, async {
                let channel = self.channel(&pool).await?;
                sqlx::query(NOTIFY)
                    .bind(channel)
                    .bind(payload)
                    .execute(&pool)
                    .await
            })
            .await;
        if sent.is_err() {
            *notifier.lock().unwrap_or_else(|e| e.into_inner()) =
                own_pool(self.options(), self.budget.timeout());
        }
    }

    /// One heartbeat every second, carrying when it was sent. A failed one
    /// only lets the cache's freshness lapse.
    async fn send_heartbeats(self: Arc<Self>, notifier: Arc<Mutex<PgPool>>) {
        let mut every = tokio::time::interval(HEARTBEAT_EVERY);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = self.stop.cancelled() => return,
                _ = every.tick() => {}
            }
            // Read before the time: a cache that subscribes after this
            // reads `hq` is vouched for by the next heartbeat.
            let cached = !self
                .subscribers
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_empty();
            let kind = if cached { "hb" } else { "hq" };
            let sent = self.base.elapsed().as_micros();
            let payload = format!("{kind}:{:x}:{sent}", self.replica);
            self.notify(&notifier, "heartbeat", payload).await;
        }
    }

    /// Acknowledges each purge heard, once every cache here has forgotten
    /// its key.
    async fn send_acks(
        self: Arc<Self>,
        mut queue: mpsc::UnboundedReceiver<(Vec<Arc<Notify>>, String)>,
        notifier: Arc<Mutex<PgPool>>,
    ) {
        loop {
            let (applied, ack) = tokio::select! {
                () = self.stop.cancelled() => return,
                next = queue.recv() => match next {
                    Some(next) => next,
                    None => return,
                },
            };
            for notify in applied {
                notify.notified().await;
            }
            self.notify(&notifier, "purge_ack", ack).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changed(namespace: &str, key: &str) -> Option<Notice> {
        Some(Notice::Changed(
            Namespace::parse(namespace.into()).unwrap(),
            Key::parse(key.into()).unwrap(),
        ))
    }

    #[test]
    fn a_change_names_its_key_by_characters_whatever_the_key_holds() {
        assert_eq!(notice("4:shöpa:b:c"), changed("shöp", "a:b:c"));
        assert_eq!(notice("3:日本語キー"), changed("日本語", "キー"));
        assert!(notice("9:short").is_none());
        // A byte count (what octet_length gave) is not read as characters.
        assert_eq!(notice("2:\u{e9}x"), None);
    }

    #[test]
    fn a_named_purge_carries_its_purger_and_sequence() {
        assert_eq!(
            notice("p:1f:42:4:shöpkey"),
            Some(Notice::Purged {
                purger: 0x1f,
                seq: 42,
                namespace: Namespace::parse("shöp".into()).unwrap(),
                key: Key::parse("key".into()).unwrap(),
            })
        );
    }

    #[test]
    fn heartbeats_acknowledgements_and_truncation_are_read() {
        assert_eq!(
            notice("hb:7:1500000"),
            Some(Notice::Heartbeat {
                from: 7,
                sent: Duration::from_millis(1500),
                cached: true,
            })
        );
        assert_eq!(
            notice("hq:7:1500000"),
            Some(Notice::Heartbeat {
                from: 7,
                sent: Duration::from_millis(1500),
                cached: false,
            })
        );
        assert_eq!(
            notice("ack:a:3:b"),
            Some(Notice::Ack {
                purger: 10,
                seq: 3,
                from: 11
            })
        );
        assert_eq!(notice("*"), Some(Notice::Truncated));
        assert!(notice("hb:zz:1").is_none());
    }
}
