//! `idem run`: consume every pipeline's source until SIGTERM or Ctrl-C, then drain and exit.

use std::time::Duration;

use anyhow::Context;
use idem_host::config::Config;
use idem_host::telemetry::export::TraceExport;

use crate::exit::Exit;
use crate::lookup::ConfigArg;

/// Consume every pipeline's queue until SIGTERM or Ctrl-C.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    config: ConfigArg,
    /// After SIGTERM/SIGINT, how long in-flight messages may take to commit and ack before
    /// the process gives up (exit 1; the unacked messages are redelivered, nothing is lost).
    #[arg(long, default_value = "30s", env = "IDEM_SHUTDOWN_TIMEOUT", value_parser = idem_host::config::parse_duration)]
    shutdown_timeout: Duration,
}

impl Args {
    /// Loads the file, starts the trace export it or the `OTEL_*` variables ask for, has
    /// `init_logs` set up logging with it, runs the host on `runtime` until a signal, then
    /// sends the last spans.
    pub fn main(
        self,
        runtime: &tokio::runtime::Runtime,
        init_logs: impl FnOnce(Option<&TraceExport>),
    ) -> anyhow::Result<Exit> {
        let config = Config::load(&self.config.config)?;
        config.require_pipelines()?;
        // The gRPC exporter's connection runs on the runtime.
        let traces = {
            let _runtime = runtime.enter();
            TraceExport::start(config.traces.as_ref()).context("traces")?
        };
        init_logs(traces.as_ref());
        if let Some(traces) = &traces {
            tracing::info!(to = traces.destination(), "Exporting traces over OTLP.");
        }
        let ran = runtime.block_on(self.run(config));
        if let Some(traces) = traces {
            traces.shutdown();
        }
        ran
    }

    async fn run(self, config: Config) -> anyhow::Result<Exit> {
        let shutdown_timeout = self.shutdown_timeout;
        let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel();
        let shutdown = async move {
            shutdown_signal().await;
            let _ = signalled_tx.send(());
        };
        let deadline = async move {
            if signalled_rx.await.is_err() {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(shutdown_timeout).await;
        };
        tokio::select! {
            ran = idem_host::run(config, shutdown) => {
                ran?;
                Ok(Exit::Success)
            }
            () = deadline => {
                tracing::error!(timeout = ?shutdown_timeout, "Shutdown timed out; exiting with messages in flight. They were not acked and will be redelivered.");
                Ok(Exit::Failure)
            }
        }
    }
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = terminate.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
