//! A read model kept by version-guarded upserts: the example of `claim = "none"`.
//!
//! Input: a `CustomerProfileChanged` event carrying the whole profile and its version,
//! `{"customer_id": 7, "version": 3, "name": "Ada", "email": "ada@example.com"}`.
//! Effect: `upsert_profile`, an `INSERT … ON CONFLICT (customer_id) DO UPDATE … WHERE
//! customer_profiles.version < EXCLUDED.version` named in `pipelines.toml`. A repeated or
//! older delivery changes no row (outcome `stale`), so no claim is needed: the newest
//! version wins whatever order the broker delivers in.

use idem_plugin::{Event, Failure, Guest, Message, Outcome, decision, exec, invalid, params};

struct CustomerProfile;

idem_plugin::export!(CustomerProfile);

impl Guest for CustomerProfile {
    fn handle(message: Message) -> Result<Outcome, Failure> {
        let event = Event::parse(&message.body)?;
        let customer_id = event.integer("customer_id")?;
        let version = event.integer("version")?;
        if version < 1 {
            return Err(invalid(format!("field \"version\" must be at least 1, got {version}")));
        }
        let name = event.text("name")?;
        let email = event.text("email")?;
        // With claim = "none" the key only names the event in logs.
        Ok(decision(
            format!("customer-profile:{customer_id}:v{version}"),
            vec![exec("upsert_profile", params![customer_id, version, name, email])],
        ))
    }
}
