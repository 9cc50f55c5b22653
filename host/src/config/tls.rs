//! TLS settings of a broker client: `[amqp.tls]`, and a JetStream source's `tls`.

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::Deserialize;

use super::text::{Document, interpolated_path_option};

/// The `[amqp.tls]` table, and a JetStream source's `tls`. Relative paths resolve against the
/// config file's directory. The server's certificate must always name the URL's host.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ClientTls {
    /// PEM file of the certificate authorities that may sign the server's certificate, trusted
    /// besides the system's store.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate, for brokers that require one (mutual TLS).
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of the client certificate.
    #[serde(default, deserialize_with = "interpolated_path_option")]
    pub key_file: Option<PathBuf>,
}

impl ClientTls {
    /// Checks that the client certificate comes with its key, and resolves the paths against
    /// the config file's directory.
    pub(super) fn checked(mut self, document: &Document) -> Result<ClientTls, &'static str> {
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err("cert_file and key_file go together (the client certificate and its key)");
        }
        for path in [&mut self.ca_file, &mut self.cert_file, &mut self.key_file]
            .into_iter()
            .flatten()
        {
            *path = document.resolve(path);
        }
        Ok(self)
    }
}
