//! Sizing wasmtime's pooling allocator from the pipelines: enough instance slots for every
//! worker at once, each slot large enough for the largest `memory_mib`, and per-component
//! limits equal to the sandbox's caps, so a component that could not run is refused when it
//! is loaded rather than when a message arrives.
//!
//! A slot's memory and tables stay mapped between instances: where the kernel has
//! `PAGEMAP_SCAN` (Linux 6.7), freeing an instance copies back only the pages it wrote, so the
//! next instance in the slot starts from the component's initial image without a page fault
//! per page it touches (a fresh Python or JavaScript instance writes hundreds). Without
//! `PAGEMAP_SCAN` a kept region would be reset whole, so nothing is kept and freed memory goes
//! back to the kernel as before.

use wasmtime::{Enabled, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::state::{MAX_INSTANCES, MAX_MEMORIES, MAX_TABLES, TABLE_ELEMENTS};
use crate::config::Config;

/// What the pool holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSize {
    /// Component instances (one per plugin call in flight).
    pub instances: u32,
    /// The largest linear memory one slot holds, in bytes.
    pub memory_bytes: usize,
}

impl PoolSize {
    /// The pool `config` asks for, or `None` when `[plugin_pool] enabled = false`.
    pub fn for_config(config: &Config) -> Option<PoolSize> {
        if !config.plugin_pool.enabled {
            return None;
        }
        let default_instances = config
            .pipelines
            .iter()
            .map(|pipeline| pipeline.workers.get().saturating_add(1))
            .sum::<usize>()
            .saturating_add(4);
        let instances = config.plugin_pool.instances.map_or_else(
            || u32::try_from(default_instances).unwrap_or(u32::MAX),
            |instances| instances.get(),
        );
        let memory_bytes = config
            .pipelines
            .iter()
            .map(|pipeline| pipeline.limits.memory_bytes())
            .max()
            .unwrap_or(0);
        Some(PoolSize {
            instances,
            memory_bytes,
        })
    }

    pub(super) fn strategy(self) -> InstanceAllocationStrategy {
        let mut pool = PoolingAllocationConfig::default();
        let caps = |cap: usize| u32::try_from(cap).unwrap_or(u32::MAX);
        pool.total_component_instances(self.instances)
            .total_stacks(self.instances)
            .max_core_instances_per_component(caps(MAX_INSTANCES))
            .total_core_instances(self.instances.saturating_mul(caps(MAX_INSTANCES)))
            .max_memories_per_component(caps(MAX_MEMORIES))
            .max_memories_per_module(caps(MAX_MEMORIES))
            .total_memories(self.instances.saturating_mul(caps(MAX_MEMORIES)))
            .max_tables_per_component(caps(MAX_TABLES))
            .max_tables_per_module(caps(MAX_TABLES))
            .total_tables(self.instances.saturating_mul(caps(MAX_TABLES)))
            .table_elements(TABLE_ELEMENTS)
            .max_memory_size(self.memory_bytes);
        if PoolingAllocationConfig::is_pagemap_scan_available() {
            pool.pagemap_scan(Enabled::Yes)
                .linear_memory_keep_resident(self.memory_bytes)
                .table_keep_resident(TABLE_ELEMENTS * size_of::<usize>());
        }
        InstanceAllocationStrategy::Pooling(pool)
    }
}
