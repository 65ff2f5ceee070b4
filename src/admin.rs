//! The operator's command line, in the same binary: `get`, `purge` and
//! `stats`, talking to the database named by the configuration (the same
//! DATABASE_URL as the servers), and `token`, which makes bearer tokens for
//! the access policy. Purge is also the `Purge` RPC, for tooling that talks to
//! a running server instead.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use crate::access;
use crate::domain::{Key, Marker, Namespace, Purged, Record, RecordState};
use crate::lifecycle::{Inspection, Lifecycle};
use crate::store::{Operations, Store, StoreStats};

fn state_name(state: Option<RecordState>) -> &'static str {
    match state {
        None => "absent",
        Some(RecordState::InProgress) => "in_progress",
        Some(RecordState::Completed) => "completed",
        Some(RecordState::Released) => "released",
    }
}

fn when(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

/// Seconds only: operators read ages, not microseconds.
fn age(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_secs(d.as_secs()))
}

/// `token`: a new token and the policy line holding its hash. `token --hash`:
/// the hash of the token on stdin (its first line).
pub fn token(hash_stdin: bool) -> anyhow::Result<String> {
    if hash_stdin {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        let token = line.trim_end_matches(['\r', '\n']);
        anyhow::ensure!(!token.is_empty(), "no token on stdin");
        return Ok(format!("{}\n", access::hash_token(token)));
    }
    let token = access::new_token();
    Ok(format!(
        "token:  {token}\npolicy: token_hashes = [\"{}\"]\n",
        access::hash_token(&token)
    ))
}

/// `get NAMESPACE KEY`: the record as `key: value` lines.
pub async fn get<S: Store>(
    lifecycle: &Lifecycle<S>,
    namespace: String,
    key: String,
) -> anyhow::Result<String> {
    let found = lifecycle
        .get(Namespace::parse(namespace)?, Key::parse(key)?)
        .await?;
    Ok(match found {
        Inspection::Live(record) => describe_record(Some(&record)),
        Inspection::Remembered(marker) => describe_marker(&marker),
        Inspection::Absent => describe_record(None),
    })
}

/// A remembered key: what its marker keeps.
pub fn describe_marker(marker: &Marker) -> String {
    let mut out = String::new();
    out.push_str(
        "state: remembered (completed; its result expired)
",
    );
    let _ = writeln!(out, "fencing_token: {}", marker.fencing_token);
    let _ = writeln!(out, "fingerprint: {}", hex(marker.fingerprint.as_ref()));
    let _ = writeln!(out, "completed_at: {}", when(marker.completed_at));
    let _ = writeln!(out, "expired_at: {}", when(marker.expired_at));
    let _ = writeln!(out, "remembered_until: {}", when(marker.remembered_until));
    out
}

fn hex(fingerprint: Option<&crate::domain::Fingerprint>) -> String {
    fingerprint
        .map(|f| f.as_bytes().iter().map(|b| format!("{b:02x}")).collect())
        .unwrap_or_default()
}

pub fn describe_record(record: Option<&Record>) -> String {
    let mut out = String::new();
    let Some(record) = record else {
        out.push_str("state: absent\n");
        return out;
    };
    let _ = writeln!(out, "state: {}", state_name(Some(record.state)));
    let _ = writeln!(out, "fencing_token: {}", record.fencing_token);
    let _ = writeln!(out, "fingerprint: {}", hex(record.fingerprint.as_ref()));
    if let Some(response) = &record.response {
        let _ = writeln!(out, "response_bytes: {}", response.len());
        if let Ok(text) = std::str::from_utf8(response) {
            let _ = writeln!(out, "response: {text}");
        }
    }
    if let Some(t) = record.lease_expires_at {
        let _ = writeln!(out, "lease_expires_at: {}", when(t));
    }
    let _ = writeln!(out, "expires_at: {}", when(record.expires_at));
    let _ = writeln!(out, "created_at: {}", when(record.created_at));
    let _ = writeln!(out, "updated_at: {}", when(record.updated_at));
    out
}

/// `purge NAMESPACE KEY`: expire the record now; logged with the reason.
pub async fn purge<S: Store>(
    lifecycle: &Lifecycle<S>,
    namespace: String,
    key: String,
    reason: &str,
) -> anyhow::Result<String> {
    let namespace = Namespace::parse(namespace)?;
    let key = Key::parse(key)?;
    let previous = lifecycle.purge(namespace.clone(), key.clone()).await?;
    let was = match previous {
        Some(Purged::Live(state)) => state_name(Some(state)),
        Some(Purged::Remembered) => "remembered",
        None => "absent",
    };
    tracing::warn!(
        namespace = namespace.as_str(),
        key = key.as_str(),
        previous_state = was,
        reason,
        source = "command line",
        "key purged"
    );
    Ok(match previous {
        Some(_) => format!("purged (was {was}): the key is claimable again\n"),
        None => "nothing to purge: no unexpired record\n".to_owned(),
    })
}

/// `stats`: records by state and namespace, the oldest, the reaper's lag.
pub async fn stats<S: Operations>(store: &S) -> anyhow::Result<String> {
    Ok(describe_stats(&store.stats().await?))
}

pub fn describe_stats(stats: &StoreStats) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "records: in_progress {} completed {} released {} expired (awaiting the reaper) {}",
        stats.count(RecordState::InProgress),
        stats.count(RecordState::Completed),
        stats.count(RecordState::Released),
        stats.expired
    );
    let _ = writeln!(
        out,
        "remembered keys (markers, no result): {}",
        stats.remembered_total()
    );
    match stats.oldest_created_at {
        Some(t) => {
            let _ = writeln!(
                out,
                "oldest record: created {} ({} ago)",
                when(t),
                age(stats.now.duration_since(t).unwrap_or_default())
            );
        }
        None => out.push_str("oldest record: none\n"),
    }
    let _ = writeln!(out, "reaper lag: {}", age(stats.reaper_lag()));
    if !stats.live.is_empty() {
        let width = stats
            .live
            .iter()
            .map(|c| c.namespace.len())
            .max()
            .unwrap_or(9)
            .max(9);
        let _ = writeln!(
            out,
            "{:width$}  {:12}  {:>10}",
            "namespace", "state", "records"
        );
        for count in &stats.live {
            let _ = writeln!(
                out,
                "{:width$}  {:12}  {:>10}",
                count.namespace,
                state_name(Some(count.state)),
                count.count
            );
        }
    }
    out
}
