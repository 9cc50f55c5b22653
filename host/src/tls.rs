//! TLS failures as the connections see them: the handshake's verdict (an untrusted or
//! mismatched certificate, a required client certificate missing, a peer that does not speak
//! TLS) reaches PostgreSQL's and RabbitMQ's clients as an I/O error carrying a rustls error.
//! It is a configuration fault; a network failure carries none and is retried.

/// Whether an I/O error carries the TLS handshake's verdict (an untrusted or mismatched
/// certificate, a peer that does not speak TLS) rather than a network failure.
pub fn carries_tls_error(io_error: &std::io::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> =
        io_error.get_ref().map(|inner| inner as _);
    while let Some(error) = source {
        if error.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        source = error.source();
    }
    false
}
