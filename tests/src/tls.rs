//! TLS for the connectivity tests: a throwaway PKI made with `openssl` (a CA, a server
//! certificate for `localhost` and `127.0.0.1`, a client certificate), an amqps endpoint (a
//! TLS-terminating proxy in front of the local RabbitMQ), and an https listener for axum.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

/// A CA with a server and a client certificate it signed, as PEM files in `directory`.
pub struct Pki {
    pub directory: PathBuf,
    pub ca: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl Pki {
    /// Makes the CA and both certificates (P-256 keys, valid two days).
    pub fn new(directory: &Path) -> Pki {
        std::fs::create_dir_all(directory).expect("PKI directory");
        let ca = self_signed_ca(directory, "ca", "idem test CA");
        let ca_key = directory.join("ca.key");
        let issue = |name: &str, subject: &str, extensions: &str| {
            let key = directory.join(format!("{name}.key"));
            let request = directory.join(format!("{name}.csr"));
            let certificate = directory.join(format!("{name}.pem"));
            let extension_file = directory.join(format!("{name}.ext"));
            std::fs::write(&extension_file, extensions).expect("write extensions");
            openssl(
                Command::new("openssl")
                    .args(["req", "-new", "-newkey", "ec", "-pkeyopt"])
                    .args(["ec_paramgen_curve:prime256v1", "-nodes", "-subj", subject])
                    .arg("-keyout")
                    .arg(&key)
                    .arg("-out")
                    .arg(&request),
            );
            openssl(
                Command::new("openssl")
                    .args(["x509", "-req", "-days", "2", "-in"])
                    .arg(&request)
                    .arg("-CA")
                    .arg(&ca)
                    .arg("-CAkey")
                    .arg(&ca_key)
                    .args(["-CAcreateserial", "-out"])
                    .arg(&certificate)
                    .arg("-extfile")
                    .arg(&extension_file),
            );
            (certificate, key)
        };
        let (server_cert, server_key) = issue(
            "server",
            "/CN=localhost",
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
        );
        let (client_cert, client_key) = issue(
            "client",
            "/CN=idem",
            "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n",
        );
        Pki {
            directory: directory.to_path_buf(),
            ca,
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }

    /// A server config presenting the server certificate; with `require_client`, only
    /// clients with a certificate this CA signed get through (mutual TLS).
    pub fn server_config(&self, require_client: bool) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let certificates = CertificateDer::pem_file_iter(&self.server_cert)
            .expect("server certificate")
            .collect::<Result<Vec<_>, _>>()
            .expect("server certificate PEM");
        let key = PrivateKeyDer::from_pem_file(&self.server_key).expect("server key");
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("protocol versions");
        let builder = if require_client {
            let mut roots = RootCertStore::empty();
            for certificate in CertificateDer::pem_file_iter(&self.ca).expect("CA") {
                roots
                    .add(certificate.expect("CA PEM"))
                    .expect("CA accepted");
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .expect("client verifier");
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        Arc::new(
            builder
                .with_single_cert(certificates, key)
                .expect("server certificate and key"),
        )
    }
}

/// A self-signed CA certificate `<name>.pem` (key `<name>.key`) in `directory`.
pub fn self_signed_ca(directory: &Path, name: &str, common_name: &str) -> PathBuf {
    std::fs::create_dir_all(directory).expect("PKI directory");
    let certificate = directory.join(format!("{name}.pem"));
    openssl(
        Command::new("openssl")
            .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
            .args(["ec_paramgen_curve:prime256v1", "-nodes", "-days", "2"])
            .arg("-subj")
            .arg(format!("/CN={common_name}"))
            .arg("-keyout")
            .arg(directory.join(format!("{name}.key")))
            .arg("-out")
            .arg(&certificate),
    );
    certificate
}

fn openssl(command: &mut Command) {
    let output = command
        .stdin(Stdio::null())
        .output()
        .expect("run openssl (apt-get install openssl)");
    assert!(
        output.status.success(),
        "openssl failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// What one TLS handshake at an endpoint came to.
#[derive(Debug, Clone)]
pub struct Handshake {
    /// `TLSv1_3 TLS13_AES_256_GCM_SHA384`, or the handshake's error.
    pub outcome: Result<String, String>,
    /// Whether the client presented a certificate.
    pub client_certificate: bool,
}

/// What a client sends before its TLS handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Preamble {
    /// Nothing: the handshake starts at once (amqps).
    None,
    /// PostgreSQL's SSLRequest, answered `S` (the server agrees to TLS).
    PostgresSslRequest,
}

/// PostgreSQL's SSLRequest: length 8, code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// A TLS-terminating proxy in front of a plain TCP service (RabbitMQ's 5672, PostgreSQL's
/// 5432), on loopback.
pub struct TlsProxy {
    pub port: u16,
    handshakes: Arc<Mutex<Vec<Handshake>>>,
    task: JoinHandle<()>,
}

impl TlsProxy {
    /// An amqps endpoint on 127.0.0.1: TLS from the first byte.
    pub async fn start(target: SocketAddr, config: Arc<rustls::ServerConfig>) -> TlsProxy {
        TlsProxy::listen(IpAddr::from([127, 0, 0, 1]), target, config, Preamble::None).await
    }

    /// A PostgreSQL server with TLS on `address` (a loopback address; `127.0.0.2` is not
    /// among the test server certificate's names): it answers the client's SSLRequest, then
    /// terminates TLS and forwards the plain protocol to `target`. A client that does not
    /// ask for TLS is turned away.
    pub async fn postgres(
        address: IpAddr,
        target: SocketAddr,
        config: Arc<rustls::ServerConfig>,
    ) -> TlsProxy {
        TlsProxy::listen(address, target, config, Preamble::PostgresSslRequest).await
    }

    async fn listen(
        address: IpAddr,
        target: SocketAddr,
        config: Arc<rustls::ServerConfig>,
        preamble: Preamble,
    ) -> TlsProxy {
        let listener = TcpListener::bind((address, 0)).await.expect("bind proxy");
        let port = listener.local_addr().expect("proxy address").port();
        let acceptor = TlsAcceptor::from(config);
        let handshakes = Arc::new(Mutex::new(Vec::new()));
        let recorded = Arc::clone(&handshakes);
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                let recorded = Arc::clone(&recorded);
                tokio::spawn(async move {
                    if preamble == Preamble::PostgresSslRequest
                        && let Err(error) = answer_ssl_request(&mut client).await
                    {
                        recorded.lock().expect("handshakes").push(Handshake {
                            outcome: Err(error),
                            client_certificate: false,
                        });
                        return;
                    }
                    let accepted = acceptor.accept(client).await;
                    let handshake = match &accepted {
                        Ok(stream) => describe(stream.get_ref().1),
                        Err(error) => Handshake {
                            outcome: Err(error.to_string()),
                            client_certificate: false,
                        },
                    };
                    recorded.lock().expect("handshakes").push(handshake);
                    let Ok(mut tls) = accepted else { return };
                    let Ok(mut upstream) = TcpStream::connect(target).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut upstream).await;
                });
            }
        });
        TlsProxy {
            port,
            handshakes,
            task,
        }
    }

    /// Every handshake so far.
    pub fn handshakes(&self) -> Vec<Handshake> {
        self.handshakes.lock().expect("handshakes").clone()
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Asserts that something connected, and that every handshake succeeded with a client
/// certificate (mutual TLS).
pub fn assert_every_handshake_presented_a_certificate(handshakes: &[Handshake]) {
    assert!(
        !handshakes.is_empty(),
        "nothing connected through the TLS endpoint"
    );
    for handshake in handshakes {
        assert!(
            handshake.outcome.is_ok(),
            "a handshake failed: {handshake:?}"
        );
        assert!(
            handshake.client_certificate,
            "no client certificate: {handshake:?}"
        );
    }
}

/// Reads a PostgreSQL client's first message; when it is an SSLRequest, answers `S`.
async fn answer_ssl_request(client: &mut TcpStream) -> Result<(), String> {
    let mut request = [0u8; 8];
    client
        .read_exact(&mut request)
        .await
        .map_err(|error| format!("no SSLRequest: {error}"))?;
    if request != SSL_REQUEST {
        return Err(format!("the client did not ask for TLS: {request:?}"));
    }
    client
        .write_all(b"S")
        .await
        .map_err(|error| format!("answering the SSLRequest: {error}"))
}

fn describe(connection: &rustls::ServerConnection) -> Handshake {
    Handshake {
        outcome: Ok(format!(
            "{:?} {:?}",
            connection.protocol_version(),
            connection
                .negotiated_cipher_suite()
                .map(|suite| suite.suite())
        )),
        client_certificate: connection
            .peer_certificates()
            .is_some_and(|certificates| !certificates.is_empty()),
    }
}

/// An https listener for `axum::serve`: TLS-accepts each connection (failed handshakes are
/// recorded and skipped).
pub struct HttpsListener {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    handshakes: Arc<Mutex<Vec<Handshake>>>,
}

impl HttpsListener {
    /// Binds a loopback port; returns the listener, its port and its handshake record.
    pub async fn bind(
        config: Arc<rustls::ServerConfig>,
    ) -> (HttpsListener, u16, Arc<Mutex<Vec<Handshake>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind https");
        let port = listener.local_addr().expect("https address").port();
        let handshakes = Arc::new(Mutex::new(Vec::new()));
        (
            HttpsListener {
                listener,
                acceptor: TlsAcceptor::from(config),
                handshakes: Arc::clone(&handshakes),
            },
            port,
            handshakes,
        )
    }
}

impl axum::serve::Listener for HttpsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, address)) = self.listener.accept().await else {
                continue;
            };
            let accepted = self.acceptor.accept(tcp).await;
            let handshake = match &accepted {
                Ok(stream) => describe(stream.get_ref().1),
                Err(error) => Handshake {
                    outcome: Err(error.to_string()),
                    client_certificate: false,
                },
            };
            self.handshakes.lock().expect("handshakes").push(handshake);
            if let Ok(stream) = accepted {
                return (stream, address);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}
