//! The configuration file (TOML), read into typed settings and checked
//! before the gateway starts: a file that loads is a gateway that can run.
//!
//! ```toml
//! listen = "0.0.0.0:8080"
//! upstream = "http://127.0.0.1:3000"
//! service = "http://127.0.0.1:50051"
//!
//! [tls]                       # optional: without it, plain HTTP
//! cert_file = "/etc/tls/tls.crt"
//! key_file = "/etc/tls/tls.key"
//!
//! [identity]
//! header = "x-api-key"
//!
//! [[route]]
//! method = "POST"
//! path = "/v1/charges"
//! namespace = "charges"
//! ```
//!
//! Every other setting has a default; `gateway/README` in the root README
//! lists them. Durations use the human form (`30s`, `5m`, `24h`).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{HeaderName, Method, StatusCode, Uri};
use serde::Deserialize;

use crate::tls::TlsFiles;

/// The service's longest namespace, in bytes.
const MAX_NAMESPACE_BYTES: usize = 128;
/// What a hashed identity adds to a route's namespace: `/` and 32 hex digits.
pub const IDENTITY_SUFFIX_BYTES: usize = 33;

/// The gateway's settings, validated.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    /// TLS on `listen` (HTTP/1.1 and HTTP/2 by ALPN); without it, plain
    /// HTTP/1.1 and h2c.
    pub tls: Option<TlsFiles>,
    /// Health (`/healthz`, `/readyz`) and Prometheus metrics (`/metrics`).
    pub admin_listen: Option<SocketAddr>,
    /// Scheme and authority of the API behind the gateway.
    pub upstream: Uri,
    /// Talk to the upstream in HTTP/2 with prior knowledge (h2c) instead of
    /// HTTP/1.1.
    pub upstream_http2: bool,
    /// The idempotency service's gRPC address.
    pub service: Uri,
    /// The bearer token the gateway presents to the service (read from
    /// `service_token_file`), when the service has an access policy.
    pub service_token: Option<String>,
    /// The prefix of every problem's `type` URI.
    pub problem_base: String,
    /// How long a shutdown waits for requests in flight.
    pub shutdown_timeout: Duration,
    pub identity: Option<Identity>,
    pub headers: Headers,
    pub routes: Vec<Route>,
}

/// Whose request it is: the header whose value names the caller, hashed
/// into the namespace so that one caller never replays another's answer.
#[derive(Debug, Clone)]
pub struct Identity {
    pub header: HeaderName,
    /// Mixed into the hash (optional): without the salt, a namespace cannot
    /// be tied to a guessed API key.
    pub salt: String,
    pub missing: MissingIdentity,
}

/// A guarded request without the identity header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingIdentity {
    /// 401, as a problem.
    Reject,
    /// Forwarded untouched, without idempotency (the API answers its own 401).
    PassThrough,
}

/// The names of the headers the gateway reads and writes.
#[derive(Debug, Clone)]
pub struct Headers {
    /// The client's key (`Idempotency-Key`).
    pub key: HeaderName,
    /// Where the upstream gets the client's key field, as sent.
    pub forward_key: HeaderName,
    /// Where the upstream gets the lease's fencing token.
    pub fencing_token: HeaderName,
}

/// One guarded route: the requests it matches and how they are handled.
#[derive(Debug, Clone)]
pub struct Route {
    /// The route's label in metrics and logs (default: its namespace).
    pub name: String,
    pub method: Method,
    pub path: PathPattern,
    /// The service namespace (the caller's hashed identity is appended).
    pub namespace: String,
    pub key_required: bool,
    pub lease_ttl: Duration,
    /// How long the answer is replayed; `None`: the service's default.
    pub retention: Option<Duration>,
    pub late_retry: LateRetry,
    pub fingerprint: Fingerprint,
    /// How long a duplicate waits for the first request's answer before 409.
    pub wait: Duration,
    /// Which statuses are stored (5xx never are).
    pub store: Vec<StatusSet>,
    /// The response headers stored and replayed (lowercase).
    pub replay_headers: Vec<HeaderName>,
    /// The largest stored response (status, headers and body, encoded).
    pub max_stored_bytes: usize,
    /// The largest request body the gateway reads to fingerprint it.
    pub max_request_bytes: usize,
    pub upstream_timeout: Duration,
    /// When the service cannot be reached: forward without idempotency
    /// (true) or answer 503 (false).
    pub fail_open: bool,
}

/// What a late retry (a key past its retention, still remembered) does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LateRetry {
    /// The namespace's or the service's policy.
    Service,
    /// Run the request again.
    Reexecute,
    /// Answer 410 with the original completion time.
    Refuse,
}

/// The parts of a request that make its fingerprint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fingerprint {
    /// The method, the request target (path and query) and the body.
    Request,
    /// The body alone.
    Body,
    /// The named fields of a JSON body (top-level names, or JSON pointers
    /// starting with `/`); a body that is not JSON is fingerprinted whole.
    JsonFields(Vec<String>),
}

/// A class of statuses (`2xx`) or one status (`404`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusSet {
    Class(u16),
    Exact(u16),
}

impl StatusSet {
    pub fn contains(self, status: StatusCode) -> bool {
        match self {
            Self::Class(class) => status.as_u16() / 100 == class,
            Self::Exact(code) => status.as_u16() == code,
        }
    }
}

impl Route {
    /// Whether a response with this status is stored and replayed.
    pub fn stores(&self, status: StatusCode) -> bool {
        !status.is_server_error() && self.store.iter().any(|set| set.contains(status))
    }
}

/// A path pattern: literal segments, `*` or `{name}` for any one segment,
/// and a final `**` for any rest (including nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    source: String,
    segments: Vec<Segment>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    One,
    Rest,
}

impl PathPattern {
    pub fn parse(source: &str) -> Result<Self, String> {
        let Some(rest) = source.strip_prefix('/') else {
            return Err(format!("path {source:?} must start with /"));
        };
        let parts: Vec<&str> = rest.split('/').collect();
        let mut segments = Vec::with_capacity(parts.len());
        for (i, part) in parts.iter().enumerate() {
            let segment = match *part {
                "**" if i + 1 == parts.len() => Segment::Rest,
                "**" => return Err(format!("path {source:?}: ** must be the last segment")),
                "*" => Segment::One,
                p if p.starts_with('{') && p.ends_with('}') && p.len() > 2 => Segment::One,
                p if p.contains(['{', '}', '*']) => {
                    return Err(format!(
                        "path {source:?}: segment {p:?} mixes a wildcard with text"
                    ));
                }
                p => Segment::Literal(p.to_owned()),
            };
            segments.push(segment);
        }
        Ok(Self {
            source: source.to_owned(),
            segments,
        })
    }

    pub fn matches(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let mut parts = rest.split('/');
        for segment in &self.segments {
            match segment {
                Segment::Rest => return true,
                Segment::One => match parts.next() {
                    Some(p) if !p.is_empty() => {}
                    _ => return false,
                },
                Segment::Literal(literal) => match parts.next() {
                    Some(p) if p == literal => {}
                    _ => return false,
                },
            }
        }
        parts.next().is_none()
    }

    pub fn as_str(&self) -> &str {
        &self.source
    }
}

impl Config {
    /// Reads and checks the file; the error names the file, and the setting
    /// (or TOML's line and column) that is wrong.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("{}: cannot read: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<Self, String> {
        let file: FileConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        file.validate()
    }

    /// The first route that guards this request, if any.
    pub fn route_for(&self, method: &Method, path: &str) -> Option<&Route> {
        self.routes
            .iter()
            .find(|route| route.method == method && route.path.matches(path))
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    listen: String,
    tls: Option<TlsFile>,
    admin_listen: Option<String>,
    upstream: String,
    #[serde(default)]
    upstream_http2: bool,
    service: String,
    service_token_file: Option<String>,
    problem_base: Option<String>,
    shutdown_timeout: Option<String>,
    identity: Option<IdentityFile>,
    #[serde(default)]
    headers: HeadersFile,
    #[serde(default, rename = "route")]
    routes: Vec<RouteFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TlsFile {
    cert_file: PathBuf,
    key_file: PathBuf,
    reload_interval: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentityFile {
    header: String,
    #[serde(default)]
    salt: String,
    missing: Option<MissingIdentity>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct HeadersFile {
    key: Option<String>,
    forward_key: Option<String>,
    fencing_token: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteFile {
    name: Option<String>,
    method: String,
    path: String,
    namespace: String,
    key: Option<KeyPolicy>,
    lease_ttl: Option<String>,
    retention: Option<String>,
    late_retry: Option<LateRetry>,
    fingerprint: Option<FingerprintFile>,
    wait: Option<String>,
    store: Option<Vec<String>>,
    replay_headers: Option<Vec<String>>,
    max_stored_bytes: Option<usize>,
    max_request_bytes: Option<usize>,
    upstream_timeout: Option<String>,
    #[serde(default)]
    fail_open: bool,
}

#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "snake_case")]
enum KeyPolicy {
    Required,
    Optional,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FingerprintFile {
    Named(String),
    Json { json_fields: Vec<String> },
}

/// The response headers replayed unless a route says otherwise: those that
/// describe the representation, never `Set-Cookie`.
pub const DEFAULT_REPLAY_HEADERS: &[&str] = &[
    "content-type",
    "content-language",
    "content-location",
    "location",
    "etag",
    "last-modified",
    "link",
    "cache-control",
    "retry-after",
];

/// The service's default largest response (IDEMPOTENCY_MAX_RESPONSE_BYTES).
pub const DEFAULT_MAX_STORED_BYTES: usize = 1024 * 1024;
const DEFAULT_MAX_REQUEST_BYTES: usize = 1024 * 1024;
/// The service's longest wait (IDEMPOTENCY_MAX_WAIT by default).
const MAX_WAIT: Duration = Duration::from_secs(30);

fn duration(field: &str, value: Option<&str>, default: Duration) -> Result<Duration, String> {
    match value {
        None => Ok(default),
        Some(text) => humantime::parse_duration(text).map_err(|e| format!("{field}: {e}")),
    }
}

fn header_name(field: &str, value: Option<&str>, default: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(value.unwrap_or(default).as_bytes())
        .map_err(|_| format!("{field}: not a header name"))
}

fn uri(field: &str, value: &str) -> Result<Uri, String> {
    let uri: Uri = value
        .parse()
        .map_err(|e| format!("{field}: {value:?} is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(format!("{field}: {value:?} must be http://host:port"));
    }
    if uri.path() != "/" && !uri.path().is_empty() {
        return Err(format!("{field}: {value:?} must have no path"));
    }
    Ok(uri)
}

impl FileConfig {
    fn validate(self) -> Result<Config, String> {
        let listen = self
            .listen
            .parse()
            .map_err(|e| format!("listen: {:?}: {e}", self.listen))?;
        let admin_listen = match self.admin_listen.as_deref() {
            None | Some("") => None,
            Some(text) => Some(
                text.parse()
                    .map_err(|e| format!("admin_listen: {text:?}: {e}"))?,
            ),
        };
        let tls = match self.tls {
            None => None,
            Some(file) => {
                let reload_interval = duration(
                    "tls.reload_interval",
                    file.reload_interval.as_deref(),
                    Duration::from_secs(10),
                )?;
                if reload_interval.is_zero() {
                    return Err("tls.reload_interval: must be positive".to_owned());
                }
                Some(TlsFiles {
                    cert: file.cert_file,
                    key: file.key_file,
                    reload_interval,
                })
            }
        };
        let identity = match self.identity {
            None => None,
            Some(file) => Some(Identity {
                header: header_name("identity.header", Some(&file.header), "")?,
                salt: file.salt,
                missing: file.missing.unwrap_or(MissingIdentity::Reject),
            }),
        };
        let headers = Headers {
            key: header_name(
                "headers.key",
                self.headers.key.as_deref(),
                "idempotency-key",
            )?,
            forward_key: header_name(
                "headers.forward_key",
                self.headers.forward_key.as_deref(),
                "idempotency-key",
            )?,
            fencing_token: header_name(
                "headers.fencing_token",
                self.headers.fencing_token.as_deref(),
                "idempotency-fencing-token",
            )?,
        };
        let mut routes = Vec::with_capacity(self.routes.len());
        for (i, route) in self.routes.into_iter().enumerate() {
            routes.push(
                route
                    .validate(identity.is_some())
                    .map_err(|e| format!("route[{i}].{e}"))?,
            );
        }
        Ok(Config {
            listen,
            tls,
            admin_listen,
            upstream: uri("upstream", &self.upstream)?,
            upstream_http2: self.upstream_http2,
            service: uri("service", &self.service)?,
            service_token: match self.service_token_file.as_deref() {
                None => None,
                Some(path) => {
                    let token = std::fs::read_to_string(path)
                        .map_err(|e| format!("service_token_file: {path}: {e}"))?;
                    let token = token.trim().to_owned();
                    if token.is_empty() {
                        return Err(format!("service_token_file: {path} is empty"));
                    }
                    Some(token)
                }
            },
            problem_base: self
                .problem_base
                .unwrap_or_else(|| "tag:idempotency-gateway,2026:problem/".to_owned()),
            shutdown_timeout: duration(
                "shutdown_timeout",
                self.shutdown_timeout.as_deref(),
                Duration::from_secs(30),
            )?,
            identity,
            headers,
            routes,
        })
    }
}

impl RouteFile {
    fn validate(self, hashed_identity: bool) -> Result<Route, String> {
        let method = Method::from_bytes(self.method.as_bytes())
            .map_err(|_| format!("method: {:?} is not a method", self.method))?;
        let path = PathPattern::parse(&self.path).map_err(|e| format!("path: {e}"))?;
        let room = MAX_NAMESPACE_BYTES
            - if hashed_identity {
                IDENTITY_SUFFIX_BYTES
            } else {
                0
            };
        if self.namespace.is_empty() || self.namespace.len() > room || self.namespace.contains('\0')
        {
            return Err(format!(
                "namespace: 1 to {room} bytes without NUL (the service's limit is \
                 {MAX_NAMESPACE_BYTES}, the hashed identity takes {IDENTITY_SUFFIX_BYTES})"
            ));
        }
        let lease_ttl = duration(
            "lease_ttl",
            self.lease_ttl.as_deref(),
            Duration::from_secs(30),
        )?;
        if lease_ttl < Duration::from_secs(1) {
            return Err("lease_ttl: at least 1s".to_owned());
        }
        let retention = match self.retention.as_deref() {
            None => None,
            Some(text) => Some(duration("retention", Some(text), Duration::ZERO)?),
        };
        if retention.is_some_and(|r| r < Duration::from_secs(1)) {
            return Err("retention: at least 1s".to_owned());
        }
        let wait = duration("wait", self.wait.as_deref(), Duration::from_secs(10))?;
        if wait > MAX_WAIT {
            return Err(format!(
                "wait: at most {}",
                humantime::format_duration(MAX_WAIT)
            ));
        }
        let fingerprint = match self.fingerprint {
            None => Fingerprint::Request,
            Some(FingerprintFile::Named(name)) => match name.as_str() {
                "request" => Fingerprint::Request,
                "body" => Fingerprint::Body,
                other => {
                    return Err(format!(
                        "fingerprint: {other:?}: \"request\", \"body\" or {{ json_fields = [...] }}"
                    ));
                }
            },
            Some(FingerprintFile::Json { json_fields }) if json_fields.is_empty() => {
                return Err("fingerprint: json_fields must name at least one field".to_owned());
            }
            Some(FingerprintFile::Json { json_fields }) => Fingerprint::JsonFields(json_fields),
        };
        let store = match self.store {
            None => vec![StatusSet::Class(2), StatusSet::Class(4)],
            Some(list) => list
                .iter()
                .map(|s| parse_status_set(s))
                .collect::<Result<_, _>>()?,
        };
        let replay_headers = match self.replay_headers {
            None => DEFAULT_REPLAY_HEADERS
                .iter()
                .map(|h| HeaderName::from_static(h))
                .collect(),
            Some(list) => list
                .iter()
                .map(|h| header_name("replay_headers", Some(h), ""))
                .collect::<Result<_, _>>()?,
        };
        Ok(Route {
            name: self.name.unwrap_or_else(|| self.namespace.clone()),
            method,
            path,
            namespace: self.namespace,
            key_required: !matches!(self.key, Some(KeyPolicy::Optional)),
            lease_ttl,
            retention,
            late_retry: self.late_retry.unwrap_or(LateRetry::Service),
            fingerprint,
            wait,
            store,
            replay_headers,
            max_stored_bytes: self.max_stored_bytes.unwrap_or(DEFAULT_MAX_STORED_BYTES),
            max_request_bytes: self.max_request_bytes.unwrap_or(DEFAULT_MAX_REQUEST_BYTES),
            upstream_timeout: duration(
                "upstream_timeout",
                self.upstream_timeout.as_deref(),
                Duration::from_secs(60),
            )?,
            fail_open: self.fail_open,
        })
    }
}

fn parse_status_set(text: &str) -> Result<StatusSet, String> {
    let set = match text.as_bytes() {
        [c @ b'1'..=b'4', b'x' | b'X', b'x' | b'X'] => StatusSet::Class(u16::from(c - b'0')),
        _ => match text.parse::<u16>() {
            Ok(code) if (100..500).contains(&code) => StatusSet::Exact(code),
            _ => {
                return Err(format!(
                    "store: {text:?}: a class (\"2xx\") or a status below 500 (5xx are never stored)"
                ));
            }
        },
    };
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"
        listen = "127.0.0.1:0"
        upstream = "http://127.0.0.1:3000"
        service = "http://127.0.0.1:50051"
    "#;

    #[test]
    fn patterns_match_segments() {
        let p = PathPattern::parse("/v1/orders/{id}/pay").unwrap();
        assert!(p.matches("/v1/orders/42/pay"));
        assert!(!p.matches("/v1/orders//pay"));
        assert!(!p.matches("/v1/orders/42/pay/now"));
        assert!(!p.matches("/v1/orders/42"));
        let rest = PathPattern::parse("/v1/**").unwrap();
        assert!(rest.matches("/v1/"));
        assert!(rest.matches("/v1/a/b/c"));
        assert!(!rest.matches("/v2/a"));
        let exact = PathPattern::parse("/charges").unwrap();
        assert!(exact.matches("/charges"));
        assert!(!exact.matches("/charges/"));
        assert!(PathPattern::parse("charges").is_err());
        assert!(PathPattern::parse("/a/**/b").is_err());
        assert!(PathPattern::parse("/a/x*").is_err());
    }

    #[test]
    fn defaults_and_routes() {
        let text = format!(
            "{MINIMAL}\n[[route]]\nmethod = \"POST\"\npath = \"/charges\"\nnamespace = \"charges\"\n"
        );
        let config = Config::parse(&text).unwrap();
        let route = config.route_for(&Method::POST, "/charges").unwrap();
        assert!(route.key_required);
        assert_eq!(route.lease_ttl, Duration::from_secs(30));
        assert_eq!(route.fingerprint, Fingerprint::Request);
        assert!(route.stores(StatusCode::CREATED));
        assert!(route.stores(StatusCode::NOT_FOUND));
        assert!(!route.stores(StatusCode::FOUND));
        assert!(!route.stores(StatusCode::BAD_GATEWAY));
        assert!(config.route_for(&Method::GET, "/charges").is_none());
        assert_eq!(config.headers.key, "idempotency-key");
    }

    #[test]
    fn errors_name_the_setting() {
        let bad = |route: &str| {
            let text = format!("{MINIMAL}\n[[route]]\n{route}\n");
            Config::parse(&text).unwrap_err()
        };
        let base = "method = \"POST\"\npath = \"/c\"\nnamespace = \"c\"";
        assert!(bad(&format!("{base}\nwait = \"31s\"")).starts_with("route[0].wait"));
        assert!(bad(&format!("{base}\nstore = [\"5xx\"]")).starts_with("route[0].store"));
        assert!(bad(&format!("{base}\nfingerprint = \"x\"")).starts_with("route[0].fingerprint"));
        assert!(bad(&format!("{base}\nlease_ttl = \"soon\"")).starts_with("route[0].lease_ttl"));
        assert!(bad(&format!("{base}\nnope = 1")).contains("nope"));
        let long = "x".repeat(96);
        let text = format!(
            "{MINIMAL}\n[identity]\nheader = \"x-api-key\"\n[[route]]\nmethod = \"POST\"\npath = \"/c\"\nnamespace = \"{long}\"\n"
        );
        assert!(
            Config::parse(&text)
                .unwrap_err()
                .starts_with("route[0].namespace")
        );
        let fields = format!("{base}\nfingerprint = {{ json_fields = [\"amount\"] }}");
        let text = format!("{MINIMAL}\n[[route]]\n{fields}\n");
        assert_eq!(
            Config::parse(&text).unwrap().routes[0].fingerprint,
            Fingerprint::JsonFields(vec!["amount".to_owned()])
        );
    }

    #[test]
    fn tls_is_off_without_its_table_and_names_its_files_with_it() {
        assert_eq!(Config::parse(MINIMAL).unwrap().tls, None);
        let text = format!(
            "{MINIMAL}\n[tls]\ncert_file = \"/etc/tls/tls.crt\"\nkey_file = \"/etc/tls/tls.key\"\n"
        );
        assert_eq!(
            Config::parse(&text).unwrap().tls,
            Some(TlsFiles {
                cert: PathBuf::from("/etc/tls/tls.crt"),
                key: PathBuf::from("/etc/tls/tls.key"),
                reload_interval: Duration::from_secs(10),
            })
        );
        let no_key = format!("{MINIMAL}\n[tls]\ncert_file = \"/etc/tls/tls.crt\"\n");
        assert!(Config::parse(&no_key).unwrap_err().contains("key_file"));
        let zero = format!("{text}reload_interval = \"0s\"\n");
        assert_eq!(
            Config::parse(&zero).unwrap_err(),
            "tls.reload_interval: must be positive"
        );
    }
}
