//! `idem-soak [--seed N] [--minutes M]`: the nemesis soak (`idem_e2e::soak`). Two `idem run`
//! hosts serve a RabbitMQ pipeline with ledger claims, a JetStream pipeline with natural
//! claims, a pipeline whose receipts leave through the outbox and a Kafka consumer group's
//! pipeline (a tansu broker from `IDEM_TEST_TANSU`), while faults drawn by the
//! seed hit them; then the checker's verdict. Exit 1 on a failure, which the same seed tries
//! again. `scripts/soak.sh` builds what it needs and runs it.

use std::process::ExitCode;

use clap::Parser;

use idem_e2e::soak::{self, Profile};

#[derive(Parser)]
struct Args {
    /// The seed of the fault schedule (default: a random one, printed in the report).
    #[arg(long)]
    seed: Option<u64>,
    /// Minutes of faults (default: the short profile, about a minute and a quarter).
    #[arg(long)]
    minutes: Option<u64>,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(rand::random);
    let profile = match args.minutes {
        Some(minutes) => Profile::long(seed, minutes),
        None => Profile::short(seed),
    };
    let report = soak::run(profile).await;
    print!("{}", report.text);
    if report.passed {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
