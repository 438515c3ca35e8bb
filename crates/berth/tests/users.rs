//! Several users on one host (issue 33 item 4, S9): tokens made, listed, expired and
//! revoked from the CLI, and a run made by another user's token working in a
//! workspace of its own, end to end as uid 65534 (`nobody`).

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::time::Duration;

use common::*;

/// A uid other than the daemon's that names a user on every Debian host.
const NOBODY: u32 = 65_534;

fn cli_out(d: &Daemon, args: &[&str]) -> (i32, String, String) {
    let out = d.cli().args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `berth token create|list|revoke`: the secret once on stdout, the list by id with
/// scope, user and expiry (never a secret), a revoked token refused at once and
/// after a restart, an expired one refused. (Before: no CLI for tokens, and no
/// expiry or revocation at all.)
#[test]
fn issue_33_tokens_are_made_listed_expired_and_revoked_from_the_cli() {
    let mut d = Daemon::start(&[]);
    let (code, secret, said) = cli_out(
        &d,
        &[
            "token",
            "create",
            "--scope",
            "operator",
            "--uid",
            &NOBODY.to_string(),
        ],
    );
    assert_eq!(code, 0, "{said}");
    let secret = secret.trim().to_string();
    assert!(secret.starts_with("berth_"), "{secret}");
    let id = said
        .split("token ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .unwrap()
        .to_string();
    assert_eq!(id.len(), 16, "{said}");
    let (_, short, _) = cli_out(
        &d,
        &["token", "create", "--scope", "read", "--expires", "1s"],
    );
    let short = short.trim().to_string();

    let (code, list, said) = cli_out(&d, &["token", "list"]);
    assert_eq!(code, 0, "{said}");
    let header = list.lines().next().unwrap();
    assert!(
        header.starts_with("id") && header.contains("expires"),
        "{list}"
    );
    let mine = list.lines().find(|l| l.starts_with(&id)).expect("listed");
    assert!(
        mine.contains("operator") && mine.contains("65534") && mine.contains("never"),
        "{mine}"
    );
    assert!(
        !list.contains(&secret) && !list.contains("berth_"),
        "no secret is listed: {list}"
    );

    let use_it = |d: &Daemon, t: &str| d.call_as(Some(t), "GET", "/v1/status", None).status;
    assert_eq!(use_it(&d, &secret), 200);
    std::thread::sleep(Duration::from_millis(1_300));
    let r = d.call_as(Some(&short), "GET", "/v1/status", None);
    assert_eq!(r.status, 401, "an expired token is refused: {}", r.body);
    assert!(r.body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("expired"));

    let (code, _, said) = cli_out(&d, &["token", "revoke", &id]);
    assert_eq!(code, 0, "{said}");
    assert_eq!(use_it(&d, &secret), 401, "revoked: refused at once");
    let (code, _, said) = cli_out(&d, &["token", "revoke", &id]);
    assert_eq!(code, 1, "a second revoke finds nothing: {said}");
    let (code, _, said) = cli_out(&d, &["token", "revoke", "NOT-AN-ID"]);
    assert_eq!(code, 1);
    assert!(said.contains("id"), "{said}");
    d.kill9_and_restart();
    assert_eq!(use_it(&d, &secret), 401, "revoked: refused after a restart");
    assert!(!cli_out(&d, &["token", "list"]).1.contains(&id));
    assert!(d
        .journal()
        .iter()
        .any(|e| e["kind"] == "token_revoked" && e["data"]["id"] == id.as_str()));
}

/// A run made by a token bound to another user gets a workspace that user owns (0700)
/// in a directory that user can reach, so `ls` and `mktemp` work in it, and no other
/// user can look in; it is removed after. (Before: the workspace and `TMPDIR` were
/// under root's 0700 state dir: Permission denied.)
#[test]
fn issue_33_another_users_run_works_in_a_workspace_of_its_own() {
    if !berth_proc::testing::root("issue_33_another_users_run_works_in_a_workspace_of_its_own") {
        return;
    }
    // Reachable by everyone: the users' directory's parent, and berth's binary.
    let open = tempfile::tempdir().unwrap();
    std::fs::set_permissions(open.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let users = open.path().join("users");
    let bin = open.path().join("berth");
    std::fs::copy(BERTH, &bin).unwrap();
    let d = Daemon::start(&[
        "--slots-max",
        "2",
        "--user-workspaces",
        users.to_str().unwrap(),
    ]);
    assert_eq!(std::fs::metadata(&users).unwrap().mode() & 0o7777, 0o711);
    let (code, token, said) = cli_out(
        &d,
        &[
            "token",
            "create",
            "--scope",
            "operator",
            "--uid",
            &NOBODY.to_string(),
        ],
    );
    assert_eq!(code, 0, "{said}");
    let script = r#"set -e
ls -la "$BERTH_WORKSPACE" >/dev/null
f=$(mktemp)
echo written > "$f"
cat "$f"
stat -c 'owner %u mode %a' "$BERTH_WORKSPACE" "$TMPDIR"
echo "ws=$BERTH_WORKSPACE"
sleep 2"#;
    let child = std::process::Command::new(&bin)
        .args([
            "run",
            "--project",
            "mine",
            "--run-id",
            "nobodys",
            "--cpus",
            "0.1",
            "--disk",
            "0",
            "--",
            "sh",
            "-c",
            script,
        ])
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("BERTH_URL", &d.url)
        .env("BERTH_TOKEN", token.trim())
        .current_dir(open.path())
        .uid(NOBODY)
        .gid(NOBODY)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    d.wait_until("nobodys is granted", |d| {
        d.get("/v1/runs/nobodys").body["state"] == "granted"
    });
    let ws = d.get("/v1/runs/nobodys").body["workspace"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(ws.starts_with(users.to_str().unwrap()), "{ws}");
    // Another user (uid 1, `daemon`) cannot look in.
    let peek = std::process::Command::new("ls")
        .arg(&ws)
        .uid(1)
        .gid(1)
        .output()
        .unwrap();
    assert!(!peek.status.success(), "another user listed {ws}");
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("written"), "{said}");
    assert_eq!(
        said.matches("owner 65534 mode 700").count(),
        2,
        "the workspace and its tmp are nobody's, 0700: {said}"
    );
    d.wait_until("nobodys is released", |d| {
        d.get("/v1/runs/nobodys").body["state"] == "released"
    });
    assert!(
        !std::path::Path::new(&ws).exists(),
        "{ws} is removed at the end"
    );
}

/// Malformed token requests are refused by field and change nothing: an expiry out of
/// range, an id that is not one, a request revoking its own token, a non-admin token
/// listing or revoking.
#[test]
fn malformed_token_requests_are_refused_by_name_and_change_nothing() {
    let d = Daemon::start(&[]);
    let count = |d: &Daemon| d.get("/v1/tokens").body["tokens"].as_array().unwrap().len();
    let before = count(&d);
    for bad in [
        r#"{"scope":"read","expires_s":0}"#,
        r#"{"scope":"read","expires_s":315360001}"#,
    ] {
        let r = d.post("/v1/tokens", bad);
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        assert_eq!(
            r.body["error"]["details"]["field"], "expires_s",
            "{}",
            r.body
        );
    }
    let r = d.call("DELETE", "/v1/tokens/ABC", None);
    assert_eq!(
        (r.status, r.body["error"]["details"]["field"].as_str()),
        (400, Some("id"))
    );
    let mine = d.get("/v1/tokens").body["tokens"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r = d.call("DELETE", &format!("/v1/tokens/{mine}"), None);
    assert_eq!((r.status, r.code()), (409, "token_in_use"), "{}", r.body);
    let op = d.post("/v1/tokens", r#"{"scope":"operator"}"#).body["token"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(d.call_as(Some(&op), "GET", "/v1/tokens", None).status, 403);
    let r = d.call_as(Some(&op), "DELETE", &format!("/v1/tokens/{mine}"), None);
    assert_eq!(r.status, 403);
    assert_eq!(count(&d), before + 1, "only the operator token was made");
}

/// `--user-workspaces` must be a real directory of berth's user that nobody else can
/// write: a symlink planted there, or a world-writable directory, stops `berth serve`
/// at start with the flag named (another user could otherwise swap their home dirs).
#[test]
fn a_users_directory_that_is_a_link_or_writable_by_others_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("link");
    std::os::unix::fs::symlink("/tmp", &link).unwrap();
    let open = dir.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    for (path, why) in [(&link, "not a link"), (&open, "writable by nobody else")] {
        let d = Daemon::unstarted(&["--user-workspaces", path.to_str().unwrap()]);
        let (status, said) = d.start_fails(&[]);
        assert!(!status.success(), "{said}");
        assert!(
            said.contains("--user-workspaces") && said.contains(why),
            "{said}"
        );
    }
}
