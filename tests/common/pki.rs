//! Certificates for the TLS tests, made with rcgen: a CA, a server
//! certificate for 127.0.0.1 and localhost, client certificates (valid,
//! expired, from another CA), written as PEM files in a temporary folder.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, date_time_ymd,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

pub struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, in PEM.
#[derive(Clone)]
pub struct Pair {
    pub cert: String,
    pub key: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Self { issuer }
    }

    pub fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// A server certificate for 127.0.0.1 and localhost.
    pub fn server(&self) -> Pair {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        params
            .distinguished_name
            .push(DnType::CommonName, "idempotency-service");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params)
    }

    /// A client certificate whose subject CN is `cn`.
    pub fn client(&self, cn: &str) -> Pair {
        self.sign(client_params(cn))
    }

    /// A client certificate that expired in 2021.
    pub fn expired_client(&self, cn: &str) -> Pair {
        let mut params = client_params(cn);
        params.not_before = date_time_ymd(2020, 1, 1);
        params.not_after = date_time_ymd(2021, 1, 1);
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> Pair {
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Pair {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

fn client_params(cn: &str) -> CertificateParams {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, cn);
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    params
}

/// Writes `contents` to `dir/name` (atomically: a rename, as Kubernetes does)
/// and returns the path.
pub fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    let temp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&temp, contents).unwrap();
    std::fs::rename(&temp, &path).unwrap();
    path
}

/// A TLS channel to `addr` that trusts `ca_pem`, presenting `client` if given.
pub fn channel(addr: SocketAddr, ca_pem: &str, client: Option<&Pair>) -> Channel {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name("localhost");
    if let Some(pair) = client {
        tls = tls.identity(Identity::from_pem(&pair.cert, &pair.key));
    }
    Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect_lazy()
}
