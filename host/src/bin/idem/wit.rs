//! `idem wit`: the plugin contract this binary was built with.

use std::path::PathBuf;

use anyhow::Context;

use crate::exit::Exit;

/// Print the plugin contract this host was built with (the WIT package `idem:plugin`), or
/// write it as a WIT package directory for a plugin project (`DIR/world.wit`).
#[derive(clap::Args)]
pub struct Args {
    /// Write `world.wit` into this directory (created if missing) instead of printing it.
    #[arg(long)]
    out: Option<PathBuf>,
}

impl Args {
    pub fn run(self) -> anyhow::Result<Exit> {
        let wit = idem_host::sandbox::WORLD_WIT;
        let Some(directory) = self.out else {
            print!("{wit}");
            return Ok(Exit::Success);
        };
        std::fs::create_dir_all(&directory)
            .with_context(|| format!("cannot create {}", directory.display()))?;
        let path = directory.join("world.wit");
        std::fs::write(&path, wit).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("idem wit: wrote {}", path.display());
        Ok(Exit::Success)
    }
}
