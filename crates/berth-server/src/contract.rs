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

/// Reads a small regular file without ever blocking or following a link at its last
/// component (S1, S2): opened `O_NOFOLLOW | O_NONBLOCK` (a FIFO swapped in for the file
/// opens at once instead of waiting for a writer, and is then refused), the type and
/// size checked on the descriptor (what was checked is what is read: no path race),
/// and at most `max_bytes + 1` bytes read. `Ok(None)` when there is no such file.
pub fn read_small(path: &Path, max_bytes: u64) -> Result<Option<String>, String> {
    let fd = match open_no_follow(path) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::NOENT) | Err(rustix::io::Errno::NOTDIR) => return Ok(None),
        Err(rustix::io::Errno::LOOP) => return Err("must be a regular file, not a link".into()),
        Err(e) => return Err(format!("cannot be read: {e}")),
    };
    let st = rustix::fs::fstat(&fd).map_err(|e| format!("cannot be read: {e}"))?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
        return Err("must be a regular file".into());
    }
    if st.st_size < 0 || st.st_size as u64 > max_bytes {
        return Err(format!("must be at most {max_bytes} bytes"));
    }
    match read_at_most(fd, max_bytes) {
        Ok(Some(text)) => Ok(Some(text)),
        Ok(None) => Err(format!("must be at most {max_bytes} bytes")),
        Err(e) => Err(format!("cannot be read: {e}")),
    }
}

/// Opens `path` for reading without following a link at its last component
/// (`ELOOP`) and without waiting for a FIFO's writer. The caller checks the type on
/// the descriptor.
pub(crate) fn open_no_follow(path: &Path) -> rustix::io::Result<std::os::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    rustix::fs::open(
        path,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY,
        Mode::empty(),
    )
}

/// Reads the file open as `fd`, at most `max_bytes` of it: `None` if it holds more
/// (it may have grown since it was measured).
pub(crate) fn read_at_most(
    fd: std::os::fd::OwnedFd,
    max_bytes: u64,
) -> std::io::Result<Option<String>> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::from(fd)
        .take(max_bytes + 1)
        .read_to_string(&mut text)?;
    Ok((text.len() as u64 <= max_bytes).then_some(text))
}

/// Reads the contract of `worktree`, if it has one. Errors name the key and the rule.
/// Blocking (file system): callers on an async runtime run it on a blocking thread.
pub fn read(worktree: &Path) -> Result<Option<Contract>, String> {
    let Some(text) = read_small(&worktree.join(".berth.toml"), CONTRACT_BYTES_MAX).map_err(bad)?
    else {
        return Ok(None);
    };
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| bad(e.message().to_string()))?;
    let mut concurrency = Concurrency::Serial;
    let mut singletons = Vec::new();
    let mut ports = Vec::new();
    for (key, value) in &table {
        match key.as_str() {
            "concurrency" => concurrency = parse_concurrency(value)?,
            "singletons" => singletons = parse_singletons(value)?,
            "port" => ports = parse_ports(value)?,
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

fn parse_concurrency(value: &toml::Value) -> Result<Concurrency, String> {
    match value.as_str() {
        Some("serial") => Ok(Concurrency::Serial),
        Some("parallel") => Ok(Concurrency::Parallel),
        Some("disabled") => Ok(Concurrency::Disabled),
        _ => Err(bad(
            "concurrency must be \"serial\", \"parallel\" or \"disabled\"",
        )),
    }
}

fn parse_singletons(value: &toml::Value) -> Result<Vec<String>, String> {
    let arr = value
        .as_array()
        .ok_or_else(|| bad("singletons must be an array of names"))?;
    let mut singletons = Vec::with_capacity(arr.len());
    for v in arr {
        let s = v
            .as_str()
            .ok_or_else(|| bad("singletons must be an array of names"))?;
        berth_core::validate::resource_name(s).map_err(|e| bad(format!("singletons: {e}")))?;
        singletons.push(s.to_string());
    }
    Ok(singletons)
}

fn parse_ports(value: &toml::Value) -> Result<Vec<Port>, String> {
    let arr = value
        .as_array()
        .ok_or_else(|| bad("port must be an array of tables ([[port]])"))?;
    let mut ports = Vec::with_capacity(arr.len());
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
    Ok(ports)
}

/// `.git`, `HEAD`, `commondir` and loose refs are one line each.
const GIT_FILE_BYTES_MAX: u64 = 4096;
/// A big monorepo's packed-refs; beyond it the commit is simply not known.
const PACKED_REFS_BYTES_MAX: u64 = 16 << 20;

/// The commit checked out in `worktree`, read from `.git` without running git. Every
/// file is read with [`read_small`]: a FIFO or a huge file planted in `.git` cannot
/// block or exhaust the daemon.
pub fn git_commit(worktree: &Path) -> Option<String> {
    let dot_git = worktree.join(".git");
    let small = |p: &Path| read_small(p, GIT_FILE_BYTES_MAX).ok().flatten();
    let git_dir = if dot_git.is_file() {
        let text = small(&dot_git)?;
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
    let head = small(&git_dir.join("HEAD"))?;
    let head = head.trim();
    let Some(reference) = head.strip_prefix("ref:").map(str::trim) else {
        return object_id(head);
    };
    // A ref names a file under the git dir; one that climbs out of it (`..`, an
    // absolute path) would make berth read, and then show, any file on the host.
    if !reference.starts_with("refs/")
        || reference
            .split('/')
            .any(|c| c.is_empty() || c == "." || c == "..")
    {
        return None;
    }
    // A linked worktree keeps refs in the common dir.
    let common = small(&git_dir.join("commondir"))
        .map(|c| git_dir.join(c.trim()))
        .unwrap_or_else(|| git_dir.clone());
    for dir in [&git_dir, &common] {
        if let Some(s) = small(&dir.join(reference)) {
            return object_id(s.trim());
        }
    }
    let packed = read_small(&common.join("packed-refs"), PACKED_REFS_BYTES_MAX)
        .ok()
        .flatten()?;
    packed
        .lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(_, r)| *r == reference)
        .and_then(|(h, _)| object_id(h))
}

/// A commit id as git writes it (40 or 64 hex digits); anything else is not one.
fn object_id(s: &str) -> Option<String> {
    (matches!(s.len(), 40 | 64) && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| s.to_ascii_lowercase())
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
        std::fs::write(
            wt.path().join(".git/refs/heads/main"),
            "abc1230000000000000000000000000000000000\n",
        )
        .unwrap();
        assert_eq!(
            git_commit(wt.path()).as_deref(),
            Some("abc1230000000000000000000000000000000000")
        );
        std::fs::remove_file(wt.path().join(".git/refs/heads/main")).unwrap();
        std::fs::write(
            wt.path().join(".git/packed-refs"),
            "# pack\ndef4560000000000000000000000000000000000 refs/heads/main\n",
        )
        .unwrap();
        assert_eq!(
            git_commit(wt.path()).as_deref(),
            Some("def4560000000000000000000000000000000000")
        );
    }
}
