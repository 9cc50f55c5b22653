//! Per-call `Store` data: the sandbox's WASI context, its limits, and the `log` import.

use wasmtime::ResourceLimiter;
use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::sandbox::{PLUGIN_TEXT_BYTES, printable};

/// Log lines one call may emit before the rest are dropped (and counted in one summary line).
const LOG_LINES_PER_CALL: u32 = 32;

pub struct PluginState {
    pipeline: String,
    wasi: WasiCtx,
    table: ResourceTable,
    pub(super) limiter: SandboxLimiter,
    log_lines: u32,
    /// Epoch ticks the guest has run through during the current call, and how many it may.
    ticks_run: u128,
    tick_budget: u128,
}

impl PluginState {
    /// A sandbox with no files, network, environment, arguments or stdio, and `memory_bytes` of memory.
    pub fn new(pipeline: &str, memory_bytes: usize) -> PluginState {
        let wasi = WasiCtxBuilder::new()
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .build();
        PluginState {
            pipeline: pipeline.to_string(),
            wasi,
            table: ResourceTable::new(),
            limiter: SandboxLimiter {
                memory_bytes,
                memory_exceeded: false,
                memory_used: 0,
            },
            log_lines: 0,
            ticks_run: 0,
            tick_budget: 1,
        }
    }

    /// Starts a call that may run for `tick_budget` epoch ticks; on a reused instance, ends
    /// the previous call's accounting first.
    pub(super) fn begin_call(&mut self, tick_budget: u128) {
        self.report_dropped_log_lines();
        self.log_lines = 0;
        self.ticks_run = 0;
        self.tick_budget = tick_budget.max(1);
    }

    /// Counts one epoch tick the guest ran through; true once the call's budget is spent.
    pub(super) fn tick(&mut self) -> bool {
        self.ticks_run += 1;
        self.ticks_run >= self.tick_budget
    }

    fn report_dropped_log_lines(&self) {
        if self.log_lines > LOG_LINES_PER_CALL {
            tracing::warn!(
                pipeline = %self.pipeline,
                dropped = self.log_lines - LOG_LINES_PER_CALL,
                "Plugin log lines dropped (limit {LOG_LINES_PER_CALL} per message)."
            );
        }
    }
}

/// Refuses memory growth past the pipeline's limit, and remembers that it did,
/// so the call's failure is reported as a memory limit rather than a generic trap.
pub(super) struct SandboxLimiter {
    memory_bytes: usize,
    pub(super) memory_exceeded: bool,
    /// Linear memory the instance holds, over all its memories: what one message costs.
    pub(super) memory_used: usize,
}

/// Tables a plugin may grow to, in elements: far above what compilers emit, far below harm.
pub(super) const TABLE_ELEMENTS: usize = 1_000_000;
/// Core instances, memories and tables one plugin instance may create. A Python or
/// JavaScript component has about a dozen core instances; the caps leave room for that and
/// stop a component built to exhaust the host.
pub(super) const MAX_INSTANCES: usize = 64;
pub(super) const MAX_MEMORIES: usize = 16;
pub(super) const MAX_TABLES: usize = 64;

impl ResourceLimiter for SandboxLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        // The limit bounds the instance's memories together: a component with many core
        // instances cannot multiply it.
        let growth = desired.saturating_sub(current);
        let total = self.memory_used.saturating_add(growth);
        if total > self.memory_bytes {
            self.memory_exceeded = true;
            wasmtime::bail!(
                "memory limit exceeded: the instance's memories would total {total} bytes, limit is {} bytes",
                self.memory_bytes
            );
        }
        self.memory_used = total;
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= TABLE_ELEMENTS)
    }

    fn instances(&self) -> usize {
        MAX_INSTANCES
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES
    }

    fn tables(&self) -> usize {
        MAX_TABLES
    }
}

impl Drop for PluginState {
    fn drop(&mut self) {
        self.report_dropped_log_lines();
    }
}

impl WasiView for PluginState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl PluginState {
    /// A line the plugin logged through its `log` import (of any contract): escaped, capped,
    /// tagged with the pipeline, and at most [`LOG_LINES_PER_CALL`] per message.
    pub(super) fn plugin_log(&mut self, level: tracing::Level, message: &str) {
        self.log_lines = self.log_lines.saturating_add(1);
        if self.log_lines > LOG_LINES_PER_CALL {
            return;
        }
        let line = printable(message, PLUGIN_TEXT_BYTES);
        let pipeline = &self.pipeline;
        match level {
            tracing::Level::TRACE => tracing::trace!(pipeline = %pipeline, plugin_log = %line),
            tracing::Level::DEBUG => tracing::debug!(pipeline = %pipeline, plugin_log = %line),
            tracing::Level::INFO => tracing::info!(pipeline = %pipeline, plugin_log = %line),
            tracing::Level::WARN => tracing::warn!(pipeline = %pipeline, plugin_log = %line),
            tracing::Level::ERROR => tracing::error!(pipeline = %pipeline, plugin_log = %line),
        }
    }
}
