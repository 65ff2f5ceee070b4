//! Where a key lives on Citus: the shard map, and the grouping of a batch's
//! keys by the worker that holds them, so that each group goes as one
//! delegated call (the `idempotency_routed_*` functions of the migration
//! `20261207000001_citus_routed_batches`).
//!
//! Citus places a row by the hash of its distribution column (`key`), which
//! for text is PostgreSQL's `hashtext`: [`hashtext`] is the same function, so
//! a key's shard is found here without a round trip. The map of each
//! shard's hash range to the worker holding it comes from the coordinator's
//! catalogue (`pg_dist_shard`, `pg_dist_placement`), read when the store
//! first needs it and again every [`REFRESH_EVERY`].
//!
//! The same read gives each node group's address (`pg_dist_node`), which
//! nodes.rs opens pools to, so that a group's call goes straight to the node
//! holding its keys.
//!
//! The map only decides how keys are grouped and where a call is sent,
//! never what a statement does: each group's call is routed by Citus by one
//! of its keys, and a key the map placed wrongly (a shard moved since the
//! last read) is still found by the node, through Citus, at the cost of a
//! hop.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use sqlx::postgres::PgPool;

use super::nodes::Node;
use super::sql::{CITUS_NODES, CITUS_SHARD_MAP};

/// How old the shard map may get before a batch asks for a fresh one (read
/// in the background: the batch goes on with the map it has). A shard moved
/// by a rebalance costs its keys one hop until then.
pub(super) const REFRESH_EVERY: Duration = Duration::from_secs(10);

/// PostgreSQL's `hashtext` (`hash_bytes` of src/common/hashfn.c, Bob
/// Jenkins's lookup3 as PostgreSQL has it, little-endian), which Citus uses
/// to place a text key: `worker_hash(key) = hashtext(key)`.
pub fn hashtext(bytes: &[u8]) -> i32 {
    fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
        *a = a.wrapping_sub(*c);
        *a ^= c.rotate_left(4);
        *c = c.wrapping_add(*b);
        *b = b.wrapping_sub(*a);
        *b ^= a.rotate_left(6);
        *a = a.wrapping_add(*c);
        *c = c.wrapping_sub(*b);
        *c ^= b.rotate_left(8);
        *b = b.wrapping_add(*a);
        *a = a.wrapping_sub(*c);
        *a ^= c.rotate_left(16);
        *c = c.wrapping_add(*b);
        *b = b.wrapping_sub(*a);
        *b ^= a.rotate_left(19);
        *a = a.wrapping_add(*c);
        *c = c.wrapping_sub(*b);
        *c ^= b.rotate_left(4);
        *b = b.wrapping_add(*a);
    }
    fn finish(a: &mut u32, b: &mut u32, c: &mut u32) {
        *c ^= *b;
        *c = c.wrapping_sub(b.rotate_left(14));
        *a ^= *c;
        *a = a.wrapping_sub(c.rotate_left(11));
        *b ^= *a;
        *b = b.wrapping_sub(a.rotate_left(25));
        *c ^= *b;
        *c = c.wrapping_sub(b.rotate_left(16));
        *a ^= *c;
        *a = a.wrapping_sub(c.rotate_left(4));
        *b ^= *a;
        *b = b.wrapping_sub(a.rotate_left(14));
        *c ^= *b;
        *c = c.wrapping_sub(b.rotate_left(24));
    }
    let word = |k: &[u8]| u32::from_le_bytes([k[0], k[1], k[2], k[3]]);
    let init = 0x9e37_79b9_u32
        .wrapping_add(bytes.len() as u32)
        .wrapping_add(3_923_095);
    let (mut a, mut b, mut c) = (init, init, init);
    let mut k = bytes;
    while k.len() >= 12 {
        a = a.wrapping_add(word(&k[0..]));
        b = b.wrapping_add(word(&k[4..]));
        c = c.wrapping_add(word(&k[8..]));
        mix(&mut a, &mut b, &mut c);
        k = &k[12..];
    }
    // The last 0 to 11 bytes, as little-endian words of a zero-padded block;
    // the lowest byte of c is left for the length.
    let mut tail = [0u8; 12];
    tail[..k.len()].copy_from_slice(k);
    a = a.wrapping_add(word(&tail[0..]));
    b = b.wrapping_add(word(&tail[4..]));
    c = c.wrapping_add(u32::from_le_bytes([0, tail[8], tail[9], tail[10]]));
    finish(&mut a, &mut b, &mut c);
    c as i32
}

/// Each shard's hash range and the node group (worker) holding it, by the
/// range's start, and each group's primary.
#[derive(Debug, Default)]
pub(super) struct ShardMap {
    ranges: Vec<(i32, i32, i32)>,
    nodes: Vec<Node>,
}

impl ShardMap {
    /// Two made-up workers, one for each half of the hash range (Citus's
    /// statements on plain PostgreSQL, in the tests).
    pub(super) fn halves() -> Self {
        Self {
            ranges: vec![(i32::MIN, -1, 1), (0, i32::MAX, 2)],
            nodes: Vec::new(),
        }
    }

    /// The map from the catalogue's rows: (shardminvalue, shardmaxvalue,
    /// groupid); rows that are not a hash range are left out. `nodes` are
    /// (groupid, nodename, nodeport).
    fn from_rows(rows: Vec<(String, String, i32)>, nodes: Vec<(i32, String, i32)>) -> Self {
        let mut ranges: Vec<(i32, i32, i32)> = rows
            .into_iter()
            .filter_map(|(min, max, group)| Some((min.parse().ok()?, max.parse().ok()?, group)))
            .collect();
        ranges.sort_unstable();
        let nodes = nodes
            .into_iter()
            .filter_map(|(group, host, port)| {
                Some(Node {
                    group,
                    host,
                    port: u16::try_from(port).ok()?,
                })
            })
            .collect();
        Self { ranges, nodes }
    }

    /// The primary of node group `group`, when the map knows it.
    pub(super) fn node(&self, group: i32) -> Option<&Node> {
        self.nodes.iter().find(|node| node.group == group)
    }

    /// The node group holding `key`'s shard, when the map knows it.
    pub(super) fn group_of(&self, key: &str) -> Option<i32> {
        let hash = hashtext(key.as_bytes());
        let at = self.ranges.partition_point(|&(min, _, _)| min <= hash);
        let &(min, max, group) = self.ranges.get(at.checked_sub(1)?)?;
        (min <= hash && hash <= max).then_some(group)
    }
}

/// The store's shard map, read in the background when it is missing or old.
#[derive(Default)]
pub(super) struct Shards {
    map: RwLock<Option<(Instant, Arc<ShardMap>)>>,
    reading: AtomicBool,
}

impl Shards {
    /// The map as it is (`None` before the first read), asking for a fresh
    /// one when it is missing or older than [`REFRESH_EVERY`].
    pub(super) fn current(self: &Arc<Self>, pool: &PgPool) -> Option<Arc<ShardMap>> {
        let map = self.map.read().unwrap_or_else(|e| e.into_inner()).clone();
        let fresh = map
            .as_ref()
            .is_some_and(|(read_at, _)| read_at.elapsed() < REFRESH_EVERY);
        if !fresh && !self.reading.swap(true, Ordering::AcqRel) {
            let shards = self.clone();
            let pool = pool.clone();
            tokio::spawn(async move {
                let read_at = Instant::now();
                let read = async {
                    let rows = sqlx::query_as(CITUS_SHARD_MAP).fetch_all(&pool).await?;
                    let nodes = sqlx::query_as(CITUS_NODES).fetch_all(&pool).await?;
                    Ok::<_, sqlx::Error>((rows, nodes))
                };
                match read.await {
                    Ok((rows, nodes)) => {
                        let map = Arc::new(ShardMap::from_rows(rows, nodes));
                        *shards.map.write().unwrap_or_else(|e| e.into_inner()) =
                            Some((read_at, map));
                    }
                    Err(error) => {
                        tracing::debug!(%error, "reading Citus's shard map failed; asked again at the next batch")
                    }
                }
                shards.reading.store(false, Ordering::Release);
            });
        }
        map.map(|(_, map)| map)
    }
}

/// Splits `order` (positions of a batch's items, in key order) into groups
/// by the node group holding each key (`key_of`), keeping key order within
/// each group. Keys the map does not place form a group of their own; no map
/// at all makes one group.
pub(super) fn group_by_worker<'a>(
    map: Option<&ShardMap>,
    order: &[usize],
    key_of: impl Fn(usize) -> &'a str,
) -> Vec<Vec<usize>> {
    let Some(map) = map else {
        return vec![order.to_vec()];
    };
    let mut groups: Vec<(Option<i32>, Vec<usize>)> = Vec::new();
    for &i in order {
        let group = map.group_of(key_of(i));
        match groups.iter_mut().find(|(g, _)| *g == group) {
            Some((_, items)) => items.push(i),
            None => groups.push((group, vec![i])),
        }
    }
    groups.into_iter().map(|(_, items)| items).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values read from PostgreSQL 15 (`SELECT hashtext(k)`), and from a
    /// Citus 12.1 coordinator (`worker_hash(k::text)`, the same values);
    /// tests/shard_hash.rs compares many more against a live PostgreSQL.
    #[test]
    fn hashtext_is_postgresqls() {
        assert_eq!(hashtext(b"abc"), -785_388_649);
        assert_eq!(hashtext(b"evt-000001"), -714_563_905);
        assert_eq!(hashtext(b"a"), 1_075_015_857);
        assert_eq!(hashtext(b"b"), -68_821_088);
    }

    #[test]
    fn keys_are_grouped_by_their_shards_worker_in_key_order() {
        let map = ShardMap::from_rows(
            vec![
                ("-2147483648".into(), "-1".into(), 1),
                ("0".into(), "2147483647".into(), 2),
            ],
            vec![(1, "w1".into(), 5432), (2, "w2".into(), 5433)],
        );
        assert_eq!(
            map.node(2).map(|n| (n.host.as_str(), n.port)),
            Some(("w2", 5433))
        );
        assert_eq!(map.node(3), None);
        let keys = ["a", "b", "c", "d", "e", "f"];
        let groups = group_by_worker(Some(&map), &[0, 1, 2, 3, 4, 5], |i| keys[i]);
        // a, c, d, e hash at or above 0; b and f below.
        let worker = |k: &str| if hashtext(k.as_bytes()) >= 0 { 2 } else { 1 };
        for group in &groups {
            let first = worker(keys[group[0]]);
            assert!(group.iter().all(|&i| worker(keys[i]) == first));
            assert!(group.windows(2).all(|w| w[0] < w[1]));
        }
        assert_eq!(groups.iter().map(Vec::len).sum::<usize>(), 6);
        assert_eq!(groups.len(), 2);
        assert_eq!(
            group_by_worker(None, &[2, 0], |i| keys[i]),
            vec![vec![2, 0]]
        );
    }
}
