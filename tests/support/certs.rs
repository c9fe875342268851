//! Certificates made by a test: a CA of its own and leaves it signs, written as PEM files.

use std::path::PathBuf;

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

use super::procs::TempDir;

/// A certificate and its key, as files.
#[derive(Debug, Clone)]
pub struct Pem {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pem {
    pub fn cert(&self) -> &str {
        self.cert.to_str().unwrap()
    }

    pub fn key(&self) -> &str {
        self.key.to_str().unwrap()
    }
}

/// A test CA.
pub struct Ca {
    name: String,
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// Its certificate, for a peer to trust.
    pub cert: PathBuf,
}

impl Ca {
    pub fn new(dir: &TempDir, name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.distinguished_name.push(DnType::CommonName, name);
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let cert = dir.write(&format!("{name}.crt"), &issuer.pem());
        Ca { name: name.to_string(), issuer, cert }
    }

    pub fn cert(&self) -> &str {
        self.cert.to_str().unwrap()
    }

    /// A server certificate for these DNS names.
    pub fn server(&self, dir: &TempDir, file: &str, dns: &[&str]) -> Pem {
        let mut params = CertificateParams::new(dns.iter().map(|d| d.to_string()).collect::<Vec<_>>()).unwrap();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.leaf(dir, file, params)
    }

    /// A client certificate naming this URI (a SPIFFE id, say).
    pub fn client(&self, dir: &TempDir, file: &str, uri: &str) -> Pem {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = vec![SanType::URI(uri.try_into().unwrap())];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.leaf(dir, file, params)
    }

    fn leaf(&self, dir: &TempDir, file: &str, mut params: CertificateParams) -> Pem {
        params.distinguished_name.push(DnType::CommonName, format!("{file} ({})", self.name));
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Pem {
            cert: dir.write(&format!("{file}.crt"), &cert.pem()),
            key: dir.write(&format!("{file}.key"), &key.serialize_pem()),
        }
    }
}
