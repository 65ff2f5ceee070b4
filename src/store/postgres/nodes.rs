//! On Citus, the nodes the store talks to besides the one DATABASE_URL names
//! (the entry):
//! - a pool for each node group that holds shards, so that each key's
//!   statement, and each batch's group, goes straight to the node holding the
//!   key's shard and runs there with local execution, without a hop through
//!   the entry (docs/scaling.md, "Calls from any node");
//! - the coordinator (the home), where the migrations go wherever the entry
//!   is, and which the purge feed listens on besides every other node
//!   (feed.rs).
//!
//! Which group holds a key, and each group's address, come from the shard
//! map (shards.rs). The map only decides where a statement is sent, never
//! what it does: a node that no longer holds a key's shard (a shard moved
//! since the map was read) routes the statement through Citus, at the cost
//! of the hop this saves.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use sqlx::postgres::{PgConnectOptions, PgPool};

use super::connections::Connections;
use super::sql::{CITUS_COORDINATOR, CITUS_IS_COORDINATOR, CITUS_VERSION};

/// A node group's primary, as `pg_dist_node` has it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Node {
    pub group: i32,
    pub host: String,
    pub port: u16,
}

/// A pool for each node group, the entry's included (the entry may be an
/// address that reaches any of several nodes), opened when a key of theirs
/// is first sent, and opened again when a group's address changes.
#[derive(Default)]
pub(super) struct Nodes {
    pools: RwLock<HashMap<i32, Opened>>,
}

/// A group's pool and the address (host, port) it was opened for.
type Opened = (String, u16, Arc<Connections>);

impl Nodes {
    /// The connections to `node`, opened with `open` (the entry's options at
    /// the node's address) the first time.
    pub(super) fn get(
        &self,
        node: &Node,
        open: impl FnOnce(&Node) -> Connections,
    ) -> Arc<Connections> {
        let known = |pools: &HashMap<i32, Opened>| {
            pools
                .get(&node.group)
                .filter(|(host, port, _)| *host == node.host && *port == node.port)
                .map(|(_, _, connections)| connections.clone())
        };
        if let Some(connections) = known(&self.pools.read().unwrap_or_else(|e| e.into_inner())) {
            return connections;
        }
        let mut pools = self.pools.write().unwrap_or_else(|e| e.into_inner());
        if let Some(connections) = known(&pools) {
            return connections;
        }
        let connections = Arc::new(open(node));
        // A group's old pool, if its address changed, closes when the last
        // statement on it ends.
        if let Some((_, _, old)) = pools.insert(
            node.group,
            (node.host.clone(), node.port, connections.clone()),
        ) {
            old.release_all();
        }
        connections
    }

    /// Every pool opened, to close them with the store.
    pub(super) fn all(&self) -> Vec<Arc<Connections>> {
        let pools = self.pools.read().unwrap_or_else(|e| e.into_inner());
        pools.values().map(|(_, _, c)| c.clone()).collect()
    }
}

/// Why a store whose entry is a Citus worker has no home.
const NO_COORDINATOR: &str = "DATABASE_URL names a Citus worker, and the cluster's metadata \
     (pg_dist_node) has no coordinator to run the migrations on and listen on: register \
     it on the coordinator with SELECT citus_set_coordinator_host('<host>', <port>) (see \
     docs/scaling.md, \"Calls from any node\")";

/// Where the migrations go, and the node the purge feed always listens on:
/// the coordinator, found once from the entry.
#[derive(Default)]
pub(super) struct Home {
    /// `None`: the entry is the home (plain PostgreSQL, or the coordinator).
    found: tokio::sync::OnceCell<Option<PgConnectOptions>>,
}

impl Home {
    /// The home's connection options, or `None` when it is the entry.
    pub(super) async fn options(
        &self,
        entry: &PgPool,
    ) -> Result<Option<PgConnectOptions>, sqlx::Error> {
        self.found
            .get_or_try_init(|| async {
                let mut connection = entry.acquire().await?;
                let citus: Option<String> = sqlx::query_scalar(CITUS_VERSION)
                    .fetch_optional(&mut *connection)
                    .await?;
                if citus.is_none() {
                    return Ok(None);
                }
                let coordinator: bool = sqlx::query_scalar(CITUS_IS_COORDINATOR)
                    .fetch_one(&mut *connection)
                    .await?;
                if coordinator {
                    return Ok(None);
                }
                let at: Option<(String, i32)> = sqlx::query_as(CITUS_COORDINATOR)
                    .fetch_optional(&mut *connection)
                    .await?;
                let (host, port) =
                    at.ok_or_else(|| sqlx::Error::Configuration(NO_COORDINATOR.into()))?;
                let port = u16::try_from(port)
                    .map_err(|_| sqlx::Error::Configuration(NO_COORDINATOR.into()))?;
                Ok(Some(at_node(entry, &host, port)))
            })
            .await
            .cloned()
    }
}

/// The entry's connection options (credentials, database, TLS, session
/// settings) at another node's address.
pub(super) fn at_node(entry: &PgPool, host: &str, port: u16) -> PgConnectOptions {
    entry
        .connect_options()
        .as_ref()
        .clone()
        .host(host)
        .port(port)
}
