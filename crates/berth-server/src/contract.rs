//! The runtime contract, `<worktree>/.berth.toml` (C1), read at acquire time so the whole
//! claim is known before the run queues (A1).

use std::path::Path;

use berth_core::{Concurrency, ContractInfo};
use sha2::{Digest, Sha256};

/// Upper bound on the file: a contract is a few lines.
pub const CONTRACT_BYTES_MAX: u64 = 64 * 1024;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    pub name: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Contract {
    pub info: ContractInfo,
    pub singletons: Vec<String>,
    pub ports: Vec<Port>,
}

fn bad(msg: impl Into<String>) -> String {
    format!("worktree .berth.toml: {}", msg.into())
}

/// Reads the contract of `worktree`, if it has one. Errors name the key and the rule.
pub fn read(worktree: &Path) -> Result<Option<Contract>, String> {
    let path = worktree.join(".berth.toml");
    let meta = match std::fs::symlink_metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(bad(format!("cannot be read: {e}"))),
    };
    if !meta.is_file() {
        return Err(bad("must be a regular file"));
    }
    if meta.len() > CONTRACT_BYTES_MAX {
        return Err(bad(format!("must be at most {CONTRACT_BYTES_MAX} bytes")));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| bad(format!("cannot be read: {e}")))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| bad(e.message().to_string()))?;
    let mut concurrency = Concurrency::Serial;
    let mut singletons = Vec::new();
    let mut ports = Vec::new();
    for (key, value) in &table {
        match key.as_str() {
            "concurrency" => {
                concurrency = match value.as_str() {
                    Some("serial") => Concurrency::Serial,
                    Some("parallel") => Concurrency::Parallel,
                    Some("disabled") => Concurrency::Disabled,
                    _ => {
                        return Err(bad(
                            "concurrency must be \"serial\", \"parallel\" or \"disabled\"",
                        ))
                    }
                }
            }
            "singletons" => {
                let arr = value
                    .as_array()
                    .ok_or_else(|| bad("singletons must be an array of names"))?;
                for v in arr {
                    let s = v
                        .as_str()
                        .ok_or_else(|| bad("singletons must be an array of names"))?;
                    berth_core::validate::resource_name(s)
                        .map_err(|e| bad(format!("singletons: {e}")))?;
                    singletons.push(s.to_string());
                }
            }
            "port" => {
                let arr = value
                    .as_array()
                    .ok_or_else(|| bad("port must be an array of tables ([[port]])"))?;
                for p in arr {
                    let t = p
                        .as_table()
                        .ok_or_else(|| bad("port entries must be tables"))?;
                    let name = t
                        .get("name")
                        .and_then(|n| n.as_str())
                        .ok_or_else(|| bad("every [[port]] needs a name"))?;
                    let upper = name.to_ascii_uppercase().replace(['-', '.'], "_");
                    if name.is_empty()
                        || name.len() > 32
                        || !upper.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    {
                        return Err(bad(format!(
                            "port name {name:?} must be 1-32 letters, digits, '-' or '_'"
                        )));
                    }
                    for k in t.keys() {
                        if !["name", "launch", "ready"].contains(&k.as_str()) {
                            return Err(bad(format!("unknown key port.{k}")));
                        }
                    }
                    ports.push(Port {
                        name: name.to_string(),
                    });
                }
            }
            other => return Err(bad(format!("unknown key {other:?}"))),
        }
    }
    // The fingerprint is the SHA-256 of the canonical form: the parsed table written
    // back out with sorted keys, so whitespace and comments do not change it.
    let canonical = toml::to_string(&table).map_err(|e| bad(e.to_string()))?;
    let fingerprint: String = Sha256::digest(canonical.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(Some(Contract {
        info: ContractInfo {
            concurrency,
            fingerprint,
            commit: git_commit(worktree),
        },
        singletons,
        ports,
    }))
}

/// The commit checked out in `worktree`, read from `.git` without running git.
pub fn git_commit(worktree: &Path) -> Option<String> {
    let dot_git = worktree.join(".git");
    let git_dir = if dot_git.is_file() {
        let text = std::fs::read_to_string(&dot_git).ok()?;
        let p = text.trim().strip_prefix("gitdir:")?.trim().to_string();
        let p = Path::new(&p);
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            worktree.join(p)
        }
    } else {
        dot_git
    };
    let head = std::fs::read_to_string(git_dir.join("HEAD")).ok()?;
    let head = head.trim();
    let Some(reference) = head.strip_prefix("ref:").map(str::trim) else {
        return Some(head.to_string());
    };
    // A linked worktree keeps refs in the common dir.
    let common = std::fs::read_to_string(git_dir.join("commondir"))
        .ok()
        .map(|c| git_dir.join(c.trim()))
        .unwrap_or_else(|| git_dir.clone());
    for dir in [&git_dir, &common] {
        if let Ok(s) = std::fs::read_to_string(dir.join(reference)) {
            return Some(s.trim().to_string());
        }
    }
    let packed = std::fs::read_to_string(common.join("packed-refs")).ok()?;
    packed
        .lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(_, r)| *r == reference)
        .map(|(h, _)| h.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_contracts_and_refuses_bad_ones() {
        let wt = tempfile::tempdir().unwrap();
        assert_eq!(read(wt.path()).unwrap(), None);
        std::fs::write(
            wt.path().join(".berth.toml"),
            "concurrency = \"parallel\"\nsingletons = [\"postgres\"]\n[[port]]\nname = \"web\"\n",
        )
        .unwrap();
        let c = read(wt.path()).unwrap().unwrap();
        assert_eq!(c.info.concurrency, Concurrency::Parallel);
        assert_eq!(c.singletons, vec!["postgres"]);
        assert_eq!(c.ports, vec![Port { name: "web".into() }]);
        // Comments and spacing do not change the fingerprint; content does.
        std::fs::write(
            wt.path().join(".berth.toml"),
            "# hi\nsingletons = [ \"postgres\" ]\nconcurrency   = \"parallel\"\n\n[[port]]\nname = \"web\"\n",
        )
        .unwrap();
        assert_eq!(
            read(wt.path()).unwrap().unwrap().info.fingerprint,
            c.info.fingerprint
        );
        std::fs::write(wt.path().join(".berth.toml"), "concurrency = \"serial\"\n").unwrap();
        assert_ne!(
            read(wt.path()).unwrap().unwrap().info.fingerprint,
            c.info.fingerprint
        );
        for bad in [
            "concurrency = \"sometimes\"",
            "colour = 1",
            "singletons = [\"a/b\"]",
            "[[port]]\nlaunch = {}",
            "not toml =",
        ] {
            std::fs::write(wt.path().join(".berth.toml"), bad).unwrap();
            let e = read(wt.path()).unwrap_err();
            assert!(e.starts_with("worktree .berth.toml:"), "{e}");
        }
    }

    #[test]
    fn reads_the_commit_from_dot_git() {
        let wt = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(wt.path().join(".git/refs/heads")).unwrap();
        std::fs::write(wt.path().join(".git/HEAD"), "ref: refs/heads/main\n").unwrap();
        std::fs::write(wt.path().join(".git/refs/heads/main"), "abc123\n").unwrap();
        assert_eq!(git_commit(wt.path()).as_deref(), Some("abc123"));
        std::fs::remove_file(wt.path().join(".git/refs/heads/main")).unwrap();
        std::fs::write(
            wt.path().join(".git/packed-refs"),
            "# pack\ndef456 refs/heads/main\n",
        )
        .unwrap();
        assert_eq!(git_commit(wt.path()).as_deref(), Some("def456"));
    }
}
