//! `[[port]]` entries of `.berth.toml` (C1): what a project's runtime listens on, how
//! berth launches it and how it knows it is ready. Every refusal names the field
//! (`port[1].ready.http`) and the rule.

use std::collections::BTreeMap;

/// Ports one contract may declare (the engine's promotion limit too).
pub const PORTS_MAX: usize = 16;
pub const PORT_NAME_BYTES_MAX: usize = 32;
/// Arguments of one command, and the size of each.
pub const ARGS_MAX: usize = 64;
pub const ARG_BYTES_MAX: usize = 4096;
/// Extra environment variables of one launch.
pub const ENV_MAX: usize = 64;
pub const HTTP_PATH_BYTES_MAX: usize = 1024;
/// How long a port may take to answer its probe, by default and at most.
pub const READY_TIMEOUT_S_DEFAULT: u64 = 60;
pub const READY_TIMEOUT_S_MAX: u64 = 600;
/// Between probes: at least 50 ms (a probe costs a connection), at most 10 s.
pub const READY_INTERVAL_MS_DEFAULT: u64 = 250;
pub const READY_INTERVAL_MS_MIN: u64 = 50;
pub const READY_INTERVAL_MS_MAX: u64 = 10_000;
/// How long a build may take, by default and at most.
pub const BUILD_TIMEOUT_S_DEFAULT: u64 = 600;
pub const BUILD_TIMEOUT_S_MAX: u64 = 3_600;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Port {
    /// `[a-z][a-z0-9_]*`: it becomes `BERTH_PORT_<NAME>`.
    pub name: String,
    pub launch: Command,
    pub ready: Ready,
    /// Run once before the launch.
    pub build: Option<Build>,
}

/// A command berth runs in the worktree, as the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Command {
    pub command: String,
    pub args: Vec<String>,
    /// Relative to the worktree, never leaving it.
    pub cwd: Option<String>,
    pub env: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    /// `GET path` answers `expect_status`.
    Http { path: String, expect_status: u16 },
    /// A TCP connection is accepted.
    Tcp,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ready {
    pub probe: Probe,
    pub timeout_ms: u64,
    pub interval_ms: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Build {
    pub command: String,
    pub args: Vec<String>,
    pub timeout_ms: u64,
}

/// A field's path and its value, for refusals that name both.
struct At<'a> {
    path: String,
    table: &'a toml::Table,
}

impl<'a> At<'a> {
    fn err(&self, key: &str, rule: impl std::fmt::Display) -> String {
        format!("{}.{key}: {rule}", self.path)
    }

    fn only(&self, keys: &[&str]) -> Result<(), String> {
        match self.table.keys().find(|k| !keys.contains(&k.as_str())) {
            Some(k) => Err(self.err(
                k,
                format!("is not a known key (known: {})", keys.join(", ")),
            )),
            None => Ok(()),
        }
    }

    fn str(&self, key: &str, max: usize) -> Result<Option<&'a str>, String> {
        match self.table.get(key) {
            None => Ok(None),
            Some(v) => {
                let s = v
                    .as_str()
                    .ok_or_else(|| self.err(key, "must be a string"))?;
                if s.len() > max || s.contains('\0') {
                    return Err(self.err(key, format!("must be at most {max} bytes, without NUL")));
                }
                Ok(Some(s))
            }
        }
    }

    fn required_str(&self, key: &str, max: usize) -> Result<&'a str, String> {
        match self.str(key, max)? {
            Some(s) if !s.is_empty() => Ok(s),
            _ => Err(self.err(key, "is required (a non-empty string)")),
        }
    }

    /// An integer in `lo..=hi`, or `default` when absent.
    fn int(&self, key: &str, lo: u64, hi: u64, default: u64) -> Result<u64, String> {
        match self.table.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_integer()
                .and_then(|n| u64::try_from(n).ok())
                .filter(|n| (lo..=hi).contains(n))
                .ok_or_else(|| self.err(key, format!("must be an integer from {lo} to {hi}"))),
        }
    }

    fn args(&self, key: &str) -> Result<Vec<String>, String> {
        let Some(v) = self.table.get(key) else {
            return Ok(Vec::new());
        };
        let rule = format!(
            "must be an array of at most {ARGS_MAX} strings of at most {ARG_BYTES_MAX} bytes"
        );
        let arr = v
            .as_array()
            .filter(|a| a.len() <= ARGS_MAX)
            .ok_or_else(|| self.err(key, &rule))?;
        arr.iter()
            .map(|a| {
                a.as_str()
                    .filter(|s| s.len() <= ARG_BYTES_MAX && !s.contains('\0'))
                    .map(str::to_string)
                    .ok_or_else(|| self.err(key, &rule))
            })
            .collect()
    }

    fn sub(&self, key: &str) -> Result<Option<At<'a>>, String> {
        match self.table.get(key) {
            None => Ok(None),
            Some(v) => {
                let table = v
                    .as_table()
                    .ok_or_else(|| self.err(key, "must be a table"))?;
                Ok(Some(At {
                    path: format!("{}.{key}", self.path),
                    table,
                }))
            }
        }
    }
}

/// The `[[port]]` array.
pub fn parse(value: &toml::Value) -> Result<Vec<Port>, String> {
    let arr = value
        .as_array()
        .ok_or_else(|| "port: must be an array of tables ([[port]])".to_string())?;
    if arr.len() > PORTS_MAX {
        return Err(format!("port: at most {PORTS_MAX} entries"));
    }
    let mut ports: Vec<Port> = Vec::with_capacity(arr.len());
    for (i, p) in arr.iter().enumerate() {
        let table = p
            .as_table()
            .ok_or_else(|| format!("port[{i}]: must be a table"))?;
        let at = At {
            path: format!("port[{i}]"),
            table,
        };
        let port = parse_port(&at)?;
        if ports.iter().any(|q| q.name == port.name) {
            return Err(at.err("name", format!("{:?} is declared twice", port.name)));
        }
        ports.push(port);
    }
    Ok(ports)
}

fn parse_port(at: &At<'_>) -> Result<Port, String> {
    at.only(&["name", "launch", "ready", "build"])?;
    let name = at.required_str("name", PORT_NAME_BYTES_MAX)?;
    let mut chars = name.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
    if !first_ok || !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
        return Err(at.err("name", "must match [a-z][a-z0-9_]* (at most 32 bytes)"));
    }
    let launch = at
        .sub("launch")?
        .ok_or_else(|| at.err("launch", "is required ({ command, args, cwd, env })"))?;
    let ready = match at.sub("ready")? {
        Some(r) => parse_ready(&r)?,
        None => Ready {
            probe: Probe::Tcp,
            timeout_ms: READY_TIMEOUT_S_DEFAULT * 1000,
            interval_ms: READY_INTERVAL_MS_DEFAULT,
        },
    };
    let build = match at.sub("build")? {
        Some(b) => Some(parse_build(&b)?),
        None => None,
    };
    Ok(Port {
        name: name.to_string(),
        launch: parse_launch(&launch)?,
        ready,
        build,
    })
}

fn parse_launch(at: &At<'_>) -> Result<Command, String> {
    at.only(&["command", "args", "cwd", "env"])?;
    let cwd = at.str("cwd", ARG_BYTES_MAX)?;
    if let Some(c) = cwd {
        let escapes = c.starts_with('/')
            || std::path::Path::new(c).components().any(|p| {
                !matches!(
                    p,
                    std::path::Component::Normal(_) | std::path::Component::CurDir
                )
            });
        if escapes {
            return Err(at.err(
                "cwd",
                "must be relative to the worktree and never leave it (no '/' first, no '..')",
            ));
        }
    }
    let mut env = BTreeMap::new();
    if let Some(e) = at.sub("env")? {
        if e.table.len() > ENV_MAX {
            return Err(at.err("env", format!("at most {ENV_MAX} variables")));
        }
        for k in e.table.keys() {
            let mut cs = k.chars();
            let ok = cs
                .next()
                .is_some_and(|c| c.is_ascii_uppercase() || c == '_')
                && cs.all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            if !ok || k.starts_with("BERTH_") || k.len() > 128 {
                return Err(e.err(k, "must be a variable name [A-Z_][A-Z0-9_]* not starting with BERTH_ (berth sets those)"));
            }
            let value = e.str(k, ARG_BYTES_MAX)?.unwrap_or_default();
            env.insert(k.clone(), value.to_string());
        }
    }
    Ok(Command {
        command: at.required_str("command", ARG_BYTES_MAX)?.to_string(),
        args: at.args("args")?,
        cwd: cwd.map(str::to_string),
        env,
    })
}

fn parse_ready(at: &At<'_>) -> Result<Ready, String> {
    at.only(&["http", "expect_status", "tcp", "timeout_s", "interval_ms"])?;
    let probe = match (at.table.get("http"), at.table.get("tcp")) {
        (Some(_), Some(_)) => return Err(at.err("http", "give http or tcp, not both")),
        (Some(_), None) => {
            let path = at.required_str("http", HTTP_PATH_BYTES_MAX)?;
            if !path.starts_with('/') || !path.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(at.err(
                    "http",
                    "must be a path starting with '/', printable ASCII without spaces",
                ));
            }
            Probe::Http {
                path: path.to_string(),
                expect_status: at.int("expect_status", 100, 599, 200)? as u16,
            }
        }
        (None, Some(t)) => {
            if t.as_bool() != Some(true) || at.table.contains_key("expect_status") {
                return Err(at.err("tcp", "must be true (and takes no expect_status)"));
            }
            Probe::Tcp
        }
        (None, None) => return Err(at.err("http", "give { http = \"/path\" } or { tcp = true }")),
    };
    Ok(Ready {
        probe,
        timeout_ms: at.int("timeout_s", 1, READY_TIMEOUT_S_MAX, READY_TIMEOUT_S_DEFAULT)? * 1000,
        interval_ms: at.int(
            "interval_ms",
            READY_INTERVAL_MS_MIN,
            READY_INTERVAL_MS_MAX,
            READY_INTERVAL_MS_DEFAULT,
        )?,
    })
}

fn parse_build(at: &At<'_>) -> Result<Build, String> {
    at.only(&["command", "args", "timeout_s"])?;
    Ok(Build {
        command: at.required_str("command", ARG_BYTES_MAX)?.to_string(),
        args: at.args("args")?,
        timeout_ms: at.int("timeout_s", 1, BUILD_TIMEOUT_S_MAX, BUILD_TIMEOUT_S_DEFAULT)? * 1000,
    })
}
