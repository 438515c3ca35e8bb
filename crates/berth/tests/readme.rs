//! The README as tests (issue 34): every code block in README.md is either run by a
//! test against a real daemon or says here why it is not, and the blocks this file
//! runs (the HTTP API, the journal, threads and budgets) run as written, in order, in
//! one shell, with the outputs they show checked where they are stable.

mod common;

use std::path::Path;
use std::time::Duration;

/// Where each README block is run, by the start of its first line.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Verdict {
    /// Run by `the_readme_api_journal_thread_and_budget_blocks_run_as_written`.
    Here,
    /// Run by another test, named.
    Elsewhere(&'static str),
    /// Not run, and why.
    Not(&'static str),
}
use Verdict::*;

const BLOCKS: &[(&str, Verdict)] = &[
    ("cargo run --release -p berth -- serve", Not("the main command: a release build of the `berth serve` the tour runs")),
    ("bash scripts/test.sh", Elsewhere(".ci/run: it is the test command CI runs")),
    ("cargo install --locked --path crates/berth          #", Not("installs into ~/.cargo/bin; the tests run the binary cargo built")),
    ("cargo install --locked --path crates/berth    #", Elsewhere("cli.rs::the_readme_tour_blocks_run_as_written (all but the install line)")),
    ("berth run --project demo --memory 1GiB", Elsewhere("cli.rs::the_readme_tour_blocks_run_as_written")),
    ("berth run --project web -- sleep 5 &", Elsewhere("cli.rs::the_readme_tour_blocks_run_as_written")),
    ("TOKEN=$(cat ~/.local/state/berth/admin.token)", Here),
    ("berth acquire --detach --run-id exp1-a7", Elsewhere("cli.rs::the_readme_tour_blocks_run_as_written")),
    ("sudo berth token create --scope operator --uid", Not("needs other users (alice, bob) on the host; users.rs tests uid-bound tokens and workspaces")),
    ("# Two attempts of this project may run side by side", Elsewhere("runtime.rs::the_readme_runtime_example_runs_as_written")),
    ("berth run --runtime --worktree .", Elsewhere("runtime.rs::the_readme_runtime_example_runs_as_written")),
    ("project shop  2 active", Not("output of `berth projects`, shown for reading")),
    ("berth events                       #", Here),
    ("1 ", Not("output; the run checks the shape of `berth events`'s lines")),
    ("import threading, berth", Elsewhere("clients/python/tests: the README's example runs as written")),
    ("(cd /path/to/berth/clients/typescript && npm ci && npm pack)", Elsewhere("clients/typescript/test: npm pack, installed into a fresh project and imported")),
    ("import { BerthClient, withBerth }", Not("a snippet around the caller's own runAgent; clients/typescript/test runs withBerth and events")),
    ("curl -s -H \"Authorization: Bearer $TOKEN\" -d '{\"project\":\"shop\",\"thread\"", Here),
    ("curl -s -H \"Authorization: Bearer $TOKEN\" $B/v1/threads/conv-42/attach", Here),
    ("berth run --project eval --budget exp-7:claude", Here),
    ("curl -s -H \"Authorization: Bearer $TOKEN\" $B/v1/scopes/exp-7/reservations", Here),
    ("berth serve --store postgres://berth@db.internal/berth", Not("needs a PostgreSQL at db.internal; fleet.rs starts hosts with these flags on pg_virtualenv's server")),
    ("berth serve --store 'postgres://berth@db.internal/berth?sslmode=verify-full", Not("needs a PostgreSQL at db.internal with a certificate of its CA; fleet_conformance.rs connects with each sslmode to pg_virtualenv's server")),
    ("berth token create --scope admin          # on build-1", Not("needs two fleet hosts; fleet_shared.rs makes a token on one host and uses and revokes it on the other")),
    ("cargo run --release -p berth-bench -- core", Not("the benchmarks: minutes each, out of the default test run by design")),
    ("crates/berth-core", Not("a listing of the layout")),
];

/// README.md's code blocks, each with its text (indentation removed): indented blocks
/// outside fences, and fenced ones at any indentation.
fn blocks(readme: &str) -> Vec<String> {
    let lines: Vec<&str> = readme.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") {
            let indent = line.len() - trimmed.len();
            let mut text = Vec::new();
            i += 1;
            while i < lines.len() && !lines[i].trim_start().starts_with("```") {
                text.push(lines[i].get(indent..).unwrap_or("").to_string());
                i += 1;
            }
            out.push(text.join("\n"));
            i += 1;
            continue;
        }
        let after_blank = i == 0 || lines[i - 1].trim().is_empty();
        if line.starts_with("    ") && after_blank {
            let mut text = Vec::new();
            while i < lines.len() && (lines[i].starts_with("    ") || lines[i].trim().is_empty()) {
                text.push(lines[i].get(4..).unwrap_or("").to_string());
                i += 1;
            }
            out.push(text.join("\n").trim_end().to_string());
            continue;
        }
        i += 1;
    }
    out
}

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap()
}

fn verdict(block: &str) -> Option<Verdict> {
    let first = block.lines().map(str::trim).find(|l| !l.is_empty())?;
    let mut found = BLOCKS.iter().filter(|(start, _)| first.starts_with(start));
    let v = found.next().map(|(_, v)| *v);
    assert!(found.next().is_none(), "two verdicts match {first:?}");
    v
}

/// A README block nobody runs is a README block that can go stale: each says where
/// it is run, or why it is not, and each verdict here still names a block.
#[test]
fn every_readme_block_is_run_by_a_test_or_says_why_not() {
    let readme = readme();
    let all = blocks(&readme);
    assert!(all.len() >= 20, "the README's blocks: {}", all.len());
    for b in &all {
        assert!(
            verdict(b).is_some(),
            "a README block without a verdict in readme.rs:\n{b}"
        );
    }
    for (start, _) in BLOCKS {
        assert!(
            all.iter().any(|b| b.trim_start().starts_with(start)),
            "the verdict for {start:?} names no README block"
        );
    }
}

/// The blocks marked `Here`, in README order, in one shell against a daemon of the
/// test's own. As a reader would, the shell starts where the tour left off: a daemon
/// with its state in `~/.local/state/berth` (HOME is the test's directory) and an
/// `./agent.sh` of the reader's own. The README's `http://localhost:7420` is the test
/// daemon's address; a `--follow` line runs for 3 s (it follows until stopped).
#[test]
fn the_readme_api_journal_thread_and_budget_blocks_run_as_written() {
    let readme = readme();
    let port = common::free_port();
    let url = format!("http://127.0.0.1:{port}");
    let mut script = vec![
        "fail() { echo \"README command failed ($1): $2\" >&2; exit 1; }".to_string(),
        "printf '#!/bin/sh\\necho agent ran\\n' > agent.sh && chmod +x agent.sh".into(),
        format!(
            "berth serve --no-memory-sampling --memory-total 8GiB --cpu-total 4 --slots-max 8 \
             --user-workspaces \"$HOME/users\" 2>serve.log &"
        ),
        "until berth status >/dev/null 2>&1; do sleep 0.1; done".into(),
    ];
    let mut ran = 0;
    for b in blocks(&readme).iter().filter(|b| verdict(b) == Some(Here)) {
        ran += 1;
        let text = b.replace("http://localhost:7420", &url);
        // One command a line: continuation lines joined, comments and output kept out.
        let mut command = String::new();
        for line in text.lines() {
            if line.trim_start().starts_with('#') || line.trim().is_empty() {
                continue;
            }
            command.push_str(line);
            if line.ends_with('\\') {
                command.push('\n');
                continue;
            }
            let shown = command.replace('\'', "'\\''");
            if command.contains("--follow") {
                script.push(format!("timeout 3 {command}"));
                script.push(format!("rc=$?; [ $rc = 124 ] || fail $rc '{shown}'"));
            } else {
                script.push(format!("{command} || fail $? '{shown}'"));
            }
            script.push("echo".into());
            command.clear();
        }
    }
    assert_eq!(ran, 6, "the README blocks run here");
    script.push("echo readme-complete".into());
    let dir = tempfile::tempdir().unwrap();
    let within = Duration::from_secs(90);
    let (ended, out) = common::run_as_reader(&script.join("\n"), dir.path(), port, None, within);
    let said = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    let all = format!("{}\n---\n{said}\n---\n{err}", script.join("\n"));
    assert!(ended, "the README's blocks did not finish: {all}");
    assert!(out.status.success(), "{all}");
    assert!(said.contains("readme-complete"), "{all}");
    // The API block: granted, renewed, the fence current, released.
    assert!(
        said.contains(r#""run_id":"demo-1""#) && said.contains(r#""state":"granted""#),
        "{all}"
    );
    assert!(said.contains(r#""current":true"#), "the fence check: {all}");
    assert!(
        said.contains(r#""ending":"released""#),
        "the release: {all}"
    );
    // `berth events`: lines of the shape the README shows (seq, time, kind, run).
    let shape = said.lines().any(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        w.len() >= 4 && w[0] == "1" && w[1].ends_with('Z') && w[2] == "queued" && w[3] == "demo-1"
    });
    assert!(shape, "berth events's first entry: {all}");
    // Threads: the registration and its record; budgets: the run, its token, the turn.
    assert!(
        said.contains(r#""key":"conv-42""#),
        "the thread's record: {all}"
    );
    assert!(
        said.contains("agent ran"),
        "berth run --budget ran ./agent.sh: {all}"
    );
    assert!(
        said.contains(r#""operation_id":"turn-41""#),
        "the reservation: {all}"
    );
}

/// The API's routes: (METHOD, path pattern, query parameter names), from the document.
fn routes() -> Vec<(String, String, Vec<String>)> {
    let doc: serde_json::Value =
        serde_json::from_str(include_str!("../../../docs/openapi.json")).unwrap();
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let Some(params) = op.get("responses").map(|_| &op["parameters"]) else {
                continue;
            };
            let query = params
                .as_array()
                .into_iter()
                .flatten()
                .filter(|p| p["in"] == "query")
                .map(|p| p["name"].as_str().unwrap().to_string())
                .collect();
            out.push((method.to_uppercase(), path.clone(), query));
        }
    }
    out
}

/// Whether `concrete` (`/v1/runs/demo-1`, `/v1/threads/`) is an instance of `pattern`
/// (`/v1/runs/{id}`): a `{name}` stands for any segment, an empty one included.
fn instance_of(concrete: &str, pattern: &str) -> bool {
    let (c, p): (Vec<&str>, Vec<&str>) =
        (concrete.split('/').collect(), pattern.split('/').collect());
    c.len() == p.len() && c.iter().zip(&p).all(|(c, p)| c == p || p.starts_with('{'))
}

/// Issue 34, docs current: every route the docs name (`GET /v1/…` in README.md,
/// docs/contract.md, ARCHITECTURE.md, docs/design.md and the clients' READMEs) is a route of the API,
/// with only query parameters it takes; every file they name exists; and
/// docs/contract.md's interface section names every operation of the API.
#[test]
fn the_docs_name_only_routes_and_files_that_exist_and_the_contract_names_every_route() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let routes = routes();
    let docs = [
        "README.md",
        "docs/contract.md",
        "ARCHITECTURE.md",
        "docs/design.md",
        "clients/typescript/README.md",
        "clients/python/README.md",
    ];
    let mut wrong = Vec::new();
    for doc in docs {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        let words: Vec<&str> = text
            .split(|c: char| c.is_whitespace() || matches!(c, '`' | '(' | ')' | ',' | '"' | '\''))
            .collect();
        for pair in words.windows(2) {
            let [method, target] = pair else { continue };
            if !["GET", "POST", "DELETE", "PUT", "PATCH"].contains(method) {
                continue;
            }
            if !(target.starts_with("/v1/") || *target == "/metrics" || *target == "/") {
                continue;
            }
            let target = target.trim_end_matches(['.', ':', ';']);
            let (path, query) = target.split_once('?').unwrap_or((target, ""));
            let Some((_, _, takes)) = routes
                .iter()
                .find(|(m, p, _)| m == method && instance_of(path, p))
            else {
                wrong.push(format!("{doc}: {method} {target} is no route of the API"));
                continue;
            };
            for name in query.split('&').filter(|q| !q.is_empty()) {
                let name = name.split('=').next().unwrap();
                if !takes.iter().any(|t| t == name) {
                    wrong.push(format!(
                        "{doc}: {method} {path} takes no query parameter {name:?}"
                    ));
                }
            }
        }
        for word in &words {
            let file = word.trim_end_matches(['.', ':', ';', ',']);
            let named = [
                "crates/", "scripts/", "docs/", "clients/", "contrib/", "tests/", ".ci/",
            ];
            if named.iter().any(|p| file.starts_with(p))
                && !file.contains(['*', '<', '{', '…'])
                && !root.join(file.split(['#', ':']).next().unwrap()).exists()
            {
                wrong.push(format!("{doc}: {file} does not exist"));
            }
        }
    }
    let contract = std::fs::read_to_string(root.join("docs/contract.md")).unwrap();
    for (method, path, _) in &routes {
        if !contract.contains(&format!("{method} {path}")) {
            wrong.push(format!("docs/contract.md does not name {method} {path}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
