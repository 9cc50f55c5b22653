//! The plugin runtime: compiles components once, runs each message in a fresh sandbox (or,
//! when a pipeline opts in, in an instance that served at most `messages_per_instance`).
//!
//! Architecture invariant: this module knows nothing of AMQP or SQL.
//! A plugin returns effects as data and does no I/O; the host decides what happens next.

mod bindings;
pub mod cache;
pub mod contract;
pub mod pool;
mod state;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest, Sha256};
use wasmtime::component::{Component, Linker};
use wasmtime::{Config as EngineConfig, Engine, Store, Trap, UpdateDeadline};

use crate::config::PluginLimits;
use crate::effect::{Failure, Outcome};
use crate::message::InboundMessage;
use bindings::PluginPre;
pub use bindings::WORLD_WIT;
use cache::{Compiled, ComponentCache};
use pool::PoolSize;
use state::PluginState;

/// How often the engine's epoch advances; the granularity of plugin deadlines.
const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Largest decision (key, statement names and parameter bytes) a plugin may return.
pub const MAX_DECISION_BYTES: usize = 1024 * 1024;

/// One engine and linker for every pipeline; an epoch ticker thread drives deadlines.
#[derive(Clone)]
pub struct PluginRuntime {
    engine: Engine,
    linker: Arc<Linker<PluginState>>,
    /// Compiled components on disk; none when turned off.
    cache: Option<ComponentCache>,
    /// The pooling allocator's size; none when instances are allocated on demand.
    pool: Option<PoolSize>,
}

/// What one sandboxed call cost.
#[derive(Debug, Clone, Copy, Default)]
pub struct CallStats {
    /// Linear memory the instance held when the call ended, over all its memories.
    pub memory_bytes: usize,
    /// Whether the call ran in an instance that had served earlier messages.
    pub reused: bool,
    /// Making the sandbox: the store and the instance (next to nothing for a reused one).
    pub instantiate: Duration,
    /// The plugin's `handle`, from the call to its returned outcome.
    pub handle: Duration,
    /// Taking a fresh sandbox down (zero when the instance is kept for the next message).
    pub teardown: Duration,
}

/// A compiled, type-checked component, ready to instantiate per message.
pub struct LoadedPlugin {
    pre: PluginPre,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// `sha256:<hex>` of the component bytes: which code decided.
    pub digest: String,
    /// The `idem:plugin` contract version it was built for (`0.3.0`); one of
    /// [`contract::SPOKEN`].
    pub contract: String,
    pub loaded_at: SystemTime,
    /// Whether it came from the compiled-component cache.
    pub compiled: Compiled,
    /// Instances kept for their next message (`limits.messages_per_instance` above 1).
    idle: Mutex<Vec<IdleInstance>>,
    /// Replaced by a newer build: keeps no idle instance.
    retired: AtomicBool,
}

#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("cannot read plugin {path:?}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "plugin {path:?} is not a valid {}@{} component: {reason}",
        contract::PACKAGE,
        contract::current()
    )]
    Invalid { path: PathBuf, reason: String },
    /// Built for a contract this host does not run.
    #[error(
        "plugin {path:?} was built for {package}@{built_for}, which this host does not run (it runs {spoken}): {rebuild}",
        package = contract::PACKAGE,
        rebuild = contract::REBUILD,
        spoken = contract::SPOKEN.map(|version| format!("{}@{version}", contract::PACKAGE)).join(", ")
    )]
    Contract { path: PathBuf, built_for: String },
    /// The plugin's own verdict: it understood the message and refused it.
    #[error("plugin refused the message ({}): {}", .0.kind.as_str(), .0.reason)]
    Rejected(Failure),
    /// Every pool slot is in use: the host's sizing, never the message's fault.
    #[error("no free plugin instance slot: {reason}")]
    PoolBusy { reason: String },
    #[error("plugin exceeded its deadline of {deadline:?}")]
    DeadlineExceeded { deadline: Duration },
    #[error("plugin exceeded its memory limit of {limit_mib} MiB")]
    MemoryExceeded { limit_mib: u32 },
    #[error("plugin trapped: {reason}")]
    Trap { reason: String },
    #[error("plugin output too large: {reason}")]
    OutputTooLarge { reason: String },
    #[error("plugin output invalid: {reason}")]
    InvalidOutput { reason: String },
}

/// How a build's digest starts.
const DIGEST_PREFIX: &str = "sha256:";

/// A plugin build's name: `sha256:` and the hex SHA-256 of its component bytes, as claims
/// (`plugin_digest`), logs, `idem status` and the console show it.
pub fn digest(bytes: &[u8]) -> String {
    format!("{DIGEST_PREFIX}{:x}", Sha256::digest(bytes))
}

impl PluginRuntime {
    /// The runtime, with the compiled-component cache in [`cache::default_directory`] and
    /// instances allocated on demand.
    pub fn new() -> Result<PluginRuntime, PluginError> {
        Self::build(cache::default_directory(), None)
    }

    /// The runtime for `config`'s pipelines: the compiled-component cache, and the pooling
    /// allocator sized from the pipelines unless `[plugin_pool] enabled = false`.
    pub fn for_config(config: &crate::config::Config) -> Result<PluginRuntime, PluginError> {
        Self::build(cache::default_directory(), PoolSize::for_config(config))
    }

    /// The runtime with compiled components in `cache_directory` and instances from a pool
    /// of `pool` (none: on demand).
    pub fn build(
        cache_directory: Option<PathBuf>,
        pool: Option<PoolSize>,
    ) -> Result<PluginRuntime, PluginError> {
        let mut engine_config = EngineConfig::new();
        engine_config
            .epoch_interruption(true)
            .wasm_component_model(true);
        if let Some(pool) = pool {
            engine_config.allocation_strategy(pool.strategy());
        }
        let engine = Engine::new(&engine_config).map_err(|error| PluginError::Invalid {
            path: PathBuf::new(),
            reason: format!("cannot configure the wasm engine: {error:#}"),
        })?;
        let mut linker = Linker::new(&engine);
        let linked = wasmtime_wasi::p2::add_to_linker_async(&mut linker)
            .and_then(|()| bindings::add_to_linker(&mut linker));
        linked.map_err(|error| PluginError::Invalid {
            path: PathBuf::new(),
            reason: format!("cannot link host imports: {error:#}"),
        })?;
        spawn_epoch_ticker(&engine);
        let cache = cache_directory.map(|directory| ComponentCache::new(directory, &engine));
        Ok(PluginRuntime {
            engine,
            linker: Arc::new(linker),
            cache,
            pool,
        })
    }

    /// Where compiled components are kept, if anywhere.
    pub fn cache_directory(&self) -> Option<&Path> {
        self.cache.as_ref().map(ComponentCache::directory)
    }

    /// Reads, compiles and type-checks a component. CPU-heavy: call off the async hot path.
    pub fn load(&self, path: &Path) -> Result<LoadedPlugin, PluginError> {
        let bytes = std::fs::read(path).map_err(|source| PluginError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        self.load_bytes(path, &bytes)
    }

    /// [`load_bytes`](Self::load_bytes) on a blocking thread, off the async workers
    /// (compiling takes seconds); the file is read first when `bytes` is `None`.
    pub async fn compile(
        &self,
        path: &Path,
        bytes: Option<Vec<u8>>,
    ) -> Result<LoadedPlugin, PluginError> {
        let runtime = self.clone();
        let owned = path.to_path_buf();
        tokio::task::spawn_blocking(move || match bytes {
            Some(bytes) => runtime.load_bytes(&owned, &bytes),
            None => runtime.load(&owned),
        })
        .await
        .unwrap_or_else(|join_error| {
            Err(PluginError::Invalid {
                path: path.to_path_buf(),
                reason: format!("compilation crashed: {join_error}"),
            })
        })
    }

    /// Compiles and type-checks component bytes that came from `path`.
    pub fn load_bytes(&self, path: &Path, bytes: &[u8]) -> Result<LoadedPlugin, PluginError> {
        let invalid = |error: wasmtime::Error| {
            let mut reason = format!("{error:#}");
            if let Some(pool) = self.pool
                && reason.contains("pooling allocator")
            {
                reason.push_str(&format!(
                    "; it does not fit the plugin pool ({} instances, {} MiB per memory, at most {} core instances, {} memories and {} tables per component): raise the pipelines' limits.memory_mib, or set [plugin_pool] enabled = false",
                    pool.instances,
                    pool.memory_bytes >> 20,
                    state::MAX_INSTANCES,
                    state::MAX_MEMORIES,
                    state::MAX_TABLES,
                ));
            }
            PluginError::Invalid {
                path: path.to_path_buf(),
                reason,
            }
        };
        let contract = contract::of_component(bytes);
        if let Some(built_for) = contract
            .as_ref()
            .filter(|version| !contract::is_spoken(version))
        {
            return Err(PluginError::Contract {
                path: path.to_path_buf(),
                built_for: built_for.clone(),
            });
        }
        let digest = digest(bytes);
        let digest_hex = digest.trim_start_matches(DIGEST_PREFIX);
        let (component, compiled) = match &self.cache {
            Some(cache) => cache.component(&self.engine, bytes, digest_hex),
            None => {
                Component::new(&self.engine, bytes).map(|component| (component, Compiled::Fresh))
            }
        }
        .map_err(invalid)?;
        let instance_pre = self.linker.instantiate_pre(&component).map_err(invalid)?;
        let contract = contract.unwrap_or_else(|| contract::current().to_string());
        let pre = PluginPre::new(&contract, instance_pre).map_err(invalid)?;
        if let Some(deprecation) = contract::deprecation(&contract) {
            tracing::warn!(plugin = %path.display(), "Plugin {deprecation}.");
        }
        Ok(LoadedPlugin {
            pre,
            path: path.to_path_buf(),
            digest,
            contract,
            loaded_at: SystemTime::now(),
            compiled,
            idle: Mutex::default(),
            retired: AtomicBool::new(false),
        })
    }

    /// Runs `plugin` on `message` in a fresh sandbox bounded by `limits`.
    pub async fn invoke(
        &self,
        plugin: &LoadedPlugin,
        limits: &PluginLimits,
        message: &InboundMessage,
    ) -> Result<Outcome, PluginError> {
        self.invoke_measured(plugin, limits, message).await.0
    }

    /// [`invoke`](Self::invoke), also reporting what the sandbox cost (for `idem try` and
    /// the benchmarks).
    ///
    /// A call that ran out of time is tried once more in a fresh sandbox before the plugin
    /// is blamed: a paused host (SIGSTOP, a VM pause), steal time or a compile on the same
    /// cores can take time the plugin never used. A plugin that really loops exceeds both.
    /// Likewise a call that failed in a reused instance (`limits.messages_per_instance`) is
    /// tried once more in a fresh one: what earlier messages left behind is not this
    /// message's fault.
    pub async fn invoke_measured(
        &self,
        plugin: &LoadedPlugin,
        limits: &PluginLimits,
        message: &InboundMessage,
    ) -> (Result<Outcome, PluginError>, CallStats) {
        let first = self
            .call_when_a_slot_is_free(plugin, limits, message, Instance::Any)
            .await;
        match &first.0 {
            Err(PluginError::DeadlineExceeded { .. }) => {
                tracing::debug!(pipeline = %message.pipeline, "Plugin call ran out of time; trying it once more in a fresh sandbox.");
            }
            Err(error) if first.1.reused => {
                tracing::debug!(pipeline = %message.pipeline, %error, "Plugin call failed in a reused instance; trying it once more in a fresh one.");
            }
            _ => return first,
        }
        self.call_when_a_slot_is_free(plugin, limits, message, Instance::Fresh)
            .await
    }

    /// [`call`](Self::call), waiting while every pool slot is in use. Slots free within a
    /// deadline, so this only waits when `[plugin_pool] instances` is set too low; it says so.
    async fn call_when_a_slot_is_free(
        &self,
        plugin: &LoadedPlugin,
        limits: &PluginLimits,
        message: &InboundMessage,
        instance: Instance,
    ) -> (Result<Outcome, PluginError>, CallStats) {
        let mut waits = 0u32;
        loop {
            match self.call(plugin, limits, message, instance).await {
                (Err(PluginError::PoolBusy { reason }), _) => {
                    waits += 1;
                    if waits % 100 == 1 {
                        tracing::warn!(pipeline = %message.pipeline, %reason, "Every plugin instance slot is in use; waiting for one. Raise [plugin_pool] instances.");
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                called => return called,
            }
        }
    }

    /// A sandbox with nothing in it yet: its store, limits and deadline accounting.
    fn new_store(&self, pipeline: &str, limits: &PluginLimits) -> Store<PluginState> {
        let mut store = Store::new(
            &self.engine,
            PluginState::new(pipeline, limits.memory_bytes()),
        );
        store.limiter(|state| &mut state.limiter);
        store.epoch_deadline_callback(|mut context| {
            if context.data_mut().tick() {
                Ok(UpdateDeadline::Interrupt)
            } else {
                Ok(UpdateDeadline::Yield(1))
            }
        });
        store
    }

    /// One call, in a fresh sandbox or (with `limits.messages_per_instance` above 1 and
    /// `instance` allowing it) in an idle instance of the same build. The deadline counts
    /// epoch ticks observed while the guest runs (a tick the guest slept through, descheduled
    /// or stopped, is not counted), so it measures the plugin, not the host; a wall-clock
    /// timeout of the same length also bounds a host call that blocks.
    async fn call(
        &self,
        plugin: &LoadedPlugin,
        limits: &PluginLimits,
        message: &InboundMessage,
        instance: Instance,
    ) -> (Result<Outcome, PluginError>, CallStats) {
        let deadline = limits.deadline();
        let reuse = limits.messages_per_instance.get();
        let idle = match instance {
            Instance::Any if reuse > 1 => plugin.take_idle(),
            _ => None,
        };
        let reused = idle.is_some();
        let started = Instant::now();
        let (mut store, mut handler, calls) = match idle {
            Some(idle) => (idle.store, Some(idle.handler), idle.calls),
            None => (self.new_store(&message.pipeline, limits), None, 0),
        };
        store
            .data_mut()
            .begin_call(deadline.as_millis().div_ceil(EPOCH_TICK.as_millis()));
        store.set_epoch_deadline(1);
        let mut stats = CallStats {
            reused,
            ..CallStats::default()
        };
        let call = async {
            let handler = match handler.take() {
                Some(handler) => handler,
                None => plugin.pre.instantiate_async(&mut store).await?,
            };
            stats.instantiate = started.elapsed();
            let returned = handler.handle(&mut store, message).await?;
            stats.handle = started.elapsed() - stats.instantiate;
            Ok::<_, wasmtime::Error>((handler, returned))
        };
        // The epoch callback stops guest code; the timeout also stops a host call that blocks.
        let result = tokio::time::timeout(deadline + EPOCH_TICK * 2, call).await;
        stats.memory_bytes = store.data().limiter.memory_used;
        let (returned, handler) = match result {
            Err(_elapsed) => (Err(PluginError::DeadlineExceeded { deadline }), None),
            Ok(Err(error)) => (
                Err(classify_trap(
                    &error,
                    store.data().limiter.memory_exceeded,
                    limits,
                )),
                None,
            ),
            Ok(Ok((handler, returned))) => (Ok(returned), Some(handler)),
        };
        let outcome = returned.and_then(|returned| {
            let outcome = returned.map_err(PluginError::Rejected)?;
            check_output(&outcome, limits)?;
            Ok(outcome)
        });
        // An instance serves again only after a clean call, and at most `reuse` messages.
        if let (Ok(_), Some(handler)) = (&outcome, handler)
            && calls + 1 < reuse
        {
            plugin.put_idle(IdleInstance {
                store,
                handler,
                calls: calls + 1,
            });
        } else {
            let tearing_down = Instant::now();
            drop(store);
            stats.teardown = tearing_down.elapsed();
        }
        (outcome, stats)
    }
}

/// Which instance a call may run in.
#[derive(Debug, Clone, Copy)]
enum Instance {
    /// An idle instance of the build when the limits allow reuse, else a fresh one.
    Any,
    /// A fresh instance.
    Fresh,
}

/// An instance between two messages, with what it has served.
struct IdleInstance {
    store: Store<PluginState>,
    handler: bindings::Plugin,
    calls: u32,
}

impl LoadedPlugin {
    fn take_idle(&self) -> Option<IdleInstance> {
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    fn put_idle(&self, instance: IdleInstance) {
        if self.retired.load(Ordering::Acquire) {
            return;
        }
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(instance);
    }

    /// Drops the build's idle instances and keeps it from keeping more: called when a new
    /// build replaces it, so its pool slots go back to the pool at once.
    pub fn retire(&self) {
        self.retired.store(true, Ordering::Release);
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

fn classify_trap(
    error: &wasmtime::Error,
    memory_exceeded: bool,
    limits: &PluginLimits,
) -> PluginError {
    if let Some(busy) = error.downcast_ref::<wasmtime::PoolConcurrencyLimitError>() {
        return PluginError::PoolBusy {
            reason: busy.to_string(),
        };
    }
    if memory_exceeded {
        return PluginError::MemoryExceeded {
            limit_mib: limits.memory_mib.get(),
        };
    }
    if error.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
        return PluginError::DeadlineExceeded {
            deadline: limits.deadline(),
        };
    }
    PluginError::Trap {
        reason: format!("{error:#}"),
    }
}

fn check_output(outcome: &Outcome, limits: &PluginLimits) -> Result<(), PluginError> {
    let Outcome::Decision(decision) = outcome else {
        return Ok(());
    };
    if decision.effects.len() > limits.max_effects.get() {
        return Err(PluginError::OutputTooLarge {
            reason: format!(
                "{} effects, limit is {}",
                decision.effects.len(),
                limits.max_effects
            ),
        });
    }
    let size = decision.size();
    if size > MAX_DECISION_BYTES {
        return Err(PluginError::OutputTooLarge {
            reason: format!("decision of {size} bytes, limit is {MAX_DECISION_BYTES}"),
        });
    }
    if decision.key.is_empty() {
        return Err(PluginError::InvalidOutput {
            reason: "decision has an empty idempotency key".into(),
        });
    }
    if let Some(position) = decision.nul_position() {
        return Err(PluginError::InvalidOutput {
            reason: format!(
                "{position} contains a NUL character, which PostgreSQL cannot store in text"
            ),
        });
    }
    Ok(())
}

/// Longest reason (failure or skip) kept from a plugin, in bytes; also the longest log line.
pub const PLUGIN_TEXT_BYTES: usize = 1024;

/// A plugin's words made safe to log and to put in a header: control characters (newlines
/// included) escaped, so one plugin cannot forge log lines, and cut to `max_bytes` with `…`.
pub(crate) fn printable(text: &str, max_bytes: usize) -> String {
    let mut printable = String::with_capacity(text.len().min(max_bytes) + 4);
    for character in text.chars() {
        if printable.len() >= max_bytes {
            printable.push('…');
            break;
        }
        if character.is_control() {
            printable.extend(character.escape_default());
        } else {
            printable.push(character);
        }
    }
    printable
}

/// Advances the engine's epoch every tick until the engine is dropped.
fn spawn_epoch_ticker(engine: &Engine) {
    let weak = engine.weak();
    let spawned = std::thread::Builder::new()
        .name("idem-epoch".into())
        .spawn(move || {
            while let Some(engine) = weak.upgrade() {
                engine.increment_epoch();
                drop(engine);
                std::thread::sleep(EPOCH_TICK);
            }
        });
    if let Err(error) = spawned {
        tracing::error!(%error, "Cannot start the plugin deadline thread; deadlines rely on timeouts only.");
    }
}

#[cfg(test)]
mod tests {
    use super::printable;

    #[test]
    fn plugin_text_is_escaped_and_capped() {
        assert_eq!(printable("a\nb\r\tc", 100), "a\\nb\\r\\tc");
        assert_eq!(printable("ordinary é", 100), "ordinary é");
        assert_eq!(
            printable(&"x".repeat(50), 10),
            format!("{}…", "x".repeat(10))
        );
    }
}
