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
    /// Change nothing: print the SQL it would run in each database (the steps not applied
    /// yet, or every step when the database cannot be read), for a DBA to review and run.
    #[arg(long)]
    print: bool,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let config = Config::load(&self.config.config)?;
        if self.print {
            print_scripts(&config).await;
            return Ok(Exit::Success);
        }
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

/// Prints, for each database, the script of the steps it lacks.
async fn print_scripts(config: &Config) {
    for (name, database_config) in config.all_databases() {
        let tables = Tables::of(database_config);
        let label = database::label(name);
        let applied = match database::connect_once(database_config).await {
            Ok(pool) => {
                let applied = database::applied_versions(&pool, &tables).await;
                pool.close().await;
                applied.map_err(|error| error.to_string())
            }
            Err(error) => Err(error.to_string()),
        };
        let applied = match applied {
            Ok(applied) => {
                println!(
                    "-- {label}: the steps not applied yet in {}",
                    tables.place()
                );
                applied
            }
            Err(error) => {
                println!(
                    "-- {label}: every step, for {} (the database could not be read: {error})",
                    tables.place()
                );
                Vec::new()
            }
        };
        print!("{}", database::script(&tables, &applied));
    }
}
