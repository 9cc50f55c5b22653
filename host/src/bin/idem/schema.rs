//! `idem schema`: the JSON Schema of pipelines.toml.

use crate::exit::Exit;

/// Print the JSON Schema of pipelines.toml, for editors (e.g. taplo, Even Better TOML:
/// `#:schema ./pipelines.schema.json` on the file's first line).
#[derive(clap::Args)]
pub struct Args {}

impl Args {
    pub fn run(self) -> anyhow::Result<Exit> {
        let schema = idem_host::config::json_schema();
        println!("{}", serde_json::to_string_pretty(&schema)?);
        Ok(Exit::Success)
    }
}
