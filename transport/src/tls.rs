//! The cluster's certificates: a cluster CA (`converged cluster init`), one
//! certificate per node signed by it (`converged cluster issue-cert`), and
//! the QUIC/TLS configurations that accept only peers holding such a
//! certificate, in both directions.

use std::path::Path;
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// ALPN of the peer protocol; a peer speaking anything else is refused.
pub const ALPN: &[u8] = b"converged/1";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("certificate generation: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Config(String),
    #[error("{0} holds no usable PEM certificate or key")]
    Pem(String),
    #[error("node name {0:?} must be 1-63 letters, digits or '-'")]
    NodeName(String),
}

fn read(dir: &Path, name: &str) -> Result<String, TlsError> {
    let path = dir.join(name);
    std::fs::read_to_string(&path).map_err(|err| TlsError::Io { path: path.display().to_string(), err })
}

fn write(dir: &Path, name: &str, contents: &str, mode: u32) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(name);
    let io = |err| TlsError::Io { path: path.display().to_string(), err };
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut f =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(mode).open(&path).map_err(io)?;
    f.write_all(contents.as_bytes()).map_err(io)
}

fn ca_params(cn: &str) -> Result<CertificateParams, TlsError> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.distinguished_name.push(DnType::CommonName, cn);
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(p)
}

/// The cluster CA: signs node certificates. Its key stays on the admin's machine.
pub struct ClusterCa {
    pub cn: String,
    pub cert_pem: String,
    key: KeyPair,
}

impl ClusterCa {
    /// A new CA named `cn` (for example "converged cluster prod-a").
    pub fn generate(cn: &str) -> Result<Self, TlsError> {
        let key = KeyPair::generate()?;
        let cert = ca_params(cn)?.self_signed(&key)?;
        Ok(Self { cn: cn.into(), cert_pem: cert.pem(), key })
    }

    /// Write `ca.pem`, `ca.key` (mode 0600) and `ca.cn` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), TlsError> {
        write(dir, "ca.pem", &self.cert_pem, 0o644)?;
        write(dir, "ca.key", &self.key.serialize_pem(), 0o600)?;
        write(dir, "ca.cn", &self.cn, 0o644)
    }

    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        let key = KeyPair::from_pem(&read(dir, "ca.key")?).map_err(|_| TlsError::Pem("ca.key".into()))?;
        Ok(Self { cn: read(dir, "ca.cn")?.trim().to_string(), cert_pem: read(dir, "ca.pem")?, key })
    }

    /// A certificate for node `name`, valid as both TLS server and client.
    pub fn issue(&self, name: &str) -> Result<NodeTls, TlsError> {
        if name.is_empty() || name.len() > 63 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(TlsError::NodeName(name.into()));
        }
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::new(vec![name.to_string()])?;
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let issuer = Issuer::new(ca_params(&self.cn)?, &self.key);
        let cert = p.signed_by(&key, &issuer)?;
        Ok(NodeTls {
            node: name.into(),
            ca_pem: self.cert_pem.clone(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

/// What one node needs to talk to its peers: the CA to trust, its own
/// certificate and key.
#[derive(Clone)]
pub struct NodeTls {
    pub node: String,
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

impl NodeTls {
    /// Write `ca.pem`, `node.pem`, `node.key` (0600) and `node.name` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), TlsError> {
        write(dir, "ca.pem", &self.ca_pem, 0o644)?;
        write(dir, "node.pem", &self.cert_pem, 0o644)?;
        write(dir, "node.key", &self.key_pem, 0o600)?;
        write(dir, "node.name", &self.node, 0o644)
    }

    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        Ok(Self {
            node: read(dir, "node.name")?.trim().to_string(),
            ca_pem: read(dir, "ca.pem")?,
            cert_pem: read(dir, "node.pem")?,
            key_pem: read(dir, "node.key")?,
        })
    }

    /// What lets this node, started again, end the connections its
    /// peers still hold to its last run: the key of its QUIC stateless
    /// reset tokens (RFC 9000 §10.3) and the key its connection IDs are
    /// signed with, both derived from its private key and so the same
    /// after a restart. A peer's packet on a connection this node lost in
    /// a crash then carries a connection ID this node recognises as its
    /// own, and is answered with a reset the peer believes: the peer drops
    /// that connection and connects again at once, instead of calling into
    /// it until its idle timeout (tens of seconds of calls that each wait
    /// out their deadline). Only the node's own key makes a valid token, so
    /// no one else can reset its peers' connections to it.
    pub fn restart_keys(&self) -> (ring::hmac::Key, u64) {
        use ring::hmac;
        let node_key = hmac::Key::new(hmac::HMAC_SHA256, self.key_pem.as_bytes());
        let reset = hmac::sign(&node_key, b"converged quic stateless reset key v1");
        let cid = hmac::sign(&node_key, b"converged quic connection id key v1");
        let cid = u64::from_le_bytes(cid.as_ref()[..8].try_into().expect("a SHA-256 tag has 32 bytes"));
        (hmac::Key::new(hmac::HMAC_SHA256, reset.as_ref()), cid)
    }

    fn parts(&self) -> Result<(rustls::RootCertStore, Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(self.ca_pem.as_bytes()) {
            let ca = ca.map_err(|_| TlsError::Pem("ca.pem".into()))?;
            roots.add(ca).map_err(|e| TlsError::Config(e.to_string()))?;
        }
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<_, _>>()
            .map_err(|_| TlsError::Pem("node.pem".into()))?;
        let key =
            PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).map_err(|_| TlsError::Pem("node.key".into()))?;
        if roots.is_empty() || chain.is_empty() {
            return Err(TlsError::Pem("ca.pem/node.pem".into()));
        }
        Ok((roots, chain, key))
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    /// Server side: only clients with a certificate from the cluster CA.
    pub fn server_config(&self) -> Result<quinn::ServerConfig, TlsError> {
        let (roots, chain, key) = self.parts()?;
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Self::provider())
            .build()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let mut tls = rustls::ServerConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain, key)
            .map_err(|e| TlsError::Config(e.to_string()))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let quic = QuicServerConfig::try_from(tls).map_err(|e| TlsError::Config(e.to_string()))?;
        Ok(quinn::ServerConfig::with_crypto(Arc::new(quic)))
    }

    /// Client side: present our certificate, trust only the cluster CA.
    pub fn client_config(&self) -> Result<quinn::ClientConfig, TlsError> {
        let (roots, chain, key) = self.parts()?;
        let mut tls = rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| TlsError::Config(e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| TlsError::Config(e.to_string()))?;
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let quic = QuicClientConfig::try_from(tls).map_err(|e| TlsError::Config(e.to_string()))?;
        Ok(quinn::ClientConfig::new(Arc::new(quic)))
    }
}
