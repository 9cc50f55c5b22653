//! Which `idem:plugin` contract a component was built for, read from the names of its
//! imports and exports (`idem:plugin/handler@0.3.0`) without compiling it, and which
//! contracts this host runs.
//!
//! The support policy (plugins/README.md, "Contract versions"): a host release runs the
//! current contract and the one before it. The one before is deprecated: it runs adapted to
//! the current one, and every load, `idem check`, `idem status`, `/admin/status` and the
//! console say so with the command that rebuilds the plugin. A deprecated contract is dropped
//! no sooner than the second host release after the one that deprecated it, and no sooner
//! than six months after; a host that no longer runs it refuses the plugin at load.

/// The WIT package of the contract.
pub const PACKAGE: &str = "idem:plugin";

/// The previous contract (main at 37b5f15): its message names the RabbitMQ `routing-key`
/// and `exchange` where the current one has `source`, `queue`, `subject`, `delivery-count`
/// and `attributes`. Deprecated.
pub const V0_2_0: &str = "0.2.0";

/// The contract versions this host runs, the newest (the one `idem wit` writes) first.
pub const SPOKEN: [&str; 2] = ["0.3.0", V0_2_0];

/// The contract `idem wit` writes and `idem new` projects are built against.
pub fn current() -> &'static str {
    SPOKEN[0]
}

/// Whether this host runs plugins built for `version`.
pub fn is_spoken(version: &str) -> bool {
    SPOKEN.contains(&version)
}

/// Whether `version` is run but deprecated: every spoken contract but the current one.
pub fn is_deprecated(version: &str) -> bool {
    is_spoken(version) && version != current()
}

/// How the host names a plugin's contract to an operator: `idem:plugin@0.3.0`, for a
/// deprecated one `idem:plugin@0.2.0 (deprecated: rebuild against idem:plugin@0.3.0)`, and
/// for one it does not run `idem:plugin@0.4.0, which this host does not run`.
pub fn describe(version: &str) -> String {
    if !is_spoken(version) {
        format!("{PACKAGE}@{version}, which this host does not run")
    } else if is_deprecated(version) {
        format!(
            "{PACKAGE}@{version} (deprecated: rebuild against {PACKAGE}@{})",
            current()
        )
    } else {
        format!("{PACKAGE}@{version}")
    }
}

/// How a plugin is moved to the current contract.
pub const REBUILD: &str = "refresh the plugin project's contract with `idem wit --out <project>/wit`, adapt the code and rebuild it with `idem build <project>`";

/// What an operator is told of a plugin built for `version` when it is deprecated (logged at
/// every load, printed by `idem check`); `None` for a contract that is not.
pub fn deprecation(version: &str) -> Option<String> {
    is_deprecated(version).then(|| {
        format!(
            "built for {PACKAGE}@{version}, which is deprecated: it runs adapted to {PACKAGE}@{} until a host release drops it (plugins/README.md, \"Contract versions\"); {REBUILD}",
            current()
        )
    })
}

/// The version of `idem:plugin` the component at `bytes` exports its handler from (or,
/// failing that, imports from); `None` when it names no `idem:plugin` interface, or is no
/// component at all (the load then says what is wrong).
pub fn of_component(bytes: &[u8]) -> Option<String> {
    let mut imported = None;
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        match payload.ok()? {
            wasmparser::Payload::ComponentExportSection(exports) => {
                for export in exports.into_iter().flatten() {
                    if let Some(version) = version_in(export.name.name, "handler") {
                        return Some(version);
                    }
                }
            }
            wasmparser::Payload::ComponentImportSection(imports) => {
                for import in imports.into_iter().flatten() {
                    imported = imported.or_else(|| version_in(import.name.name, ""));
                }
            }
            _ => {}
        }
    }
    imported
}

/// `0.3.0` for `idem:plugin/<interface>@0.3.0` (any interface when `interface` is empty).
fn version_in(name: &str, interface: &str) -> Option<String> {
    let rest = name.strip_prefix(PACKAGE)?.strip_prefix('/')?;
    let (named, version) = rest.split_once('@')?;
    (interface.is_empty() || named == interface).then(|| version.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_names_give_their_version() {
        assert_eq!(
            version_in("idem:plugin/handler@0.3.0", "handler").as_deref(),
            Some("0.3.0")
        );
        assert_eq!(
            version_in("idem:plugin/log@0.2.0", "").as_deref(),
            Some("0.2.0")
        );
        assert_eq!(version_in("idem:plugin/log@0.2.0", "handler"), None);
        assert_eq!(version_in("wasi:cli/environment@0.2.0", ""), None);
        assert_eq!(version_in("idem:pluginx/handler@0.3.0", ""), None);
        assert!(is_spoken(current()));
        assert!(is_spoken(V0_2_0));
        assert!(!is_spoken("0.1.0"));
        assert!(is_deprecated(V0_2_0));
        assert!(!is_deprecated(current()));
        assert!(!is_deprecated("0.1.0"));
        assert_eq!(describe(current()), format!("idem:plugin@{}", current()));
        assert_eq!(
            describe("0.4.0"),
            "idem:plugin@0.4.0, which this host does not run"
        );
        assert_eq!(
            describe("0.2.0"),
            format!(
                "idem:plugin@0.2.0 (deprecated: rebuild against idem:plugin@{})",
                current()
            )
        );
    }

    #[test]
    fn what_is_no_component_names_no_contract() {
        assert_eq!(of_component(b""), None);
        assert_eq!(of_component(b"not wasm at all"), None);
    }
}
