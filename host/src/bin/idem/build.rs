//! `idem build`: a plugin project built with its language's toolchain.

use std::path::PathBuf;

use crate::exit::Exit;
use crate::kit;

/// Build the plugin project in DIR into DIR/<name>.wasm (or --output) with its language's
/// toolchain.
#[derive(clap::Args)]
pub struct Args {
    #[arg(default_value = ".")]
    directory: PathBuf,
    /// Where to write the component (default: DIR/<name>.wasm); replaced by rename.
    #[arg(long, short)]
    output: Option<PathBuf>,
}

impl Args {
    pub fn run(self) -> anyhow::Result<Exit> {
        kit::build(&self.directory, self.output.as_deref())
    }
}
