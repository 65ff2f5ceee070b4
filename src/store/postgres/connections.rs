//! Connection keeping for the call path: statements take a connection in
//! arrival order, keep it between statements while it is known clean, and
//! stop trusting connections older than the last connection-level error (a
//! database restart), so no call fails on a connection left dead.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Connection as _, Postgres};
use tokio::sync::{Semaphore, SemaphorePermit};

/// How long a connection may go from statement to statement outside the
/// pool before it is handed back, so the pool's lifetime and idle rules still
/// reach it.
pub(super) const HOLD_FOR: Duration = Duration::from_secs(60);

/// The connections of the statements on the call path. sqlx 0.8 tests every
/// connection handed back to its pool with a round trip to the database
/// before anyone may have it again: one extra round trip per statement. A
/// connection whose statement ran to its end is in a known clean state, so
/// it is kept here instead and the next statement takes it at once. A
/// statement that failed, or was cancelled with its call, drops its
/// connection into the pool, which tests it as before.
///
/// When the database restarts, every connection opened before is dead, and
/// nothing says so until a statement is sent on it. So a connection-level
/// error anywhere (a statement's, or the health check's) makes every
/// connection older than it suspect (`Suspicion`): each is pinged before its
/// next statement, and dropped when the ping fails, so the calls after a
/// restart run on live connections.
pub(super) struct Connections {
    pub(super) pool: PgPool,
    /// One permit per connection the pool may open: statements wait here in
    /// arrival order, whether their connection then comes from `kept` or
    /// from the pool.
    pub(super) permits: Semaphore,
    /// Each kept connection, when it left the pool, and when it was last
    /// known to be alive (a statement or a ping ran on it).
    pub(super) kept: std::sync::Mutex<Vec<(PoolConnection<Postgres>, Instant, Instant)>>,
    pub(super) suspicion: Arc<Suspicion>,
    /// A Citus node's connections only (`fail_fast`): while the node could
    /// not be reached, a statement that needs a new connection checks first
    /// that the node accepts TCP connections, and fails at once when it does
    /// not, instead of waiting out the pool's acquire timeout (sqlx retries
    /// a refused connection until then). So a batch whose keys live on a
    /// worker that is down fails that worker's group at once, and the other
    /// workers' keys are not held up by it.
    pub(super) unreachable: Option<Unreachable>,
}

/// How long a TCP connection to a node found unreachable may take before
/// the node counts as still down (the check runs only after a failure).
const REACH_CHECK: Duration = Duration::from_millis(200);

/// Whether a node was found unreachable at its last attempt, and where it is.
pub(super) struct Unreachable {
    address: (String, u16),
    down: std::sync::atomic::AtomicBool,
}

impl Unreachable {
    /// For the node the pool connects to; `None` for a Unix socket.
    pub(super) fn of(pool: &PgPool) -> Option<Self> {
        let options = pool.connect_options();
        let host = options.get_host();
        if host.starts_with('/') {
            return None;
        }
        Some(Self {
            address: (host.to_owned(), options.get_port()),
            down: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Whether to try the pool: yes, unless the node was down at its last
    /// attempt and refuses (or does not answer) a TCP connection now.
    async fn worth_trying(&self) -> bool {
        if !self.down.load(std::sync::atomic::Ordering::Acquire) {
            return true;
        }
        let (host, port) = &self.address;
        matches!(
            tokio::time::timeout(
                REACH_CHECK,
                tokio::net::TcpStream::connect((host.as_str(), *port))
            )
            .await,
            Ok(Ok(_))
        )
    }

    fn found(&self, down: bool) {
        self.down.store(down, std::sync::atomic::Ordering::Release);
    }
}

/// The last moment a connection-level error was seen: a connection last
/// known alive before it may be dead.
pub(super) struct Suspicion {
    base: Instant,
    /// Nanoseconds from `base` to the last error, plus one; 0: none yet.
    since: std::sync::atomic::AtomicU64,
}

impl Suspicion {
    pub(super) fn new() -> Self {
        Self {
            base: Instant::now(),
            since: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// From now on, connections last known alive before now are suspect.
    pub(super) fn raise(&self) {
        let now = self.base.elapsed().as_nanos() as u64 + 1;
        self.since
            .fetch_max(now, std::sync::atomic::Ordering::AcqRel);
    }

    /// Whether a connection last known alive at `alive` must be checked.
    pub(super) fn covers(&self, alive: Instant) -> bool {
        match self.since.load(std::sync::atomic::Ordering::Acquire) {
            0 => false,
            since => alive <= self.base + Duration::from_nanos(since - 1),
        }
    }
}

impl Connections {
    pub(super) async fn take(&self) -> Result<Held<'_>, sqlx::Error> {
        let permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| sqlx::Error::PoolClosed)?;
        loop {
            let kept = self.kept.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some((mut connection, since, alive)) = kept else {
                if let Some(unreachable) = &self.unreachable
                    && !unreachable.worth_trying().await
                {
                    return Err(sqlx::Error::PoolTimedOut);
                }
                // The pool checks its own (see `before_acquire`).
                let connection = match self.pool.acquire().await {
                    Ok(connection) => connection,
                    Err(error) => {
                        if let Some(unreachable) = &self.unreachable {
                            unreachable.found(matches!(
                                error,
                                sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)
                            ));
                        }
                        return Err(error);
                    }
                };
                if let Some(unreachable) = &self.unreachable {
                    unreachable.found(false);
                }
                let now = Instant::now();
                return Ok(Held {
                    connection: Some((connection, now)),
                    owner: self,
                    _permit: permit,
                });
            };
            if self.suspicion.covers(alive) && connection.ping().await.is_err() {
                // Dead: closed when dropped; try the next one.
                continue;
            }
            return Ok(Held {
                connection: Some((connection, since)),
                owner: self,
                _permit: permit,
            });
        }
    }

    /// A statement found its connection dead: every connection older is
    /// suspect, and a Citus node's next new connection is checked first.
    pub(super) fn lost(&self) {
        self.suspicion.raise();
        if let Some(unreachable) = &self.unreachable {
            unreachable.found(true);
        }
    }

    pub(super) fn kept(&self) -> usize {
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Hands every kept connection back to the pool (to close it).
    pub(super) fn release_all(&self) {
        self.permits.close();
        self.kept.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// The connections a statement goes on: the entry's, borrowed from the
/// store, or a Citus node's (nodes.rs), held for the statement.
pub(super) enum Route<'a> {
    Entry(&'a Connections),
    Node(Arc<Connections>),
}

impl std::ops::Deref for Route<'_> {
    type Target = Connections;
    fn deref(&self) -> &Connections {
        match self {
            Self::Entry(connections) => connections,
            Self::Node(connections) => connections,
        }
    }
}

/// A connection taken for one statement. Dropped without `keep`, it goes
/// back to the pool, which tests it.
pub(super) struct Held<'a> {
    connection: Option<(PoolConnection<Postgres>, Instant)>,
    owner: &'a Connections,
    _permit: SemaphorePermit<'a>,
}

impl Held<'_> {
    /// The statement ran to its end: keep the connection for the next one.
    pub(super) fn keep(mut self) {
        if let Some((connection, since)) = self.connection.take()
            && since.elapsed() < HOLD_FOR
            && !self.owner.permits.is_closed()
        {
            self.owner
                .kept
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((connection, since, Instant::now()));
        }
    }
}

impl std::ops::Deref for Held<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        &self.connection.as_ref().expect("held until dropped").0
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.connection.as_mut().expect("held until dropped").0
    }
}

/// Runs one statement on a held connection: `held!(store, |conn| query...
/// .fetch_one(conn))`, inside `Budget::run`, on the store's entry
/// connections; `held!(on connections, …)` on other ones (a Citus node's).
///
/// A statement whose connection turned out to be dead is sent once more, on
/// a connection checked first: the database restarted since the connection
/// was last used, and the caller must not pay for it. Sending it again is
/// safe whether or not the first one took effect, because every statement on
/// the call path is answered through the lifecycle, which reads what a
/// repeat finds: a Claim finds its own lease token (a retried Claim), a
/// Complete or Release finds its own token on the completed or released
/// record, a read reads. `held!(once on connections, …)` sends it once
/// (Purge, whose answer says whether it found a record).
macro_rules! held {
    (once on $connections:expr, |$conn:ident| $statement:expr) => {
        async {
            let connections: &$crate::store::postgres::connections::Connections = &$connections;
            let mut held = connections.take().await?;
            let $conn = &mut *held;
            match $statement.await {
                Ok(result) => {
                    held.keep();
                    Ok::<_, sqlx::Error>(result)
                }
                Err(error) => {
                    if $crate::store::postgres::sqlstate::connection_lost(&error) {
                        connections.lost();
                    }
                    Err(error)
                }
            }
        }
    };
    (on $connections:expr, |$conn:ident| $statement:expr) => {
        async {
            let connections: &$crate::store::postgres::connections::Connections = &$connections;
            let mut again = true;
            loop {
                let mut held = connections.take().await?;
                let $conn = &mut *held;
                match $statement.await {
                    Ok(result) => {
                        held.keep();
                        break Ok::<_, sqlx::Error>(result);
                    }
                    Err(error) if $crate::store::postgres::sqlstate::connection_lost(&error) => {
                        connections.lost();
                        if !std::mem::take(&mut again) {
                            break Err(error);
                        }
                    }
                    Err(error) => break Err(error),
                }
            }
        }
    };
    ($store:expr, |$conn:ident| $statement:expr) => {
        held!(on $store.connections, |$conn| $statement)
    };
}

pub(super) use held;
