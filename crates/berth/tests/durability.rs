//! D2 against power loss, not only process death: a `kill -9` keeps the page cache, so
//! the crash tests would pass with `synchronous=OFF` or an answer sent before its
//! commit. Here the real daemon runs under `strace -f`, and the order of its system
//! calls is checked: every acknowledgement of a change (a 2xx answer to a POST) is
//! written to its socket only after the ledger's WAL was written and then fsynced,
//! both after the request was read. What is acknowledged is on the disk, whatever
//! the power does next.
//!
//! Needs `strace` (scripts/test.sh installs it when run as root).

mod common;

use std::collections::HashMap;

use common::Daemon;
use serde_json::json;

/// What the check needs from a trace, in the order the calls happened.
#[derive(Debug, PartialEq)]
enum Ev {
    /// A request starting `POST ` was read from connection `.0`.
    Post(String),
    /// An answer with this status began to be written to connection `.0`.
    Answer(String, u16),
    /// A write to the ledger's WAL began.
    WalWrite,
    /// An fsync or fdatasync of the ledger's WAL returned 0.
    WalSync,
    /// That sync was an `fsync` (issue 37: the WAL is synced with `fdatasync`).
    WalFullSync,
    /// The fence marker's temporary file was written, fsynced (returned 0), renamed
    /// over `fence.floor` (returned 0); the state dir was fsynced (returned 0).
    MarkerWrite,
    MarkerSync,
    MarkerRename,
    DirSync,
    /// A POST read from connection `.0` named run `.1` in its body (concern d).
    PostId(String, String),
    /// A write to the WAL began, carrying these bytes (as strace prints them).
    WalData(String),
}

/// The call's name, its first argument (the descriptor as `-yy` prints it) and the
/// text after it, or `None` for lines that are not calls (signals, exits).
fn split_call(call: &str) -> Option<(&str, &str, &str)> {
    let (name, args) = call.split_once('(')?;
    // The descriptor ends at the next argument, or at the call's end (`fsync(fd)`).
    let (fd, rest) = args
        .split_once(", ")
        .or_else(|| args.split_once(')'))
        .unwrap_or((args, ""));
    Some((name, fd.trim_end(), rest))
}

/// The connection of a descriptor printed as `21<TCP:[a:p->b:q]>`, if a TCP one.
fn connection(fd: &str) -> Option<String> {
    let i = fd.find("<TCP:")?;
    Some(fd[i..].to_string())
}

/// Events seen when a call begins (writes carry their data then).
fn on_entry(call: &str, out: &mut Vec<(usize, Ev)>, line: usize) {
    let Some((name, fd, rest)) = split_call(call) else {
        return;
    };
    match name {
        "write" | "writev" | "sendto" | "sendmsg" => {
            if let Some(c) = connection(fd) {
                if let Some(i) = rest.find("\"HTTP/1.1 ") {
                    let status = rest[i + 10..]
                        .get(..3)
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                    out.push((line, Ev::Answer(c, status)));
                }
            } else if fd.ends_with("-wal>") {
                out.push((line, Ev::WalWrite));
                out.push((line, Ev::WalData(rest.to_string())));
            } else if fd.ends_with("/fence.floor.tmp>") {
                out.push((line, Ev::MarkerWrite));
            }
        }
        "pwrite64" | "pwritev" | "pwritev2" if fd.ends_with("-wal>") => {
            out.push((line, Ev::WalWrite));
            out.push((line, Ev::WalData(rest.to_string())));
        }
        _ => {}
    }
}

/// Events seen when a call returns (reads carry their data then; syncs succeed then).
fn on_exit(call: &str, out: &mut Vec<(usize, Ev)>, line: usize) {
    let Some((name, fd, rest)) = split_call(call) else {
        return;
    };
    let ret = call.rsplit_once(" = ").map(|(_, r)| r.trim());
    match name {
        "read" | "recvfrom" | "recvmsg" => {
            if let Some(c) = connection(fd) {
                if rest.trim_start().starts_with("\"POST ") {
                    // The run id of the body, as strace escapes it (`\"run_id\":\"x\"`).
                    let id = rest
                        .split_once("run_id\\\":\\\"")
                        .and_then(|(_, t)| t.split_once("\\\""))
                        .map(|(id, _)| id.to_string());
                    if let Some(id) = id {
                        out.push((line, Ev::PostId(c.clone(), id)));
                    }
                    out.push((line, Ev::Post(c)));
                }
            }
        }
        "fsync" | "fdatasync" if fd.ends_with("-wal>") && ret == Some("0") => {
            if name == "fsync" {
                out.push((line, Ev::WalFullSync));
            }
            out.push((line, Ev::WalSync))
        }
        "fsync" | "fdatasync" if fd.ends_with("/fence.floor.tmp>") && ret == Some("0") => {
            out.push((line, Ev::MarkerSync))
        }
        "fsync"
            if STATE_DIR.with(|d| fd.ends_with(&format!("<{}>", d.borrow())))
                && ret == Some("0") =>
        {
            out.push((line, Ev::DirSync))
        }
        "rename" | "renameat" | "renameat2"
            if call.contains("fence.floor.tmp\"") && ret == Some("0") =>
        {
            out.push((line, Ev::MarkerRename))
        }
        _ => {}
    }
}

std::thread_local! {
    /// The daemon's state dir as strace prints it (the directory fsynced after the
    /// marker's rename).
    static STATE_DIR: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// L1/S6 (issue 32 concern c): a fence above the marker is never answered before the
/// marker that covers it is durable: each rename of the marker follows a write and
/// then an fsync of its temporary file, and the state dir is fsynced after the rename
/// before any change is acknowledged. Returns the renames seen and what broke the rule.
fn check_marker(events: &[(usize, Ev)]) -> (usize, Vec<String>) {
    let (mut written, mut synced, mut renamed) = (None::<usize>, None::<usize>, None::<usize>);
    let mut renames = 0;
    let mut broken = Vec::new();
    for (line, ev) in events {
        match ev {
            Ev::MarkerWrite => written = Some(*line),
            Ev::MarkerSync => synced = Some(*line),
            Ev::MarkerRename => {
                renames += 1;
                let durable = matches!((written, synced), (Some(w), Some(s)) if s > w);
                if !durable {
                    broken.push(format!(
                        "the marker renamed at line {} from a file written at {written:?}, fsynced at {synced:?}",
                        line + 1
                    ));
                }
                (written, synced, renamed) = (None, None, Some(*line));
            }
            Ev::DirSync => renamed = None,
            Ev::Answer(_, status) if (200..300).contains(status) => {
                if let Some(r) = renamed {
                    broken.push(format!(
                        "answer {status} at line {} before the state dir was fsynced after the marker's rename at {}",
                        line + 1,
                        r + 1
                    ));
                }
            }
            _ => {}
        }
    }
    (renames, broken)
}

/// The events of an `strace -f -yy` trace. A call another thread interrupts is printed
/// in two lines (`<unfinished ...>`, then `<... name resumed>`): joined per thread,
/// with its entry at the first line and its return at the second.
fn events(trace: &str) -> Vec<(usize, Ev)> {
    let mut out = Vec::new();
    let mut pending: HashMap<&str, &str> = HashMap::new();
    for (n, line) in trace.lines().enumerate() {
        let Some((pid, rest)) = line.split_once(' ') else {
            continue;
        };
        let rest = rest.trim_start();
        if let Some(head) = rest.strip_suffix("<unfinished ...>") {
            on_entry(head, &mut out, n);
            pending.insert(pid, head);
        } else if rest.starts_with("<... ") {
            let Some(head) = pending.remove(pid) else {
                continue;
            };
            let tail = rest.split_once("resumed>").map_or("", |(_, t)| t);
            on_exit(&format!("{head}{tail}"), &mut out, n);
        } else {
            on_entry(rest, &mut out, n);
            on_exit(rest, &mut out, n);
        }
    }
    out
}

/// Every 2xx answer to a POST must follow, on its own connection, the request; after
/// the request a WAL write; after that write a WAL fsync. Returns the number of
/// answers checked and a description of each that broke the rule.
fn check(events: &[(usize, Ev)]) -> (usize, Vec<String>) {
    let mut post_at: HashMap<&str, usize> = HashMap::new();
    let mut writes: Vec<usize> = Vec::new();
    let mut last_sync: Option<usize> = None;
    let mut checked = 0;
    let mut broken = Vec::new();
    for (line, ev) in events {
        match ev {
            Ev::Post(c) => {
                post_at.insert(c, *line);
            }
            Ev::WalWrite => writes.push(*line),
            Ev::WalSync => last_sync = Some(*line),
            Ev::MarkerWrite
            | Ev::MarkerSync
            | Ev::MarkerRename
            | Ev::DirSync
            | Ev::PostId(..)
            | Ev::WalFullSync
            | Ev::WalData(_) => {}
            Ev::Answer(c, status) => {
                let Some(read) = post_at.remove(c.as_str()) else {
                    continue;
                };
                if !(200..300).contains(status) {
                    continue;
                }
                checked += 1;
                let write = writes.iter().copied().find(|w| *w > read);
                let synced = matches!((write, last_sync), (Some(w), Some(s)) if s > w);
                if !synced {
                    broken.push(format!(
                        "answer {status} at trace line {} to the POST read at line {}: \
                         WAL written after it at {write:?}, last WAL fsync at {last_sync:?}",
                        line + 1,
                        read + 1
                    ));
                }
            }
        }
    }
    (checked, broken)
}

/// Concern (d): under concurrent clients, every 2xx answer to a POST naming a run
/// follows the fsync of its own commit: the first WAL write after the request that
/// carries the run's id (its row's page: only its own commit writes it first), then a
/// WAL fsync, then the answer. (The check above, "a write after the request, then a
/// sync", passes when another client's commit was synced first.) Returns the answers
/// tied and what broke the rule.
fn check_own_commit(events: &[(usize, Ev)]) -> (usize, Vec<String>) {
    let mut asked: HashMap<&str, (usize, &str)> = HashMap::new();
    let mut own_write: HashMap<&str, usize> = HashMap::new();
    let mut syncs: Vec<usize> = Vec::new();
    let (mut tied, mut broken) = (0, Vec::new());
    for (line, ev) in events {
        match ev {
            Ev::PostId(c, id) => {
                asked.insert(c, (*line, id));
            }
            Ev::WalData(data) => {
                for (read, id) in asked.values() {
                    if *read < *line && data.contains(*id) {
                        own_write.entry(*id).or_insert(*line);
                    }
                }
            }
            Ev::WalSync => syncs.push(*line),
            Ev::Answer(c, status) if (200..300).contains(status) => {
                let Some((_, id)) = asked.remove(c.as_str()) else {
                    continue;
                };
                let write = own_write.get(id).copied();
                let synced = write.is_some_and(|w| syncs.iter().any(|s| *s > w && *s < *line));
                tied += 1;
                if !synced {
                    broken.push(format!(
                        "run {id}: answered {status} at line {}, its commit written at {write:?}, not fsynced before",
                        line + 1
                    ));
                }
            }
            _ => {}
        }
    }
    (tied, broken)
}

fn strace() -> Option<&'static str> {
    ["/usr/bin/strace", "/bin/strace"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
}

/// The daemon (with `extra`) under `strace -f`, strings shown up to `strlen` bytes:
/// the daemon, where the trace goes, and the dir that holds it; `None` (the test is
/// skipped, or fails where it must run) without strace.
fn traced(
    test: &str,
    extra: &[&str],
    strlen: usize,
) -> Option<(Daemon, std::path::PathBuf, tempfile::TempDir)> {
    let Some(strace) = strace() else {
        berth_proc::testing::unavailable(
            berth_proc::testing::REQUIRE_ROOT,
            test,
            "strace is not installed (scripts/test.sh installs it when run as root)",
        );
        return None;
    };
    let mut d = Daemon::unstarted(extra);
    let state = d.state.display().to_string();
    STATE_DIR.with(|s| *s.borrow_mut() = state);
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace");
    // strace, then setpriv: the daemon dies with strace (the harness kills strace).
    let mut args: Vec<String> = [
        "-f",
        "-qq",
        "-yy",
        "-s",
        &strlen.to_string(),
        "-e",
        "trace=read,recvfrom,recvmsg,write,writev,sendto,sendmsg,pwrite64,pwritev,pwritev2,fsync,fdatasync,rename,renameat,renameat2",
        "-o",
    ]
    .map(String::from)
    .to_vec();
    args.push(trace.display().to_string());
    args.extend(["setpriv", "--pdeathsig", "KILL", "--"].map(String::from));
    args.push(common::BERTH.to_string());
    args.append(&mut d.args);
    d.args = args;
    d.bin = strace.into();
    d.spawn();
    Some((d, trace, dir))
}

#[test]
fn every_acknowledged_change_follows_an_fsync_of_the_ledger() {
    const TEST: &str = "every_acknowledged_change_follows_an_fsync_of_the_ledger";
    // A marker block of 2 fences: it is raised every other grant (concern c).
    let extra = ["--slots-max", "4", "--fence-reserve-block", "2"];
    let Some((mut d, trace, _dir)) = traced(TEST, &extra, 48) else {
        return;
    };

    // Changes of every kind the ledger records: grants, renewals, releases, a
    // registration, and a grant answered to a waiter long after its request was read.
    const RUNS: usize = 20;
    let mut posts = 0;
    let hold = d.post(
        "/v1/runs",
        &json!({"run_id": "hold", "project": "hold", "resources": {"cpu_millis": 100, "memory": 16777216}}).to_string(),
    );
    assert_eq!(hold.status, 201, "{:?}", hold.body);
    posts += 1;
    for i in 0..RUNS {
        let id = format!("r{i}");
        let r = d.post(
            "/v1/runs",
            &json!({"run_id": id, "project": id, "resources": {"cpu_millis": 100, "memory": 16777216}}).to_string(),
        );
        assert_eq!(r.status, 201, "{:?}", r.body);
        let fence = r.body["fence"].as_u64().unwrap();
        let renew = d.post(
            &format!("/v1/runs/{id}/renew"),
            &json!({"fence": fence}).to_string(),
        );
        assert_eq!(renew.status, 200, "{:?}", renew.body);
        let release = d.post(
            &format!("/v1/runs/{id}/release"),
            &json!({"fence": fence}).to_string(),
        );
        assert_eq!(release.status, 200, "{:?}", release.body);
        posts += 3;
    }
    let mut sleeper = std::process::Command::new("sleep")
        .arg("3600")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let reg = d.post(
        "/v1/runs/hold/processes",
        &json!({"fence": hold.body["fence"], "pid": sleeper.id()}).to_string(),
    );
    assert_eq!(reg.status, 201, "{:?}", reg.body);
    posts += 1;
    // Fill the slots, queue a waiter, then free a slot: the waiter's answer comes
    // from the grant the release made.
    for id in ["f1", "f2", "f3"] {
        let r = d.post(
            "/v1/runs",
            &json!({"run_id": id, "project": id, "resources": {"cpu_millis": 100, "memory": 16777216}}).to_string(),
        );
        assert_eq!(r.status, 201, "{:?}", r.body);
        posts += 1;
    }
    let mut waiter = common::long_poll(
        &d,
        &json!({"run_id": "w", "project": "w", "resources": {"cpu_millis": 100, "memory": 16777216}}),
    );
    d.wait_until("the waiter queues", |d| {
        d.get("/v1/runs/w").body["state"] == "queued"
    });
    let f1 = d.get("/v1/runs/f1").body["fence"].clone();
    let release = d.post("/v1/runs/f1/release", &json!({"fence": f1}).to_string());
    assert_eq!(release.status, 200, "{:?}", release.body);
    posts += 2;
    {
        use std::io::Read;
        waiter
            .set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        let mut answer = [0u8; 64];
        let n = waiter.read(&mut answer).unwrap();
        assert!(
            answer[..n].starts_with(b"HTTP/1.1 201"),
            "{}",
            String::from_utf8_lossy(&answer[..n])
        );
    }
    d.kill9();
    let _ = sleeper.kill();
    let _ = sleeper.wait();

    let text = std::fs::read_to_string(&trace).unwrap();
    let evs = events(&text);
    let (checked, broken) = check(&evs);
    assert!(
        broken.is_empty(),
        "{} of {checked} acknowledgements were not durable when sent:\n{}\n(trace: {} lines)",
        broken.len(),
        broken.join("\n"),
        text.lines().count()
    );
    // Every POST this test made was found and checked: a trace the parser misread
    // cannot pass for a clean one.
    assert_eq!(checked, posts, "answers checked vs POSTs made");
    let (renames, broken) = check_marker(&evs);
    assert!(
        broken.is_empty(),
        "the fence marker was not durable in time:\n{}",
        broken.join("\n")
    );
    // 25 grants with a block of 2 (the marker moves every third fence): each seen.
    assert!(renames >= 6, "{renames} renames of the marker seen");
    // Issue 37: the WAL is synced with `fdatasync` (SQLite built with HAVE_FDATASYNC,
    // `.cargo/config.toml`): its data and size, without a journal commit for its
    // times. `fsync` cost ~30 us more per commit on this machine's disk.
    let syncs = evs.iter().filter(|(_, e)| matches!(e, Ev::WalSync)).count();
    let full = evs
        .iter()
        .filter(|(_, e)| matches!(e, Ev::WalFullSync))
        .count();
    assert!(
        syncs >= posts && full == 0,
        "{full} of {syncs} WAL syncs were fsync"
    );
}

/// Concern (d): eight clients at once acquire six runs each; every answer
/// follows the fsync of its own commit, not merely some fsync after some write.
#[test]
fn under_concurrent_clients_each_answer_follows_the_fsync_of_its_own_commit() {
    const TEST: &str = "under_concurrent_clients_each_answer_follows_the_fsync_of_its_own_commit";
    let Some((mut d, trace, _dir)) = traced(TEST, &["--slots-max", "64"], 8192) else {
        return;
    };
    const CLIENTS: usize = 8;
    const EACH: usize = 6;
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (url, token) = (d.url.clone(), d.token.clone());
            std::thread::spawn(move || {
                let agent: ureq::Agent = ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .build()
                    .into();
                for i in 0..EACH {
                    let id = format!("cc{c}x{i}z");
                    let body = json!({"run_id": id, "project": id,
                        "resources": {"cpu_millis": 10, "memory": 1048576, "disk": 0}});
                    let r = agent
                        .post(format!("{url}/v1/runs"))
                        .header("Authorization", format!("Bearer {token}"))
                        .header("Content-Type", "application/json")
                        .send(body.to_string().as_bytes())
                        .unwrap();
                    assert_eq!(r.status().as_u16(), 201);
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    d.kill9();
    let text = std::fs::read_to_string(&trace).unwrap();
    let (tied, broken) = check_own_commit(&events(&text));
    assert!(
        broken.is_empty(),
        "{} of {tied} answers came before their own commit was durable:\n{}",
        broken.len(),
        broken.join("\n")
    );
    assert_eq!(
        tied,
        CLIENTS * EACH,
        "answers tied to their commits vs acquires made"
    );
}

/// The checker itself, on hand-written traces: a clean order passes; an answer before
/// the fsync, with no fsync at all, or with the WAL written before the request only,
/// fails; calls split across lines by other threads are joined.
#[test]
fn the_syscall_order_check_catches_an_answer_before_the_fsync() {
    let conn = "21<TCP:[127.0.0.1:1->127.0.0.1:2]>";
    let post = format!(
        "7 recvfrom({conn}, \"POST /v1/runs HTTP/1.1\\r\\n\"..., 8192, 0, NULL, NULL) = 200"
    );
    let write = "8 pwrite64(12</s/ledger.db-wal>, \"\\0\"..., 4096, 0) = 4096";
    let sync = "8 fdatasync(12</s/ledger.db-wal>) = 0";
    let answer = format!(
        "7 writev({conn}, [{{iov_base=\"HTTP/1.1 201 Created\\r\\n\"..., iov_len=10}}], 1) = 10"
    );
    let run = |lines: &[&str]| check(&events(&lines.join("\n")));
    assert_eq!(run(&[&post, write, sync, &answer]), (1, vec![]));
    assert_eq!(
        run(&[&post, write, &answer, sync]).1.len(),
        1,
        "answer before fsync"
    );
    assert_eq!(run(&[&post, write, &answer]).1.len(), 1, "no fsync");
    assert_eq!(
        run(&[write, sync, &post, &answer]).1.len(),
        1,
        "nothing written after the request"
    );
    // A GET or a refusal needs nothing durable.
    let refused = answer.replace("201 Created", "409 Conflict");
    assert_eq!(run(&[&post, &refused]), (0, vec![]));
    // Split calls: the fsync returns (resumed) only after the answer began.
    let split_sync = "8 fdatasync(12</s/ledger.db-wal> <unfinished ...>";
    let resumed = "8 <... fdatasync resumed>) = 0";
    assert_eq!(
        run(&[&post, write, split_sync, &answer, resumed]).1.len(),
        1
    );
    assert_eq!(
        run(&[&post, write, split_sync, resumed, &answer]),
        (1, vec![])
    );
    // Concern (d): A's answer after B's commit was synced, before A's own was: the
    // first check passes it, the own-commit check does not.
    let c1 = "21<TCP:[127.0.0.1:1->127.0.0.1:2]>";
    let c2 = "22<TCP:[127.0.0.1:3->127.0.0.1:4]>";
    let post_id = |c: &str, id: &str| {
        format!("7 recvfrom({c}, \"POST /v1/runs HTTP/1.1\\r\\n\\r\\n{{\\\"run_id\\\":\\\"{id}\\\"}}\", 8192, 0, NULL, NULL) = 90")
    };
    let write_of =
        |id: &str| format!("8 pwrite64(12</s/ledger.db-wal>, \"\\0{id}\\0\", 4096, 0) = 4096");
    let answer_on = |c: &str| {
        format!(
            "7 writev({c}, [{{iov_base=\"HTTP/1.1 201 Created\\r\\n\"..., iov_len=10}}], 1) = 10"
        )
    };
    let (pa, pb, wa, wb) = (
        post_id(c1, "ra"),
        post_id(c2, "rb"),
        write_of("ra"),
        write_of("rb"),
    );
    let (aa, ab) = (answer_on(c1), answer_on(c2));
    let early = [&pa[..], &pb, &wb, sync, &aa, &wa, sync, &ab];
    assert_eq!(run(&early).1.len(), 0, "the first check cannot see it");
    let own = check_own_commit(&events(&early.join("\n")));
    assert_eq!((own.0, own.1.len()), (2, 1), "{own:?}");
    let fine = [&pa[..], &pb, &wb, &wa, sync, &aa, &ab];
    assert_eq!(check_own_commit(&events(&fine.join("\n"))), (2, vec![]));
    // The marker: written, fsynced, renamed, its directory fsynced, then answered.
    STATE_DIR.with(|d| *d.borrow_mut() = "/s".into());
    let m_write = "9 write(14</s/fence.floor.tmp>, \"5\\n\", 2) = 2";
    let m_sync = "9 fsync(14</s/fence.floor.tmp>) = 0";
    let m_rename = "9 rename(\"/s/fence.floor.tmp\", \"/s/fence.floor\") = 0";
    let d_sync = "9 fsync(15</s>) = 0";
    let marker = |lines: &[&str]| check_marker(&events(&lines.join("\n")));
    assert_eq!(
        marker(&[m_write, m_sync, m_rename, d_sync, &answer]),
        (1, vec![])
    );
    assert_eq!(
        marker(&[m_write, m_rename, d_sync, &answer]).1.len(),
        1,
        "no fsync"
    );
    assert_eq!(
        marker(&[m_write, m_sync, m_rename, &answer, d_sync])
            .1
            .len(),
        1,
        "answered first"
    );
    let split_read = format!("7 recvfrom({conn},  <unfinished ...>");
    let read_resumed =
        "7 <... recvfrom resumed>\"POST /v1/runs HTTP/1.1\\r\\n\"..., 8192, 0, NULL, NULL) = 200";
    assert_eq!(
        run(&[&split_read, read_resumed, write, sync, &answer]),
        (1, vec![])
    );
}
