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
//!
//! On Citus a NOTIFY reaches only the listeners of the node it is sent on,
//! and a row's triggers run on the node holding it. So the feed listens,
//! and sends its heartbeats, on the coordinator (the home) and on every
//! other node group's primary of `pg_dist_node`, read every [`NODES_EVERY`];
//! it is caught up only to the earliest heartbeat back among all of them. A
//! Purge runs on the node holding its key, with that node's clock, and is
//! heard and acknowledged there; the replicas it waits for are those heard
//! there or at the home within [`BOUND`].

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use super::nodes::{Home, at_node};
use super::sql::{CITUS_NODES, CITUS_VERSION};
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
/// (UTF-8) keeps, where bytes would not. The statement notifies in its own
/// transaction, on the node it runs on (on Citus, the one holding the key,
/// whose clock then decides the purge as it decides the key's Claims); an
/// identical notification from the trigger in the same transaction is
/// delivered once.
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

/// How often, on Citus, the feed reads which nodes the cluster has, to
/// listen on the ones that joined.
pub(super) const NODES_EVERY: Duration = Duration::from_secs(1);

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

/// A node the feed listens and sends heartbeats on: the home (where Purge
/// and its acknowledgements go), and on Citus every other node group's
/// primary, where the triggers of the keys' shards announce their changes.
struct Listened {
    /// Host and port, as `pg_dist_node` (or the home's options) give them.
    address: Address,
    /// Whether this is the home (the coordinator on Citus), which the
    /// replicas heard there are counted from for every node's purges.
    home: bool,
    options: PgConnectOptions,
    /// Stops this node's listener when the node leaves the cluster (a child
    /// of the feed's own).
    stop: CancellationToken,
    /// The heartbeats' (and, at the home, the acknowledgements') connection.
    notifier: Mutex<PgPool>,
}

/// A node's address: host and port.
type Address = (String, u16);

#[derive(Default)]
struct Heard {
    /// When each node's current listener's LISTEN took effect; absent while
    /// it has none.
    listening_since: HashMap<Address, Instant>,
    /// When each replica's latest heartbeat (with a cache) arrived, on each
    /// node.
    replicas: HashMap<Address, HashMap<u64, Instant>>,
    /// Which node is the home.
    home: Option<Address>,
    waiting: HashMap<u64, Waiting>,
    /// For each node listened on, when this replica's latest heartbeat
    /// (with a cache) that came back there was sent; `None` until one has,
    /// and again from the moment its listener is lost. The feed is caught
    /// up to the earliest of them, and only when every node has one.
    caught_up: HashMap<Address, Option<Duration>>,
}

impl Heard {
    /// When every notification committed on every node listened on, before
    /// then, has been heard.
    fn caught_up(&self) -> Option<Duration> {
        let mut earliest: Option<Duration> = None;
        for sent in self.caught_up.values() {
            let sent = (*sent)?;
            earliest = Some(earliest.map_or(sent, |e| e.min(sent)));
        }
        earliest
    }
}

/// One store's feed: started at the first purge or subscription, then
/// running until the store closes.
pub(super) struct Feed {
    replica: u64,
    /// The origin of the heartbeats' timestamps.
    base: Instant,
    /// The store's entry pool, which finds the home and the nodes.
    entry: PgPool,
    /// The home node (the coordinator, on Citus, whichever node the entry
    /// is), listened on whatever else is.
    home: Arc<Home>,
    budget: Budget,
    stop: CancellationToken,
    channel: tokio::sync::OnceCell<String>,
    started: AtomicBool,
    next_purge: AtomicU64,
    heard: Mutex<Heard>,
    /// The nodes listened on, the home first.
    nodes: Mutex<Vec<Arc<Listened>>>,
    /// Held while a node's state changes and the caches are told, so that
    /// a `Lost` and a `CaughtUp` computed before it reach them in order.
    telling: tokio::sync::Mutex<()>,
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
            budget: budget.clone(),
            stop: stop.clone(),
            channel: tokio::sync::OnceCell::new(),
            started: AtomicBool::new(false),
            next_purge: AtomicU64::new(0),
            heard: Mutex::default(),
            nodes: Mutex::default(),
            telling: tokio::sync::Mutex::new(()),
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

/// Acknowledgements to send, each on the node its purge was heard on, once
/// the caches have applied what came before it.
type Ack = (Vec<Arc<Notify>>, String, Arc<Listened>);
type Acks = mpsc::UnboundedSender<Ack>;

impl Feed {
    fn heard(&self) -> std::sync::MutexGuard<'_, Heard> {
        self.heard.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn nodes(&self) -> Vec<Arc<Listened>> {
        self.nodes.lock().unwrap_or_else(|e| e.into_inner()).clone()
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

    /// Finds the home and, on Citus, the other nodes (asked again, with a
    /// growing pause, until the entry answers), then starts the listeners,
    /// the heartbeats and the acknowledgements, and on Citus follows the
    /// nodes as they join and leave.
    fn start(self: &Arc<Self>) {
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let feed = self.clone();
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(100);
            let (home, others) = loop {
                let found = async {
                    let home = feed.home.options(&feed.entry).await?;
                    let others = feed.others().await?;
                    Ok::<_, sqlx::Error>((home, others))
                };
                match found.await {
                    Ok((home, others)) => {
                        break (
                            home.unwrap_or_else(|| feed.entry.connect_options().as_ref().clone()),
                            others,
                        );
                    }
                    // A worker whose cluster names no coordinator: said
                    // plainly, it will not mend by itself.
                    Err(error @ sqlx::Error::Configuration(_)) => {
                        tracing::warn!(%error, "the purge feed has no node to run on")
                    }
                    Err(error) => {
                        tracing::debug!(%error, "cannot find the nodes the purge feed runs on yet")
                    }
                }
                tokio::select! {
                    () = feed.stop.cancelled() => return,
                    () = tokio::time::sleep(pause) => {}
                }
                pause = (pause * 2).min(Duration::from_secs(5));
            };
            let (acks, queue) = mpsc::unbounded_channel();
            let address = (home.get_host().to_owned(), home.get_port());
            feed.heard().home = Some(address.clone());
            feed.add(address, home, true, &acks).await;
            tokio::spawn(feed.clone().send_acks(queue));
            let Some(others) = others else {
                // Plain PostgreSQL: the home is every node there is.
                return feed.send_heartbeats().await;
            };
            feed.follow_nodes(others, &acks, false).await;
            tokio::spawn(feed.clone().send_heartbeats());
            let mut every = tokio::time::interval(NODES_EVERY);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = feed.stop.cancelled() => return,
                    _ = every.tick() => {}
                }
                match feed.others().await {
                    Ok(Some(others)) => feed.follow_nodes(others, &acks, true).await,
                    Ok(None) => {}
                    Err(error) => {
                        tracing::debug!(%error, "cannot read the cluster's nodes; listening on the ones known")
                    }
                }
            }
        });
    }

    /// On Citus, every node group's primary but the coordinator's (the
    /// home), as `pg_dist_node` has them; `None` on plain PostgreSQL.
    async fn others(&self) -> Result<Option<Vec<Address>>, sqlx::Error> {
        let mut connection = self.entry.acquire().await?;
        let citus: Option<String> = sqlx::query_scalar(CITUS_VERSION)
            .fetch_optional(&mut *connection)
            .await?;
        if citus.is_none() {
            return Ok(None);
        }
        let rows: Vec<(i32, String, i32)> = sqlx::query_as(CITUS_NODES)
            .fetch_all(&mut *connection)
            .await?;
        Ok(Some(
            rows.into_iter()
                .filter(|(group, _, _)| *group != 0)
                .filter_map(|(_, host, port)| Some((host, u16::try_from(port).ok()?)))
                .collect(),
        ))
    }

    /// Listens on the nodes of `others` not listened on yet, and stops
    /// listening on those no longer among them. A node joining `late`
    /// (after the first reading) may have changed keys before its listener
    /// began: the caches forget everything, and are vouched for again only
    /// once every node, the new one included, has carried a heartbeat.
    async fn follow_nodes(self: &Arc<Self>, others: Vec<Address>, acks: &Acks, late: bool) {
        let known = self.nodes();
        for gone in known
            .iter()
            .filter(|node| !node.home && !others.contains(&node.address))
        {
            tracing::info!(host = %gone.address.0, port = gone.address.1, "a node left the cluster; the purge feed stops listening on it");
            gone.stop.cancel();
            let _telling = self.telling.lock().await;
            self.nodes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retain(|node| node.address != gone.address || node.home);
            {
                let mut heard = self.heard();
                heard.caught_up.remove(&gone.address);
                heard.replicas.remove(&gone.address);
            }
        }
        for address in others {
            if known.iter().any(|node| node.address == address) {
                continue;
            }
            if late {
                tracing::info!(host = %address.0, port = address.1, "a node joined the cluster; the purge feed listens on it too");
            }
            let options = at_node(&self.entry, &address.0, address.1);
            self.add(address, options, false, acks).await;
            if late {
                let _telling = self.telling.lock().await;
                self.tell(|| PurgeEvent::Lost).await;
            }
        }
    }

    /// Starts listening on a node, not caught up there yet.
    async fn add(
        self: &Arc<Self>,
        address: Address,
        options: PgConnectOptions,
        home: bool,
        acks: &Acks,
    ) {
        let node = Arc::new(Listened {
            notifier: Mutex::new(own_pool(&options, self.budget.timeout())),
            address,
            home,
            options,
            stop: self.stop.child_token(),
        });
        {
            let _telling = self.telling.lock().await;
            self.heard().caught_up.insert(node.address.clone(), None);
            self.nodes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(node.clone());
        }
        tokio::spawn(self.clone().listen(node, acks.clone()));
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

    /// The listening side of one node: keeps a LISTEN connection, applies
    /// what it hears, says `Lost` whenever the connection fails or goes
    /// quiet, then connects again with a growing pause.
    async fn listen(self: Arc<Self>, node: Arc<Listened>, acks: Acks) {
        let mut pause = Duration::from_millis(100);
        loop {
            // A new pool each time: a dropped listener's connection may hang
            // in its UNLISTEN, and must not be the next listener's.
            let pool = own_pool(&node.options, self.budget.timeout());
            let connect = tokio::time::timeout(self.budget.timeout(), async {
                let mut listener = PgListener::connect_with(&pool).await?;
                listener.ignore_pool_close_event(true);
                let channel = self.channel(&pool).await?;
                listener.listen(&channel).await?;
                Ok::<_, sqlx::Error>(listener)
            });
            let listener = tokio::select! {
                () = node.stop.cancelled() => return,
                listener = connect => listener,
            };
            match listener {
                Ok(Ok(mut listener)) => {
                    pause = Duration::from_millis(100);
                    let since = Instant::now();
                    self.heard()
                        .listening_since
                        .insert(node.address.clone(), since);
                    let mut own_heard = since;
                    loop {
                        let quiet = tokio::time::Instant::from_std(own_heard + WATCHDOG);
                        let received = tokio::select! {
                            () = node.stop.cancelled() => return,
                            received = tokio::time::timeout_at(quiet, listener.try_recv()) => received,
                        };
                        let payload = match received {
                            Ok(Ok(Some(notification))) => notification.payload().to_owned(),
                            Ok(Ok(None) | Err(_)) => {
                                tracing::warn!(
                                    host = %node.address.0, port = node.address.1,
                                    "lost the connection that listens for purges; reconnecting"
                                );
                                break;
                            }
                            Err(_) => {
                                tracing::warn!(
                                    host = %node.address.0, port = node.address.1,
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
                        self.hear(&node, &payload, &acks).await;
                    }
                }
                Ok(Err(error)) => tracing::debug!(%error, "cannot listen for purges yet"),
                Err(_) => tracing::debug!("cannot listen for purges yet: timed out"),
            }
            {
                let _telling = self.telling.lock().await;
                {
                    let mut heard = self.heard();
                    heard.listening_since.remove(&node.address);
                    if let Some(sent) = heard.caught_up.get_mut(&node.address) {
                        *sent = None;
                    }
                }
                self.tell(|| PurgeEvent::Lost).await;
            }
            drop(pool);
            tokio::select! {
                () = node.stop.cancelled() => return,
                () = tokio::time::sleep(pause) => {}
            }
            pause = (pause * 2).min(Duration::from_secs(5));
        }
    }

    /// Applies one notification heard on `node`, in the order the node's
    /// channel delivered it.
    async fn hear(&self, node: &Arc<Listened>, payload: &str, acks: &Acks) {
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
                    let replicas = heard.replicas.entry(node.address.clone()).or_default();
                    if cached {
                        replicas.insert(from, now);
                    }
                    if from == self.replica {
                        replicas.retain(|_, at| *at + BOUND * 2 > now);
                    }
                }
                // A heartbeat sent before a cache subscribed vouches for
                // nothing: no purge waited for its sender.
                if from == self.replica && cached {
                    let _telling = self.telling.lock().await;
                    let caught_up = {
                        let mut heard = self.heard();
                        if let Some(at) = heard.caught_up.get_mut(&node.address) {
                            *at = Some(at.map_or(sent, |at| at.max(sent)));
                        }
                        heard.caught_up()
                    };
                    if let Some(sent) = caught_up {
                        self.tell(|| PurgeEvent::CaughtUp(self.base + sent)).await;
                    }
                }
            }
            Notice::Purged {
                purger,
                seq,
                namespace,
                key,
            } => {
                if purger == self.replica {
                    self.roster(seq, &node.address);
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
                let _ = acks.send((applied, ack, node.clone()));
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

    /// This replica's purge `seq` has just been heard on the node at
    /// `address`, the one it ran on: every notification committed there
    /// before it has been too. The replicas heard there, or at the home,
    /// within [`BOUND`] before now are the ones that may still answer from
    /// memory (one heard at the home but not there, not listening there yet,
    /// never acknowledges, and the purge waits the bound); if this listener
    /// was not listening through all of that window, it may have missed one,
    /// and the purge waits the bound.
    fn roster(&self, seq: u64, address: &Address) {
        let now = Instant::now();
        let mut heard = self.heard();
        let whole_window = heard
            .listening_since
            .get(address)
            .is_some_and(|since| *since + BOUND <= now);
        let mut nodes = vec![address];
        nodes.extend(heard.home.as_ref().filter(|home| *home != address));
        let roster: HashSet<u64> = nodes
            .into_iter()
            .filter_map(|node| heard.replicas.get(node))
            .flatten()
            .filter(|&(_, &at)| at + BOUND >= now)
            .map(|(&replica, _)| replica)
            .collect();
        if let Some(waiting) = heard.waiting.get_mut(&seq) {
            waiting.roster = whole_window.then_some(roster);
            waiting.check();
        }
    }

    /// Sends a notification through a node's notifier connection; a failed
    /// one replaces that connection for the next.
    async fn notify(&self, node: &Listened, operation: &'static str, payload: String) {
        let pool = node
            .notifier
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
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
            *node.notifier.lock().unwrap_or_else(|e| e.into_inner()) =
                own_pool(&node.options, self.budget.timeout());
        }
    }

    /// One heartbeat every second on every node, carrying when it was
    /// sent. A failed one only lets the cache's freshness lapse.
    async fn send_heartbeats(self: Arc<Self>) {
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
            let nodes = self.nodes();
            futures_util::future::join_all(
                nodes
                    .iter()
                    .map(|node| self.notify(node, "heartbeat", payload.clone())),
            )
            .await;
        }
    }

    /// Acknowledges each purge heard, once every cache here has forgotten
    /// its key, on the node it was heard on.
    async fn send_acks(self: Arc<Self>, mut queue: mpsc::UnboundedReceiver<Ack>) {
        loop {
            let (applied, ack, node) = tokio::select! {
                () = self.stop.cancelled() => return,
                next = queue.recv() => match next {
                    Some(next) => next,
                    None => return,
                },
            };
            for notify in applied {
                notify.notified().await;
            }
            self.notify(&node, "purge_ack", ack).await;
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
