//! The `[plugin_pool]` table: wasmtime's pooling allocator for plugin instances.

use std::num::NonZeroU32;

use schemars::JsonSchema;
use serde::Deserialize;

/// The `[plugin_pool]` table: wasmtime's pooling allocator keeps instance slots (memories,
/// tables, stacks) mapped, so a message's fresh instance costs no mmap or munmap.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginPoolConfig {
    /// Default true; false allocates each instance on demand.
    #[serde(default = "default_enabled")]
    pub enabled: bool,
    /// Plugin instances that may exist at once. Default: every pipeline's workers, plus one
    /// per pipeline (a hot swap's self-test), plus 4.
    pub instances: Option<NonZeroU32>,
}

impl Default for PluginPoolConfig {
    fn default() -> Self {
        PluginPoolConfig {
            enabled: default_enabled(),
            instances: None,
        }
    }
}

fn default_enabled() -> bool {
    true
}
