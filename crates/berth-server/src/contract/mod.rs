//! The runtime contract, `<worktree>/.berth.toml` (C1), read at acquire time so the whole
//! claim is known before the run queues (A1).

pub mod ports;

use std::path::Path;

use berth_core::{Concurrency, ContractInfo};
use sha2::{Digest, Sha256};

pub use ports::Port;

/// Upper bound on the file: a contract is a few lines.
pub const CONTRACT_BYTES_MAX: u64 = 64 * 1024;

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
            "singletons" => singletons.extend(parse_singletons("singletons", value)?),
            // F1: fleet-wide singletons are held in the fleet store as well as here;
            // the engine knows them by their prefix.
            "fleet_singletons" => singletons.extend(
                parse_singletons("fleet_singletons", value)?
                    .into_iter()
                    .map(|s| format!("{}{s}", berth_core::FLEET_SINGLETON_PREFIX)),
            ),
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

fn parse_singletons(key: &str, value: &toml::Value) -> Result<Vec<String>, String> {
    let not_names = || bad(format!("{key} must be an array of names"));
    let arr = value.as_array().ok_or_else(not_names)?;
    let mut singletons = Vec::with_capacity(arr.len());
    for v in arr {
        let s = v.as_str().ok_or_else(not_names)?;
        berth_core::validate::resource_name(s).map_err(|e| bad(format!("{key}: {e}")))?;
        singletons.push(s.to_string());
    }
    Ok(singletons)
}

fn parse_ports(value: &toml::Value) -> Result<Vec<Port>, String> {
    ports::parse(value).map_err(bad)
}

/// `.git`, `HEAD`, `commondir` and loose refs are one line each.
const GIT_FILE_BYTES_MAX: u64 = 4096;
/// A big monorepo's packed-refs; beyond it the commit is simply not known.
const PACKED_REFS_BYTES_MAX: u64 = 16 << 20;

/// The commit checked out in `worktree`, read from `.git` without running git. Every
/// file below the git directory is opened with `openat2(RESOLVE_BENEATH |
/// RESOLVE_NO_SYMLINKS)` from a pinned descriptor of that directory, and read only if
/// the descriptor is a small regular file: a link planted anywhere in `.git` (`refs ->
/// /etc`, `refs -> /dev`) is refused, never followed, and a FIFO or a huge file cannot
/// block or exhaust the daemon (S2).
pub fn git_commit(worktree: &Path) -> Option<String> {
    use rustix::fs::{Mode, OFlags};
    let dir = OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC;
    let wt = rustix::fs::open(worktree, dir, Mode::empty()).ok()?;
    let git_dir = match open_beneath(&wt, ".git", dir) {
        Ok(d) => d,
        // A `gitdir:` file (a linked worktree, a submodule): the directory it names,
        // absolute or relative to the worktree, where git itself would look; below
        // it, nothing is followed.
        Err(_) => {
            let text = read_beneath(&wt, ".git", GIT_FILE_BYTES_MAX)?;
            let p = text.trim().strip_prefix("gitdir:")?.trim().to_string();
            rustix::fs::openat(&wt, p.as_str(), dir, Mode::empty()).ok()?
        }
    };
    let head = read_beneath(&git_dir, "HEAD", GIT_FILE_BYTES_MAX)?;
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
    // A linked worktree keeps refs in the common dir (named relative to the git dir).
    let common = read_beneath(&git_dir, "commondir", GIT_FILE_BYTES_MAX)
        .and_then(|c| rustix::fs::openat(&git_dir, c.trim(), dir, Mode::empty()).ok());
    for d in [Some(&git_dir), common.as_ref()].into_iter().flatten() {
        if let Some(s) = read_beneath(d, reference, GIT_FILE_BYTES_MAX) {
            return object_id(s.trim());
        }
    }
    let packed = read_beneath(
        common.as_ref().unwrap_or(&git_dir),
        "packed-refs",
        PACKED_REFS_BYTES_MAX,
    )?;
    packed
        .lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(_, r)| *r == reference)
        .and_then(|(h, _)| object_id(h))
}

/// Opens `path` below `dir`: never above it, through no link of any kind, on no other
/// mount's magic links, and without waiting for a FIFO's writer.
fn open_beneath(
    dir: &std::os::fd::OwnedFd,
    path: &str,
    flags: rustix::fs::OFlags,
) -> rustix::io::Result<std::os::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    // openat2 refuses O_PATH with any flag but O_CLOEXEC, O_DIRECTORY and O_NOFOLLOW.
    let tty = if flags.contains(OFlags::PATH) {
        OFlags::empty()
    } else {
        OFlags::NOCTTY
    };
    rustix::fs::openat2(
        dir,
        path,
        flags | OFlags::CLOEXEC | tty,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
}

/// The text of `path` below `dir` if it is a regular file of at most `max_bytes`.
fn read_beneath(dir: &std::os::fd::OwnedFd, path: &str, max_bytes: u64) -> Option<String> {
    use rustix::fs::OFlags;
    let fd = open_beneath(dir, path, OFlags::RDONLY | OFlags::NONBLOCK).ok()?;
    let st = rustix::fs::fstat(&fd).ok()?;
    let regular =
        rustix::fs::FileType::from_raw_mode(st.st_mode) == rustix::fs::FileType::RegularFile;
    if !regular || st.st_size < 0 || st.st_size as u64 > max_bytes {
        return None;
    }
    read_at_most(fd, max_bytes).ok().flatten()
}

/// A commit id as git writes it (40 or 64 hex digits); anything else is not one.
fn object_id(s: &str) -> Option<String> {
    (matches!(s.len(), 40 | 64) && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| s.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 32 finding 9: `.git/refs -> /etc` with `HEAD: ref: refs/shadow` made the
    /// daemon open `/etc/shadow` (and `refs -> /dev` opened `/dev/ptmx`). A link
    /// anywhere below the git dir is refused now, never followed, whatever it names.
    #[test]
    fn regression_links_under_dot_git_are_never_followed() {
        let commit = "abc1230000000000000000000000000000000000";
        let outside = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(outside.path().join("heads")).unwrap();
        std::fs::write(outside.path().join("heads/main"), format!("{commit}\n")).unwrap();
        std::fs::write(outside.path().join("HEAD"), "ref: refs/heads/main\n").unwrap();
        let wt = tempfile::tempdir().unwrap();
        let git = wt.path().join(".git");
        std::fs::create_dir_all(&git).unwrap();
        std::fs::write(git.join("HEAD"), "ref: refs/heads/main\n").unwrap();
        // The same ref, a real file: read.
        std::fs::create_dir_all(git.join("refs/heads")).unwrap();
        std::fs::write(git.join("refs/heads/main"), format!("{commit}\n")).unwrap();
        assert_eq!(git_commit(wt.path()).as_deref(), Some(commit));
        // `refs` a link out of the git dir: not followed.
        std::fs::remove_dir_all(git.join("refs")).unwrap();
        std::os::unix::fs::symlink(outside.path(), git.join("refs")).unwrap();
        assert_eq!(git_commit(wt.path()), None);
        // A link in the middle of the ref's path, and `.git` itself a link: the same.
        std::fs::remove_file(git.join("refs")).unwrap();
        std::fs::create_dir_all(git.join("refs")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("heads"), git.join("refs/heads")).unwrap();
        assert_eq!(git_commit(wt.path()), None);
        std::fs::remove_dir_all(&git).unwrap();
        std::os::unix::fs::symlink(outside.path(), &git).unwrap();
        assert_eq!(git_commit(wt.path()), None);
        // `refs -> /dev` with a device for a ref: refused before anything is opened.
        std::fs::remove_file(&git).unwrap();
        std::fs::create_dir_all(&git).unwrap();
        std::fs::write(git.join("HEAD"), "ref: refs/null\n").unwrap();
        std::os::unix::fs::symlink("/dev", git.join("refs")).unwrap();
        assert_eq!(git_commit(wt.path()), None);
    }

    #[test]
    fn reads_contracts_and_refuses_bad_ones() {
        let wt = tempfile::tempdir().unwrap();
        assert_eq!(read(wt.path()).unwrap(), None);
        std::fs::write(
            wt.path().join(".berth.toml"),
            "concurrency = \"parallel\"\nsingletons = [\"postgres\"]\n[[port]]\nname = \"web\"\nlaunch = { command = \"srv\" }\n",
        )
        .unwrap();
        let c = read(wt.path()).unwrap().unwrap();
        assert_eq!(c.info.concurrency, Concurrency::Parallel);
        assert_eq!(c.singletons, vec!["postgres"]);
        assert_eq!(c.ports.len(), 1);
        assert_eq!(c.ports[0].name, "web");
        assert_eq!(c.ports[0].launch.command, "srv");
        assert_eq!(c.ports[0].ready.probe, ports::Probe::Tcp);
        // Comments and spacing do not change the fingerprint; content does.
        std::fs::write(
            wt.path().join(".berth.toml"),
            "# hi\nsingletons = [ \"postgres\" ]\nconcurrency   = \"parallel\"\n\n[[port]]\nname = \"web\"\nlaunch.command = \"srv\"\n",
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

    /// Every port field is parsed; a table of malformed contracts is each refused with
    /// the field named.
    #[test]
    fn port_entries_are_parsed_and_every_malformed_field_is_named() {
        let wt = tempfile::tempdir().unwrap();
        let write = |text: &str| std::fs::write(wt.path().join(".berth.toml"), text).unwrap();
        write(
            r#"concurrency = "parallel"
[[port]]
name = "web"
launch = { command = "python3", args = ["-m", "http.server"], cwd = "site", env = { MODE = "dev" } }
ready = { http = "/health", expect_status = 204, timeout_s = 30, interval_ms = 100 }
build = { command = "make", args = ["assets"], timeout_s = 120 }
[[port]]
name = "db_2"
launch = { command = "pg" }
ready = { tcp = true }
"#,
        );
        let c = read(wt.path()).unwrap().unwrap();
        let web = &c.ports[0];
        assert_eq!(web.launch.args, ["-m", "http.server"]);
        assert_eq!(web.launch.cwd.as_deref(), Some("site"));
        assert_eq!(web.launch.env["MODE"], "dev");
        assert_eq!(
            web.ready.probe,
            ports::Probe::Http {
                path: "/health".into(),
                expect_status: 204
            }
        );
        assert_eq!((web.ready.timeout_ms, web.ready.interval_ms), (30_000, 100));
        let b = web.build.as_ref().unwrap();
        assert_eq!((b.command.as_str(), b.timeout_ms), ("make", 120_000));
        assert_eq!(c.ports[1].ready.probe, ports::Probe::Tcp);
        assert_eq!(c.ports[1].ready.timeout_ms, 60_000);

        let l = "launch = { command = \"x\" }";
        let cases: Vec<(String, &str)> = vec![
            ("port = 1".into(), "port: must be an array"),
            ("port = [1]".into(), "port[0]: must be a table"),
            (format!("[[port]]\n{l}"), "port[0].name: is required"),
            (format!("[[port]]\nname = \"Web\"\n{l}"), "port[0].name: must match"),
            (format!("[[port]]\nname = \"9a\"\n{l}"), "port[0].name: must match"),
            (format!("[[port]]\nname = \"w-b\"\n{l}"), "port[0].name: must match"),
            (format!("[[port]]\nname = \"{}\"\n{l}", "a".repeat(33)), "port[0].name: must be at most 32"),
            (format!("[[port]]\nname = \"w\"\n{l}\n[[port]]\nname = \"w\"\n{l}"), "port[1].name: \"w\" is declared twice"),
            ("[[port]]\nname = \"w\"".into(), "port[0].launch: is required"),
            ("[[port]]\nname = \"w\"\nlaunch = \"srv\"".into(), "port[0].launch: must be a table"),
            ("[[port]]\nname = \"w\"\nlaunch = {}".into(), "port[0].launch.command: is required"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"\" }".into(), "port[0].launch.command: is required"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", args = \"-v\" }".into(), "port[0].launch.args: must be an array"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", args = [1] }".into(), "port[0].launch.args: must be an array"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", cwd = \"../up\" }".into(), "port[0].launch.cwd: must be relative"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", cwd = \"/etc\" }".into(), "port[0].launch.cwd: must be relative"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", cwd = \"a/../../b\" }".into(), "port[0].launch.cwd: must be relative"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", env = { lower = \"1\" } }".into(), "port[0].launch.env.lower: must be a variable name"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", env = { BERTH_FENCE = \"1\" } }".into(), "port[0].launch.env.BERTH_FENCE: must be a variable name"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", env = { A = 1 } }".into(), "port[0].launch.env.A: must be a string"),
            ("[[port]]\nname = \"w\"\nlaunch = { command = \"x\", shell = true }".into(), "port[0].launch.shell: is not a known key"),
            (format!("[[port]]\nname = \"w\"\n{l}\nready = {{}}"), "port[0].ready.http: give"),
            (format!("[[port]]\nname = \"w\"\n{l}\nready = {{ http = \"health\" }}"), "port[0].ready.http: must be a path"),
            (format!("[[port]]\nname = \"w\"\n{l}\nready = {{ http = \"/a b\" }}"), "port[0].ready.http: must be a path"),
            (format!("[[port]]\nname = \"w\"\n{l}\nready = {{ http = \"/\", tcp = true }}"), "port[0].ready.http: give http or tcp, not both"),
            (format!("[[port]]\nname = \"w\"\n{l}\nready = {{ tcp = false }}"), "port[0].ready.tcp: must be true"),
            (format!("[[port]]\nname = \"w\"\n{l}\nready = {{ http = \"/\", expect_status = 99 }}"), "port[0].ready.expect_status: must be an integer from 100 to 599"),
            (format!("[[port]]\nname = \"w\"\n{l}\nready = {{ tcp = true, timeout_s = 0 }}"), "port[0].ready.timeout_s: must be an integer from 1 to 600"),
            (format!("[[port]]\nname = \"w\"\n{l}\nready = {{ tcp = true, interval_ms = 5 }}"), "port[0].ready.interval_ms: must be an integer from 50 to 10000"),
            (format!("[[port]]\nname = \"w\"\n{l}\nbuild = {{ args = [] }}"), "port[0].build.command: is required"),
            (format!("[[port]]\nname = \"w\"\n{l}\nbuild = {{ command = \"m\", timeout_s = 99999 }}"), "port[0].build.timeout_s: must be an integer from 1 to 3600"),
            (format!("[[port]]\nname = \"w\"\n{l}\nhealth = 1"), "port[0].health: is not a known key"),
        ];
        assert!(cases.len() >= 20);
        for (text, want) in &cases {
            write(text);
            let e = read(wt.path()).unwrap_err();
            assert!(
                e.starts_with("worktree .berth.toml: ") && e.contains(want),
                "{text:?}: wanted {want:?}, got {e:?}"
            );
        }
    }

    /// A `.berth.toml` that is a link (say, to a file outside the worktree) is refused,
    /// never followed.
    #[test]
    fn a_linked_contract_is_refused() {
        let wt = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(
            outside.path().join("c.toml"),
            "concurrency = \"parallel\"\n",
        )
        .unwrap();
        std::os::unix::fs::symlink(outside.path().join("c.toml"), wt.path().join(".berth.toml"))
            .unwrap();
        let e = read(wt.path()).unwrap_err();
        assert!(e.contains("must be a regular file, not a link"), "{e}");
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
