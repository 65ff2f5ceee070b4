//! The purge feed: the NOTIFY a purge sends with its commit, the replica's
//! LISTEN connection (outside the pool), and the heartbeats that vouch,
//! in commit order, that nothing was missed. The replay cache follows it.

use std::time::{Duration, Instant};

use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::domain::{Key, Namespace};
use crate::store::{Budget, PurgeEvent};

/// The name of the channel purges are announced on, as an SQL expression:
/// one per schema, so that deployments (or tests) sharing a database but not
/// a table do not hear each other. Channel names are at most 63 bytes, hence
/// the digest.
macro_rules! purges_channel {
    () => {
        "'idempotency_purges_' || left(md5(current_schema()), 16)"
    };
}

/// Expires a record now: it is absent to every call from this statement on.
/// The notification goes out with the purge's commit, and only then, to
/// every replica listening on the purges channel (their replay caches drop
/// the key). Its payload is the namespace's length in bytes, a colon, the
/// namespace and the key.
pub(super) const PURGE: &str = concat!(
    "
WITH purged AS (
    UPDATE idempotency_records
    SET expires_at = now(), lease_expires_at = NULL, updated_at = now()
    WHERE namespace = $1 AND key = $2 AND expires_at > now()
    RETURNING state)
SELECT p.state
FROM purged AS p
CROSS JOIN LATERAL (
    SELECT pg_notify(",
    purges_channel!(),
    ", octet_length($1)::text || ':' || $1 || $2)) AS told"
);

/// The purges channel's name, for LISTEN.
pub(super) const PURGES_CHANNEL: &str = concat!("SELECT ", purges_channel!());

/// A heartbeat on the purges channel: the payload `hb:<replica>:<sent>`
/// comes back to the replica that sent it after every notification
/// committed before it.
pub(super) const HEARTBEAT: &str = concat!("SELECT pg_notify(", purges_channel!(), ", $1)");

/// How often a replica sends itself a heartbeat on the purges channel.
pub(super) const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);

/// The feed's listening side: forwards purges and this replica's own
/// heartbeats, and says `Lost` whenever its connection fails (then connects
/// again, with a growing pause).
pub(super) async fn listen_for_purges(
    pool: PgPool,
    events: mpsc::Sender<PurgeEvent>,
    replica: u64,
    base: Instant,
    stop: CancellationToken,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        let connect = async {
            let mut listener = PgListener::connect_with(&pool).await?;
            listener.ignore_pool_close_event(true);
            let channel: String = sqlx::query_scalar(PURGES_CHANNEL)
                .fetch_one(&mut listener)
                .await?;
            listener.listen(&channel).await?;
            Ok::<_, sqlx::Error>(listener)
        };
        let listener = tokio::select! {
            () = stop.cancelled() => return,
            listener = connect => listener,
        };
        match listener {
            Ok(mut listener) => {
                pause = Duration::from_millis(100);
                loop {
                    let received = tokio::select! {
                        () = stop.cancelled() => return,
                        received = listener.try_recv() => received,
                    };
                    let event = match received {
                        Ok(Some(notification)) => {
                            match feed_event(notification.payload(), replica, base) {
                                Some(event) => event,
                                None => continue,
                            }
                        }
                        Ok(None) | Err(_) => break,
                    };
                    if events.send(event).await.is_err() {
                        return;
                    }
                }
                tracing::warn!("lost the connection that listens for purges; reconnecting");
            }
            Err(error) => {
                tracing::debug!(%error, "cannot listen for purges yet");
            }
        }
        if events.send(PurgeEvent::Lost).await.is_err() {
            return;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(5));
    }
}

/// Reads one notification of the purges channel: a purge (from any replica), this
/// replica's heartbeat, or another replica's heartbeat (`None`, as is
/// anything unreadable, which no version of this service sends).
pub(super) fn feed_event(payload: &str, replica: u64, base: Instant) -> Option<PurgeEvent> {
    if let Some(heartbeat) = payload.strip_prefix("hb:") {
        let (from, sent) = heartbeat.split_once(':')?;
        if u64::from_str_radix(from, 16).ok()? != replica {
            return None;
        }
        let sent = Duration::from_micros(sent.parse().ok()?);
        return Some(PurgeEvent::CaughtUp(base + sent));
    }
    let (length, rest) = payload.split_once(':')?;
    let length: usize = length.parse().ok()?;
    if !rest.is_char_boundary(length) {
        return None;
    }
    let (namespace, key) = rest.split_at(length);
    let namespace = Namespace::parse(namespace.to_owned()).ok()?;
    let key = Key::parse(key.to_owned()).ok()?;
    Some(PurgeEvent::Purged(namespace, key))
}

/// The feed's heartbeats: one NOTIFY every second, carrying when it was
/// sent, through the pool's reserve connection.
pub(super) async fn send_heartbeats(
    pool: PgPool,
    budget: Budget,
    replica: u64,
    base: Instant,
    stop: CancellationToken,
) {
    let mut every = tokio::time::interval(HEARTBEAT_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        let sent = base.elapsed().as_micros();
        let payload = format!("hb:{replica:x}:{sent}");
        let notify = sqlx::query(HEARTBEAT).bind(payload).execute(&pool);
        // A failed heartbeat only lets the cache's freshness lapse.
        let _ = budget.run("heartbeat", notify).await;
    }
}

/// Starts the feed: a listener on a pool of one connection of its own (sqlx's
/// listener keeps the connection it takes, which would otherwise be the
/// calls' pool's spare, the one health and the reaper rely on), and a
/// heartbeat every second through `pool`.
pub(super) fn start(
    pool: &PgPool,
    budget: &Budget,
    stop: &CancellationToken,
) -> mpsc::Receiver<PurgeEvent> {
    let (events, feed) = mpsc::channel(1024);
    let replica: u64 = rand::random();
    let base = Instant::now();
    let own = PgPoolOptions::new()
        .max_connections(1)
        .min_connections(0)
        .acquire_timeout(budget.timeout())
        .connect_lazy_with(pool.connect_options().as_ref().clone());
    tokio::spawn(listen_for_purges(own, events, replica, base, stop.clone()));
    tokio::spawn(send_heartbeats(
        pool.clone(),
        budget.clone(),
        replica,
        base,
        stop.clone(),
    ));
    feed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_purge_notification_names_its_key_whatever_the_key_holds() {
        let base = Instant::now();
        let event = feed_event("5:shöpa:b:c", 7, base);
        let Some(PurgeEvent::Purged(namespace, key)) = event else {
            panic!("expected a purge, got {event:?}");
        };
        assert_eq!((namespace.as_str(), key.as_str()), ("shöp", "a:b:c"));
        assert!(feed_event("9:short", 7, base).is_none());
        assert!(feed_event("1:\u{e9}x", 7, base).is_none());
    }

    #[test]
    fn only_this_replicas_heartbeats_vouch_for_its_cache() {
        let base = Instant::now();
        match feed_event("hb:7:1500000", 7, base) {
            Some(PurgeEvent::CaughtUp(sent)) => {
                assert_eq!(sent, base + Duration::from_millis(1500))
            }
            other => panic!("expected a heartbeat, got {other:?}"),
        }
        assert!(feed_event("hb:8:1500000", 7, base).is_none());
    }
}
