//! The real parts the gateway's tests run: an upstream HTTP app that counts
//! its effects (in this process, on a free port), the idempotency service's
//! binary (on SQLite or on a fresh PostgreSQL schema), the gateway's binary
//! with a config file written per test, and a reqwest client.

#![allow(dead_code)]

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idempotency_proto::v1::GetRequest;
use idempotency_proto::v1::idempotency_service_client::IdempotencyServiceClient;
use tempfile::TempDir;

pub const GATEWAY: &str = env!("CARGO_BIN_EXE_idempotency-gateway");

/// Waits for `condition` with a deadline; fails the test when it passes.
pub async fn eventually(what: &str, within: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !condition() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// ---------------------------------------------------------------- upstream

/// What the upstream saw.
#[derive(Default)]
pub struct Seen {
    /// Effects per path.
    pub effects: HashMap<String, u64>,
    /// (path, forwarded key header, fencing token header) per request.
    pub requests: Vec<(String, Option<String>, Option<String>)>,
}

#[derive(Default)]
pub struct UpstreamState {
    pub seen: Mutex<Seen>,
    /// Requests to /flaky answered 500 before it succeeds.
    pub fail_next: AtomicU32,
    /// Requests that have started (before any delay).
    pub started: AtomicU32,
}

pub struct TestUpstream {
    pub addr: SocketAddr,
    pub state: Arc<UpstreamState>,
}

impl TestUpstream {
    pub fn effects(&self, path: &str) -> u64 {
        self.state
            .seen
            .lock()
            .unwrap()
            .effects
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    pub fn requests(&self) -> Vec<(String, Option<String>, Option<String>)> {
        self.state.seen.lock().unwrap().requests.clone()
    }

    /// The app, on a free port, HTTP/1.1 and h2c. Its routes:
    /// - `POST /charges` (and any other POST): an effect; 201 with a JSON
    ///   body naming the effect's number and the fencing token, `Location`,
    ///   `Set-Cookie`; `x-delay-ms` delays the answer, `x-status` sets it;
    /// - `POST /flaky`: an effect; 500 while `fail_next` lasts, else 201;
    /// - `POST /big`: an effect; 200 with `x-size` bytes of body;
    /// - `GET /hello`: 200 `hello`, no effect.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(UpstreamState::default());
        let shared = state.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = shared.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |request| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(state, request).await) }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self { addr, state }
    }
}

fn header(request: &Request<Incoming>, name: &str) -> Option<String> {
    request
        .headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_owned())
}

type TestBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

fn full(bytes: impl Into<Bytes>) -> TestBody {
    Full::new(bytes.into()).boxed()
}

/// `size` bytes in 64 KiB chunks, made as they are sent, with no length.
fn streamed(size: usize) -> TestBody {
    const CHUNK: usize = 64 * 1024;
    let chunk = Bytes::from(vec![b'y'; CHUNK]);
    let chunks = (0..size.div_ceil(CHUNK)).map(move |i| {
        let len = CHUNK.min(size - i * CHUNK);
        Ok::<_, Infallible>(hyper::body::Frame::data(chunk.slice(..len)))
    });
    http_body_util::StreamBody::new(futures_util::stream::iter(chunks)).boxed()
}

async fn handle(state: Arc<UpstreamState>, request: Request<Incoming>) -> Response<TestBody> {
    let path = request.uri().path().to_owned();
    if request.method() == http::Method::GET {
        let mut response = Response::new(full(Bytes::from_static(b"hello")));
        let version = format!("{:?}", request.version());
        response
            .headers_mut()
            .insert("x-saw-version", version.parse().unwrap());
        if let Some(ff) = header(&request, "x-forwarded-for") {
            response
                .headers_mut()
                .insert("x-saw-forwarded-for", ff.parse().unwrap());
        }
        return response;
    }
    state.started.fetch_add(1, Ordering::SeqCst);
    let delay = header(&request, "x-delay-ms").map_or(0, |d| d.parse().unwrap());
    let status = header(&request, "x-status").map_or(201, |s| s.parse().unwrap());
    let size: usize = header(&request, "x-size").map_or(0, |s| s.parse().unwrap());
    let key = header(&request, "idempotency-key");
    let fencing = header(&request, "idempotency-fencing-token");
    // Read as it streams: only its length is kept.
    let mut received = 0usize;
    let mut body = request.into_body();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.unwrap().into_data() {
            received += data.len();
        }
    }
    if delay > 0 {
        tokio::time::sleep(Duration::from_millis(delay)).await;
    }
    let number = {
        let mut seen = state.seen.lock().unwrap();
        seen.requests.push((path.clone(), key, fencing.clone()));
        let count = seen.effects.entry(path.clone()).or_default();
        *count += 1;
        *count
    };
    let (status, body) = match path.as_str() {
        "/flaky"
            if state
                .fail_next
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok() =>
        {
            (500, "{\"error\":\"try again\"}".to_owned())
        }
        "/big" => (200, "x".repeat(size)),
        "/sink" => (200, format!("{{\"received\":{received}}}")),
        "/stream" => {
            let mut response = Response::new(streamed(size));
            response
                .headers_mut()
                .insert("content-type", "application/octet-stream".parse().unwrap());
            return response;
        }
        _ => (
            status,
            format!(
                "{{\"effect\":{number},\"fencing_token\":{}}}",
                fencing.unwrap_or("null".into())
            ),
        ),
    };
    let mut response = Response::new(full(body));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    let headers = response.headers_mut();
    headers.insert("content-type", "application/json".parse().unwrap());
    headers.insert("location", format!("{path}/{number}").parse().unwrap());
    headers.insert("set-cookie", format!("session={number}").parse().unwrap());
    headers.insert("x-not-replayed", "1".parse().unwrap());
    response
}

// ----------------------------------------------------------------- service

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    Sqlite,
    Postgres,
}

fn service_binary() -> PathBuf {
    if let Ok(path) = std::env::var("IDEMPOTENCY_BIN") {
        return PathBuf::from(path);
    }
    let target = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target");
    for profile in ["release", "debug"] {
        let path = target.join(profile).join("idempotency-service");
        if path.exists() {
            return path;
        }
    }
    panic!("build the service first (cargo build --release), or set IDEMPOTENCY_BIN");
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A fresh schema in the `idempotency_test` database (made with psql).
fn postgres_url() -> String {
    let admin = std::env::var("TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_owned());
    let psql = |url: &str, sql: &str| {
        Command::new("psql")
            .args([url, "-qc", sql])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("psql (PostgreSQL must run on 127.0.0.1:5432, see README)")
    };
    // Several tests race to create it: losing is fine.
    let _ = psql(&admin, "CREATE DATABASE idempotency_test");
    let (head, query) = admin
        .split_once('?')
        .map_or((admin.as_str(), None), |(h, q)| (h, Some(q)));
    let base = format!("{}/idempotency_test", &head[..head.rfind('/').unwrap()]);
    let schema = format!("gw_{:016x}", rand::random::<u64>());
    assert!(
        psql(&base, &format!("CREATE SCHEMA {schema}")).success(),
        "create the schema"
    );
    let options = format!("options=-c%20search_path%3D{schema}");
    match query {
        Some(q) => format!("{base}?{q}&{options}"),
        None => format!("{base}?{options}"),
    }
}

pub struct ServiceProcess {
    pub child: Child,
    pub port: u16,
    /// DATABASE_URL or IDEMPOTENCY_DATA_DIR, and its value.
    store: (&'static str, String),
    env: Vec<(&'static str, String)>,
    dir: TempDir,
}

impl ServiceProcess {
    pub async fn start(store: Store) -> Self {
        Self::start_with(store, &[]).await
    }

    /// The same with more environment variables (a policy file).
    pub async fn start_with(store: Store, env: &[(&'static str, String)]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let store = match store {
            Store::Sqlite => (
                "IDEMPOTENCY_DATA_DIR",
                dir.path().join("data").to_str().unwrap().to_owned(),
            ),
            Store::Postgres => ("DATABASE_URL", postgres_url()),
        };
        let port = free_port();
        let child = Self::spawn(port, &store, env, &dir);
        let service = Self {
            child,
            port,
            store,
            env: env.to_vec(),
            dir,
        };
        service.wait_ready().await;
        service
    }

    fn spawn(
        port: u16,
        store: &(&'static str, String),
        env: &[(&'static str, String)],
        dir: &TempDir,
    ) -> Child {
        let mut command = Command::new(service_binary());
        for (name, _) in std::env::vars() {
            if name.starts_with("DATABASE_URL") || name.starts_with("IDEMPOTENCY_") {
                command.env_remove(name);
            }
        }
        command
            .current_dir(dir.path())
            .env("IDEMPOTENCY_LISTEN_ADDR", format!("127.0.0.1:{port}"))
            .env("IDEMPOTENCY_METRICS_ADDR", "")
            .env("RUST_LOG", "warn")
            .env(store.0, &store.1)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null());
        command.spawn().expect("start the idempotency service")
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Starts it again on the same port and store, and waits until it answers.
    pub async fn restart(&mut self) {
        self.child = Self::spawn(self.port, &self.store, &self.env, &self.dir);
        self.wait_ready().await;
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    async fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(mut client) = IdempotencyServiceClient::connect(self.url()).await {
                let request = GetRequest {
                    namespace: "ready".into(),
                    key: "ready".into(),
                };
                // Any answer but UNAVAILABLE: with a policy, an anonymous
                // Get is UNAUTHENTICATED, and the service is up.
                match client.get(request).await {
                    Ok(_) => return,
                    Err(status) if status.code() != tonic::Code::Unavailable => return,
                    Err(_) => {}
                }
            }
            assert!(
                Instant::now() < deadline,
                "the service did not answer within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ----------------------------------------------------------------- gateway

pub struct GatewayProcess {
    pub child: Child,
    pub url: String,
    pub admin: String,
    _dir: TempDir,
}

/// The routes every test has; `extra` is appended (more routes).
pub fn config(upstream: SocketAddr, service: &str, extra: &str) -> String {
    format!(
        r#"
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
upstream = "http://{upstream}"
service = "{service}"
shutdown_timeout = "2s"

[identity]
header = "x-api-key"

[[route]]
method = "POST"
path = "/charges"
namespace = "charges"
lease_ttl = "3s"
wait = "10s"

[[route]]
method = "POST"
path = "/flaky"
namespace = "flaky"

[[route]]
method = "POST"
path = "/big"
namespace = "big"
max_stored_bytes = 4096
max_request_bytes = 65536

[[route]]
method = "POST"
path = "/stream"
namespace = "stream"
max_stored_bytes = 65536

[[route]]
method = "POST"
path = "/optional"
namespace = "optional"
key = "optional"

[[route]]
method = "POST"
path = "/impatient"
namespace = "impatient"
wait = "200ms"
{extra}
"#
    )
}

impl GatewayProcess {
    pub fn start(config: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gateway.toml");
        std::fs::write(&path, config).unwrap();
        let mut child = Command::new(GATEWAY)
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the gateway");
        let (tx, rx) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut url = None;
        let mut admin = None;
        while url.is_none() || admin.is_none() {
            let line = rx
                .recv_timeout(Duration::from_secs(10))
                .expect("the gateway said where it listens within 10 s");
            if let Some(rest) = line.strip_prefix("listening on ") {
                url = Some(rest.to_owned());
            } else if let Some(rest) = line.strip_prefix("admin on ") {
                admin = Some(rest.to_owned());
            }
        }
        Self {
            child,
            url: url.unwrap(),
            admin: admin.unwrap(),
            _dir: dir,
        }
    }

    /// The process's peak resident memory (VmHWM), in bytes.
    pub fn peak_memory(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
        kib * 1024
    }

    /// SIGTERM.
    pub fn terminate(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    pub async fn metrics(&self) -> String {
        reqwest::get(format!("{}/metrics", self.admin))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The whole rig: upstream, service, gateway, and a client.
pub struct Rig {
    pub upstream: TestUpstream,
    pub service: ServiceProcess,
    pub gateway: GatewayProcess,
    pub client: reqwest::Client,
}

impl Rig {
    /// Returns once `n` requests have reached the upstream (within 5 s).
    pub async fn until_upstream_started(&self, n: u32) {
        eventually(
            &format!("{n} request(s) reached the upstream"),
            Duration::from_secs(5),
            || self.upstream.state.started.load(Ordering::SeqCst) == n,
        )
        .await;
    }

    pub async fn start(store: Store) -> Self {
        Self::with_routes(store, "").await
    }

    pub async fn with_routes(store: Store, extra: &str) -> Self {
        let upstream = TestUpstream::start().await;
        let service = ServiceProcess::start(store).await;
        let gateway = GatewayProcess::start(&config(upstream.addr, &service.url(), extra));
        Self {
            upstream,
            service,
            gateway,
            client: reqwest::Client::new(),
        }
    }

    /// A POST to `path` with the key (as an sf-string) and the API key.
    pub fn post(&self, path: &str, key: Option<&str>, api_key: &str) -> reqwest::RequestBuilder {
        let mut request = self
            .client
            .post(format!("{}{path}", self.gateway.url))
            .header("x-api-key", api_key)
            .header("content-type", "application/json")
            .body(r#"{"amount":100}"#);
        if let Some(key) = key {
            request = request.header("idempotency-key", format!("\"{key}\""));
        }
        request
    }
}

/// A response read whole: what the tests compare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub content_type: Option<String>,
    pub location: Option<String>,
    pub replayed: Option<String>,
    pub retry_after: Option<String>,
    pub set_cookie: Option<String>,
    pub body: String,
}

impl Answer {
    pub async fn of(response: reqwest::Response) -> Self {
        let h = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        let (content_type, location, replayed, retry_after, set_cookie) = (
            h("content-type"),
            h("location"),
            h("idempotent-replayed"),
            h("retry-after"),
            h("set-cookie"),
        );
        Self {
            status: response.status().as_u16(),
            content_type,
            location,
            replayed,
            retry_after,
            set_cookie,
            body: response.text().await.unwrap(),
        }
    }

    /// The same from a hyper response (the TLS client's).
    pub async fn of_hyper(response: Response<Incoming>) -> Self {
        let h = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        let (content_type, location, replayed, retry_after, set_cookie) = (
            h("content-type"),
            h("location"),
            h("idempotent-replayed"),
            h("retry-after"),
            h("set-cookie"),
        );
        let status = response.status().as_u16();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        Self {
            status,
            content_type,
            location,
            replayed,
            retry_after,
            set_cookie,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap()
    }

    /// The answer without what only the first one has or lacks.
    pub fn as_replayed(&self) -> Self {
        Self {
            replayed: Some("true".into()),
            set_cookie: None,
            ..self.clone()
        }
    }
}

// --------------------------------------------------------------------- tls

/// A certificate authority of the test's own and a server certificate it
/// signed for 127.0.0.1 and localhost, written as PEM files for the
/// gateway's `[tls]`. A client trusts this CA and nothing else.
pub struct TestPki {
    pub ca: String,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    _dir: TempDir,
}

impl TestPki {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (ca, server) = signed_pair("gateway test CA");
        let cert_file = dir.path().join("tls.crt");
        let key_file = dir.path().join("tls.key");
        std::fs::write(&cert_file, &server.0).unwrap();
        std::fs::write(&key_file, &server.1).unwrap();
        Self {
            ca,
            cert_file,
            key_file,
            _dir: dir,
        }
    }

    /// Replaces the certificate and key with a new pair from a new CA, as
    /// Kubernetes updates a Secret (a rename), and returns the new CA.
    pub fn rotate(&self) -> String {
        let (ca, (cert, key)) = signed_pair("gateway test CA, rotated");
        for (path, contents) in [(&self.key_file, key), (&self.cert_file, cert)] {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, contents).unwrap();
            std::fs::rename(&tmp, path).unwrap();
        }
        ca
    }

    /// The `[tls]` table of the gateway's config, re-reading every 100 ms.
    pub fn config(&self) -> String {
        format!(
            "\n[tls]\ncert_file = {:?}\nkey_file = {:?}\nreload_interval = \"100ms\"\n",
            self.cert_file, self.key_file
        )
    }
}

/// A CA's certificate, and a server certificate and key it signed (PEM).
fn signed_pair(ca_name: &str) -> (String, (String, String)) {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair,
    };
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, ca_name);
    let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let mut params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, "idempotency-gateway");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    (issuer.pem(), (cert.pem(), key.serialize_pem()))
}

/// A TLS client of the gateway (rustls, hyper), trusting one CA and
/// offering the given ALPN protocols; each request is a new connection, so
/// each one is a new handshake with the certificate in force.
pub struct TlsClient {
    connector: tokio_rustls::TlsConnector,
}

impl TlsClient {
    pub fn new(ca_pem: &str, alpn: &[&[u8]]) -> Self {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Self {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
        }
    }

    /// A TLS connection to `url` (`https://ADDR`), handshake done.
    pub async fn connect(
        &self,
        url: &str,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let addr = url.strip_prefix("https://").expect("an https:// URL");
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        self.connector.connect(name, tcp).await
    }

    /// The rig's POST (`Rig::post`) over a new TLS connection, in the HTTP
    /// version the handshake chose: the version and the answer.
    pub async fn post(
        &self,
        url: &str,
        path: &str,
        key: &str,
        api_key: &str,
    ) -> std::io::Result<(http::Version, Answer)> {
        let stream = self.connect(url).await?;
        let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
        let request = Request::post(path)
            .header("host", "localhost")
            .header("x-api-key", api_key)
            .header("content-type", "application/json")
            .header("idempotency-key", format!("\"{key}\""))
            .body(Full::new(Bytes::from_static(br#"{"amount":100}"#)))
            .unwrap();
        let io = TokioIo::new(stream);
        let response = if h2 {
            let (mut sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                    .await
                    .map_err(std::io::Error::other)?;
            tokio::spawn(connection);
            sender.send_request(request).await
        } else {
            let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(connection);
            sender.send_request(request).await
        }
        .map_err(std::io::Error::other)?;
        let version = response.version();
        Ok((version, Answer::of_hyper(response).await))
    }
}
