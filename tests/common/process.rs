//! The real binary as a child process, for what only a process can show:
//! kill -9, SIGTERM, the `migrate` subcommand, starting with no arguments,
//! a start that fails; and a scrape of its metrics endpoint.

use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use idempotency_service::grpc::proto::idempotency_service_client::IdempotencyServiceClient;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::{Client, StoreFixture, eventually};

pub const BINARY: &str = env!("CARGO_BIN_EXE_idempotency-service");

/// A free loopback port (bound, read, released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The binary with a clean environment: no inherited DATABASE_URL or
/// IDEMPOTENCY_* settings, only what the test passes.
pub fn command(dir: &Path) -> Command {
    let mut command = Command::new(BINARY);
    command.current_dir(dir);
    for (name, _) in std::env::vars() {
        if name.starts_with("DATABASE_URL") || name.starts_with("IDEMPOTENCY_") {
            command.env_remove(name);
        }
    }
    // Metrics off unless a test asks: the default port is one for all.
    command.env("IDEMPOTENCY_METRICS_ADDR", "");
    command.stdout(Stdio::null()).stderr(Stdio::null());
    command
}

/// The binary, as `command` makes it, on `store`: its PostgreSQL URL or its
/// SQLite data directory.
pub fn store_command(store: &StoreFixture, dir: &Path) -> Command {
    let mut command = command(dir);
    match &store.next_database_url() {
        Some(url) => command.env("DATABASE_URL", url),
        None => command.env("IDEMPOTENCY_DATA_DIR", &store.data_dir),
    };
    command
}

/// Runs the binary until it exits, with its stdout and stderr; fails the
/// test if it is still running after `within` (and kills it).
pub fn output_within(mut command: Command, within: Duration) -> Output {
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = command.spawn().expect("start the server binary");
    let pid = child.id().to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(output) => output.expect("the binary's output"),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            panic!("the binary was still running after {within:?}");
        }
    }
}

pub struct ServerProcess {
    pub child: Child,
    pub port: u16,
    /// Where health is probed: the main port, or a plaintext health port.
    pub health_port: u16,
}

impl ServerProcess {
    /// Starts the binary listening on a free port and waits for SERVING.
    pub async fn start(command: Command) -> Self {
        let port = free_port();
        Self::start_on(command, port, port).await
    }

    /// The same, probing health on the plaintext `health_port` (for a server
    /// whose main port speaks TLS).
    pub async fn start_probing(command: Command, health_port: u16) -> Self {
        Self::start_on(command, free_port(), health_port).await
    }

    async fn start_on(mut command: Command, port: u16, health_port: u16) -> Self {
        command.env("IDEMPOTENCY_LISTEN_ADDR", format!("127.0.0.1:{port}"));
        command.env("IDEMPOTENCY_HEALTH_CHECK_INTERVAL", "200ms");
        let child = command.spawn().expect("start the server binary");
        let server = Self {
            child,
            port,
            health_port,
        };
        assert_eq!(
            server.wait_for_health(ServingStatus::Serving).await,
            Some(()),
            "the server never became SERVING"
        );
        server
    }

    /// Starts the binary on a free port and waits until it is SERVING or
    /// has exited: an exit gives its status and stderr.
    pub async fn start_or_exit(mut command: Command) -> Result<Self, (ExitStatus, String)> {
        let port = free_port();
        command.env("IDEMPOTENCY_LISTEN_ADDR", format!("127.0.0.1:{port}"));
        command.env("IDEMPOTENCY_HEALTH_CHECK_INTERVAL", "200ms");
        command.stderr(Stdio::piped());
        let child = command.spawn().expect("start the server binary");
        let mut server = Self {
            child,
            port,
            health_port: port,
        };
        let health = HealthClient::new(Self::plaintext(port));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = server.child.try_wait().unwrap() {
                let mut stderr = String::new();
                if let Some(mut pipe) = server.child.stderr.take() {
                    pipe.read_to_string(&mut stderr).unwrap();
                }
                return Err((status, stderr));
            }
            let request = HealthCheckRequest {
                service: String::new(),
            };
            let serving =
                tokio::time::timeout(Duration::from_secs(1), health.clone().check(request))
                    .await
                    .is_ok_and(|r| {
                        r.is_ok_and(|r| r.into_inner().status == ServingStatus::Serving as i32)
                    });
            if serving {
                return Ok(server);
            }
            assert!(
                Instant::now() < deadline,
                "the server neither became SERVING nor exited within 30 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn channel(&self) -> Channel {
        Self::plaintext(self.port)
    }

    fn plaintext(port: u16) -> Channel {
        Channel::from_shared(format!("http://127.0.0.1:{port}"))
            .unwrap()
            .connect_lazy()
    }

    pub fn client(&self) -> Client {
        IdempotencyServiceClient::new(self.channel())
    }

    pub async fn wait_for_health(&self, status: ServingStatus) -> Option<()> {
        let health = HealthClient::new(Self::plaintext(self.health_port));
        eventually(Duration::from_secs(30), || {
            let mut health = health.clone();
            async move {
                let response = health
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                    .ok()?;
                (response.into_inner().status == status as i32).then_some(())
            }
        })
        .await
    }

    /// kill -9: no shutdown code runs.
    pub fn kill_hard(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// SIGTERM, then the exit status.
    pub async fn terminate(mut self) -> ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success());
        let status = eventually(Duration::from_secs(30), || {
            let status = self.child.try_wait().unwrap();
            async move { status }
        })
        .await;
        status.expect("the server did not exit within 30 s of SIGTERM")
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GET /metrics over plain HTTP/1.0, parsed into `name{labels}` -> value.
pub async fn scrape(port: u16) -> std::collections::HashMap<String, f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    stream.read_to_string(&mut body).await.unwrap();
    body.lines()
        .filter(|l| {
            !l.starts_with('#') && !l.is_empty() && !l.starts_with("HTTP/") && l.contains(' ')
        })
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}
