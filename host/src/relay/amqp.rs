//! Outbox rows to AMQP exchanges: published persistent and `mandatory` with the idempotency
//! key as `message-id`, through the one confirmed publish (`source::rabbitmq::publish`); an
//! unroutable message is a failed attempt.

use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};

use super::DeliveryError;
use crate::config::AmqpConfig;
use crate::source::rabbitmq::{self, publish};
use crate::store::outbox::Taken;

/// AMQP persistent delivery mode.
const PERSISTENT: u8 = 2;

/// The relay's connection to the broker of AMQP destinations, opened at the first use and
/// again after it failed.
#[derive(Default)]
pub(super) struct Publisher {
    open: Option<(AmqpConfig, Connection, Channel)>,
}

impl Publisher {
    /// Publishes `row` with `sent_headers` to `exchange` on `broker` under `routing_key`;
    /// `Ok` once the broker confirmed it.
    pub async fn deliver(
        &mut self,
        broker: &AmqpConfig,
        exchange: &str,
        routing_key: &str,
        row: &Taken,
        sent_headers: &[(String, String)],
    ) -> Result<(), DeliveryError> {
        // A name or key over AMQP's 255 bytes (a row written before rows were checked)
        // fails the attempt instead of the relay.
        let short = |text: &str, what: &str| {
            ShortString::try_new(text).map_err(|_| DeliveryError::Publish {
                exchange: exchange.to_string(),
                reason: format!("{what} of {} bytes does not fit AMQP's 255", text.len()),
            })
        };
        let mut headers = FieldTable::default();
        for (name, value) in sent_headers {
            headers.insert(
                short(name, "a header name")?,
                AMQPValue::LongString(value.as_str().into()),
            );
        }
        headers.insert(
            "idempotency-key".into(),
            AMQPValue::LongString(row.idempotency_key.as_str().into()),
        );
        let properties = BasicProperties::default()
            .with_delivery_mode(PERSISTENT)
            .with_message_id(short(&row.idempotency_key, "the idempotency key")?)
            .with_headers(headers);
        let channel = self.channel(broker).await?;
        match publish::confirmed(&channel, exchange, routing_key, &row.payload, properties).await {
            Ok(()) => Ok(()),
            Err(publish::Unconfirmed::Returned) => Err(DeliveryError::Unroutable {
                exchange: exchange.to_string(),
                routing_key: routing_key.to_string(),
            }),
            Err(unconfirmed) => {
                // A confirm or a return that comes late must not be taken for the next
                // publish's: a channel that timed out is not used again.
                if matches!(
                    unconfirmed,
                    publish::Unconfirmed::Channel(_) | publish::Unconfirmed::TimedOut(_)
                ) {
                    self.open = None;
                }
                Err(DeliveryError::Publish {
                    exchange: exchange.to_string(),
                    reason: unconfirmed.to_string(),
                })
            }
        }
    }

    /// A channel with publisher confirms on `broker`: the one open, or a new one.
    async fn channel(&mut self, broker: &AmqpConfig) -> Result<Channel, DeliveryError> {
        if let Some((open_on, connection, channel)) = &self.open
            && open_on == broker
            && connection.status().connected()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        self.close().await;
        let (connection, channel) = rabbitmq::connect_channel(broker, "outbox relay")
            .await
            .map_err(|error| DeliveryError::Broker(error.to_string()))?;
        channel
            .confirm_select(lapin::options::ConfirmSelectOptions::default())
            .await
            .map_err(|error| {
                DeliveryError::Broker(format!("enable publisher confirms for the outbox: {error}"))
            })?;
        self.open = Some((broker.clone(), connection, channel.clone()));
        Ok(channel)
    }

    /// Closes the connection, if one is open.
    pub async fn close(&mut self) {
        if let Some((_, connection, _)) = self.open.take() {
            let _ = connection.close(200, "idem relay stopping".into()).await;
        }
    }
}
