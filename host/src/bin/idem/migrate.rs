//! `idem migrate`: create or update the host's tables.

use std::process::ExitCode;

use idem_host::config::Config;
use idem_host::store::database;

use crate::ConfigArg;

/// Create or update the host's tables (processed_messages).
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<ExitCode> {
        let config = Config::load(&self.config.config)?;
        let pool = database::connect_once(&config.database).await?;
        database::migrate(&pool, &config.database).await?;
        println!("migrations applied");
        Ok(ExitCode::SUCCESS)
    }
}
