//! Issue 35 (after issue 10): no function in any crate is longer than `FN_LINES_MAX`
//! lines (TigerBeetle's 70), and no test function longer than `TEST_FN_LINES_MAX`.
//!
//! How it is checked: every `.rs` file under `crates/` is read whole. A function is
//! measured from the line that declares it (`fn`, after any of `pub`, `pub(..)`,
//! `const`, `async`, `unsafe`, `extern "C"`) to the first later line that is its own
//! indentation followed by `}`, which is where rustfmt puts the closing brace (`cargo
//! fmt --check` runs before the tests in `.ci/run`); a signature over several lines
//! counts from its first, and a declaration without a body (`;`) is not a function.
//! Test code is held to the test limit: a file under a `tests/` directory, a file a
//! `#[cfg(test)] mod name;` declares, a `#[cfg(test)] mod name { … }` block wherever it
//! is in its file, and a function marked `#[test]` or `#[tokio::test]`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const FN_LINES_MAX: usize = 70;
const TEST_FN_LINES_MAX: usize = 150;

/// Test suites that ship in a library (every store implementation runs them): their
/// functions are tests, held to the test limit.
const TEST_SUITES: &[&str] = &[
    "crates/berth-store/src/conformance.rs",
    "crates/berth-store/src/fleet/conformance.rs",
];

/// The name of the function a line declares, if it declares one.
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
            "extern \"C\" ",
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
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

fn indent(line: &str) -> &str {
    &line[..line.len() - line.trim_start().len()]
}

/// Lines inside `#[cfg(test)] mod name { … }` blocks, wherever they are in the file.
fn test_blocks(lines: &[&str]) -> Vec<bool> {
    let mut inside = vec![false; lines.len()];
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() != "#[cfg(test)]" {
            i += 1;
            continue;
        }
        let mut j = i + 1;
        while j < lines.len() && lines[j].trim_start().starts_with("#[") {
            j += 1;
        }
        let decl = lines.get(j).map_or("", |l| l.trim());
        let is_mod = decl.starts_with("mod ") || decl.starts_with("pub mod ");
        if is_mod && decl.ends_with('{') {
            let close = format!("{}}}", indent(lines[j]));
            let end = (j + 1..lines.len())
                .find(|&k| lines[k] == close)
                .unwrap_or(lines.len() - 1);
            inside[i..=end].iter_mut().for_each(|x| *x = true);
            i = end;
        }
        i += 1;
    }
    inside
}

/// The files `#[cfg(test)] mod name;` declares, next to the file that declares them.
fn test_module_files(path: &Path, lines: &[&str]) -> Vec<PathBuf> {
    let dir = match path.file_name().and_then(|n| n.to_str()) {
        Some("lib.rs" | "main.rs" | "mod.rs") => path.parent().unwrap().to_path_buf(),
        _ => path.with_extension(""),
    };
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        if l.trim() != "#[cfg(test)]" {
            continue;
        }
        let next = lines.get(i + 1).map_or("", |l| l.trim());
        if let Some(name) = next.strip_prefix("mod ").and_then(|n| n.strip_suffix(';')) {
            out.push(dir.join(format!("{name}.rs")));
            out.push(dir.join(name).join("mod.rs"));
        }
    }
    out
}

/// (lines, name, first line, is test code) of every function with a body in `text`.
fn functions(text: &str, whole_file_is_test: bool) -> Vec<(usize, String, usize, bool)> {
    let lines: Vec<&str> = text.lines().collect();
    let in_test_block = test_blocks(&lines);
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(name) = declared_fn(line) else {
            continue;
        };
        // The signature ends at the first line ending in `{` (a body) or `;` (none).
        let Some(open) = (i..lines.len()).find(|&k| {
            let t = lines[k].trim_end();
            t.ends_with('{') || t.ends_with(';') || (t.contains('{') && t.ends_with('}'))
        }) else {
            continue;
        };
        if !lines[open].trim_end().ends_with('{') {
            continue; // a declaration, or a body on one line
        }
        let close = format!("{}}}", indent(line));
        let Some(end) = (open + 1..lines.len()).find(|&k| lines[k] == close) else {
            continue;
        };
        let attrs = lines[..i]
            .iter()
            .rev()
            .take_while(|l| l.trim_start().starts_with("#[") || l.trim_start().starts_with("///"));
        let marked = attrs
            .into_iter()
            .any(|l| l.contains("#[test]") || l.contains("#[tokio::test"));
        let test = whole_file_is_test || in_test_block[i] || marked;
        found.push((end - i + 1, name.to_string(), i + 1, test));
    }
    found
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() && !p.ends_with("target") && !p.ends_with("node_modules") {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_function_in_any_crate_is_over_70_lines_and_no_test_over_150() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    files.sort();
    let texts: Vec<(PathBuf, String)> = files
        .into_iter()
        .map(|f| {
            let t = std::fs::read_to_string(&f).unwrap();
            (f, t)
        })
        .collect();
    let mut test_files = BTreeSet::new();
    for (f, t) in &texts {
        let lines: Vec<&str> = t.lines().collect();
        test_files.extend(test_module_files(f, &lines));
    }
    let mut wrong = Vec::new();
    let mut measured = 0;
    for (f, text) in &texts {
        let rel = f.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        let whole_test = rel.split('/').any(|c| c == "tests")
            || test_files.contains(f)
            || TEST_SUITES.contains(&rel.as_str());
        for (n, name, at, test) in functions(text, whole_test) {
            measured += 1;
            let max = if test {
                TEST_FN_LINES_MAX
            } else {
                FN_LINES_MAX
            };
            if n > max {
                wrong.push(format!("{rel}:{at} {name} is {n} lines (max {max})"));
            }
        }
    }
    assert!(
        measured > 1_000,
        "only {measured} functions found: the reader is broken"
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The reader itself: a multi-line signature counts from its first line, a declaration
/// has no body, a test block anywhere in a file is test code, and so is a `#[test]`.
#[test]
fn the_function_reader_measures_what_rustfmt_writes() {
    let text = "\
fn one() {
    a();
}

pub(crate) async fn long(
    x: u32,
) -> u32 {
    x
}

trait T {
    fn declared(&self) -> u32;
}

#[cfg(test)]
mod tests {
    fn helper() {
        b();
    }
}

fn after_the_tests() {
    c();
}

#[test]
fn marked() {
    d();
}
";
    let got: Vec<(usize, String, usize, bool)> = functions(text, false);
    let want = [
        (3, "one", 1, false),
        (5, "long", 5, false),
        (3, "helper", 17, true),
        (3, "after_the_tests", 22, false),
        (3, "marked", 27, true),
    ];
    let want: Vec<(usize, String, usize, bool)> = want
        .iter()
        .map(|(n, s, at, t)| (*n, s.to_string(), *at, *t))
        .collect();
    assert_eq!(got, want);
}
