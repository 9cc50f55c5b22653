//! A delivery as the plugin sees it: source-neutral, owned data.

/// One message handed to a plugin (`message` in `wit/world.wit`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboundMessage {
    pub pipeline: String,
    /// The kind of source: `rabbitmq`, `jetstream` or `kafka`.
    pub source: String,
    /// The queue (RabbitMQ), stream (JetStream) or topic (Kafka) consumed.
    pub queue: String,
    /// The subject (JetStream), the routing key (RabbitMQ), or the topic (Kafka).
    pub subject: String,
    pub body: Vec<u8>,
    /// Headers in the source's order; non-string values rendered as text.
    pub headers: Vec<(String, String)>,
    pub message_id: Option<String>,
    pub redelivered: bool,
    /// Deliveries so far, this one included, when the source counts them.
    pub delivery_count: Option<u32>,
    /// What only this kind of source knows (`exchange`, `routing-key`, `stream-sequence`…).
    pub attributes: Vec<(String, String)>,
}

impl InboundMessage {
    /// The value of attribute `name`, if the source gave one.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}
