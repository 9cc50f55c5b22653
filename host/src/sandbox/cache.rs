//! Compiled components on disk, so a host (or a hot swap back to a known build) is ready
//! without compiling again: a Python or JavaScript component takes seconds to compile and
//! milliseconds to load compiled.
//!
//! One file per component build and engine: `<sha256 of the component>-<engine key>.cwasm`,
//! where the engine key hashes wasmtime's version and every setting that affects compiled
//! code. The file holds a magic, the SHA-256 of the compiled artifact, then the artifact; it is
//! written to a temporary file, synced and renamed into place (atomic), and checked against
//! its SHA-256 before wasmtime loads it. A file that fails the check, or that wasmtime refuses
//! (another version, another configuration), is removed and rebuilt.
//!
//! Architecture invariant: only files this module wrote, whose checksum matches, are loaded;
//! the directory is created private to the host's user.

use std::hash::{Hash, Hasher};
use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use wasmtime::Engine;
use wasmtime::component::Component;

/// The environment variable naming the cache directory; `off` turns the cache off.
pub const CACHE_ENV: &str = "IDEM_COMPILE_CACHE";
const MAGIC: &[u8; 12] = b"idem-cwasm-1";

/// Where compiled components are kept.
#[derive(Debug, Clone)]
pub struct ComponentCache {
    directory: PathBuf,
    /// Hex digest of wasmtime's compatibility hash for the engine.
    engine_key: String,
}

/// How a component became ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compiled {
    /// Loaded from the cache.
    Cached,
    /// Compiled now (and written to the cache, if there is one).
    Fresh,
}

impl Compiled {
    pub fn as_str(self) -> &'static str {
        match self {
            Compiled::Cached => "cache",
            Compiled::Fresh => "compiled",
        }
    }
}

/// The directory from `IDEM_COMPILE_CACHE`, else `$XDG_CACHE_HOME/idem/components`, else
/// `$HOME/.cache/idem/components`; `None` when turned off or no home is known.
pub fn default_directory() -> Option<PathBuf> {
    let variable = |name| std::env::var_os(name).filter(|value| !value.is_empty());
    if let Some(configured) = variable(CACHE_ENV) {
        return (configured != "off").then(|| PathBuf::from(configured));
    }
    let base = variable("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| variable("HOME").map(|home| Path::new(&home).join(".cache")))?;
    Some(base.join("idem").join("components"))
}

impl ComponentCache {
    pub fn new(directory: PathBuf, engine: &Engine) -> ComponentCache {
        let mut hasher = Sha256Hasher(Sha256::new());
        engine.precompile_compatibility_hash().hash(&mut hasher);
        let engine_key = format!("{:x}", hasher.0.finalize());
        ComponentCache {
            directory,
            engine_key: engine_key[..16].to_string(),
        }
    }

    pub fn directory(&self) -> &Path {
        &self.directory
    }

    /// The compiled component for `bytes` (whose SHA-256 is `digest_hex`): from the cache
    /// when a sound file is there, compiled and stored otherwise.
    pub fn component(
        &self,
        engine: &Engine,
        bytes: &[u8],
        digest_hex: &str,
    ) -> wasmtime::Result<(Component, Compiled)> {
        let path = self
            .directory
            .join(format!("{digest_hex}-{}.cwasm", self.engine_key));
        if let Some(component) = self.read(engine, &path) {
            return Ok((component, Compiled::Cached));
        }
        let component = Component::new(engine, bytes)?;
        match component.serialize() {
            Ok(artifact) => {
                if let Err(error) = self.write(&path, &artifact) {
                    tracing::warn!(path = %path.display(), %error, "Cannot store the compiled plugin; the next start compiles it again.");
                }
            }
            Err(error) => {
                tracing::warn!(%error, "Cannot serialize the compiled plugin; it is not cached.");
            }
        }
        Ok((component, Compiled::Fresh))
    }

    fn read(&self, engine: &Engine, path: &Path) -> Option<Component> {
        if !self.is_private() {
            return None;
        }
        let file = match std::fs::read(path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return None,
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "Cannot read the compiled plugin; compiling it.");
                return None;
            }
        };
        let Some(artifact) = verified(&file) else {
            tracing::warn!(path = %path.display(), "Compiled plugin fails its checksum (truncated or altered); rebuilding it.");
            let _ = std::fs::remove_file(path);
            return None;
        };
        // SAFETY: `Component::deserialize` trusts its input to be wasmtime's own output. These
        // bytes are: this module wrote them (`write`), into a directory private to this user,
        // and their SHA-256 was just checked against the one written with them, so a torn or
        // altered file never reaches wasmtime. wasmtime itself refuses an artifact from
        // another version or configuration (handled below as stale).
        #[allow(unsafe_code)]
        let loaded = unsafe { Component::deserialize(engine, artifact) };
        match loaded {
            Ok(component) => Some(component),
            Err(error) => {
                tracing::info!(path = %path.display(), error = %format!("{error:#}"), "Compiled plugin is stale; rebuilding it.");
                let _ = std::fs::remove_file(path);
                None
            }
        }
    }

    fn write(&self, path: &Path, artifact: &[u8]) -> std::io::Result<()> {
        create_private_directory(&self.directory)?;
        if !self.is_private() {
            return Err(std::io::Error::other(
                "the directory is writable by other users; idem loads compiled code only from a directory only its user can write",
            ));
        }
        let temporary = self.directory.join(format!(
            ".{}.{}.{:08x}.tmp",
            path.file_name()
                .and_then(|name| name.to_str())
                .unwrap_or("component"),
            std::process::id(),
            rand::random::<u32>()
        ));
        let written = (|| {
            let mut file = std::fs::File::create(&temporary)?;
            file.write_all(MAGIC)?;
            file.write_all(&Sha256::digest(artifact))?;
            file.write_all(artifact)?;
            file.sync_all()?;
            std::fs::rename(&temporary, path)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&temporary);
        }
        written
    }
}

impl ComponentCache {
    /// Whether only this user can write the directory (or it does not exist yet): compiled
    /// code from a directory others can write could be anyone's.
    fn is_private(&self) -> bool {
        use std::os::unix::fs::PermissionsExt;
        match std::fs::metadata(&self.directory) {
            Ok(metadata) => {
                let private = metadata.permissions().mode() & 0o022 == 0;
                if !private {
                    tracing::warn!(directory = %self.directory.display(), "The compiled-plugin cache is writable by other users; not using it (chmod go-w, or set IDEM_COMPILE_CACHE).");
                }
                private
            }
            Err(_) => true,
        }
    }
}

/// The artifact in a cache file, if the file is whole and unaltered.
fn verified(file: &[u8]) -> Option<&[u8]> {
    let rest = file.strip_prefix(MAGIC.as_slice())?;
    let (checksum, artifact) = rest.split_at_checked(32)?;
    (Sha256::digest(artifact).as_slice() == checksum).then_some(artifact)
}

fn create_private_directory(directory: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(directory)
}

/// Feeds `Hash` output into SHA-256, so the engine key is the same in every process.
struct Sha256Hasher(Sha256);

impl Hasher for Sha256Hasher {
    fn finish(&self) -> u64 {
        0
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_whole_files_verify() {
        let artifact = b"compiled code";
        let mut file = MAGIC.to_vec();
        file.extend_from_slice(&Sha256::digest(artifact));
        file.extend_from_slice(artifact);
        assert_eq!(verified(&file), Some(artifact.as_slice()));
        assert_eq!(verified(&file[..file.len() - 1]), None, "truncated");
        let mut altered = file.clone();
        *altered.last_mut().expect("byte") ^= 1;
        assert_eq!(verified(&altered), None, "altered");
        assert_eq!(verified(b"idem"), None, "too short");
    }
}
