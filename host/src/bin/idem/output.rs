//! How a command prints its report: as text for a person, or as one JSON document on stdout
//! for a script (`--format json`; the log lines stay on stderr).

use clap::ValueEnum;

/// `--format`, for the commands that report.
#[derive(clap::Args, Clone, Copy)]
pub struct FormatArg {
    /// How to print the report: text, or one JSON document on stdout.
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// The same as `--format json` (kept for scripts written before `--format`).
    #[arg(long, hide = true)]
    json: bool,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Format {
    Text,
    Json,
}

impl FormatArg {
    /// Whether the report is JSON.
    pub fn is_json(self) -> bool {
        self.json || self.format == Format::Json
    }
}

/// Prints `report` as one pretty JSON document on stdout.
pub fn print_json(report: &serde_json::Value) -> anyhow::Result<()> {
    println!("{}", serde_json::to_string_pretty(report)?);
    Ok(())
}
