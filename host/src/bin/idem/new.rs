//! `idem new`: a plugin project outside any checkout.

use std::path::PathBuf;

use crate::exit::Exit;
use crate::kit::{self, Language};

/// Write a new plugin project in DIR (named after it): the handler, the guest helper, the
/// WIT, pinned build files, cases.json, a pipeline fragment and a README.
#[derive(clap::Args)]
pub struct Args {
    #[arg(value_enum)]
    language: Language,
    directory: PathBuf,
}

impl Args {
    pub fn run(self) -> anyhow::Result<Exit> {
        kit::new(self.language, &self.directory)
    }
}
