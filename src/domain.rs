//! The vocabulary of the service: validated newtypes for what callers send
//! (namespace, key, fingerprint, lease token, durations, response bodies,
//! checkpoints), the stored record, and the outcomes of each call.
//!
//! Everything here is parsed once, at the edge: a `Key` that exists is valid,
//! and nothing past the gRPC adapter checks lengths again. This module knows
//! neither tonic nor SQL.

use std::fmt;
use std::time::{Duration, SystemTime};

use crate::error::Error;

/// Longest namespace, in bytes of UTF-8.
pub const MAX_NAMESPACE_BYTES: usize = 128;
/// Longest key, in bytes of UTF-8.
pub const MAX_KEY_BYTES: usize = 512;
/// Longest payload fingerprint, in bytes (a SHA-512 digest fits).
pub const MAX_FINGERPRINT_BYTES: usize = 64;
/// Shortest lease or retention a caller may ask for. Shorter leases would
/// expire while a request is still on the wire.
pub const MIN_DURATION: Duration = Duration::from_secs(1);

/// Checks the rules shared by namespaces and keys: non-empty, bounded, no NUL
/// (NUL is the one character PostgreSQL text cannot hold, and a common way to
/// smuggle a truncated identity past a C-string API).
fn identifier(field: &'static str, value: String, max_bytes: usize) -> Result<String, Error> {
    if value.is_empty() {
        return Err(Error::invalid(field, "must not be empty"));
    }
    if value.len() > max_bytes {
        return Err(Error::invalid(
            field,
            format!("must be at most {max_bytes} bytes, got {}", value.len()),
        ));
    }
    if value.contains('\0') {
        return Err(Error::invalid(field, "must not contain a NUL character"));
    }
    Ok(value)
}

/// Groups keys, usually one per consuming service. Compared byte for byte: no
/// case folding, trimming or Unicode normalisation, because two spellings that
/// look alike may be two different tenants.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Namespace(String);

impl Namespace {
    pub fn parse(value: String) -> Result<Self, Error> {
        identifier("namespace", value, MAX_NAMESPACE_BYTES).map(Self)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An event's stable identity within its namespace, compared byte for byte.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key(String);

impl Key {
    pub fn parse(value: String) -> Result<Self, Error> {
        identifier("key", value, MAX_KEY_BYTES).map(Self)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A digest of an event's payload. Only non-empty fingerprints exist: an empty
/// one on the wire means "don't check" and parses to `None`, so a stored record
/// either has one to compare against or accepts any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(Vec<u8>);

impl Fingerprint {
    pub fn parse(value: Vec<u8>) -> Result<Option<Self>, Error> {
        if value.len() > MAX_FINGERPRINT_BYTES {
            return Err(Error::invalid(
                "fingerprint",
                format!(
                    "must be at most {MAX_FINGERPRINT_BYTES} bytes, got {}",
                    value.len()
                ),
            ));
        }
        Ok((!value.is_empty()).then_some(Self(value)))
    }

    /// Wraps bytes read back from the store, which only ever holds fingerprints
    /// that were parsed on the way in.
    pub fn from_stored(value: Vec<u8>) -> Option<Self> {
        (!value.is_empty()).then_some(Self(value))
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }

    /// The fingerprint policy: a mismatch needs a fingerprint on both sides,
    /// and different ones. An empty side means the caller opted out of the check.
    pub fn conflicts(stored: Option<&Self>, offered: Option<&Self>) -> bool {
        matches!((stored, offered), (Some(a), Some(b)) if a != b)
    }
}

/// The secret that proves a caller holds a lease: 128 random bits, written as
/// 32 lowercase hexadecimal characters. Random rather than sequential so that a
/// caller cannot complete or release a lease it was never given.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken([u8; 16]);

impl LeaseToken {
    /// A fresh token from the thread-local CSPRNG.
    pub fn generate() -> Self {
        Self(rand::random())
    }

    pub fn parse(value: &str) -> Result<Self, Error> {
        let invalid = |reason| Error::invalid("lease_token", reason);
        if value.is_empty() {
            return Err(invalid("must not be empty"));
        }
        if value.len() != 32 {
            return Err(invalid("must be 32 lowercase hexadecimal characters"));
        }
        let mut bytes = [0u8; 16];
        for (byte, pair) in bytes.iter_mut().zip(value.as_bytes().chunks_exact(2)) {
            let high = hex_value(pair[0]);
            let low = hex_value(pair[1]);
            match (high, low) {
                (Some(high), Some(low)) => *byte = high << 4 | low,
                _ => return Err(invalid("must be 32 lowercase hexadecimal characters")),
            }
        }
        Ok(Self(bytes))
    }

    pub fn from_bytes(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

impl fmt::Display for LeaseToken {
    /// One write of 32 characters: every Claim that wins sends one, and
    /// sixteen `{:02x}` writes cost more than the rest of its encoding.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut text = [0u8; 32];
        for (pair, byte) in text.chunks_exact_mut(2).zip(self.0) {
            pair[0] = HEX[usize::from(byte >> 4)];
            pair[1] = HEX[usize::from(byte & 0x0f)];
        }
        f.write_str(std::str::from_utf8(&text).map_err(|_| fmt::Error)?)
    }
}

/// Tokens are secrets: debug output never shows one.
impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("LeaseToken(..)")
    }
}

/// The server's bounds and defaults for what callers may ask for.
#[derive(Debug, Clone)]
pub struct Limits {
    pub default_lease_ttl: Duration,
    pub max_lease_ttl: Duration,
    pub default_retention: Duration,
    pub max_retention: Duration,
    pub max_response_bytes: usize,
    pub max_checkpoint_bytes: usize,
    /// The longest a Claim waits for another holder (`wait` is shortened to
    /// it).
    pub max_wait: Duration,
    /// The most Claims that wait at once in this process.
    pub max_waiters: usize,
    /// The server's remembering, for namespaces the policy file does not
    /// name.
    pub remembering: Remembering,
}

/// What a Claim of a remembered key does (a key whose completed result
/// expired, before its horizon).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateRetry {
    /// Claim it anew with the next fencing token, saying it completed
    /// before.
    Reexecute,
    /// Answer that it expired, changing nothing.
    Refuse,
}

/// How a namespace's keys are remembered past their result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Remembering {
    /// How long after its Complete a key is remembered (its horizon). Not
    /// longer than the retention: nothing is remembered past the result.
    pub remember_for: Duration,
    /// What a Claim of a remembered key does when it does not say.
    pub late_retry: LateRetry,
}

impl Remembering {
    /// The server's default: a week, re-executed (see the README: what
    /// callers saw before, with the fencing counter going on).
    pub const DEFAULT: Remembering = Remembering {
        remember_for: Duration::from_secs(7 * 24 * 3600),
        late_retry: LateRetry::Reexecute,
    };
}

/// The longest `wait` a Claim may ask for; anything above is a mistake.
pub const MAX_REQUESTED_WAIT: Duration = Duration::from_secs(3600);

impl Default for Limits {
    fn default() -> Self {
        Self {
            default_lease_ttl: Duration::from_secs(30),
            max_lease_ttl: Duration::from_secs(3600),
            default_retention: Duration::from_secs(24 * 3600),
            max_retention: Duration::from_secs(30 * 24 * 3600),
            max_response_bytes: 1024 * 1024,
            max_checkpoint_bytes: 64 * 1024,
            max_wait: Duration::from_secs(30),
            max_waiters: 512,
            remembering: Remembering::DEFAULT,
        }
    }
}

impl Limits {
    /// How long a Claim may wait: zero when unset; at most an hour (else
    /// INVALID_ARGUMENT naming `wait`), shortened to the server's maximum.
    pub fn wait(&self, requested: Option<Duration>) -> Result<Duration, Error> {
        match requested {
            None => Ok(Duration::ZERO),
            Some(wait) if wait > MAX_REQUESTED_WAIT => {
                Err(Error::invalid("wait", "must be at most 1 hour"))
            }
            Some(wait) => Ok(wait.min(self.max_wait)),
        }
    }

    /// A lease length: the default when unset, else within 1 s..=max.
    pub fn lease_ttl(&self, requested: Option<Duration>) -> Result<Duration, Error> {
        bounded("lease_ttl", requested, self.max_lease_ttl)
            .map(|ttl| ttl.unwrap_or(self.default_lease_ttl))
    }

    /// A retention on a Claim: the default when unset.
    pub fn claim_retention(&self, requested: Option<Duration>) -> Result<Duration, Error> {
        bounded("retention", requested, self.max_retention)
            .map(|retention| retention.unwrap_or(self.default_retention))
    }

    /// A retention on a Complete: `None` when unset, so that the Claim's holds.
    pub fn complete_retention(
        &self,
        requested: Option<Duration>,
    ) -> Result<Option<Duration>, Error> {
        bounded("retention", requested, self.max_retention)
    }

    pub fn response(&self, body: Vec<u8>) -> Result<Vec<u8>, Error> {
        if body.len() > self.max_response_bytes {
            return Err(Error::invalid(
                "response",
                format!(
                    "must be at most {} bytes, got {}",
                    self.max_response_bytes,
                    body.len()
                ),
            ));
        }
        Ok(body)
    }

    /// A checkpoint to save: `None` (keep the saved one) or at most the limit.
    pub fn checkpoint(&self, data: Option<Vec<u8>>) -> Result<Option<Vec<u8>>, Error> {
        match data {
            Some(data) if data.len() > self.max_checkpoint_bytes => Err(Error::invalid(
                "checkpoint",
                format!(
                    "must be at most {} bytes, got {}",
                    self.max_checkpoint_bytes,
                    data.len()
                ),
            )),
            other => Ok(other),
        }
    }
}

fn bounded(
    field: &'static str,
    requested: Option<Duration>,
    max: Duration,
) -> Result<Option<Duration>, Error> {
    match requested {
        Some(d) if d < MIN_DURATION => Err(Error::invalid(field, "must be at least 1s")),
        Some(d) if d > max => Err(Error::invalid(
            field,
            format!("must be at most {}", humantime::format_duration(max)),
        )),
        other => Ok(other),
    }
}

/// Where a stored record is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    InProgress,
    Completed,
    Released,
}

/// How far an earlier lease holder got, as it said with ExtendLease or
/// Release: opaque bytes, and the fencing token of the lease it was saved
/// under. A Claim that takes the key over hands it to the new holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    pub data: Vec<u8>,
    pub fencing_token: u64,
}

impl Checkpoint {
    /// From the store's two columns: a checkpoint exists when both do.
    pub fn from_stored(data: Option<Vec<u8>>, fencing_token: Option<i64>) -> Option<Self> {
        match (data, fencing_token) {
            (Some(data), Some(fencing_token)) => Some(Self {
                data,
                fencing_token: fencing_token as u64,
            }),
            _ => None,
        }
    }
}

/// What a Purge found: a live record (its state), or a remembered key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purged {
    Live(RecordState),
    Remembered,
}

/// One key's record as the store holds it. It may be expired: deciding what
/// that means is the lifecycle's job, with the store's clock.
#[derive(Debug, Clone)]
pub struct Record {
    pub state: RecordState,
    pub fencing_token: u64,
    pub lease_token: Option<LeaseToken>,
    pub fingerprint: Option<Fingerprint>,
    pub response: Option<Vec<u8>>,
    /// The retention asked for at claim time, used when the Complete names none
    /// and to keep an abandoned in-progress record past its lease.
    pub retention: Duration,
    pub lease_expires_at: Option<SystemTime>,
    pub expires_at: SystemTime,
    pub created_at: SystemTime,
    pub updated_at: SystemTime,
    /// The last checkpoint saved since the key was last absent or completed.
    pub checkpoint: Option<Checkpoint>,
    /// A completed record's horizon: until when its key is remembered once
    /// `expires_at` passes (a horizon not later than that remembers
    /// nothing). `None`: forgotten when it expires.
    pub remember_until: Option<SystemTime>,
}

impl Record {
    pub fn is_expired(&self, now: SystemTime) -> bool {
        self.expires_at <= now
    }

    /// The checkpoint a caller may see: only while the work is unfinished
    /// (in progress or released); a completed key has none.
    pub fn open_checkpoint(&self) -> Option<&Checkpoint> {
        match self.state {
            RecordState::InProgress | RecordState::Released => self.checkpoint.as_ref(),
            RecordState::Completed => None,
        }
    }
}

/// A read of one key together with the store's clock at the moment of the read,
/// so every time comparison uses the store's clock, never the replica's.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub now: SystemTime,
    pub record: Option<Record>,
}

impl Snapshot {
    /// The record, unless it is missing or expired: an expired record is absent
    /// at once, whether or not the reaper has deleted it yet.
    pub fn live(self) -> Option<Record> {
        let now = self.now;
        self.record.filter(|r| !r.is_expired(now))
    }

    /// The key's marker, when it is remembered: completed, its result
    /// expired, its horizon not passed (whether or not the reaper has
    /// dropped the result's bytes yet).
    pub fn remembered(&self) -> Option<Marker> {
        let record = self.record.as_ref()?;
        let remembered_until = record.remember_until?;
        (record.state == RecordState::Completed
            && record.is_expired(self.now)
            && remembered_until > self.now)
            .then(|| Marker {
                fencing_token: record.fencing_token,
                fingerprint: record.fingerprint.clone(),
                created_at: record.created_at,
                completed_at: record.updated_at,
                expired_at: record.expires_at,
                remembered_until,
            })
    }
}

/// What is kept of a remembered key: no response, no checkpoint.
#[derive(Debug, Clone)]
pub struct Marker {
    /// The last lease's fencing token; a re-execution gets the next one.
    pub fencing_token: u64,
    pub fingerprint: Option<Fingerprint>,
    pub created_at: SystemTime,
    pub completed_at: SystemTime,
    /// When the result expired.
    pub expired_at: SystemTime,
    /// The horizon: after it the key is forgotten.
    pub remembered_until: SystemTime,
}

/// A Claim as the store receives it: everything resolved, token generated
/// (or the caller's).
#[derive(Debug, Clone)]
pub struct NewLease {
    pub namespace: Namespace,
    pub key: Key,
    pub fingerprint: Option<Fingerprint>,
    pub lease_token: LeaseToken,
    pub lease_ttl: Duration,
    pub retention: Duration,
    /// What this Claim does if the key is remembered.
    pub late_retry: LateRetry,
}

/// A validated Complete, as the lifecycle and the store receive it.
#[derive(Debug, Clone)]
pub struct Completion {
    pub namespace: Namespace,
    pub key: Key,
    pub lease_token: LeaseToken,
    pub response: Vec<u8>,
    /// `None`: the Claim's retention.
    pub retention: Option<Duration>,
    /// How long after this Complete the key is remembered (the namespace's
    /// `remember_for`); nothing is remembered when it is not longer than
    /// the retention. Set by the lifecycle, not by callers.
    pub remember_for: Option<Duration>,
}

/// What the store reports when a Claim won the key.
#[derive(Debug, Clone)]
pub struct Lease {
    pub lease_token: LeaseToken,
    pub fencing_token: u64,
    pub lease_expires_at: SystemTime,
    pub expires_at: SystemTime,
    /// The checkpoint an earlier holder saved, which this one resumes from.
    pub checkpoint: Option<Checkpoint>,
}

/// What a Claim tells the caller to do next.
#[derive(Debug, Clone)]
pub enum ClaimOutcome {
    /// Do the work, then Complete or Release. `took_over` says the key was
    /// taken from a claimant whose lease had expired (it died or was too slow);
    /// `retried` that the Claim repeated the current lease's token, and got
    /// that lease back unchanged; `completed_before` that the key was
    /// remembered (a late retry, re-executed), and when it completed.
    Claimed {
        lease: Lease,
        took_over: bool,
        retried: bool,
        completed_before: Option<SystemTime>,
    },
    /// Someone else holds a live lease: try again after `retry_after`.
    InProgress {
        lease_expires_at: SystemTime,
        retry_after: Duration,
        expires_at: SystemTime,
    },
    /// The work is done: return the stored response (the replay).
    Completed {
        response: Vec<u8>,
        expires_at: SystemTime,
    },
    /// The same identity arrived with a different payload: reject it.
    FingerprintMismatch,
    /// The key is remembered and this Claim refuses late retries: the
    /// effect happened at `completed_at`, and its result is gone.
    Expired {
        completed_at: SystemTime,
        fencing_token: u64,
    },
}

impl ClaimOutcome {
    /// A short name for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Claimed { retried: true, .. } => "retried",
            Self::Claimed {
                completed_before: Some(_),
                ..
            } => "reexecuted",
            Self::Claimed { .. } => "claimed",
            Self::InProgress { .. } => "in_progress",
            Self::Completed { .. } => "completed",
            Self::FingerprintMismatch => "fingerprint_mismatch",
            Self::Expired { .. } => "expired",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_token_round_trips_through_its_text_form() {
        let token = LeaseToken::generate();
        let text = token.to_string();
        assert_eq!(text.len(), 32);
        assert!(
            text.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
        );
        assert_eq!(LeaseToken::parse(&text).unwrap(), token);
    }

    #[test]
    fn lease_token_rejects_uppercase_and_wrong_lengths() {
        for bad in ["", "abc", &"A".repeat(32), &"g".repeat(32), &"a".repeat(33)] {
            let err = LeaseToken::parse(bad).unwrap_err();
            assert!(err.to_string().starts_with("lease_token:"), "{err}");
        }
    }

    #[test]
    fn empty_fingerprint_means_no_check() {
        assert_eq!(Fingerprint::parse(vec![]).unwrap(), None);
        let a = Fingerprint::parse(b"a".to_vec()).unwrap();
        let b = Fingerprint::parse(b"b".to_vec()).unwrap();
        assert!(!Fingerprint::conflicts(a.as_ref(), None));
        assert!(!Fingerprint::conflicts(None, b.as_ref()));
        assert!(!Fingerprint::conflicts(a.as_ref(), a.as_ref()));
        assert!(Fingerprint::conflicts(a.as_ref(), b.as_ref()));
    }

    #[test]
    fn durations_are_bounded_inclusively() {
        let limits = Limits::default();
        assert_eq!(limits.lease_ttl(None).unwrap(), Duration::from_secs(30));
        assert_eq!(limits.lease_ttl(Some(MIN_DURATION)).unwrap(), MIN_DURATION);
        assert_eq!(
            limits.lease_ttl(Some(Duration::from_secs(3600))).unwrap(),
            Duration::from_secs(3600)
        );
        assert!(limits.lease_ttl(Some(Duration::from_millis(999))).is_err());
        assert!(limits.lease_ttl(Some(Duration::from_secs(3601))).is_err());
    }
}
