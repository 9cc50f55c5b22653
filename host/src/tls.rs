//! TLS failures as the connections see them: the handshake's verdict (an untrusted or
//! mismatched certificate, a required client certificate missing, a peer that does not speak
//! TLS) reaches PostgreSQL's and RabbitMQ's clients as an I/O error carrying a rustls error.
//! It is a configuration fault; a network failure carries none and is retried.
//!
//! And the one trust policy of every TLS client idem opens (PostgreSQL, RabbitMQ, NATS,
//! HTTPS deliveries): the system's store plus the CA file the client's settings name
//! ([`authorities`]), checked as the client's settings say ([`Verify`], libpq's `sslmode`
//! for PostgreSQL). The bookkeeping pool's driver (sqlx, with its native-roots TLS) applies
//! the same policy to the same settings.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

use crate::config::ClientTls;

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
    /// The authorities trusted besides the system's store.
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

/// The authorities a TLS client of idem trusts: the system's store, found as OpenSSL finds
/// it (`SSL_CERT_FILE` and `SSL_CERT_DIR` when set; on Debian `/etc/ssl/certs`, where
/// `update-ca-certificates` installs a corporate CA), and the certificates of `ca_file` (a
/// PEM file; `files.roots` names its setting in errors). A system store that cannot be read
/// where `SSL_CERT_FILE` or `SSL_CERT_DIR` point is refused; elsewhere its unreadable entries
/// are skipped, with a warning.
pub fn authorities(
    ca_file: Option<&Path>,
    files: &FileSettings,
) -> Result<rustls::RootCertStore, TlsFileError> {
    let system = rustls_native_certs::load_native_certs();
    if let Some(error) = system.errors.first() {
        let chosen = ["SSL_CERT_FILE", "SSL_CERT_DIR"]
            .into_iter()
            .find_map(|name| std::env::var_os(name).map(|path| (name, path)));
        match chosen {
            Some((name, path)) => {
                return Err(TlsFileError {
                    what: name,
                    path: path.into(),
                    reason: error.to_string(),
                });
            }
            None => tracing::warn!(
                %error,
                "Part of the system's certificate store could not be read; the rest is trusted."
            ),
        }
    }
    let mut roots = rustls::RootCertStore::empty();
    roots.add_parsable_certificates(system.certs);
    if let Some(path) = ca_file {
        let mut added = 0;
        for certificate in
            CertificateDer::pem_file_iter(path).map_err(file_error(files.roots, path))?
        {
            let certificate = certificate.map_err(file_error(files.roots, path))?;
            roots
                .add(certificate)
                .map_err(file_error(files.roots, path))?;
            added += 1;
        }
        if added == 0 {
            return Err(file_error(files.roots, path)("it holds no PEM certificate"));
        }
    }
    Ok(roots)
}

/// A rustls client configuration: the [`authorities`] (with `root_cert`), checked as `verify`
/// says, and the client certificate `cert` with its `key` when the server asks for one.
/// `files` names the settings in errors.
pub fn client_config(
    verify: Verify,
    root_cert: Option<&Path>,
    client: Option<(&Path, &Path)>,
    files: &FileSettings,
) -> Result<rustls::ClientConfig, TlsFileError> {
    let roots = authorities(root_cert, files)?;
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

/// A broker's TLS client settings (RabbitMQ's `[amqp.tls]`, a JetStream source's `tls`;
/// none given: the system's store alone): the server's certificate signed by one of the
/// [`authorities`] and naming the host, and the client certificate when one is set.
pub fn broker_config(
    settings: Option<&ClientTls>,
    files: &FileSettings,
) -> Result<rustls::ClientConfig, TlsFileError> {
    client_config(
        Verify::Full,
        settings.and_then(|settings| settings.ca_file.as_deref()),
        settings.and_then(|settings| {
            settings
                .cert_file
                .as_deref()
                .zip(settings.key_file.as_deref())
        }),
        files,
    )
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
