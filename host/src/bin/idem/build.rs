//! `idem build`: a plugin project built with its language's toolchain.

use std::path::PathBuf;
use std::process::ExitCode;

use crate::scaffold;

/// Build the plugin project in DIR into DIR/<name>.wasm with its language's toolchain.
#[derive(clap::Args)]
pub struct Args {
    #[arg(default_value = ".")]
    directory: PathBuf,
}

impl Args {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        scaffold::build(&self.directory)
    }
}
