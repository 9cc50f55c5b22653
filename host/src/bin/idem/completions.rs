//! `idem completions`: a shell completion script.

use std::process::ExitCode;

/// Print a shell completion script: `idem completions bash > /etc/bash_completion.d/idem`.
#[derive(clap::Args)]
pub struct Args {
    #[arg(value_enum)]
    shell: clap_complete::Shell,
}

impl Args {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        let mut command = <crate::Cli as clap::CommandFactory>::command();
        clap_complete::generate(self.shell, &mut command, "idem", &mut std::io::stdout());
        Ok(ExitCode::SUCCESS)
    }
}
