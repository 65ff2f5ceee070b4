//! The service's listening ports: gRPC, the plaintext health-only port and
//! the metrics port. A port that cannot be bound stops the start with one
//! line naming the setting, the address and what to do instead, such as
//! `IDEMPOTENCY_METRICS_ADDR=0.0.0.0:8464 is in use; set another address, or
//! "" to turn metrics off`.

use std::io;
use std::net::SocketAddr;

use tokio::net::{TcpListener, TcpSocket};

/// Connections the kernel queues before the server accepts them (what
/// `tokio::net::TcpListener::bind` uses).
const BACKLOG: u32 = 1024;

/// A port the service listens on: its setting, and what an empty value turns
/// off (`None` when the setting cannot be empty).
#[derive(Debug, Clone, Copy)]
pub struct Port {
    pub setting: &'static str,
    pub off: Option<&'static str>,
}

/// The gRPC port.
pub const GRPC: Port = Port {
    setting: "IDEMPOTENCY_LISTEN_ADDR",
    off: None,
};

/// The plaintext port that serves only grpc.health.v1.
pub const HEALTH: Port = Port {
    setting: "IDEMPOTENCY_HEALTH_LISTEN_ADDR",
    off: Some("the health-only listener"),
};

/// The Prometheus endpoint.
pub const METRICS: Port = Port {
    setting: "IDEMPOTENCY_METRICS_ADDR",
    off: Some("metrics"),
};

impl Port {
    /// Binds `addr` and listens (inside the Tokio runtime).
    pub fn bind(self, addr: SocketAddr) -> anyhow::Result<TcpListener> {
        let socket = if addr.is_ipv4() {
            TcpSocket::new_v4()
        } else {
            TcpSocket::new_v6()
        };
        let socket = socket.map_err(|e| self.error(addr, &e))?;
        // As tokio's and std's bind do: a restarted server gets its port back
        // while connections of the previous one are in TIME_WAIT.
        socket
            .set_reuseaddr(true)
            .map_err(|e| self.error(addr, &e))?;
        socket.bind(addr).map_err(|e| self.error(addr, &e))?;
        socket.listen(BACKLOG).map_err(|e| self.error(addr, &e))
    }

    /// One line: the setting, the address, the cause and the way out.
    pub fn error(self, addr: SocketAddr, error: &io::Error) -> anyhow::Error {
        let Self { setting, off } = self;
        let way_out = match off {
            None => "set another address".to_owned(),
            Some(what) => format!("set another address, or \"\" to turn {what} off"),
        };
        match error.kind() {
            io::ErrorKind::AddrInUse => anyhow::anyhow!("{setting}={addr} is in use; {way_out}"),
            io::ErrorKind::AddrNotAvailable => {
                anyhow::anyhow!("{setting}={addr}: no such address on this machine; {way_out}")
            }
            io::ErrorKind::PermissionDenied => anyhow::anyhow!(
                "{setting}={addr}: permission denied (ports below 1024 need privileges); {way_out}"
            ),
            _ => anyhow::anyhow!("{setting}={addr}: cannot listen: {error}; {way_out}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_port_in_use_is_named_with_its_setting_and_the_way_out() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = taken.local_addr().unwrap();
        let error = METRICS.bind(addr).unwrap_err().to_string();
        assert_eq!(
            error,
            format!(
                "IDEMPOTENCY_METRICS_ADDR={addr} is in use; set another address, or \"\" to turn metrics off"
            )
        );
        let error = GRPC.bind(addr).unwrap_err().to_string();
        assert_eq!(
            error,
            format!("IDEMPOTENCY_LISTEN_ADDR={addr} is in use; set another address")
        );
        drop(taken);
        let listener = HEALTH.bind(addr).unwrap();
        assert_eq!(listener.local_addr().unwrap(), addr);
    }
}
