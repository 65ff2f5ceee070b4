//! Configuration: command-line flags, each with an environment variable, each
//! documented here and therefore in `--help`. Durations use the human form
//! (`30s`, `24h`, `30days`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::parser::ValueSource;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};

use crate::domain::{LateRetry, Limits, Remembering};
use crate::store::StoreOptions;
use crate::tls::{ClientAuth, TlsFiles};

/// A shared deduplication store over gRPC: claim an event's key, complete it
/// once, replay the result to every redelivery.
#[derive(Debug, Parser)]
#[command(name = "idempotency-service", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub config: Config,
}

impl Cli {
    /// Parses the command line and the environment (exiting with clap's
    /// message on an error), noting which settings nobody set.
    pub fn parse_noting_defaults() -> Self {
        Self::try_parse_noting_defaults_from(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }

    /// `parse_noting_defaults` from these arguments.
    pub fn try_parse_noting_defaults_from<I, T>(args: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = Self::command().try_get_matches_from(args)?;
        let mut cli = Self::from_arg_matches(&matches)?;
        cli.config.metrics_addr_is_default =
            matches.value_source("metrics_addr") == Some(ValueSource::DefaultValue);
        Ok(cli)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum Command {
    /// Serve gRPC (the default when no command is given).
    Serve,
    /// Apply the database migrations, then exit.
    Migrate,
    /// Show one key's record, read from the database.
    Get {
        /// The key's namespace.
        namespace: String,
        /// The key.
        key: String,
    },
    /// Make a key claimable again at once (its record expires now; logged).
    Purge {
        /// The key's namespace.
        namespace: String,
        /// The key.
        key: String,
        /// Why, for the log (an incident or ticket reference).
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Records by state and namespace, the oldest record, and the reaper's lag.
    Stats,
    /// Make a new bearer token and print it with the line for the policy file
    /// (which holds only the token's hash).
    Token {
        /// Read a token from stdin and print only its hash.
        #[arg(long)]
        hash: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log pipelines.
    Json,
}

/// `IDEMPOTENCY_METRICS_ADDR`'s default (README: configuration, why 8464).
pub const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:8464";

#[derive(Debug, Clone, Args)]
pub struct Config {
    /// The store. `postgres://user:password@host:5432/db` for PostgreSQL (the
    /// production store, for several replicas), `sqlite:///path/file.db` for an
    /// SQLite file. Unset: the embedded SQLite file in --data-dir.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub database_url: Option<String>,

    /// A file that holds the store's URL (a Kubernetes Secret mounted as a
    /// file), instead of DATABASE_URL.
    #[arg(long, env = "DATABASE_URL_FILE", global = true)]
    pub database_url_file: Option<PathBuf>,

    /// The folder of the embedded SQLite store (created when missing); used
    /// when DATABASE_URL is unset.
    #[arg(
        long,
        env = "IDEMPOTENCY_DATA_DIR",
        default_value = "./data",
        global = true
    )]
    pub data_dir: PathBuf,

    /// The gRPC address to listen on.
    #[arg(long, env = "IDEMPOTENCY_LISTEN_ADDR", default_value = "0.0.0.0:50051")]
    pub listen_addr: SocketAddr,

    /// The server's TLS certificate chain (PEM). With --tls-key-file, the gRPC
    /// port speaks only TLS. Re-read when it changes.
    #[arg(long, env = "IDEMPOTENCY_TLS_CERT_FILE")]
    pub tls_cert_file: Option<PathBuf>,

    /// The private key of the TLS certificate (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, env = "IDEMPOTENCY_TLS_KEY_FILE")]
    pub tls_key_file: Option<PathBuf>,

    /// CA certificates (PEM) that client certificates must chain to: turns on
    /// mutual TLS. A client certificate's subject CN is an identity of the
    /// policy.
    #[arg(long, env = "IDEMPOTENCY_TLS_CLIENT_CA_FILE")]
    pub tls_client_ca_file: Option<PathBuf>,

    /// With a client CA: whether every connection must present a client
    /// certificate, or only may (callers without one use a bearer token).
    #[arg(long, env = "IDEMPOTENCY_TLS_CLIENT_AUTH", value_enum, default_value_t = ClientAuth::Required)]
    pub tls_client_auth: ClientAuth,

    /// The access policy (TOML): identities, their credentials, namespaces
    /// and RPCs. Unset: every caller may do everything (logged as a warning).
    /// Re-read when it changes.
    #[arg(long, env = "IDEMPOTENCY_POLICY_FILE")]
    pub policy_file: Option<PathBuf>,

    /// How often the TLS and policy files are checked for changes.
    #[arg(long, env = "IDEMPOTENCY_RELOAD_INTERVAL", default_value = "10s", value_parser = humantime::parse_duration)]
    pub reload_interval: Duration,

    /// An extra plaintext address serving only grpc.health.v1, without
    /// credentials, for probes that cannot speak TLS (kubelet). Empty: off.
    #[arg(long, env = "IDEMPOTENCY_HEALTH_LISTEN_ADDR", default_value = "")]
    pub health_listen_addr: String,

    /// The most calls in flight; more get RESOURCE_EXHAUSTED at once.
    #[arg(long, env = "IDEMPOTENCY_MAX_CONCURRENT_CALLS", default_value_t = 1024)]
    pub max_concurrent_calls: usize,

    /// The most concurrent calls (HTTP/2 streams) on one connection.
    #[arg(
        long,
        env = "IDEMPOTENCY_MAX_STREAMS_PER_CONNECTION",
        default_value_t = 128
    )]
    pub max_streams_per_connection: u32,

    /// The longest any call may take, receiving its request included; a
    /// caller's deadline (grpc-timeout) shortens it. Then DEADLINE_EXCEEDED.
    #[arg(long, env = "IDEMPOTENCY_CALL_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub call_timeout: Duration,

    /// The lease length when a Claim or ExtendLease does not name one.
    #[arg(long, env = "IDEMPOTENCY_DEFAULT_LEASE_TTL", default_value = "30s", value_parser = humantime::parse_duration)]
    pub default_lease_ttl: Duration,

    /// The longest lease a caller may ask for.
    #[arg(long, env = "IDEMPOTENCY_MAX_LEASE_TTL", default_value = "1h", value_parser = humantime::parse_duration)]
    pub max_lease_ttl: Duration,

    /// How long a result is kept and replayed when neither the Claim nor the
    /// Complete names a retention: the redelivery window.
    #[arg(long, env = "IDEMPOTENCY_DEFAULT_RETENTION", default_value = "24h", value_parser = humantime::parse_duration)]
    pub default_retention: Duration,

    /// The longest retention a caller may ask for.
    #[arg(long, env = "IDEMPOTENCY_MAX_RETENTION", default_value = "30days", value_parser = humantime::parse_duration)]
    pub max_retention: Duration,

    /// The largest response a Complete may store, in bytes.
    #[arg(long, env = "IDEMPOTENCY_MAX_RESPONSE_BYTES", default_value_t = 1024 * 1024)]
    pub max_response_bytes: usize,

    /// The largest checkpoint ExtendLease or Release may save, in bytes.
    #[arg(long, env = "IDEMPOTENCY_MAX_CHECKPOINT_BYTES", default_value_t = 64 * 1024)]
    pub max_checkpoint_bytes: usize,

    /// The longest a Claim waits for another holder's lease to end
    /// (ClaimRequest.wait is shortened to it, and to the call's deadline).
    #[arg(long, env = "IDEMPOTENCY_MAX_WAIT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub max_wait: Duration,

    /// The most Claims that wait at once on this replica; past it a Claim
    /// that asks to wait answers OUTCOME_IN_PROGRESS at once. Each waiting
    /// call is also a call in flight, so at most half of
    /// IDEMPOTENCY_MAX_CONCURRENT_CALLS wait, whatever this says.
    #[arg(long, env = "IDEMPOTENCY_MAX_WAITERS", default_value_t = 512)]
    pub max_waiters: usize,

    /// How long after its Complete a key is remembered: once its result's
    /// retention ends, a marker (fingerprint, fencing token, when it
    /// completed; no response) is kept until then, so that a late retry is
    /// answered by IDEMPOTENCY_LATE_RETRY instead of looking new, and the
    /// fencing token goes on. A result whose retention reaches past it is
    /// simply forgotten when it expires; "0s" turns remembering off. A
    /// namespace may set its own in the policy file.
    #[arg(long, env = "IDEMPOTENCY_REMEMBER_FOR", default_value = "7days", value_parser = humantime::parse_duration)]
    pub remember_for: Duration,

    /// What a Claim of a remembered key does when it does not say
    /// (ClaimRequest.late_retry): `reexecute` (claim it again with the next
    /// fencing token, saying it completed before) or `refuse` (answer
    /// OUTCOME_EXPIRED). A namespace may set its own in the policy file.
    #[arg(long, env = "IDEMPOTENCY_LATE_RETRY", default_value = "reexecute", value_parser = parse_late_retry)]
    pub late_retry: LateRetry,

    /// How often the reaper deletes expired records. Expired records are absent
    /// to every call at once; the reaper only reclaims their space.
    #[arg(long, env = "IDEMPOTENCY_REAPER_INTERVAL", default_value = "60s", value_parser = humantime::parse_duration)]
    pub reaper_interval: Duration,

    /// How many expired records the reaper deletes per statement.
    #[arg(long, env = "IDEMPOTENCY_REAPER_BATCH_SIZE", default_value_t = 1000)]
    pub reaper_batch_size: u32,

    /// The most database connections this instance opens.
    #[arg(long, env = "IDEMPOTENCY_DB_POOL_SIZE", default_value_t = 16)]
    pub db_pool_size: u32,

    /// How long one database operation may take (connecting included) before
    /// the call fails with UNAVAILABLE.
    #[arg(long, env = "IDEMPOTENCY_DB_TIMEOUT", default_value = "5s", value_parser = humantime::parse_duration)]
    pub db_timeout: Duration,

    /// Run the migrations at start. Turn off when a separate job runs
    /// `idempotency-service migrate` (the Helm chart does).
    #[arg(long, env = "IDEMPOTENCY_RUN_MIGRATIONS", default_value_t = true, action = clap::ArgAction::Set)]
    pub run_migrations: bool,

    /// How often health checks the store.
    #[arg(long, env = "IDEMPOTENCY_HEALTH_CHECK_INTERVAL", default_value = "1s", value_parser = humantime::parse_duration)]
    pub health_check_interval: Duration,

    /// How long a graceful shutdown waits for calls in flight.
    #[arg(long, env = "IDEMPOTENCY_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = humantime::parse_duration)]
    pub shutdown_timeout: Duration,

    /// Coalesce concurrent Claims and Completes into one statement per kind
    /// (PostgreSQL; the embedded store has a single writer anyway). A lone
    /// call still goes at once on its own (docs/benchmarks.md).
    #[arg(long, env = "IDEMPOTENCY_COALESCE", default_value_t = true, action = clap::ArgAction::Set)]
    pub coalesce: bool,

    /// On Citus, send each key's statement (and each batch's group of keys)
    /// straight to the node holding the key's shard, from the shard map
    /// (`pg_dist_shard`, `pg_dist_node`), so it runs there without a hop
    /// through the node DATABASE_URL names. Needs the service to reach every
    /// node at the address the cluster's metadata gives it; false sends
    /// everything to the DATABASE_URL node, which routes it.
    #[arg(long, env = "IDEMPOTENCY_CITUS_DIRECT", default_value_t = true, action = clap::ArgAction::Set)]
    pub citus_direct: bool,

    /// For the tests only: on plain PostgreSQL, send the statements and
    /// functions the store sends on Citus (the conformance suite runs them so
    /// that, without Citus, a rule the two engines write differently fails a
    /// test). Never needed in production: the store finds Citus by itself.
    #[arg(long, env = "IDEMPOTENCY_CITUS_STATEMENTS", default_value_t = false, hide = true, action = clap::ArgAction::Set)]
    pub citus_statements: bool,

    /// The most calls coalesced into one statement.
    #[arg(long, env = "IDEMPOTENCY_COALESCE_MAX_BATCH", default_value_t = 128)]
    pub coalesce_max_batch: usize,

    /// How long a coalescing worker waits for more calls when its batch is not
    /// full. 0s (the default) never waits: only calls already queued are
    /// batched, so a lone call is not delayed.
    #[arg(long, env = "IDEMPOTENCY_COALESCE_WINDOW", default_value = "0s", value_parser = humantime::parse_duration)]
    pub coalesce_window: Duration,

    /// Coalesced statements of one kind in flight at once. Few is the point:
    /// calls that arrive while every worker is busy wait and go together.
    #[arg(long, env = "IDEMPOTENCY_COALESCE_WORKERS", default_value_t = 1)]
    pub coalesce_workers: usize,

    /// Bytes of completed records each replica keeps in memory to answer
    /// duplicate Claims without asking PostgreSQL (the replay cache); 0
    /// turns it off. Purges reach every replica's cache through
    /// LISTEN/NOTIFY (README: the replay cache). The embedded SQLite store
    /// has no cache: its reads are local.
    #[arg(long, env = "IDEMPOTENCY_REPLAY_CACHE_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub replay_cache_bytes: u64,

    /// The most items in one ClaimBatch or CompleteBatch.
    #[arg(long, env = "IDEMPOTENCY_MAX_BATCH_ITEMS", default_value_t = 500)]
    pub max_batch_items: usize,

    /// The Prometheus endpoint (`/metrics`); empty turns it off. The default
    /// port, 8464, is outside Prometheus' own ports and the 9100-9999 block
    /// its exporters claim, and outside the range the OS hands out to
    /// outgoing connections (README: configuration). Left at the default and
    /// found in use (a second replica on one host), metrics move to a free
    /// port, logged; an address set explicitly that is in use stops the start.
    #[arg(long, env = "IDEMPOTENCY_METRICS_ADDR", default_value = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: String,

    /// Whether nobody set the metrics address (flag or environment), so that
    /// the default may give way to a free port (`Cli::parse_noting_defaults`).
    #[arg(skip)]
    pub metrics_addr_is_default: bool,

    /// Namespaces that get their own `namespace` label on metrics, comma
    /// separated (at most 100); others are counted as "other". Empty: metrics
    /// carry no namespace label.
    #[arg(long, env = "IDEMPOTENCY_METRICS_NAMESPACES", value_delimiter = ',')]
    pub metrics_namespaces: Vec<String>,

    /// How often the `idempotency_records` gauge counts records by state
    /// (exact up to a million rows; above, estimated from a sample); 0s
    /// turns it off.
    #[arg(long, env = "IDEMPOTENCY_RECORDS_GAUGE_INTERVAL", default_value = "60s", value_parser = humantime::parse_duration)]
    pub records_gauge_interval: Duration,

    /// Log format. The filter comes from RUST_LOG (default: info).
    #[arg(long, env = "IDEMPOTENCY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
}

impl Config {
    /// The configuration with every default, for tests and embedding.
    pub fn defaults() -> Self {
        Cli::parse_from(["idempotency-service"]).config
    }

    pub fn limits(&self) -> Limits {
        Limits {
            default_lease_ttl: self.default_lease_ttl,
            max_lease_ttl: self.max_lease_ttl,
            default_retention: self.default_retention,
            max_retention: self.max_retention,
            max_response_bytes: self.max_response_bytes,
            max_checkpoint_bytes: self.max_checkpoint_bytes,
            max_wait: self.max_wait,
            max_waiters: self.max_waiters.min(self.max_concurrent_calls / 2),
            remembering: Remembering {
                remember_for: self.remember_for,
                late_retry: self.late_retry,
            },
        }
    }

    pub fn coalesce_options(&self) -> crate::store::coalesce::CoalesceOptions {
        crate::store::coalesce::CoalesceOptions {
            max_batch: self.coalesce_max_batch,
            window: self.coalesce_window,
            workers: self.coalesce_workers,
            timeout: self.db_timeout,
            split_failed: false,
        }
    }

    /// The metrics address; `None` when metrics are off.
    pub fn metrics_addr(&self) -> anyhow::Result<Option<SocketAddr>> {
        let addr = self.metrics_addr.trim();
        if addr.is_empty() {
            return Ok(None);
        }
        addr.parse()
            .map(Some)
            .map_err(|_| anyhow::anyhow!("IDEMPOTENCY_METRICS_ADDR must be host:port or empty"))
    }

    pub fn store_options(&self) -> anyhow::Result<StoreOptions> {
        Ok(StoreOptions {
            database_url: self.database_url()?,
            data_dir: self.data_dir.clone(),
            pool_size: self.db_pool_size,
            timeout: self.db_timeout,
            citus_statements: self.citus_statements,
            citus_direct: self.citus_direct,
        })
    }

    /// The store's URL, from DATABASE_URL or the file DATABASE_URL_FILE names.
    /// Errors never show the URL.
    fn database_url(&self) -> anyhow::Result<Option<String>> {
        let Some(path) = &self.database_url_file else {
            return Ok(self.database_url.clone());
        };
        anyhow::ensure!(
            self.database_url.is_none(),
            "set DATABASE_URL or DATABASE_URL_FILE, not both"
        );
        let url = std::fs::read_to_string(path).map_err(|e| {
            anyhow::anyhow!("DATABASE_URL_FILE: cannot read {}: {e}", path.display())
        })?;
        let url = url.trim();
        anyhow::ensure!(
            !url.is_empty(),
            "DATABASE_URL_FILE: {} is empty",
            path.display()
        );
        Ok(Some(url.to_owned()))
    }

    /// The TLS files, when TLS is on.
    pub fn tls_files(&self) -> anyhow::Result<Option<TlsFiles>> {
        match (&self.tls_cert_file, &self.tls_key_file) {
            (None, None) => {
                anyhow::ensure!(
                    self.tls_client_ca_file.is_none(),
                    "IDEMPOTENCY_TLS_CLIENT_CA_FILE needs IDEMPOTENCY_TLS_CERT_FILE and IDEMPOTENCY_TLS_KEY_FILE"
                );
                Ok(None)
            }
            (Some(cert), Some(key)) => Ok(Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: self.tls_client_ca_file.clone(),
                client_auth: self.tls_client_auth,
            })),
            _ => anyhow::bail!(
                "IDEMPOTENCY_TLS_CERT_FILE and IDEMPOTENCY_TLS_KEY_FILE go together: set both or neither"
            ),
        }
    }

    /// The plaintext health-only address; `None` when off.
    pub fn health_listen_addr(&self) -> anyhow::Result<Option<SocketAddr>> {
        let addr = self.health_listen_addr.trim();
        if addr.is_empty() {
            return Ok(None);
        }
        addr.parse().map(Some).map_err(|_| {
            anyhow::anyhow!("IDEMPOTENCY_HEALTH_LISTEN_ADDR must be host:port or empty")
        })
    }

    /// Rejects settings that cannot work together, naming the variable.
    pub fn validate(&self) -> anyhow::Result<()> {
        let one_second = Duration::from_secs(1);
        let checks = [
            (
                self.max_lease_ttl >= one_second,
                "IDEMPOTENCY_MAX_LEASE_TTL must be at least 1s",
            ),
            (
                self.max_retention >= one_second,
                "IDEMPOTENCY_MAX_RETENTION must be at least 1s",
            ),
            (
                (one_second..=self.max_lease_ttl).contains(&self.default_lease_ttl),
                "IDEMPOTENCY_DEFAULT_LEASE_TTL must lie between 1s and IDEMPOTENCY_MAX_LEASE_TTL",
            ),
            (
                (one_second..=self.max_retention).contains(&self.default_retention),
                "IDEMPOTENCY_DEFAULT_RETENTION must lie between 1s and IDEMPOTENCY_MAX_RETENTION",
            ),
            (
                !self.reaper_interval.is_zero(),
                "IDEMPOTENCY_REAPER_INTERVAL must be positive",
            ),
            (
                self.reaper_batch_size > 0,
                "IDEMPOTENCY_REAPER_BATCH_SIZE must be positive",
            ),
            (
                self.db_pool_size > 0,
                "IDEMPOTENCY_DB_POOL_SIZE must be positive",
            ),
            (
                !self.db_timeout.is_zero(),
                "IDEMPOTENCY_DB_TIMEOUT must be positive",
            ),
            (
                !self.health_check_interval.is_zero(),
                "IDEMPOTENCY_HEALTH_CHECK_INTERVAL must be positive",
            ),
            (
                !self.reload_interval.is_zero(),
                "IDEMPOTENCY_RELOAD_INTERVAL must be positive",
            ),
            (
                self.max_concurrent_calls > 0,
                "IDEMPOTENCY_MAX_CONCURRENT_CALLS must be positive",
            ),
            (
                self.max_streams_per_connection > 0,
                "IDEMPOTENCY_MAX_STREAMS_PER_CONNECTION must be positive",
            ),
            (
                !self.call_timeout.is_zero(),
                "IDEMPOTENCY_CALL_TIMEOUT must be positive",
            ),
        ];
        self.metrics_addr()?;
        self.health_listen_addr()?;
        self.tls_files()?;
        anyhow::ensure!(
            self.metrics_namespaces.len() <= 100,
            "IDEMPOTENCY_METRICS_NAMESPACES lists more than 100 namespaces"
        );
        match checks.iter().find(|(ok, _)| !ok) {
            Some((_, message)) => anyhow::bail!("{message}"),
            None => Ok(()),
        }
    }
}

/// A late-retry policy as the settings and the policy file write it.
pub fn parse_late_retry(text: &str) -> Result<LateRetry, String> {
    match text {
        "reexecute" => Ok(LateRetry::Reexecute),
        "refuse" => Ok(LateRetry::Refuse),
        other => Err(format!(
            "{other:?} is not a late-retry policy (reexecute or refuse)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_address_is_known_to_be_the_default_only_when_nobody_set_it() {
        let unset = Cli::try_parse_noting_defaults_from(["idempotency-service"]).unwrap();
        // The test's own environment may set it; then it is not the default.
        let from_env = std::env::var_os("IDEMPOTENCY_METRICS_ADDR").is_some();
        assert_eq!(unset.config.metrics_addr_is_default, !from_env);
        let set = Cli::try_parse_noting_defaults_from([
            "idempotency-service",
            "--metrics-addr",
            DEFAULT_METRICS_ADDR,
        ])
        .unwrap();
        assert_eq!(set.config.metrics_addr, DEFAULT_METRICS_ADDR);
        assert!(!set.config.metrics_addr_is_default);
    }

    #[test]
    fn defaults_match_the_documented_ones() {
        let config = Cli::try_parse_from(["idempotency-service"]).unwrap().config;
        assert_eq!(config.listen_addr, "0.0.0.0:50051".parse().unwrap());
        assert_eq!(
            config.metrics_addr().unwrap(),
            Some("0.0.0.0:8464".parse().unwrap())
        );
        assert_eq!(config.default_lease_ttl, Duration::from_secs(30));
        assert_eq!(config.max_lease_ttl, Duration::from_secs(3600));
        assert_eq!(config.default_retention, Duration::from_secs(86_400));
        assert_eq!(config.max_retention, Duration::from_secs(30 * 86_400));
        assert_eq!(config.max_response_bytes, 1_048_576);
        assert_eq!(config.max_checkpoint_bytes, 65_536);
        assert_eq!(config.reaper_interval, Duration::from_secs(60));
        assert!(config.run_migrations);
        config.validate().unwrap();
    }

    #[test]
    fn a_default_above_its_maximum_is_refused() {
        let mut config = Config::defaults();
        config.default_lease_ttl = Duration::from_secs(7200);
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("IDEMPOTENCY_DEFAULT_LEASE_TTL"), "{error}");
    }

    #[test]
    fn the_database_url_comes_from_its_file_without_the_newline() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("url");
        std::fs::write(&path, "postgres://u:secret@db/x\n").unwrap();
        let mut config = Config::defaults();
        config.database_url_file = Some(path);
        assert_eq!(
            config.store_options().unwrap().database_url.as_deref(),
            Some("postgres://u:secret@db/x")
        );
        config.database_url = Some("postgres://u:secret@db/y".into());
        let error = config.store_options().unwrap_err().to_string();
        assert_eq!(error, "set DATABASE_URL or DATABASE_URL_FILE, not both");
    }

    #[test]
    fn a_tls_certificate_needs_its_key() {
        let mut config = Config::defaults();
        config.tls_cert_file = Some("cert.pem".into());
        let error = config.validate().unwrap_err().to_string();
        assert!(error.contains("IDEMPOTENCY_TLS_KEY_FILE"), "{error}");
    }
}
