//! End-to-end tests against real PostgreSQL and RabbitMQ (start them with scripts/services.sh).

mod alerting;
mod batching;
mod broker;
mod claims;
mod connectivity;
mod console;
mod contracts;
mod crash;
mod databases;
mod dedup;
mod hosts;
mod hot_swap;
mod jetstream;
mod languages;
mod operations;
mod outbox;
mod pause;
mod plugin_kit;
mod pooler;
mod queues;
mod sandbox;
mod schema_change;
mod shared_database;
mod traces;
mod triage;
mod trust;
