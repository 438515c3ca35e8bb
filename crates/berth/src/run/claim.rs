//! What a run claims, from the flags of `berth run` and `berth acquire`: its project,
//! resources, keys, budget and run id, as an acquire request.

use super::*;

/// A flag that takes one of the words of `berth_core`'s codec.
pub(super) fn words(
    all: impl Iterator<Item = &'static str>,
) -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(all)
}

#[derive(Args, Debug, Clone)]
pub struct ClaimArgs {
    /// Project (default: the git toplevel's directory name, else the current directory's).
    #[arg(long)]
    pub project: Option<String>,
    /// `managed` runs hold the project's runtime key; `analysis` runs only read
    /// [default: managed].
    #[arg(long, value_parser = words(berth_core::Class::ALL.iter().map(|c| c.as_str())))]
    pub class: Option<String>,
    /// `background` runs wait while any foreground run waits [default: foreground].
    #[arg(long, value_parser = words(berth_core::Priority::ALL.iter().map(|p| p.as_str())))]
    pub priority: Option<String>,
    /// Slots [default: 1].
    #[arg(long)]
    pub slots: Option<u64>,
    /// Memory, e.g. 4GiB [default: the daemon's, 2GiB + 128MiB unless configured].
    #[arg(long, value_parser = crate::args::parse_size)]
    pub memory: Option<u64>,
    /// CPUs, decimal (1.5) or millis (500m) [default: the daemon's, 0.5 unless
    /// configured].
    #[arg(long, value_parser = crate::args::parse_cpus)]
    pub cpus: Option<u64>,
    /// Disk for the workspace, e.g. 20GiB [default: the daemon's, 10GiB unless
    /// configured].
    #[arg(long, value_parser = crate::args::parse_size)]
    pub disk: Option<u64>,
    /// NAME=COUNT of a named resource (repeatable).
    #[arg(long = "resource", value_name = "NAME=COUNT")]
    pub resources: Vec<String>,
    /// An exclusive singleton key (repeatable).
    #[arg(long = "singleton")]
    pub singletons: Vec<String>,
    /// The worktree whose .berth.toml shapes the claim (absolute or relative).
    #[arg(long)]
    pub worktree: Option<PathBuf>,
    /// The run's id; a retry with the same id re-attaches to it [default: a random
    /// `r-…`].
    #[arg(long)]
    pub run_id: Option<String>,
    /// Lease ttl, e.g. 5m [default: 5m]; `berth run` renews every third of it.
    #[arg(long, value_parser = crate::args::parse_duration)]
    pub ttl: Option<u64>,
    /// How long to wait in the queue, e.g. 30m; 0 = do not wait [default: 30m].
    #[arg(long, value_parser = crate::args::parse_duration)]
    pub wait: Option<u64>,
    /// SCOPE:HARNESS: the experiment budget whose harness token is part of the claim;
    /// the run waits with `budget.full` while the harness is at its limit.
    #[arg(long, value_name = "SCOPE:HARNESS")]
    pub budget: Option<String>,
    /// HARNESS=LIMIT,...: the scope's per-harness limits, required the first time the
    /// scope is used (then frozen; a different one is refused).
    #[arg(long, value_name = "HARNESS=LIMIT,...", requires = "budget")]
    pub budget_policy: Option<String>,
    /// The operation the run's token is reserved under [default: run].
    #[arg(long, requires = "budget")]
    pub operation_id: Option<String>,
    /// The agent thread the run works in: BERTH_WORKSPACE is the thread's persistent
    /// workspace (its tmp, logs and output stay the run's own).
    #[arg(long, value_name = "KEY")]
    pub thread: Option<String>,
    #[command(flatten)]
    pub conn: ConnArgs,
}

/// `--budget`, `--budget-policy` and `--operation-id` as the acquire's budget.
pub(super) fn budget_of(c: &ClaimArgs) -> anyhow::Result<Option<BudgetClaim>> {
    let Some(b) = &c.budget else {
        return Ok(None);
    };
    let (scope, harness) = b
        .split_once(':')
        .ok_or_else(|| anyhow!("--budget {b:?}: expected SCOPE:HARNESS"))?;
    let per_harness = match &c.budget_policy {
        Some(p) => {
            let mut m = BTreeMap::new();
            for pair in p.split(',') {
                let (h, n) = pair
                    .split_once('=')
                    .ok_or_else(|| anyhow!("--budget-policy {pair:?}: expected HARNESS=LIMIT"))?;
                let n: u32 = n
                    .parse()
                    .map_err(|_| anyhow!("--budget-policy {pair:?}: LIMIT must be 1 to 1024"))?;
                if m.insert(h.to_string(), n).is_some() {
                    return Err(anyhow!("--budget-policy: {h} appears twice"));
                }
            }
            Some(UniqueMap(m))
        }
        None => None,
    };
    Ok(Some(BudgetClaim {
        scope: scope.into(),
        harness: harness.into(),
        per_harness,
        operation_id: c.operation_id.clone(),
        manifest: None,
    }))
}

#[derive(Args)]
pub struct AcquireArgs {
    #[command(flatten)]
    pub claim: ClaimArgs,
    /// Do not wait here: print the queued run at once (it keeps its place until --wait
    /// without a connection); follow it with `berth wait RUN_ID`.
    #[arg(long)]
    pub detach: bool,
}

pub(super) fn default_project() -> String {
    let top = std::process::Command::new("git")
        .args(["rev-parse", "--show-toplevel"])
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let dir = top.or_else(|| std::env::current_dir().ok());
    dir.and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .filter(|n| validate::project(n).is_ok())
        .unwrap_or_else(|| "default".into())
}

pub(crate) fn random_id() -> String {
    let mut buf = [0u8; 8];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        let _ = std::io::Read::read_exact(&mut f, &mut buf);
    }
    let hex: String = buf.iter().map(|b| format!("{b:02x}")).collect();
    format!("r-{hex}")
}

/// The acquire body. The run id is chosen here, so a retry re-attaches (L7).
pub(super) fn acquire_body(c: &ClaimArgs) -> anyhow::Result<AcquireRequest> {
    let mut resources = BTreeMap::new();
    for (k, v) in [
        ("slots", c.slots),
        ("memory", c.memory),
        ("cpu_millis", c.cpus),
        ("disk", c.disk),
    ] {
        if let Some(v) = v {
            resources.insert(k.to_string(), v);
        }
    }
    for r in &c.resources {
        let (n, v) = r
            .split_once('=')
            .ok_or_else(|| anyhow!("--resource {r:?}: expected NAME=COUNT"))?;
        let v: u64 = v
            .parse()
            .map_err(|_| anyhow!("--resource {r:?}: COUNT must be a whole number"))?;
        resources.insert(n.into(), v);
    }
    let worktree = match &c.worktree {
        Some(w) => Some(
            std::fs::canonicalize(w)
                .map_err(|e| anyhow!("--worktree {}: {e}", w.display()))?
                .to_string_lossy()
                .into_owned(),
        ),
        None => None,
    };
    Ok(AcquireRequest {
        run_id: Some(c.run_id.clone().unwrap_or_else(random_id)),
        project: c.project.clone().unwrap_or_else(default_project),
        class: c
            .class
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| anyhow!("--class: {e}"))?,
        priority: c
            .priority
            .as_deref()
            .map(str::parse)
            .transpose()
            .map_err(|e| anyhow!("--priority: {e}"))?,
        resources: (!resources.is_empty()).then_some(UniqueMap(resources)),
        singletons: (!c.singletons.is_empty()).then(|| c.singletons.clone()),
        worktree,
        ttl_s: c.ttl.map(|t| (t / 1000).max(1)),
        wait_s: c.wait.map(|w| w / 1000),
        budget: budget_of(c)?,
        thread: c.thread.clone(),
        ..Default::default()
    })
}
