//! `idem migrate`: create or update the host's tables.

use idem_host::config::Config;
use idem_host::store::database;
use idem_host::store::tables::Tables;

use crate::exit::Exit;
use crate::lookup::ConfigArg;

/// Create or update the host's tables (processed_messages, idem_outbox, idem_consumers) in
/// every database of the config (`[database]` and each `[databases.<name>]`), in its
/// `schema`, with their history (idem_migrations).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
    /// Create idem's tables even though another installation of idem, with rows, is in
    /// another schema of the database: a second installation apart from it. Without it,
    /// `migrate` refuses and names that schema, because those are most likely this
    /// configuration's claims, left behind by a changed `schema` or search path.
    #[arg(long)]
    new_installation: bool,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.config.config)?;
        for (_, database_config, prefix) in crate::lookup::each_database(&config) {
            let pool = database::connect_once(database_config).await?;
            let elsewhere = if self.new_installation {
                database::Elsewhere::Ignore
            } else {
                database::Elsewhere::Refuse
            };
            let migration = database::migrate(&pool, database_config, elsewhere).await;
            pool.close().await;
            let migration = migration?;
            let tables = Tables::of(database_config);
            if let Some(from) = &migration.moved_from {
                println!(
                    "{prefix}moved idem's tables from schema {from:?} to {}",
                    tables.place()
                );
            }
            if migration.history_adopted > 0 {
                println!(
                    "{prefix}moved idem's migration history ({} rows) out of _sqlx_migrations into idem_migrations",
                    migration.history_adopted
                );
            }
            println!(
                "{prefix}migrations applied ({} new) in {}",
                migration.applied,
                tables.place()
            );
        }
        Ok(Exit::Success)
    }
}
