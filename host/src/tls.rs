//! TLS failures as the connections see them: the handshake's verdict (an untrusted or
//! mismatched certificate, a required client certificate missing, a peer that does not speak
//! TLS) reaches PostgreSQL's and RabbitMQ's clients as an I/O error carrying a rustls error.
//! It is a configuration fault; a network failure carries none and is retried. And the TLS
//! client settings of the message transactions' PostgreSQL sessions (as libpq's `sslmode`)
//! and of NATS connections.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// Whether an I/O error carries the TLS handshake's verdict (an untrusted or mismatched
/// certificate, a peer that does not speak TLS) rather than a network failure.
pub fn carries_tls_error(io_error: &std::io::Error) -> bool {
    io_error
        .get_ref()
        .is_some_and(|inner| chain_carries_tls_error(inner))
}

/// Whether `error` or any error it wraps is a rustls error.
pub fn chain_carries_tls_error(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        // An I/O error's `source` skips the error it wraps.
        next = match error.downcast_ref::<std::io::Error>() {
            Some(io_error) => io_error.get_ref().map(|inner| inner as _),
            None => error.source(),
        };
    }
    false
}

/// How a PostgreSQL session checks the server's certificate, as libpq's `sslmode` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verify {
    /// `prefer`, `require`: encrypted, the certificate not checked.
    Nothing,
    /// `verify-ca`: signed by a trusted authority, whatever name it carries.
    Authority,
    /// `verify-full`: signed by a trusted authority and naming the host.
    Full,
}

/// Why TLS settings cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {what} {path}: {reason}")]
pub struct TlsFileError {
    what: &'static str,
    path: PathBuf,
    reason: String,
}

/// The settings a client's TLS files are named by, for the errors that name them.
pub struct FileSettings {
    /// The authorities trusted besides the public roots.
    pub roots: &'static str,
    /// The client certificate.
    pub cert: &'static str,
    /// The client certificate's private key.
    pub key: &'static str,
}

/// A PostgreSQL session's TLS files, as libpq names them.
pub const POSTGRES_FILES: FileSettings = FileSettings {
    roots: "sslrootcert",
    cert: "sslcert",
    key: "sslkey",
};

/// A rustls client configuration: the authorities of `root_cert` (a PEM file) beside the
/// Mozilla roots, checked as `verify` says, and the client certificate `cert` with its `key`
/// when the server asks for one. For a PostgreSQL session the same rules as the bookkeeping
/// pool's driver; `files` names the settings in errors.
pub fn client_config(
    verify: Verify,
    root_cert: Option<&Path>,
    client: Option<(&Path, &Path)>,
    files: &FileSettings,
) -> Result<rustls::ClientConfig, TlsFileError> {
    let mut roots =
        rustls::RootCertStore::from_iter(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = root_cert {
        for certificate in
            CertificateDer::pem_file_iter(path).map_err(file_error(files.roots, path))?
        {
            let certificate = certificate.map_err(file_error(files.roots, path))?;
            roots
                .add(certificate)
                .map_err(file_error(files.roots, path))?;
        }
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(file_error("the TLS provider", Path::new("")))?;
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        Arc::clone(&provider),
    )
    .build()
    .map_err(file_error(files.roots, root_cert.unwrap_or(Path::new(""))))?;
    let builder = match verify {
        Verify::Full => builder.with_webpki_verifier(webpki),
        Verify::Authority | Verify::Nothing => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Lenient {
                webpki,
                check_chain: verify == Verify::Authority,
            })),
    };
    match client {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let chain = CertificateDer::pem_file_iter(cert)
                .map_err(file_error(files.cert, cert))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(file_error(files.cert, cert))?;
            let key_der = PrivateKeyDer::from_pem_file(key).map_err(file_error(files.key, key))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(file_error(files.cert, cert))
        }
    }
}

/// A `TlsFileError` for `what` at `path`, from whatever the reading or the check said.
fn file_error<E: std::fmt::Display>(
    what: &'static str,
    path: &Path,
) -> impl Fn(E) -> TlsFileError + use<E> {
    let path = path.to_path_buf();
    move |error| TlsFileError {
        what,
        path: path.clone(),
        reason: error.to_string(),
    }
}

/// `verify-ca`, `prefer` and `require`: the chain is checked but not the name
/// (`check_chain`), or nothing but the handshake's own signatures.
#[derive(Debug)]
struct Lenient {
    webpki: Arc<rustls::client::WebPkiServerVerifier>,
    check_chain: bool,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if !self.check_chain {
            return Ok(ServerCertVerified::assertion());
        }
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}
