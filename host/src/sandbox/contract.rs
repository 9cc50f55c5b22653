//! Which `idem:plugin` contract a component was built for, read from the names of its
//! imports and exports (`idem:plugin/handler@0.3.0`) without compiling it, and which
//! contracts this host runs.

/// The WIT package of the contract.
pub const PACKAGE: &str = "idem:plugin";

/// The contract versions this host runs, the newest (the one `idem wit` writes) first.
pub const SPOKEN: [&str; 1] = ["0.3.0"];

/// The contract `idem wit` writes and `idem new` projects are built against.
pub fn current() -> &'static str {
    SPOKEN[0]
}

/// Whether this host runs plugins built for `version`.
pub fn is_spoken(version: &str) -> bool {
    SPOKEN.contains(&version)
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
        assert!(!is_spoken("0.1.0"));
    }

    #[test]
    fn what_is_no_component_names_no_contract() {
        assert_eq!(of_component(b""), None);
        assert_eq!(of_component(b"not wasm at all"), None);
    }
}
