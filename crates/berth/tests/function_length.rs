//! Issue 10: no function in berth-server or the berth CLI is longer than
//! `FN_LINES_MAX` lines, so each reads like the core's (TigerBeetle aims at 70).
//!
//! How it is checked: every `.rs` file under `crates/berth-server/src` and
//! `crates/berth/src` is read; each line that declares a function with a body (`fn`,
//! after any of `pub`, `pub(..)`, `const`, `async`, `unsafe`) is measured to the first
//! later line that is its own indentation followed by `}`, which is where rustfmt puts
//! the closing brace (`cargo fmt --check` runs before the tests in `.ci/run`). Unit
//! tests (from a file's first `#[cfg(test)]` at column 0) are not held to it: a
//! scenario written out in full is clearer than one split to fit.

use std::path::{Path, PathBuf};

const FN_LINES_MAX: usize = 80;

/// The name of the function a line declares, if it declares one with a body.
fn declared_fn(line: &str) -> Option<&str> {
    let mut rest = line.trim_start();
    loop {
        let before = rest;
        for prefix in [
            "pub(crate) ",
            "pub(super) ",
            "pub ",
            "const ",
            "async ",
            "unsafe ",
        ] {
            if let Some(r) = rest.strip_prefix(prefix) {
                rest = r;
            }
        }
        if rest == before {
            break;
        }
    }
    let rest = rest.strip_prefix("fn ")?;
    if line.trim_end().ends_with(';') {
        return None;
    }
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

/// (lines, name, first line) of every function in `text` outside its unit tests.
fn functions(text: &str) -> Vec<(usize, String, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .iter()
        .position(|l| l.starts_with("#[cfg(test)]"))
        .unwrap_or(lines.len());
    let mut found = Vec::new();
    for (i, line) in lines[..end].iter().enumerate() {
        let Some(name) = declared_fn(line) else {
            continue;
        };
        let indent = &line[..line.len() - line.trim_start().len()];
        let close = format!("{indent}}}");
        if let Some(k) = lines[i + 1..end].iter().position(|l| *l == close) {
            found.push((k + 2, name.to_string(), i + 1));
        }
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_function_in_the_server_or_the_cli_is_over_80_lines() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for dir in ["berth-server/src", "berth/src"] {
        rust_files(&crates.join(dir), &mut files);
    }
    files.sort();
    let mut measured = 0;
    let mut long = Vec::new();
    for f in &files {
        for (n, name, at) in functions(&std::fs::read_to_string(f).unwrap()) {
            measured += 1;
            if n > FN_LINES_MAX {
                long.push(format!("{}:{at} {name}: {n} lines", f.display()));
            }
        }
    }
    // Not vacuous: the scan finds the functions there are.
    assert!(measured > 300, "only {measured} functions found");
    assert!(
        long.is_empty(),
        "{} functions over {FN_LINES_MAX} lines:\n{}",
        long.len(),
        long.join("\n")
    );
}

#[test]
fn the_measure_counts_a_function_from_its_line_to_its_closing_brace() {
    let text = "fn a() {\n    x();\n}\n\n    pub(crate) async fn b(\n        y: u8,\n    ) -> u8 {\n        y\n    }\nfn c();\n#[cfg(test)]\nfn t() {\n}\n";
    assert_eq!(
        functions(text),
        [(3, "a".to_string(), 1), (5, "b".to_string(), 5)]
    );
}
