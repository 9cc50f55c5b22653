//! `idem completions`: a shell completion script.

use crate::exit::Exit;

/// Print a shell completion script: `idem completions bash > /etc/bash_completion.d/idem`.
#[derive(clap::Args)]
pub struct Args {
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

impl Args {
    pub fn run(self) -> anyhow::Result<Exit> {
        let mut command = <crate::Cli as clap::CommandFactory>::command();
        clap_complete::generate(self.shell, &mut command, "idem", &mut std::io::stdout());
        Ok(Exit::Success)
    }
}
