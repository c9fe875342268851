//! TLS on the main port (`server.tls`), and mutual TLS: a client must present a certificate the
//! configured CA signed, carrying one of the allowed identities as a subject alternative name (a
//! DNS name, or a URI such as a SPIFFE id). A client that does not is refused in the handshake, so
//! no call of any service (Check, the ext_proc stream, Admission) ever reaches tollgate from it.
//!
//! Handshakes run off the accept loop, at most [`MAX_HANDSHAKES`] at once and each for at most
//! [`HANDSHAKE_TIMEOUT`]: a client that connects and says nothing holds neither the loop nor memory.
//!
//! Certificates rotate without a restart: every `server.tls.reload_ms` (10 s) the files are looked
//! at (as the policy file is, through symlinks, so a Kubernetes Secret volume's swap is seen), and
//! when one changed the configuration is rebuilt and used for every handshake from then on.
//! Connections already open keep theirs. Files that cannot be used are refused with a warning, and
//! the configuration in force stays.

use std::io;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::{
    self, CertificateError, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme,
};
use tokio_rustls::server::TlsStream;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::config::TlsSettings;
use crate::reload::{Seen, seen};

/// How long a client may take to complete its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; connections beyond wait in the listen backlog.
pub const MAX_HANDSHAKES: usize = 256;

/// Why the TLS files could not be used; names the policy field.
#[derive(Debug, thiserror::Error)]
#[error("server.tls.{field} ({path}): {why}")]
pub struct TlsError {
    field: &'static str,
    path: String,
    why: String,
}

impl TlsError {
    fn new(field: &'static str, path: &Path, why: impl ToString) -> Self {
        TlsError { field, path: path.display().to_string(), why: why.to_string() }
    }
}

fn certificates(field: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|e| TlsError::new(field, path, e))?;
    if certs.is_empty() {
        return Err(TlsError::new(field, path, "holds no PEM certificate"));
    }
    Ok(certs)
}

/// The rustls configuration `settings` describe, for gRPC (HTTP/2), with its files read and
/// checked: a certificate that does not match its key, a CA file without a usable certificate, and
/// the like stop the start.
pub fn server_config(settings: &TlsSettings) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_for(settings, Alpn::H2)
}

/// The protocol a TLS port speaks, as it tells clients in the handshake (ALPN).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// gRPC.
    H2,
    /// Plain HTTP/1.1 (the admission webhook).
    Http1,
}

fn server_config_for(settings: &TlsSettings, alpn: Alpn) -> Result<Arc<ServerConfig>, TlsError> {
    let provider = Arc::new(ring::default_provider());
    let chain = certificates("cert", &settings.cert)?;
    let key = PrivateKeyDer::from_pem_file(&settings.key).map_err(|e| TlsError::new("key", &settings.key, e))?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::new("cert", &settings.cert, e))?;
    let builder = match &settings.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in certificates("client_ca", ca)? {
                roots.add(cert).map_err(|e| TlsError::new("client_ca", ca, e))?;
            }
            let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::new("client_ca", ca, e))?;
            let allowed = AllowedClients { inner, allowed: settings.allowed_clients.clone() };
            builder.with_client_cert_verifier(Arc::new(allowed))
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::new("key", &settings.key, format!("does not go with server.tls.cert: {e}")))?;
    config.alpn_protocols = match alpn {
        Alpn::H2 => vec![b"h2".to_vec()],
        Alpn::Http1 => vec![b"http/1.1".to_vec()],
    };
    Ok(Arc::new(config))
}

/// The TLS configuration in force, rebuilt when its files change.
pub struct LiveTls {
    settings: TlsSettings,
    alpn: Alpn,
    config: RwLock<Arc<ServerConfig>>,
    seen: Mutex<Vec<Option<Seen>>>,
}

impl std::fmt::Debug for LiveTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveTls").field("settings", &self.settings).finish_non_exhaustive()
    }
}

impl LiveTls {
    /// Reads the files, for gRPC; an error names the field.
    pub fn load(settings: &TlsSettings) -> Result<Arc<LiveTls>, TlsError> {
        LiveTls::load_for(settings, Alpn::H2)
    }

    /// Reads the files, for a port speaking `alpn`.
    pub fn load_for(settings: &TlsSettings, alpn: Alpn) -> Result<Arc<LiveTls>, TlsError> {
        let seen = LiveTls::stamps(settings);
        let config = server_config_for(settings, alpn)?;
        Ok(Arc::new(LiveTls { settings: settings.clone(), alpn, config: RwLock::new(config), seen: Mutex::new(seen) }))
    }

    /// Looks at the files every `every` (off the async workers: reading them blocks) until `stop`.
    pub fn watch(self: &Arc<Self>, every: Duration, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        let live = Arc::clone(self);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = ticks.tick() => {
                        let live = Arc::clone(&live);
                        let _ = tokio::task::spawn_blocking(move || live.refresh()).await;
                    }
                    () = stop.cancelled() => return,
                }
            }
        })
    }

    fn stamps(settings: &TlsSettings) -> Vec<Option<Seen>> {
        [Some(&settings.cert), Some(&settings.key), settings.client_ca.as_ref()]
            .into_iter()
            .flatten()
            .map(|p| seen(p))
            .collect()
    }

    /// The configuration new handshakes use.
    pub fn current(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.config.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Rebuilds the configuration if a file changed since the last look. True when it did.
    pub fn refresh(&self) -> bool {
        let now = LiveTls::stamps(&self.settings);
        {
            let mut last = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if *last == now {
                return false;
            }
            *last = now;
        }
        match server_config_for(&self.settings, self.alpn) {
            Ok(config) => {
                *self.config.write().unwrap_or_else(PoisonError::into_inner) = config;
                tracing::info!(cert = %self.settings.cert.display(), "TLS files changed: new handshakes use them");
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "TLS files changed but cannot be used; the ones in force stay");
                false
            }
        }
    }
}

/// The identities a certificate names: its DNS and URI subject alternative names.
pub fn identities(cert: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert.as_ref()) else { return Vec::new() };
    let Ok(Some(san)) = parsed.subject_alternative_name() else { return Vec::new() };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(n) | GeneralName::URI(n) => Some((*n).to_string()),
            _ => None,
        })
        .collect()
}

/// The CA's verdict, then the allow-list's.
#[derive(Debug)]
struct AllowedClients {
    inner: Arc<dyn ClientCertVerifier>,
    allowed: Vec<String>,
}

impl ClientCertVerifier for AllowedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner.verify_client_cert(end_entity, intermediates, now)?;
        if self.allowed.iter().any(|a| a == "*") {
            return Ok(ClientCertVerified::assertion());
        }
        let names = identities(end_entity);
        if names.iter().any(|n| self.allowed.contains(n)) {
            return Ok(ClientCertVerified::assertion());
        }
        tracing::warn!(identities = ?names, "refused a client certificate: no allowed identity (server.tls.allowed_clients)");
        Err(rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure))
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The connections of `listener` that completed a handshake, each with TCP_NODELAY set. Accepting
/// stops, and the listener closes, when `stop` is cancelled or the stream is dropped.
pub fn incoming(
    listener: TcpListener,
    live: Arc<LiveTls>,
    stop: CancellationToken,
) -> ReceiverStream<io::Result<TlsStream<TcpStream>>> {
    let (tx, rx) = mpsc::channel(MAX_HANDSHAKES);
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    if let Some(every) = live.settings.reload {
        live.watch(every, stop.clone());
    }
    tokio::spawn(async move {
        let mut tcp = super::server::incoming(listener);
        loop {
            // The semaphore is never closed: acquiring fails only if it were.
            let permit = tokio::select! {
                permit = Arc::clone(&handshakes).acquire_owned() => permit,
                () = stop.cancelled() => return,
            };
            let Ok(permit) = permit else { return };
            let accepted = tokio::select! {
                accepted = tcp.next() => accepted,
                () = stop.cancelled() => return,
                () = tx.closed() => return,
            };
            let stream = match accepted {
                Some(Ok(stream)) => stream,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "accept failed");
                    continue;
                }
                None => return,
            };
            let (acceptor, tx) = (TlsAcceptor::from(live.current()), tx.clone());
            tokio::spawn(async move {
                let peer = stream.peer_addr().ok();
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => {
                        drop(permit);
                        let _ = tx.send(Ok(tls)).await;
                    }
                    Ok(Err(e)) => tracing::info!(?peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::info!(?peer, "TLS handshake not completed within {HANDSHAKE_TIMEOUT:?}"),
                }
            });
        }
    });
    ReceiverStream::new(rx)
}
