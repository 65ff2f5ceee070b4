//! The gRPC port's connections: plain TCP, or TLS with rustls (mutual TLS when
//! a client CA is configured).
//!
//! [`incoming`] accepts TCP connections and, with TLS, handshakes each one in
//! its own task under a timeout (a slow or silent client holds nothing but its
//! own task), using the newest certificate: the files are re-read when they
//! change ([`crate::reload`]). Each connection carries a [`PeerInfo`], which
//! tonic puts into every request's extensions, so the guard can read the
//! verified client certificate's Common Name.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::reload::Reloading;

/// The longest a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections accepted but not yet taken by the server.
const BACKLOG: usize = 128;

/// Whether a client certificate must be presented when a client CA is set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClientAuth {
    /// Every connection must present a certificate that chains to the CA.
    Required,
    /// A certificate, when presented, must chain to the CA; callers without
    /// one identify with a bearer token.
    Optional,
}

/// Where the PEM files are.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
    pub client_auth: ClientAuth,
}

/// The server's TLS configuration, rebuilt when its files change.
pub type TlsConfig = Reloading<Arc<ServerConfig>>;

impl TlsFiles {
    /// Loads the files now (an error stops the start) and keeps them reloadable.
    pub fn open(&self) -> anyhow::Result<Arc<TlsConfig>> {
        let mut files = vec![(CERT_FILE, self.cert.clone()), (KEY_FILE, self.key.clone())];
        files.extend(self.client_ca.clone().map(|path| (CLIENT_CA_FILE, path)));
        let this = self.clone();
        Reloading::open("TLS certificate", files, move |contents| {
            this.server_config(contents).map(Arc::new)
        })
    }

    /// A file with the setting that names it, for errors:
    /// `IDEMPOTENCY_TLS_KEY_FILE=/etc/tls/tls.key`.
    fn named(setting: &str, path: &Path) -> String {
        format!("{setting}={}", path.display())
    }

    /// Builds a rustls configuration from the contents of the certificate
    /// chain, the key and optionally the client CA bundle. Every error names
    /// the setting of the file at fault.
    fn server_config(&self, contents: &[Vec<u8>]) -> anyhow::Result<ServerConfig> {
        let cert = Self::named(CERT_FILE, &self.cert);
        let key_file = Self::named(KEY_FILE, &self.key);
        let chain = CertificateDer::pem_slice_iter(&contents[0])
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("{cert} is not PEM: {e}"))?;
        anyhow::ensure!(!chain.is_empty(), "{cert} holds no PEM certificate");
        let key = PrivateKeyDer::from_pem_slice(&contents[1])
            .map_err(|e| anyhow::anyhow!("{key_file} holds no PEM private key: {e}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?;
        let builder = match (contents.get(2), &self.client_ca) {
            (Some(ca), Some(path)) => {
                let ca_file = Self::named(CLIENT_CA_FILE, path);
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(ca) {
                    let cert = cert.map_err(|e| anyhow::anyhow!("{ca_file} is not PEM: {e}"))?;
                    roots.add(cert).map_err(|e| {
                        anyhow::anyhow!("{ca_file} holds a certificate that is not valid: {e}")
                    })?;
                }
                anyhow::ensure!(!roots.is_empty(), "{ca_file} holds no PEM certificate");
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
                let verifier = match self.client_auth {
                    ClientAuth::Required => verifier.build(),
                    ClientAuth::Optional => verifier.allow_unauthenticated().build(),
                }
                .map_err(|e| anyhow::anyhow!("{ca_file}: {e}"))?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| anyhow::anyhow!("{cert} and {key_file} do not form a usable pair: {e}"))?;
        // gRPC is HTTP/2 only; clients such as grpc-go insist on ALPN.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// The settings that name the TLS files.
const CERT_FILE: &str = "IDEMPOTENCY_TLS_CERT_FILE";
const KEY_FILE: &str = "IDEMPOTENCY_TLS_KEY_FILE";
const CLIENT_CA_FILE: &str = "IDEMPOTENCY_TLS_CLIENT_CA_FILE";

/// What the guard may know about a connection.
#[derive(Debug, Clone, Default)]
pub struct PeerInfo {
    pub remote_addr: Option<SocketAddr>,
    /// The verified client certificate's subject Common Name (mutual TLS).
    pub client_cert_cn: Option<Arc<str>>,
}

/// One accepted connection, plain or TLS.
pub struct Conn {
    io: Io,
    peer: PeerInfo,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.peer.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Accepts connections on `listener` until `cancel` fires or the server stops
/// taking them; with `tls`, only connections whose handshake succeeded.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<TlsConfig>>,
    cancel: CancellationToken,
) -> ReceiverStream<io::Result<Conn>> {
    let (tx, rx) = mpsc::channel(BACKLOG);
    tokio::spawn(async move {
        loop {
            let (stream, remote_addr) = tokio::select! {
                () = cancel.cancelled() => return,
                () = tx.closed() => return,
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors and the like: wait, go on.
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = stream.set_nodelay(true);
            let peer = PeerInfo {
                remote_addr: Some(remote_addr),
                client_cert_cn: None,
            };
            match &tls {
                None => {
                    let conn = Conn {
                        io: Io::Plain(stream),
                        peer,
                    };
                    if tx.send(Ok(conn)).await.is_err() {
                        return;
                    }
                }
                Some(tls) => {
                    let acceptor = TlsAcceptor::from(tls.current().as_ref().clone());
                    let tx = tx.clone();
                    tokio::spawn(async move {
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await
                        {
                            Ok(Ok(stream)) => {
                                let peer = PeerInfo {
                                    client_cert_cn: client_cert_cn(&stream),
                                    ..peer
                                };
                                let conn = Conn {
                                    io: Io::Tls(Box::new(stream)),
                                    peer,
                                };
                                let _ = tx.send(Ok(conn)).await;
                            }
                            Ok(Err(error)) => {
                                tracing::debug!(%remote_addr, %error, "TLS handshake failed");
                                crate::metrics::record_tls_handshake_failure();
                            }
                            Err(_) => {
                                tracing::debug!(%remote_addr, "TLS handshake timed out");
                                crate::metrics::record_tls_handshake_failure();
                            }
                        }
                    });
                }
            }
        }
    });
    ReceiverStream::new(rx)
}

/// The subject CN of the client's (verified) certificate.
fn client_cert_cn(stream: &TlsStream<TcpStream>) -> Option<Arc<str>> {
    let cert = stream.get_ref().1.peer_certificates()?.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
    Some(Arc::from(cn))
}
