//! Hot swap: compile and check a new plugin build off the hot path, then swap it atomically.
//!
//! Triggers: the plugin file changing (watched), SIGHUP, or `POST /admin/reload/<pipeline>`.
//! Architecture invariant: a build that fails to compile, to type-check against the world,
//! or its pipeline's self-test is refused and the old build keeps serving. Messages in flight
//! finish on the build they started with (they hold an `Arc` to it).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use notify::{RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::pipeline::{self, Pipeline, PipelineError};
use crate::sandbox::{self, PluginError};

/// How long the watcher waits for a file to stop changing before reloading it.
const SETTLE: Duration = Duration::from_millis(150);

/// What a reload did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reloaded {
    /// A new build now serves.
    Swapped { from: String, to: String },
    /// The file holds the build already serving.
    Unchanged { digest: String },
}

/// What the last reload attempt of a pipeline's plugin did.
#[derive(Debug, Clone, Default)]
pub struct ReloadStatus {
    pub last_attempt_at: Option<SystemTime>,
    /// Why the last attempt was refused; `None` after a success.
    pub last_error: Option<String>,
}

/// A pipeline's reloads: one at a time, and the last one's outcome.
#[derive(Debug, Default)]
pub(super) struct Reloads {
    one_at_a_time: tokio::sync::Mutex<()>,
    status: Mutex<ReloadStatus>,
}

impl Reloads {
    pub(super) fn status(&self) -> ReloadStatus {
        self.status
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }
}

/// Loads the pipeline's plugin file again and swaps it in if it is new and passes its checks.
pub async fn reload(pipeline: &Pipeline, trigger: &'static str) -> Result<Reloaded, PipelineError> {
    let _one_at_a_time = pipeline.reloads.one_at_a_time.lock().await;
    let result = load_and_swap(pipeline).await;
    let name = pipeline.name();
    let mut status = pipeline
        .reloads
        .status
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    status.last_attempt_at = Some(SystemTime::now());
    match &result {
        Ok(Reloaded::Swapped { from, to }) => {
            status.last_error = None;
            pipeline.metrics.plugin_reloaded(name, "applied");
            info!(pipeline = %name, trigger, from = %from, to = %to, "Plugin swapped.");
        }
        Ok(Reloaded::Unchanged { digest }) => {
            status.last_error = None;
            pipeline.metrics.plugin_reloaded(name, "unchanged");
            info!(pipeline = %name, trigger, digest = %digest, "Plugin file unchanged; nothing to swap.");
        }
        Err(refusal) => {
            status.last_error = Some(refusal.to_string());
            pipeline.metrics.plugin_reloaded(name, "refused");
            error!(pipeline = %name, trigger, error = %refusal, "New plugin refused; the previous build keeps serving.");
        }
    }
    result
}

async fn load_and_swap(pipeline: &Pipeline) -> Result<Reloaded, PipelineError> {
    let config = &pipeline.config;
    let plugin_error = |source| PipelineError::Plugin {
        pipeline: config.name.clone(),
        source,
    };
    let bytes = tokio::fs::read(&config.plugin).await.map_err(|source| {
        plugin_error(PluginError::Read {
            path: config.plugin.clone(),
            source,
        })
    })?;
    let current = pipeline.plugin.load_full();
    let digest = sandbox::digest(&bytes);
    if digest == current.digest {
        return Ok(Reloaded::Unchanged { digest });
    }
    let loaded = pipeline
        .runtime
        .compile(&config.plugin, Some(bytes))
        .await
        .map_err(plugin_error)?;
    pipeline::self_test(&pipeline.runtime, config, &pipeline.statements, &loaded).await?;
    let to = loaded.digest.clone();
    // The replaced build's idle instances give their pool slots back now, not when its
    // last in-flight message settles.
    pipeline.plugin.swap(Arc::new(loaded)).retire();
    Ok(Reloaded::Swapped {
        from: current.digest.clone(),
        to,
    })
}

/// Reloads a pipeline's plugin whenever its file changes, until `shutdown`.
/// Watches each plugin's directory, so replacing the file by rename is seen too.
pub fn spawn_watcher(pipelines: Vec<Arc<Pipeline>>, shutdown: CancellationToken) {
    let watched: Vec<Arc<Pipeline>> = pipelines
        .into_iter()
        .filter(|pipeline| pipeline.config.watch)
        .collect();
    if watched.is_empty() {
        return;
    }
    let (changed_tx, mut changed_rx) = mpsc::unbounded_channel::<PathBuf>();
    let watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // Only writes, creations and renames: our own reads of the file (access events)
        // must not trigger another reload.
        if let Ok(event) = event
            && is_write(&event.kind)
        {
            for path in event.paths {
                let _ = changed_tx.send(path);
            }
        }
    });
    let mut watcher = match watcher {
        Ok(watcher) => watcher,
        Err(error) => {
            warn!(%error, "Cannot watch plugin files; reload with SIGHUP or the admin endpoint.");
            return;
        }
    };
    let mut by_file: HashMap<PathBuf, Vec<Arc<Pipeline>>> = HashMap::new();
    for pipeline in watched {
        let file = absolute(&pipeline.config.plugin);
        if let Some(directory) = file.parent()
            && let Err(error) = watcher.watch(directory, RecursiveMode::NonRecursive)
        {
            warn!(pipeline = %pipeline.name(), %error, directory = %directory.display(), "Cannot watch the plugin's directory.");
        }
        by_file.entry(file).or_default().push(pipeline);
    }
    tokio::spawn(async move {
        let _keep_watching = watcher;
        loop {
            let first = tokio::select! {
                changed = changed_rx.recv() => changed,
                () = shutdown.cancelled() => return,
            };
            let Some(first) = first else { return };
            let mut changed = vec![first];
            // Let a copy or a build finish writing before reading the file.
            while let Ok(Some(path)) = tokio::time::timeout(SETTLE, changed_rx.recv()).await {
                changed.push(path);
            }
            let mut reloaded: Vec<&Arc<Pipeline>> = Vec::new();
            for path in changed {
                if let Some(pipelines) = by_file.get(&absolute(&path)) {
                    for pipeline in pipelines {
                        if !reloaded.iter().any(|done| Arc::ptr_eq(done, pipeline)) {
                            reloaded.push(pipeline);
                        }
                    }
                }
            }
            for pipeline in reloaded {
                let _ = reload(pipeline, "file-changed").await;
            }
        }
    });
}

/// Reloads every pipeline's plugin on SIGHUP, until `shutdown`.
pub fn spawn_sighup_listener(pipelines: Vec<Arc<Pipeline>>, shutdown: CancellationToken) {
    #[cfg(unix)]
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let mut hangups = match signal(SignalKind::hangup()) {
            Ok(hangups) => hangups,
            Err(error) => {
                warn!(%error, "Cannot listen for SIGHUP.");
                return;
            }
        };
        loop {
            tokio::select! {
                received = hangups.recv() => if received.is_none() { return },
                () = shutdown.cancelled() => return,
            }
            for pipeline in &pipelines {
                let _ = reload(pipeline, "sighup").await;
            }
        }
    });
    #[cfg(not(unix))]
    let _ = (pipelines, shutdown);
}

fn is_write(kind: &notify::EventKind) -> bool {
    use notify::event::{MetadataKind, ModifyKind};
    match kind {
        notify::EventKind::Create(_) => true,
        notify::EventKind::Modify(ModifyKind::Metadata(MetadataKind::AccessTime)) => false,
        notify::EventKind::Modify(_) => true,
        _ => false,
    }
}

fn absolute(path: &std::path::Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}
