//! Who may call, and on what: the access policy. A TOML file maps each
//! identity's credentials (hashes of bearer tokens, a client certificate's
//! Common Name) to the namespaces and RPCs it may use and its rate limit.
//!
//! No tonic here: `grpc::guard` hands this module the credentials a call
//! carries and the RPC it names, and the adapter asks the caller's
//! [`Identity`] about each namespace once the request is parsed.
//!
//! Tokens are never stored: the policy holds `sha256:<hex>` of each, and a
//! presented token's hash is compared with every entry in constant time.

use std::borrow::Cow;
use std::collections::HashMap;
use std::num::NonZeroU32;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use rand::RngCore;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::domain::{LateRetry, Namespace, Remembering};
use crate::error::{Error, Reason};

/// Every RPC of the service, by the name the policy uses.
pub const RPCS: [&str; 8] = [
    "Claim",
    "Complete",
    "Release",
    "ExtendLease",
    "Get",
    "ClaimBatch",
    "CompleteBatch",
    "Purge",
];

/// The RPCs an identity gets when its entry names none: all but Purge, which
/// is for operators.
const DEFAULT_RPCS: &[&str] = &[
    "Claim",
    "Complete",
    "Release",
    "ExtendLease",
    "Get",
    "ClaimBatch",
    "CompleteBatch",
];

const TOKEN_PREFIX: &str = "idem_";
const HASH_PREFIX: &str = "sha256:";

/// A new bearer token: `idem_` and 32 random bytes in hex.
pub fn new_token() -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{TOKEN_PREFIX}{}", hex(&bytes))
}

/// The form a token takes in the policy file: `sha256:` and the lowercase hex
/// SHA-256 of its UTF-8 text.
pub fn hash_token(token: &str) -> String {
    format!("{HASH_PREFIX}{}", hex(&Sha256::digest(token.as_bytes())))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

fn parse_hash(text: &str) -> Option<[u8; 32]> {
    let digits = text.strip_prefix(HASH_PREFIX)?;
    if digits.len() != 64
        || !digits
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&digits[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

fn namespace_settings(entry: NamespaceEntry) -> anyhow::Result<NamespaceSettings> {
    anyhow::ensure!(
        !entry.names.is_empty(),
        "names must name at least one namespace (\"*\" for all)"
    );
    let names = entry
        .names
        .iter()
        .map(|n| NamespaceGrant::parse(n))
        .collect::<anyhow::Result<_>>()
        .context("names")?;
    let remember_for = entry
        .remember_for
        .map(|text| {
            humantime::parse_duration(&text)
                .map_err(|e| anyhow::anyhow!("remember_for: {text:?} is not a duration: {e}"))
        })
        .transpose()?;
    let late_retry = entry
        .late_retry
        .map(|text| {
            crate::config::parse_late_retry(&text).map_err(|e| anyhow::anyhow!("late_retry: {e}"))
        })
        .transpose()?;
    Ok(NamespaceSettings {
        names,
        remember_for,
        late_retry,
    })
}

/// Namespace settings as the lifecycle asks for them, from the policy as it
/// is now (the file is reloaded when it changes).
impl crate::lifecycle::NamespaceSettings for crate::reload::Reloading<Policy> {
    fn remembering(&self, namespace: &Namespace, default: Remembering) -> Remembering {
        self.current().remembering(namespace, default)
    }
}

/// The file's shape.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyFile {
    #[serde(default)]
    identity: Vec<IdentityEntry>,
    #[serde(default)]
    namespace: Vec<NamespaceEntry>,
}

/// A `[[namespace]]` entry: settings for the namespaces it names.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NamespaceEntry {
    names: Vec<String>,
    remember_for: Option<String>,
    late_retry: Option<String>,
}

/// The settings of the namespaces one entry names; unset ones are the
/// server's.
#[derive(Debug)]
struct NamespaceSettings {
    names: Vec<NamespaceGrant>,
    remember_for: Option<std::time::Duration>,
    late_retry: Option<LateRetry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentityEntry {
    name: String,
    #[serde(default)]
    token_hashes: Vec<String>,
    client_cert_cn: Option<String>,
    namespaces: Vec<String>,
    rpcs: Option<Vec<String>>,
    rate_limit_per_second: Option<u32>,
    rate_limit_burst: Option<u32>,
}

/// The namespaces one grant covers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum NamespaceGrant {
    /// `*`: every namespace.
    All,
    /// `payments/*`: every namespace that starts with `payments/`.
    Prefix(String),
    /// `orders`: that namespace only.
    Exact(String),
}

impl NamespaceGrant {
    fn parse(text: &str) -> anyhow::Result<Self> {
        if text == "*" {
            return Ok(Self::All);
        }
        let (name, grant) = match text.strip_suffix("/*") {
            Some(prefix) => (prefix, Self::Prefix(format!("{prefix}/"))),
            None => (text, Self::Exact(text.to_owned())),
        };
        anyhow::ensure!(
            !name.contains('*'),
            "{text:?}: `*` may only stand alone or end a prefix as `/*`"
        );
        Namespace::parse(name.to_owned())
            .map_err(|e| anyhow::anyhow!("{text:?} is not a valid namespace: {e}"))?;
        Ok(grant)
    }

    fn covers(&self, namespace: &str) -> bool {
        match self {
            Self::All => true,
            Self::Prefix(prefix) => namespace.starts_with(prefix.as_str()),
            Self::Exact(name) => namespace == name,
        }
    }
}

/// A caller the policy knows, with what it may do.
#[derive(Debug)]
pub struct Identity {
    name: String,
    namespaces: Vec<NamespaceGrant>,
    /// One bit per entry of [`RPCS`].
    rpcs: u16,
    limiter: Option<DefaultDirectRateLimiter>,
}

impl Identity {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// PERMISSION_DENIED unless the identity may call `rpc`.
    pub fn check_rpc(&self, rpc: &str) -> Result<(), Error> {
        match RPCS.iter().position(|r| *r == rpc) {
            Some(bit) if self.rpcs & (1 << bit) != 0 => Ok(()),
            _ => Err(Error::PermissionDenied(Cow::Owned(format!(
                "{rpc} is not granted to identity {:?}",
                self.name
            )))),
        }
    }

    /// PERMISSION_DENIED unless the identity may use `namespace`.
    pub fn check_namespace(&self, namespace: &Namespace) -> Result<(), Error> {
        if self.namespaces.iter().any(|g| g.covers(namespace.as_str())) {
            return Ok(());
        }
        Err(Error::PermissionDenied(Cow::Owned(format!(
            "namespace: {:?} is not granted to identity {:?}",
            namespace.as_str(),
            self.name
        ))))
    }

    /// Takes one call from the identity's rate limit; RESOURCE_EXHAUSTED when
    /// it is spent.
    pub fn check_rate(&self) -> Result<(), Error> {
        use governor::clock::{Clock, DefaultClock};
        match &self.limiter {
            Some(limiter) => limiter
                .check()
                .map_err(|not_until| Error::ResourceExhausted {
                    reason: Reason::RateLimited,
                    message: "this identity's rate limit is reached; retry with backoff",
                    retry_after: not_until.wait_time_from(DefaultClock::default().now()),
                }),
            None => Ok(()),
        }
    }
}

/// The credentials one call carries.
#[derive(Debug, Clone, Copy, Default)]
pub struct Credentials<'a> {
    /// The bearer token from the `authorization` metadata, when there is one.
    /// `Some("")` when the header is there but is not a bearer token.
    pub token: Option<&'a str>,
    /// The verified client certificate's subject Common Name (mutual TLS).
    pub client_cert_cn: Option<&'a str>,
}

/// The parsed policy file.
#[derive(Debug)]
pub struct Policy {
    identities: Vec<Arc<Identity>>,
    /// `[[namespace]]` entries, in the file's order: the first that names a
    /// namespace decides its settings.
    namespaces: Vec<NamespaceSettings>,
    /// Token hash → index into `identities`.
    tokens: Vec<([u8; 32], usize)>,
    /// Client certificate CN → index into `identities`.
    common_names: HashMap<String, usize>,
}

impl Policy {
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the policy file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in the policy file {}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let file: PolicyFile = toml::from_str(text).map_err(|e| toml_error(text, &e))?;
        let mut policy = Policy {
            identities: Vec::with_capacity(file.identity.len()),
            namespaces: Vec::with_capacity(file.namespace.len()),
            tokens: Vec::new(),
            common_names: HashMap::new(),
        };
        for (index, entry) in file.identity.into_iter().enumerate() {
            let name = entry.name.clone();
            policy
                .add(index, entry)
                .with_context(|| format!("identity {name:?}"))?;
        }
        for (index, entry) in file.namespace.into_iter().enumerate() {
            let settings = namespace_settings(entry)
                .with_context(|| format!("namespace entry {}", index + 1))?;
            policy.namespaces.push(settings);
        }
        Ok(policy)
    }

    /// A namespace's remembering: the first `[[namespace]]` entry naming it
    /// overrides what it sets of the server's.
    pub fn remembering(&self, namespace: &Namespace, default: Remembering) -> Remembering {
        let Some(entry) = self
            .namespaces
            .iter()
            .find(|e| e.names.iter().any(|n| n.covers(namespace.as_str())))
        else {
            return default;
        };
        Remembering {
            remember_for: entry.remember_for.unwrap_or(default.remember_for),
            late_retry: entry.late_retry.unwrap_or(default.late_retry),
        }
    }

    fn add(&mut self, index: usize, entry: IdentityEntry) -> anyhow::Result<()> {
        anyhow::ensure!(!entry.name.trim().is_empty(), "name must not be empty");
        anyhow::ensure!(
            self.identities.iter().all(|i| i.name != entry.name),
            "the name is used twice"
        );
        anyhow::ensure!(
            !entry.token_hashes.is_empty() || entry.client_cert_cn.is_some(),
            "needs token_hashes or client_cert_cn"
        );
        for text in &entry.token_hashes {
            let hash = parse_hash(text).with_context(|| {
                format!("token_hashes: {text:?} is not sha256: and 64 lowercase hex digits")
            })?;
            anyhow::ensure!(
                self.tokens.iter().all(|(h, _)| *h != hash),
                "token_hashes: a hash is listed twice"
            );
            self.tokens.push((hash, index));
        }
        if let Some(cn) = entry.client_cert_cn {
            anyhow::ensure!(!cn.is_empty(), "client_cert_cn must not be empty");
            anyhow::ensure!(
                self.common_names.insert(cn.clone(), index).is_none(),
                "client_cert_cn {cn:?} belongs to two identities"
            );
        }
        anyhow::ensure!(
            !entry.namespaces.is_empty(),
            "namespaces must name at least one namespace (\"*\" for all)"
        );
        let namespaces = entry
            .namespaces
            .iter()
            .map(|n| NamespaceGrant::parse(n))
            .collect::<anyhow::Result<_>>()
            .context("namespaces")?;
        let rpc_names: Vec<&str> = match &entry.rpcs {
            None => DEFAULT_RPCS.to_vec(),
            Some(list) if list.iter().any(|r| r == "*") => RPCS.to_vec(),
            Some(list) => list.iter().map(String::as_str).collect(),
        };
        let mut rpcs = 0u16;
        for rpc in rpc_names {
            let bit = RPCS.iter().position(|r| *r == rpc).with_context(|| {
                format!("rpcs: unknown RPC {rpc:?}; known: {}", RPCS.join(", "))
            })?;
            rpcs |= 1 << bit;
        }
        let limiter = match (entry.rate_limit_per_second, entry.rate_limit_burst) {
            (None, None) => None,
            (None, Some(_)) => anyhow::bail!("rate_limit_burst needs rate_limit_per_second"),
            (Some(rate), burst) => {
                let rate =
                    NonZeroU32::new(rate).context("rate_limit_per_second must be positive")?;
                let burst = match burst {
                    Some(b) => NonZeroU32::new(b).context("rate_limit_burst must be positive")?,
                    None => rate,
                };
                Some(RateLimiter::direct(
                    Quota::per_second(rate).allow_burst(burst),
                ))
            }
        };
        self.identities.push(Arc::new(Identity {
            name: entry.name,
            namespaces,
            rpcs,
            limiter,
        }));
        Ok(())
    }

    pub fn identities(&self) -> usize {
        self.identities.len()
    }

    /// The identity the credentials belong to. A token, when present, decides;
    /// otherwise the client certificate does.
    pub fn authenticate(&self, credentials: Credentials<'_>) -> Result<Arc<Identity>, Error> {
        if let Some(token) = credentials.token {
            let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
            // Every entry is compared, in constant time, whatever matches.
            let mut found = None;
            for (hash, index) in &self.tokens {
                if bool::from(hash.ct_eq(&digest)) {
                    found = Some(*index);
                }
            }
            return found
                .map(|i| self.identities[i].clone())
                .ok_or(Error::Unauthenticated("the bearer token is not known"));
        }
        if let Some(cn) = credentials.client_cert_cn {
            return self
                .common_names
                .get(cn)
                .map(|&i| self.identities[i].clone())
                .ok_or(Error::Unauthenticated(
                    "the client certificate's subject is not in the policy",
                ));
        }
        Err(Error::Unauthenticated(
            "credentials required: a bearer token in `authorization`, or a client certificate",
        ))
    }
}

/// A TOML error on one line (`line 3, column 7: expected ...`): toml's own
/// message quotes the offending line over several.
fn toml_error(text: &str, error: &toml::de::Error) -> anyhow::Error {
    let message = error
        .message()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    match error.span() {
        Some(span) => {
            let before = text.get(..span.start).unwrap_or(text);
            let line = before.matches('\n').count() + 1;
            let column = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
            anyhow::anyhow!("line {line}, column {column}: {message}")
        }
        None => anyhow::anyhow!("{message}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ns(name: &str) -> Namespace {
        Namespace::parse(name.to_owned()).unwrap()
    }

    fn policy(token: &str) -> Policy {
        Policy::parse(&format!(
            r#"
            [[identity]]
            name = "orders"
            token_hashes = ["{}"]
            namespaces = ["orders", "payments/*"]

            [[identity]]
            name = "oncall"
            client_cert_cn = "oncall.ops"
            namespaces = ["*"]
            rpcs = ["*"]
            rate_limit_per_second = 1
            rate_limit_burst = 2
            "#,
            hash_token(token)
        ))
        .unwrap()
    }

    #[test]
    fn a_toml_error_is_one_line_with_its_position() {
        let error = Policy::parse("[[identity]]\nname = = \"x\"\n")
            .unwrap_err()
            .to_string();
        assert!(!error.contains('\n'), "{error}");
        assert!(error.starts_with("line 2, column "), "{error}");
    }

    #[test]
    fn a_token_names_its_identity_and_others_are_refused() {
        let token = new_token();
        let policy = policy(&token);
        let who = |token| {
            policy
                .authenticate(Credentials {
                    token,
                    client_cert_cn: None,
                })
                .map(|i| i.name().to_owned())
        };
        assert_eq!(who(Some(&token)).unwrap(), "orders");
        let stranger = new_token();
        assert!(matches!(
            who(Some(&stranger)),
            Err(Error::Unauthenticated(_))
        ));
        assert!(matches!(who(Some("")), Err(Error::Unauthenticated(_))));
        assert!(matches!(who(None), Err(Error::Unauthenticated(_))));
    }

    #[test]
    fn a_token_decides_over_a_certificate() {
        let policy = policy(&new_token());
        let result = policy.authenticate(Credentials {
            token: Some("wrong"),
            client_cert_cn: Some("oncall.ops"),
        });
        assert!(matches!(result, Err(Error::Unauthenticated(_))));
        let oncall = policy
            .authenticate(Credentials {
                token: None,
                client_cert_cn: Some("oncall.ops"),
            })
            .unwrap();
        assert_eq!(oncall.name(), "oncall");
    }

    #[test]
    fn the_first_namespace_entry_naming_a_namespace_sets_its_remembering() {
        use std::time::Duration;
        let policy = Policy::parse(
            r#"
            [[namespace]]
            names = ["payments/*"]
            late_retry = "refuse"

            [[namespace]]
            names = ["payments/stripe", "orders"]
            remember_for = "30days"
            "#,
        )
        .unwrap();
        let default = Remembering::DEFAULT;
        assert_eq!(
            policy.remembering(&ns("payments/stripe"), default),
            Remembering {
                remember_for: default.remember_for,
                late_retry: LateRetry::Refuse,
            }
        );
        assert_eq!(
            policy.remembering(&ns("orders"), default),
            Remembering {
                remember_for: Duration::from_secs(30 * 24 * 3600),
                late_retry: LateRetry::Reexecute,
            }
        );
        assert_eq!(policy.remembering(&ns("other"), default), default);
        for (text, error) in [
            (
                "[[namespace]]\nnames = []",
                "names must name at least one namespace",
            ),
            (
                "[[namespace]]\nnames = [\"a\"]\nlate_retry = \"never\"",
                "late_retry: \"never\" is not a late-retry policy (reexecute or refuse)",
            ),
            (
                "[[namespace]]\nnames = [\"a\"]\nremember_for = \"soon\"",
                "remember_for: \"soon\" is not a duration",
            ),
        ] {
            let message = format!("{:#}", Policy::parse(text).unwrap_err());
            assert!(message.contains("namespace entry 1"), "{message}");
            assert!(message.contains(error), "{message}");
        }
    }

    #[test]
    fn namespaces_match_exactly_or_by_prefix() {
        let token = new_token();
        let policy = policy(&token);
        let orders = policy
            .authenticate(Credentials {
                token: Some(&token),
                client_cert_cn: None,
            })
            .unwrap();
        for granted in ["orders", "payments/eu", "payments/eu/refunds"] {
            assert!(orders.check_namespace(&ns(granted)).is_ok(), "{granted}");
        }
        for denied in ["orders2", "orders/x", "payments", "paymentsx/eu", "billing"] {
            let error = orders.check_namespace(&ns(denied)).unwrap_err();
            assert_eq!(
                error.to_string(),
                format!("namespace: {denied:?} is not granted to identity \"orders\"")
            );
        }
    }

    #[test]
    fn purge_is_granted_only_when_named() {
        let token = new_token();
        let policy = policy(&token);
        let orders = policy
            .authenticate(Credentials {
                token: Some(&token),
                client_cert_cn: None,
            })
            .unwrap();
        assert!(orders.check_rpc("Claim").is_ok());
        assert!(matches!(
            orders.check_rpc("Purge"),
            Err(Error::PermissionDenied(_))
        ));
        let oncall = policy
            .authenticate(Credentials {
                token: None,
                client_cert_cn: Some("oncall.ops"),
            })
            .unwrap();
        assert!(oncall.check_rpc("Purge").is_ok());
    }

    #[test]
    fn the_rate_limit_allows_its_burst_then_refuses() {
        let policy = policy(&new_token());
        let oncall = policy
            .authenticate(Credentials {
                token: None,
                client_cert_cn: Some("oncall.ops"),
            })
            .unwrap();
        assert!(oncall.check_rate().is_ok());
        assert!(oncall.check_rate().is_ok());
        assert!(matches!(
            oncall.check_rate(),
            Err(Error::ResourceExhausted { .. })
        ));
    }

    #[test]
    fn a_bad_policy_names_the_identity_and_the_field() {
        let cases = [
            (
                r#"[[identity]]
                name = "a"
                namespaces = ["x"]"#,
                "needs token_hashes or client_cert_cn",
            ),
            (
                r#"[[identity]]
                name = "a"
                token_hashes = ["md5:00"]
                namespaces = ["x"]"#,
                "token_hashes",
            ),
            (
                r#"[[identity]]
                name = "a"
                client_cert_cn = "a"
                namespaces = ["x"]
                rpcs = ["Claim", "Delete"]"#,
                "unknown RPC \"Delete\"",
            ),
            (
                r#"[[identity]]
                name = "a"
                client_cert_cn = "a"
                namespaces = ["pay*"]"#,
                "namespaces",
            ),
            (
                r#"[[identity]]
                name = "a"
                client_cert_cn = "a"
                namespaces = ["x"]
                colour = "blue""#,
                "colour",
            ),
        ];
        for (text, expected) in cases {
            let error = format!("{:#}", Policy::parse(text).unwrap_err());
            assert!(error.contains(expected), "{error}");
        }
    }

    #[test]
    fn hashes_are_sha256_hex_of_the_token_text() {
        assert_eq!(
            hash_token("abc"),
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let token = new_token();
        assert!(token.starts_with("idem_") && token.len() == 5 + 64);
    }
}
