//! `idem replay`: every dead letter back to its pipeline, one pass (= `idem dlq replay`).

use idem_host::source::dead_letters::Selection;

use crate::dlq;
use crate::exit::Exit;
use crate::lookup::ConfigArg;
use crate::output::FormatArg;

/// Move dead-lettered messages back to their pipeline's queue or stream, oldest first (safe: claims
/// dedup them). `idem dlq replay` does the same by selection.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
    #[arg(long, short)]
    pipeline: String,
    /// Move at most this many messages.
    #[arg(long)]
    limit: Option<u64>,
    #[command(flatten)]
    pub format: FormatArg,
}

impl Args {
    pub async fn run(self) -> anyhow::Result<Exit> {
        let selection = Selection {
            limit: self.limit,
            ..Default::default()
        };
        dlq::replay_from(
            &self.config.config,
            &self.pipeline,
            selection,
            false,
            self.format,
        )
        .await
    }
}
