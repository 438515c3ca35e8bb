//! `berth run` and friends against the real daemon: concurrency limits, serial
//! projects, exit codes, the environment, signal forwarding, release on exit.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::Daemon;
use serde_json::json;

/// A CMD that records how many runs of its group are inside at once: it creates a
/// marker, counts the markers, holds for a while, removes it. The largest count seen is
/// the real concurrency (the last of N concurrent runs to arrive sees all N).
fn probe_script(dir: &Path, group: &str) -> String {
    format!(
        "d={dir}/{group}; mkdir -p $d; touch $d/$BERTH_RUN_ID; n=$(ls $d | wc -l); echo $n >> {dir}/{group}.counts; sleep 0.4; rm $d/$BERTH_RUN_ID",
        dir = dir.display()
    )
}

fn max_count(dir: &Path, group: &str) -> usize {
    std::fs::read_to_string(dir.join(format!("{group}.counts")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

/// A small `berth run` of `project` running the probe script of `group`.
fn spawn_probe(d: &Daemon, project: &str, dir: &Path, group: &str) -> std::process::Child {
    d.cli()
        .args([
            "run",
            "--project",
            project,
            "--cpus",
            "0.1",
            "--memory",
            "10MiB",
            "--disk",
            "0",
            "--",
            "sh",
            "-c",
        ])
        .arg(probe_script(dir, group))
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn concurrency_never_exceeds_slots_max() {
    let d = Daemon::start(&["--slots-max", "3", "--cpu-total", "64"]);
    let dir = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..10)
        .map(|i| spawn_probe(&d, &format!("p{i}"), dir.path(), "all"))
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let max = max_count(dir.path(), "all");
    assert!(max <= 3, "saw {max} runs at once with --slots-max 3");
    assert!(
        max >= 2,
        "runs never overlapped (max {max}): the test would prove nothing"
    );
    let lines = std::fs::read_to_string(dir.path().join("all.counts")).unwrap();
    assert_eq!(lines.lines().count(), 10);
}

#[test]
fn serial_projects_serialize_while_different_projects_run_in_parallel() {
    let d = Daemon::start(&["--slots-max", "8", "--cpu-total", "64"]);
    let dir = tempfile::tempdir().unwrap();
    let mut children = Vec::new();
    for i in 0..4 {
        for (group, project) in [
            ("same", "acme/web".to_string()),
            ("diff", format!("solo{i}")),
        ] {
            children.push(spawn_probe(&d, &project, dir.path(), group));
        }
    }
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    assert_eq!(
        max_count(dir.path(), "same"),
        1,
        "runs of one serial project overlapped"
    );
    assert!(
        max_count(dir.path(), "diff") >= 2,
        "different projects never ran in parallel"
    );
}

#[test]
fn exit_codes_environment_and_release_on_exit() {
    let d = Daemon::start(&["--slots-max", "2"]);
    // CMD's exit code is berth's.
    let st = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--cpus",
            "0.1",
            "--",
            "sh",
            "-c",
            "exit 7",
        ])
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(7));
    // The environment of W2, a workspace with an empty out/ (W4), TMPDIR inside it.
    let out = d
        .cli()
        .args(["run", "--project", "Acme", "--run-id", "env-1", "--cpus", "0.1", "--", "sh", "-c",
               "env | grep -E '^(BERTH_|TMPDIR=)' | sort; ls -A $BERTH_OUTPUT_DIR | wc -l; test -d $TMPDIR && echo tmp-ok"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for var in [
        "BERTH_URL=",
        "BERTH_RUN_ID=env-1",
        "BERTH_FENCE=",
        "BERTH_PROJECT=Acme",
        "BERTH_CLASS=managed",
        "BERTH_PRIORITY=foreground",
        "BERTH_LEASE_EXPIRES_AT=",
        "BERTH_WORKSPACE=",
        "BERTH_TMP_DIR=",
        "TMPDIR=",
        "BERTH_LOG_DIR=",
        "BERTH_CACHE_DIR=",
        "BERTH_BROWSER_DIR=",
        "BERTH_OUTPUT_DIR=",
        "BERTH_CONCURRENCY=serial",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(var)),
            "missing {var} in\n{text}"
        );
    }
    assert!(text.contains("\n0\n") && text.contains("tmp-ok"), "{text}");
    // Released when CMD exited, and its workspace is gone.
    d.wait_until("env-1 is released", |d| {
        d.get("/v1/runs/env-1").body["state"] == "released"
    });
    let ws = text
        .lines()
        .find_map(|l| l.strip_prefix("BERTH_WORKSPACE="))
        .unwrap()
        .to_string();
    d.wait_until("the workspace is removed", |_| !Path::new(&ws).exists());
    // Refused: 69. Admission timeout: 75. Usage: 2.
    let st = d
        .cli()
        .args(["run", "--project", "p", "--memory", "64GiB", "--", "true"])
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(69));
    let blocker = d.post("/v1/runs", &json!({"run_id": "blocker", "project": "busy", "resources": {"slots": 2, "cpu_millis": 10}}).to_string());
    assert_eq!(blocker.status, 201);
    let st = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--cpus",
            "0.1",
            "--wait",
            "1s",
            "--",
            "true",
        ])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(75));
    let st = d
        .cli()
        .args(["run", "--project", "p"])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(2));
    let st = d
        .cli()
        .args(["run", "--memory", "lots", "--", "true"])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(st.code(), Some(2));
}

#[test]
fn signals_are_forwarded_to_cmd_and_the_lease_released() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("got-term");
    let script = format!(
        "trap 'echo term > {m}; exit 42' TERM; echo started > {m}.start; while true; do sleep 0.05; done",
        m = marker.display()
    );
    let mut child = d
        .cli()
        .args([
            "run",
            "--project",
            "p",
            "--run-id",
            "sig-1",
            "--cpus",
            "0.1",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = dir.path().join("got-term.start");
    for _ in 0..200 {
        if start.exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    assert!(start.exists(), "CMD never started");
    rustix::process::kill_process(
        rustix::process::Pid::from_child(&child),
        rustix::process::Signal::TERM,
    )
    .unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(42), "berth run should exit with CMD's code");
    assert_eq!(std::fs::read_to_string(&marker).unwrap().trim(), "term");
    // The broker stops what is left of CMD's tree, then the run is released.
    d.wait_until("sig-1 is released", |d| {
        d.get("/v1/runs/sig-1").body["state"] == "released"
    });
}

/// Every client command prints JSON with `--json` (for scripts) and a line or table
/// for people otherwise.
#[test]
fn every_client_command_has_json_for_scripts_and_lines_for_people() {
    let d = Daemon::start(&["--slots-max", "2"]);
    let json_of = |args: &[&str]| -> serde_json::Value {
        let out = d.cli().args(args).arg("--json").output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{args:?} --json: {e}: {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    };
    let human = |args: &[&str]| -> String {
        let out = d.cli().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            serde_json::from_str::<serde_json::Value>(&text).is_err(),
            "{args:?} printed JSON for people: {text}"
        );
        text
    };
    let lease = json_of(&[
        "acquire",
        "--project",
        "s",
        "--run-id",
        "s-1",
        "--cpus",
        "0.1",
        "--ttl",
        "1m",
    ]);
    let fence = lease["fence"].as_u64().unwrap().to_string();
    let line = human(&[
        "acquire",
        "--project",
        "t",
        "--run-id",
        "t-1",
        "--cpus",
        "0.25",
        "--memory",
        "1GiB",
    ]);
    assert!(
        line.starts_with("run t-1 (t): granted, fence ") && line.contains("1 GiB, 0.25 cpu"),
        "{line}"
    );
    // A 5 minute ttl, shown relative to now.
    assert!(
        line.contains("expires in 4m5") || line.contains("expires in 5m00s"),
        "{line}"
    );
    assert_eq!(
        json_of(&["renew", "s-1", "--fence", &fence, "--ttl", "2m"])["state"],
        "granted"
    );
    let line = human(&["renew", "s-1", "--fence", &fence]);
    assert!(
        line.contains("expires in 1m5") || line.contains("expires in 2m00s"),
        "{line}"
    );
    let runs = json_of(&["runs"]);
    assert_eq!(runs["runs"].as_array().unwrap().len(), 2, "{runs}");
    let table = human(&["runs"]);
    assert!(table.lines().next().unwrap().contains(" age "), "{table}");
    assert!(
        table.lines().any(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            // run, project, state, age: seconds old, not minutes.
            cols.first() == Some(&"t-1")
                && cols
                    .get(3)
                    .and_then(|a| a.strip_suffix('s')?.parse::<u64>().ok())
                    .is_some_and(|secs| secs < 60)
        }),
        "a run granted just now is seconds old: {table}"
    );
    assert!(
        table
            .lines()
            .any(|l| l.starts_with("s-1") && (l.contains(" in 2m00s ") || l.contains(" in 1m5"))),
        "{table}"
    );
    let status = json_of(&["status"]);
    assert!(status["resources"].is_array(), "{status}");
    let text = human(&["status"]);
    assert!(text.contains("project s") && text.contains("GiB"), "{text}");
    assert_eq!(
        json_of(&["release", "s-1", "--fence", &fence])["state"],
        "released"
    );
    let reap = json_of(&["reap"]);
    assert!(reap["examined"].is_u64(), "{reap}");
    assert!(human(&["reap"]).starts_with("reaped "));
    // Ended runs, with how they ended.
    let all = human(&["runs", "--all"]);
    assert!(
        all.lines()
            .any(|l| l.starts_with("s-1") && l.contains("released")),
        "{all}"
    );
    let out = d
        .cli()
        .args(["release", "s-1", "--fence", "999"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

#[test]
fn berth_run_shows_position_and_reason_while_it_waits() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let h = d.post(
        "/v1/runs",
        &json!({"run_id": "h", "project": "acme", "resources": {"cpu_millis": 10}}).to_string(),
    );
    let fence = h.body["fence"].as_u64().unwrap();
    let child = d
        .cli()
        .args(["run", "--project", "acme", "--cpus", "0.1", "--", "true"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    d.wait_until("a waiter queues", |d| {
        d.get("/v1/runs").body["runs"].as_array().unwrap().len() == 2
    });
    std::thread::sleep(Duration::from_millis(300));
    d.post("/v1/runs/h/release", &json!({"fence": fence}).to_string());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    // Not a terminal: plain lines, each with its time.
    let line = err
        .lines()
        .find(|l| {
            l.contains("berth: waiting: position 1, project acme is serial; run h holds it, ")
        })
        .unwrap_or_else(|| panic!("{err}"));
    let clock = line.split(' ').next().unwrap();
    assert!(
        clock.len() == 9 && clock.ends_with('Z') && clock.as_bytes()[2] == b':',
        "{line}"
    );
    assert!(!err.contains('\r'));
}

/// Fail fast: with no daemon, `berth run` and every client command exit 69 at once and
/// say what to do.
#[test]
fn a_refused_connection_exits_69_at_once_with_the_hint() {
    let port = common::free_port();
    let url = format!("http://127.0.0.1:{port}");
    for args in [
        &["run", "--project", "p", "--", "true"][..],
        &["status"][..],
        &["runs"][..],
        &["acquire", "--project", "p"][..],
        &["renew", "r", "--fence", "1"][..],
        &["release", "r", "--fence", "1"][..],
        &["reap"][..],
    ] {
        let t = std::time::Instant::now();
        let out = Command::new(common::BERTH)
            .args(args)
            .env("BERTH_URL", &url)
            .env("BERTH_TOKEN", "t")
            .output()
            .unwrap();
        let took = t.elapsed();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(69), "{args:?}: {err}");
        assert!(
            err.contains("is `berth serve` running?") && err.contains(&url),
            "{args:?}: {err}"
        );
        assert!(took < Duration::from_secs(2), "{args:?} took {took:?}");
    }
}

/// A missing token names the file that was tried, and --state-dir says where to look.
#[test]
fn a_missing_token_names_the_file_tried_and_state_dir_finds_it() {
    let d = Daemon::start(&["--slots-max", "1"]);
    // The CLI with no token given: it must find one (or say where it looked).
    let tokenless = |args: &[&std::ffi::OsStr], state_env: Option<&std::path::Path>| {
        let mut c = Command::new(common::BERTH);
        c.args(args)
            .env("BERTH_URL", &d.url)
            .env_remove("BERTH_TOKEN");
        if let Some(s) = state_env {
            c.env("BERTH_STATE_DIR", s);
        }
        c.output().unwrap()
    };
    let os = |s: &'static str| std::ffi::OsStr::new(s);
    let empty = tempfile::tempdir().unwrap();
    let out = tokenless(
        &[os("status"), os("--state-dir"), empty.path().as_os_str()],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&empty.path().join("admin.token").display().to_string()),
        "{err}"
    );
    // The daemon's own state dir holds its admin token.
    let out = tokenless(
        &[
            os("status"),
            os("--json"),
            os("--state-dir"),
            d.state.as_os_str(),
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = tokenless(&[os("runs"), os("--json")], Some(&d.state));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--wait 0` on a busy host: one line saying why, exit 75, no waiting line.
#[test]
fn wait_0_on_a_busy_host_prints_one_line() {
    let d = Daemon::start(&["--slots-max", "1"]);
    let h = d.post(
        "/v1/runs",
        &json!({"run_id": "h", "project": "busy", "resources": {"cpu_millis": 10}}).to_string(),
    );
    assert_eq!(h.status, 201);
    let out = d
        .cli()
        .args(["run", "--project", "other", "--wait", "0", "--", "true"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(!err.contains("waiting"), "{err}");
}

/// The README's tour, with its own flags: two default runs of different projects run
/// side by side, and a second run of one project waits for the first.
#[test]
fn the_readme_tour_runs_different_projects_side_by_side() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let serve = readme
        .lines()
        .find_map(|l| l.trim().strip_prefix("berth serve "))
        .expect("the tour starts the daemon");
    let flags: Vec<&str> = serve.trim_end_matches('&').split_whitespace().collect();
    assert!(flags.contains(&"--slots-max"), "{flags:?}");
    let d = Daemon::start(&flags);
    let dir = tempfile::tempdir().unwrap();
    let run = |project: &str, name: &str| {
        let marker = dir.path().join(name);
        d.cli()
            .args(["run", "--project", project, "--wait", "0", "--", "sh", "-c"])
            .arg(format!("touch {}; sleep 2", marker.display()))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let a = run("demo", "a");
    let b = run("other", "b");
    let both = [a, b].map(|c| c.wait_with_output().unwrap());
    for o in &both {
        assert!(
            o.status.success(),
            "a default run was not admitted at once: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    assert!(dir.path().join("a").exists() && dir.path().join("b").exists());
}

/// Shell completions and the man page come from the binary itself.
#[test]
fn completions_and_the_man_page() {
    for (shell, mark) in [
        ("bash", "complete -F _berth"),
        ("zsh", "#compdef berth"),
        ("fish", "complete -c berth"),
    ] {
        let out = Command::new(common::BERTH)
            .args(["completions", shell])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(mark),
            "{shell}: {text}"
        );
        assert!(text.contains("state-dir"), "{shell}: flags missing");
    }
    let out = Command::new(common::BERTH).arg("man").output().unwrap();
    let man = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && man.contains(".TH berth 1"), "{man}");
    assert!(
        man.contains("serve") && man.contains("completions"),
        "{man}"
    );
    // Issue 33 item 7: a page per subcommand, `berth man run`, and --install.
    let out = Command::new(common::BERTH)
        .args(["man", "run"])
        .output()
        .unwrap();
    let page = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && page.contains(".TH berth-run 1"),
        "{page}"
    );
    assert!(page.contains("lease"), "{page}");
    let out = Command::new(common::BERTH)
        .args(["man", "nope"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(common::BERTH)
        .args(["man", "--install"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    // Every page the top page points at exists.
    let named: Vec<String> = man
        .lines()
        .filter_map(|l| l.strip_suffix("(1)"))
        .map(|n| n.replace("\\-", "-"))
        .collect();
    assert!(named.len() >= 15, "{named:?}");
    for n in named
        .iter()
        .chain([&"berth".to_string(), &"berth-scope-show".to_string()])
    {
        assert!(
            dir.path().join(format!("{n}.1")).is_file(),
            "{n}.1 is missing"
        );
    }
}

/// Issue 33 item 7: the daemon's log has ANSI colour only on a terminal (a log
/// redirected to a file kept the escapes), and `NO_COLOR` turns it off there too.
#[test]
fn the_daemons_log_has_no_colour_in_a_file() {
    let d = Daemon::start(&[]);
    d.post("/v1/reap", "{}");
    let log = std::fs::read_to_string(&d.log).unwrap();
    assert!(log.contains("berth_server"), "a tracing line: {log}");
    assert!(!log.contains('\x1b'), "ANSI escapes in a log file: {log:?}");
}

/// The example configuration in contrib/ is one `berth serve` accepts, and it is in
/// force (its slots_max shows in the status).
#[test]
fn the_example_berth_toml_is_accepted() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../contrib/berth.toml");
    let d = Daemon::start(&["--config", example]);
    let s = d.get("/v1/status").body;
    assert_eq!(
        s["slots_max"], 2,
        "the harness's --slots-max wins over the file: {s}"
    );
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../contrib/berth.service"
    ))
    .unwrap();
    assert!(unit.contains("ExecStart=") && unit.contains("berth serve"));
}

/// Malformed values for the new list parameter and the new serve settings are refused
/// with the field named, and nothing starts or changes.
#[test]
fn bad_list_parameters_and_default_settings_are_refused_by_name() {
    let d = Daemon::start(&["--slots-max", "1"]);
    for q in ["all=maybe", "all=", "everything=true"] {
        let r = d.get(&format!("/v1/runs?{q}"));
        assert_eq!((r.status, r.code()), (400, "invalid"), "{q}: {:?}", r.body);
        let field = r.body["error"]["details"]["field"].as_str().unwrap_or("");
        assert!(
            q.starts_with(field) && !field.is_empty(),
            "{q}: {:?}",
            r.body
        );
    }
    for (flag, value) in [
        ("--default-cpus", "0"),
        ("--default-cpus", "-1"),
        ("--default-cpus", "lots"),
        ("--default-memory", "big"),
    ] {
        let (st, out) = d.start_fails(&[&format!("{flag}={value}")]);
        assert!(!st.success());
        assert!(out.contains(flag), "{flag} {value}: {out}");
    }
    let dir = tempfile::tempdir().unwrap();
    let toml = dir.path().join("berth.toml");
    std::fs::write(&toml, "default_cpus = 0.0\n").unwrap();
    let (st, out) = d.start_fails(&["--config", toml.to_str().unwrap()]);
    assert!(!st.success());
    assert!(out.contains("default_cpus"), "{out}");
    // The running daemon is unchanged.
    assert_eq!(d.get("/v1/status").body["slots_max"], 1);
}

/// Issue 33 item 1: with one descriptor too many inherited from its parent, the gate's
/// pipe landed on fd 10 or above, dash said `Bad fd number` and every run failed
/// (exit 69). Now `berth run` works with 0, 1, 9, 10, 64 and 1,000 inherited
/// descriptors under dash and bash, and CMD sees every one of them (berth's own are
/// not passed on), make's jobserver included.
#[test]
fn issue_33_inherited_descriptors_pass_through_and_never_break_the_gate() {
    let d = Daemon::start(&["--slots-max", "4"]);
    // A parent that leaves `n` descriptors open (inheritable), then becomes berth run.
    let parent = r#"import os, sys
n = int(sys.argv[1])
for _ in range(n):
    os.set_inheritable(os.open("/dev/null", os.O_RDONLY), True)
os.execv(sys.argv[2], sys.argv[2:])"#;
    let count = |n: usize, via_berth: bool, shell: &str| -> (std::process::Output, usize) {
        let mut c = std::process::Command::new("python3");
        c.env("BERTH_URL", &d.url)
            .env("BERTH_TOKEN", &d.token)
            .args(["-c", parent])
            .arg(n.to_string());
        if via_berth {
            c.arg(common::BERTH)
                .args(["run", "--project", "fds", "--cpus", "0.1", "--"]);
        }
        c.args([shell, "-c", "ls /proc/self/fd | wc -l"])
            .stdin(std::process::Stdio::null());
        let out = c.output().unwrap();
        let seen = String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0);
        (out, seen)
    };
    for shell in ["/bin/sh", "/bin/bash"] {
        // What CMD sees when its parent runs it itself (the test's own descriptors).
        let (_, baseline) = count(0, false, shell);
        assert!(baseline >= 4, "{shell}: {baseline}");
        for n in [0usize, 1, 9, 10, 64, 1_000] {
            let (out, seen) = count(n, true, shell);
            let said = String::from_utf8_lossy(&out.stderr);
            assert!(
                out.status.success(),
                "{n} descriptors, {shell}: {:?} {said}",
                out.status
            );
            // Every inherited descriptor, and none of berth's own.
            assert_eq!(
                seen,
                baseline + n,
                "{n} descriptors, {shell}: CMD saw {seen}"
            );
        }
    }
    // make's jobserver: the descriptors named in MAKEFLAGS are open in CMD.
    let dir = tempfile::tempdir().unwrap();
    let check = r#"for f in $(echo "$MAKEFLAGS" | sed -n 's/.*jobserver-auth=\([0-9]*\),\([0-9]*\).*/\1 \2/p'); do test -e /proc/self/fd/$f || exit 9; done; echo "$MAKEFLAGS" | grep -q jobserver-auth"#;
    std::fs::write(
        dir.path().join("Makefile"),
        format!(
            "all:\n\t+{} run --project mk --cpus 0.1 -- sh -c '{}'\n",
            common::BERTH,
            check.replace('$', "$$").replace('\'', "'\\''")
        ),
    )
    .unwrap();
    let out = std::process::Command::new("make")
        .args(["-s", "-j2", "-C"])
        .arg(dir.path())
        .env("BERTH_URL", &d.url)
        .env("BERTH_TOKEN", &d.token)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "make: {:?} {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 33 item 6: `status`, `runs --all`, `threads --json`, `budget` and the other
/// printing commands panicked (`failed printing to stdout: Broken pipe`, exit 101)
/// when their reader had gone (`| head -c 1`). Each now ends quietly: killed by
/// SIGPIPE as Unix tools are, with nothing on stderr. Every subcommand is tried.
#[test]
fn issue_33_a_closed_pipe_ends_every_command_quietly() {
    use std::os::unix::process::ExitStatusExt;
    let d = Daemon::start(&["--slots-max", "4"]);
    let r = d.post(
        "/v1/runs",
        &json!({"run_id": "p", "project": "p", "resources": {"cpu_millis": 100}}).to_string(),
    );
    assert_eq!(r.status, 201, "{:?}", r.body);
    let fence = r.body["fence"].as_u64().unwrap().to_string();
    // Every subcommand that prints on stdout (`serve` and `run` have none of their own).
    let every: Vec<Vec<&str>> = vec![
        vec!["status"],
        vec!["status", "--json"],
        vec!["runs"],
        vec!["runs", "--all"],
        vec!["acquire", "--project", "q", "--cpus", "0.1", "--disk", "0"],
        vec!["acquire", "--project", "q", "--detach", "--json"],
        vec!["wait", "p"],
        vec!["renew", "p", "--fence", &fence],
        vec!["reap"],
        vec!["events"],
        vec!["events", "--json"],
        vec!["threads"],
        vec!["threads", "--json"],
        vec!["drain"],
        vec!["budget"],
        vec!["scope", "show", "none"],
        vec!["fleet"],
        vec!["token", "list"],
        vec!["man", "run"],
        vec!["completions", "bash"],
        vec!["man"],
        vec!["--help"],
        vec!["run", "--help"],
        vec!["--version"],
        vec!["release", "p", "--fence", &fence],
    ];
    for args in &every {
        // A pipe whose reader is already gone: the first write fails with EPIPE.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let started = std::time::Instant::now();
        let out = d
            .cli()
            .args(args)
            .stdout(writer)
            .stderr(std::process::Stdio::piped())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        // Killed by SIGPIPE, or its own exit (a refusal is 69): never a panic's 101.
        assert!(
            out.status.signal() == Some(libc::SIGPIPE)
                || out.status.code().is_some_and(|c| c != 101),
            "berth {args:?}: {:?} {said}",
            out.status
        );
        // And at once: `berth wait` on a run granted already long-polled a whole
        // minute for a change that was never coming.
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "berth {args:?} took {:?}",
            started.elapsed()
        );
        assert!(
            !said.contains("panicked") && !said.contains("Broken pipe"),
            "berth {args:?}: {said}"
        );
    }
}

/// Issue 33 item 7: `contrib/berth.service` agrees with the README's install steps
/// (`cargo install` puts berth in ~/.cargo/bin, `berth man --install` the pages its
/// `Documentation=` names) and `systemd-analyze verify` accepts it. (Before: it ran a
/// path no README step made, and named a man page nothing installed.)
#[test]
fn the_systemd_unit_verifies_against_the_readme_install_steps() {
    let have = |tool: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !have("systemd-analyze") || !have("man") {
        assert!(
            std::env::var_os("CI").is_none(),
            "systemd-analyze and man are needed to verify contrib/berth.service"
        );
        eprintln!("skipped: systemd-analyze or man is not installed");
        return;
    }
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    assert!(readme.contains("cargo install --locked --path crates/berth"));
    assert!(readme.contains("berth man --install ~/.local/share/man/man1"));
    let unit = concat!(env!("CARGO_MANIFEST_DIR"), "/../../contrib/berth.service");
    assert!(std::fs::read_to_string(unit)
        .unwrap()
        .contains("ExecStart=%h/.cargo/bin/berth serve"));
    // The README's steps, into a home of its own.
    let home = tempfile::tempdir().unwrap();
    let bin = home.path().join(".cargo/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy(common::BERTH, bin.join("berth")).unwrap();
    let man = home.path().join(".local/share/man");
    let out = Command::new(common::BERTH)
        .args(["man", "--install"])
        .arg(man.join("man1"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let out = Command::new("systemd-analyze")
        .args(["verify", unit])
        .env("HOME", home.path())
        .env("MANPATH", &man)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "systemd-analyze verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Issue 34: `contrib/berth.toml` shows the real defaults (it said so, but set
/// slots_max = 4 and a 2 GiB reserve): loading it changes nothing that
/// `berth serve --print-config` shows, and every key it prints is in the file.
#[test]
fn the_example_berth_toml_shows_the_real_defaults() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../contrib/berth.toml");
    let state = tempfile::tempdir().unwrap();
    let print = |extra: &[&str]| -> String {
        let out = Command::new(common::BERTH)
            .args(["serve", "--print-config", "--state-dir"])
            .arg(state.path())
            .args(extra)
            .env_remove("BERTH_USER_WORKSPACES")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let defaults = print(&[]);
    assert!(defaults.contains("slots_max = ") && defaults.contains("thread_ttl = \"7d\""));
    assert_eq!(print(&["--config", example]), defaults);
    let file = std::fs::read_to_string(example).unwrap();
    for key in defaults
        .lines()
        .filter_map(|l| l.split_once(" = "))
        .map(|(k, _)| k)
    {
        assert!(
            file.contains(&format!("\n{key} = ")) || file.contains(&format!("\n# {key} = ")),
            "contrib/berth.toml lacks {key}"
        );
    }
    // And a flag shows through.
    assert!(print(&["--slots-max", "3"]).contains("slots_max = 3\n"));
}

/// Issue 34, docs as tests: the README's tour runs as written. Every shell block of
/// "A five-minute tour" but the install line and the HTTP API block (which
/// readme.rs runs, with the other API blocks) runs, in order, in one shell, against the daemon the tour itself starts
/// (on a port and state dir of the test's own, through BERTH_LISTEN, BERTH_URL and
/// BERTH_STATE_DIR); the test only waits for that daemon to answer before going on.
#[test]
fn the_readme_tour_blocks_run_as_written() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let start = readme.find("## A five-minute tour").expect("the tour");
    let end = start + 3 + readme[start + 3..].find("\n## ").unwrap();
    let mut script = vec!["set -e".to_string()];
    let mut blocks = 0;
    let mut block: Vec<&str> = Vec::new();
    for line in readme[start..end].lines().chain([""]) {
        if let Some(code) = line.strip_prefix("    ") {
            block.push(code);
            continue;
        }
        if block.is_empty() {
            continue;
        }
        let text = block.join("\n");
        block.clear();
        if text.starts_with("TOKEN=") {
            continue; // the API block: readme.rs runs it
        }
        blocks += 1;
        for l in text.lines().filter(|l| !l.starts_with("cargo install")) {
            script.push(l.to_string());
            if l.starts_with("berth serve") {
                script.push("until berth status >/dev/null 2>&1; do sleep 0.1; done".into());
            }
        }
    }
    assert!(blocks >= 4, "the tour's blocks: {script:?}");
    script.push("wait %2 %3 2>/dev/null || true".into());
    script.push("echo tour-complete".into());
    let dir = tempfile::tempdir().unwrap();
    let (port, state) = (common::free_port(), dir.path().join("state"));
    let within = Duration::from_secs(60);
    let (ended, out) =
        common::run_as_reader(&script.join("\n"), dir.path(), port, Some(&state), within);
    let said = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(ended, "the tour did not finish: {said}{err}");
    assert!(
        out.status.success(),
        "{}\n---\n{said}{err}",
        script.join("\n")
    );
    assert!(said.contains("I waited for the first web run"), "{said}");
    assert!(said.contains("BERTH_RUN_ID="), "{said}");
    assert!(said.contains("reaped "), "berth reap's report: {said}");
    assert!(said.contains("exp1-a7"), "the detached run: {said}");
    assert!(said.contains("tour-complete"), "{said}");
}
