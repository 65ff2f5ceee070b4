//! TLS on the proxy's listener, with rustls: HTTP/1.1 and HTTP/2 offered by
//! ALPN (`h2`, `http/1.1`), the certificate and key read from PEM files and
//! read again when they change.
//!
//! The files are re-read every `reload_interval` and compared with what was
//! loaded (a whole read, not a timestamp: Kubernetes swaps a Secret's files
//! through a symlink, and cert-manager rotates them in place). New contents
//! that load take effect for the next handshake; contents that do not load
//! are logged once and the previous certificate stays in force.
//!
//! This is the service's `src/tls.rs` and `src/reload.rs` cut down to what
//! a listener without client certificates needs. It is a copy because the
//! gateway does not depend on the service crate (that would bring its store
//! into the gateway's build), and the service's modules are not a library of
//! their own.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use tracing::{error, info};

/// The longest a TLS handshake may take before the connection is dropped:
/// a slow or silent client holds nothing but its own task meanwhile.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Where the PEM files are, and how often they are read again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, leaf first (`tls.cert_file`).
    pub cert: PathBuf,
    /// Its private key, PKCS#8, PKCS#1 or SEC1 (`tls.key_file`).
    pub key: PathBuf,
    pub reload_interval: Duration,
}

/// The certificate in force, rebuilt when its files change.
pub struct Certificate {
    files: TlsFiles,
    state: RwLock<Loaded>,
}

struct Loaded {
    /// What the files held when last read, to tell a change.
    contents: [Vec<u8>; 2],
    acceptor: TlsAcceptor,
}

impl Certificate {
    /// Reads and loads the files now: an error here stops the start, and
    /// names the setting of the file at fault.
    pub fn open(files: &TlsFiles) -> Result<Arc<Self>, String> {
        let contents = read(files)?;
        let acceptor = acceptor(files, &contents)?;
        Ok(Arc::new(Self {
            files: files.clone(),
            state: RwLock::new(Loaded { contents, acceptor }),
        }))
    }

    /// The acceptor for the next handshake.
    pub fn acceptor(&self) -> TlsAcceptor {
        self.state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .acceptor
            .clone()
    }

    /// Reads the files again and loads them when they changed. True when a
    /// new certificate is in force.
    pub fn check(&self) -> bool {
        let contents = match read(&self.files) {
            Ok(contents) => contents,
            Err(error) => {
                error!(%error, "cannot read the TLS files; keeping the certificate in force");
                return false;
            }
        };
        if self
            .state
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contents
            == contents
        {
            return false;
        }
        match acceptor(&self.files, &contents) {
            Ok(acceptor) => {
                *self.state.write().unwrap_or_else(|e| e.into_inner()) =
                    Loaded { contents, acceptor };
                info!("TLS certificate reloaded");
                true
            }
            Err(error) => {
                error!(%error, "the TLS files changed but do not load; keeping the certificate in force");
                // Remember them, so the same broken contents are logged once.
                self.state
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .contents = contents;
                false
            }
        }
    }

    /// Checks the files every `reload_interval`, for as long as it runs (the
    /// server aborts it when it stops).
    pub async fn watch(self: Arc<Self>) {
        let mut ticker = tokio::time::interval(self.files.reload_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            let this = self.clone();
            // File reads and certificate parsing are blocking work.
            let _ = tokio::task::spawn_blocking(move || this.check()).await;
        }
    }
}

fn read(files: &TlsFiles) -> Result<[Vec<u8>; 2], String> {
    let read = |setting: &str, path: &PathBuf| {
        std::fs::read(path).map_err(|e| format!("{setting}: {}: cannot read: {e}", path.display()))
    };
    Ok([
        read("tls.cert_file", &files.cert)?,
        read("tls.key_file", &files.key)?,
    ])
}

/// A rustls acceptor from the chain and the key; every error names the
/// setting of the file at fault.
fn acceptor(files: &TlsFiles, contents: &[Vec<u8>; 2]) -> Result<TlsAcceptor, String> {
    let cert = format!("tls.cert_file: {}", files.cert.display());
    let key_file = format!("tls.key_file: {}", files.key.display());
    let chain = CertificateDer::pem_slice_iter(&contents[0])
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{cert} is not PEM: {e}"))?;
    if chain.is_empty() {
        return Err(format!("{cert} holds no PEM certificate"));
    }
    let key = PrivateKeyDer::from_pem_slice(&contents[1])
        .map_err(|e| format!("{key_file} holds no PEM private key: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS protocol versions: {e}"))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| format!("{cert} and {key_file} do not form a usable pair: {e}"))?;
    // HTTP/2 preferred; a client that offers neither (or no ALPN at all)
    // speaks HTTP/1.1, which the server's automatic builder detects.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_that_cannot_be_read_or_do_not_load_are_errors_naming_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let files = TlsFiles {
            cert: dir.path().join("tls.crt"),
            key: dir.path().join("tls.key"),
            reload_interval: Duration::from_secs(10),
        };
        let error = Certificate::open(&files).err().unwrap();
        assert!(error.starts_with("tls.cert_file: "), "{error}");
        std::fs::write(&files.cert, "not a certificate").unwrap();
        std::fs::write(&files.key, "not a key").unwrap();
        let error = Certificate::open(&files).err().unwrap();
        assert!(error.contains("holds no PEM certificate"), "{error}");
    }
}
