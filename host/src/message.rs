//! A delivery as the plugin sees it: broker-neutral, owned data.

/// One message handed to a plugin.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboundMessage {
    pub pipeline: String,
    pub body: Vec<u8>,
    /// Headers in broker order; non-string values rendered as text.
    pub headers: Vec<(String, String)>,
    pub routing_key: String,
    pub exchange: String,
    pub message_id: Option<String>,
    pub redelivered: bool,
}
