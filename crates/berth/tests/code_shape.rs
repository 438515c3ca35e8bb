//! Issue 35: the shape of the code, read from the source of every crate.
//!
//! 1. No function in any crate is longer than `FN_LINES_MAX` lines (TigerBeetle's
//!    70), and no test function longer than `TEST_FN_LINES_MAX`.
//! 2. No crate's top-level modules depend on each other in a cycle (see
//!    `no_crate_has_a_module_cycle`).
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

use std::collections::{BTreeMap, BTreeSet};
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

/// Every `.rs` file under `dir` with its text, in path order, and the files that
/// `#[cfg(test)] mod name;` lines declare (test code, wherever it is).
fn sources(dir: &Path) -> (Vec<(PathBuf, String)>, BTreeSet<PathBuf>) {
    let mut files = Vec::new();
    rust_files(dir, &mut files);
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
    (texts, test_files)
}

#[test]
fn no_function_in_any_crate_is_over_70_lines_and_no_test_over_150() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let (texts, test_files) = sources(&root.join("crates"));
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

/// The top-level modules of the crate that `crate::…` paths in `text` name, outside
/// comments: `crate::daemon::Msg`, `crate::{auth, error::ApiError}`.
fn crate_refs(text: &str) -> BTreeSet<String> {
    let code: String = text
        .lines()
        .map(strip_comment)
        .collect::<Vec<_>>()
        .join("\n");
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `my_crate::`, `$crate::`
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The first segment of each path at the group's own depth.
            let (mut depth, mut start) = (1, true);
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 1 => start = true,
                    c if depth == 1 && start && (c.is_alphanumeric() || c == '_') => {
                        out.insert(ident(&group[i..]));
                        start = false;
                    }
                    _ => {}
                }
                if depth == 0 {
                    break;
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.remove("");
    out
}

/// A line without its `//` comment (a `//` inside a string literal is kept).
fn strip_comment(line: &str) -> &str {
    let mut in_str = false;
    let mut prev = ' ';
    for (i, c) in line.char_indices() {
        match c {
            '"' if prev != '\\' => in_str = !in_str,
            '/' if !in_str && prev == '/' => return &line[..i - 1],
            _ => {}
        }
        prev = if prev == '\\' && c == '\\' { ' ' } else { c };
    }
    line
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        g: &BTreeMap<String, BTreeSet<String>>,
        m: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == m) {
            let mut cycle = path[at..].to_vec();
            cycle.push(m.to_string());
            return Some(cycle);
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in g.get(m).into_iter().flatten() {
            if let Some(c) = visit(g, next, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|m| visit(graph, m, &mut Vec::new(), &mut done))
}

/// Issue 35: the modules of a crate form layers. A module that names another through
/// `crate::` depends on it; the graph of a crate's top-level modules (`src/x.rs` or
/// `src/x/`, the crate root aside: it wires everything) has no cycle, so each module
/// can be read, tested and changed knowing only the ones below it. Test code
/// (`#[cfg(test)]` files and blocks) and comments do not count. Inside a directory
/// module, files that are one type's `impl` split by concern (the daemon, the
/// engine) use each other through `super` freely: they are one module.
#[test]
fn no_crate_has_a_module_cycle() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let mut checked = 0;
    let mut wrong = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        let src = krate.unwrap().path().join("src");
        if !src.is_dir() {
            continue;
        }
        let (texts, test_files) = sources(&src);
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (f, text) in &texts {
            let rel = f.strip_prefix(&src).unwrap();
            let top = rel.iter().next().unwrap().to_string_lossy();
            let top = top.trim_end_matches(".rs").to_string();
            if top == "lib" || top == "main" || test_files.contains(f) {
                continue;
            }
            let lines: Vec<&str> = text.lines().collect();
            let in_test = test_blocks(&lines);
            let code: Vec<&str> = lines
                .iter()
                .zip(&in_test)
                .filter(|(_, t)| !**t)
                .map(|(l, _)| *l)
                .collect();
            let refs = crate_refs(&code.join("\n"));
            let deps = graph.entry(top.clone()).or_default();
            deps.extend(refs.into_iter().filter(|r| *r != top));
        }
        let modules: BTreeSet<String> = graph.keys().cloned().collect();
        for deps in graph.values_mut() {
            deps.retain(|d| modules.contains(d));
        }
        checked += graph.len();
        if let Some(cycle) = find_cycle(&graph) {
            wrong.push(format!("{}: {}", src.display(), cycle.join(" -> ")));
        }
    }
    assert!(
        checked > 50,
        "only {checked} modules read: the reader is broken"
    );
    assert!(wrong.is_empty(), "module cycles:\n{}", wrong.join("\n"));
}

/// The reader of `crate::` paths and the cycle finder themselves.
#[test]
fn the_module_reader_sees_paths_groups_and_not_comments() {
    let text = "use crate::daemon::{Msg, Reply};\n\
                use crate::{auth, error::ApiError, fleet::{self, Job}};\n\
                // crate::runtime is only mentioned\n\
                let x = \"http://crate::not_a_path\"; // crate::nor_this\n\
                impl From<crate::listen::Violation> for X {}\n\
                $crate::macro_path; my_crate::other;\n";
    let want: BTreeSet<String> = ["auth", "daemon", "error", "fleet", "listen", "not_a_path"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(crate_refs(text), want);
    let g = |edges: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(find_cycle(&g(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    assert_eq!(
        find_cycle(&g(&[("a", "b"), ("b", "c"), ("c", "b")])),
        Some(vec!["b".to_string(), "c".to_string(), "b".to_string()])
    );
}

/// Issue 35: every limit ARCHITECTURE.md and docs/design.md quote as `` `NAME` (value) ``
/// is a constant of the code with that value (units converted: `(1 s)` for a
/// `…_MS` of 1,000, `(64 KiB)` for 65,536). A renamed constant, or a value changed in
/// the code and not in the docs, fails here. A name defined differently in two crates
/// is quoted with its crate (`berth_client::ANSWER_BYTES_MAX`).
#[test]
fn every_constant_the_docs_quote_has_the_value_the_code_has() {
    let root = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
    let defs = constant_definitions(root);
    assert!(defs.len() > 100, "only {} constants found", defs.len());
    let mut checked = 0;
    let mut wrong = Vec::new();
    for doc in ["ARCHITECTURE.md", "docs/design.md"] {
        let text = std::fs::read_to_string(root.join(doc)).unwrap();
        for (name, quoted) in quoted_constants(&text) {
            checked += 1;
            match (doc_value(&quoted), constant_value(&defs, &name, 0)) {
                (Some(want), Ok(have)) if want == have => {}
                (want, have) => wrong.push(format!(
                    "{doc}: `{name}` ({quoted}): the docs say {want:?}, the code has {have:?}"
                )),
            }
        }
    }
    assert!(checked >= 15, "only {checked} quoted constants found");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// A constant's value in a base unit: microseconds for times, bytes or a plain count.
#[derive(Debug, PartialEq)]
enum Value {
    Micros(u128),
    Plain(u128),
}

/// Every `const NAME: T = EXPR;` of the crates' non-test sources: (crate dir, expr).
fn constant_definitions(root: &Path) -> BTreeMap<String, Vec<(String, String)>> {
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    let mut defs: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        if rel.split('/').any(|c| c == "tests") {
            continue;
        }
        let krate = rel.split('/').nth(1).unwrap().to_string();
        let text = std::fs::read_to_string(&f).unwrap();
        for (at, _) in text.match_indices("const ") {
            let rest = &text[at + "const ".len()..];
            let Some((name, rest)) = rest.split_once(':') else {
                continue;
            };
            let plain = name
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            let Some((_, expr)) = rest.split_once('=') else {
                continue;
            };
            let Some((expr, _)) = expr.split_once(';') else {
                continue;
            };
            if plain && !name.is_empty() && !rest.starts_with(':') {
                defs.entry(name.to_string())
                    .or_default()
                    .push((krate.clone(), expr.trim().to_string()));
            }
        }
    }
    defs
}

/// The `` `NAME` (value) `` quotes of a document: (name as written, value text).
fn quoted_constants(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for part in text.split('`').collect::<Vec<_>>().windows(2) {
        let [name, after] = part else { continue };
        let last = name.rsplit("::").next().unwrap_or("");
        let is_const = last.len() > 2
            && last.contains('_')
            && last
                .chars()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
        let Some(value) = after.strip_prefix(" (") else {
            continue;
        };
        if let (true, Some((value, _))) = (is_const, value.split_once(')')) {
            if value.starts_with(|c: char| c.is_ascii_digit()) {
                out.push((name.to_string(), value.replace('\n', " ")));
            }
        }
    }
    out
}

/// `16,384`, `300 µs`, `1 s`, `64 KiB` in base units.
fn doc_value(text: &str) -> Option<Value> {
    let digits: String = text
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == ',')
        .collect();
    let n: u128 = digits.replace(',', "").parse().ok()?;
    Some(match text[digits.len()..].trim() {
        "" => Value::Plain(n),
        "µs" | "us" => Value::Micros(n),
        "ms" => Value::Micros(n * 1_000),
        "s" => Value::Micros(n * 1_000_000),
        "min" => Value::Micros(n * 60_000_000),
        "KiB" => Value::Plain(n << 10),
        "MiB" => Value::Plain(n << 20),
        "GiB" => Value::Plain(n << 30),
        _ => return None,
    })
}

/// The value of constant `name` (`crate_name::NAME` picks the crate's definition);
/// every definition of an unqualified name must agree.
fn constant_value(
    defs: &BTreeMap<String, Vec<(String, String)>>,
    name: &str,
    depth: usize,
) -> Result<Value, String> {
    if depth > 8 {
        return Err(format!("{name}: defined in a loop"));
    }
    // A qualifier that names a crate picks its definition; a module path does not.
    let (krate, last) = match name.rsplit_once("::") {
        Some((k, l)) => (Some(k.rsplit("::").next().unwrap().replace('_', "-")), l),
        None => (None, name),
    };
    let all = defs.get(last).map(Vec::as_slice).unwrap_or_default();
    let krate = krate.filter(|k| all.iter().any(|(c, _)| c == k));
    let found: Vec<&(String, String)> = defs
        .get(last)
        .map(|d| {
            d.iter()
                .filter(|(c, _)| krate.as_ref().is_none_or(|k| k == c))
                .collect()
        })
        .unwrap_or_default();
    let mut values = Vec::new();
    for (_, expr) in &found {
        let unit = |n: u128| match last {
            l if l.ends_with("_MS") => Value::Micros(n * 1_000),
            l if l.ends_with("_US") => Value::Micros(n),
            l if l.ends_with("_S") => Value::Micros(n * 1_000_000),
            _ => Value::Plain(n),
        };
        let v = match duration(expr) {
            Some((inner, scale)) => Value::Micros(eval(defs, inner, depth)? * scale),
            None => unit(eval(defs, expr, depth)?),
        };
        if !values.contains(&v) {
            values.push(v);
        }
    }
    match values.len() {
        0 => Err(format!("{name}: no such constant")),
        1 => Ok(values.remove(0)),
        _ => Err(format!(
            "{name}: defined differently in several crates; quote it with its crate"
        )),
    }
}

/// `Duration::from_secs(E)` and the like: (E, microseconds per unit).
fn duration(expr: &str) -> Option<(&str, u128)> {
    for (f, scale) in [
        ("from_secs(", 1_000_000),
        ("from_millis(", 1_000),
        ("from_micros(", 1),
    ] {
        if let Some(rest) = expr
            .strip_prefix("Duration::")
            .and_then(|e| e.strip_prefix(f))
        {
            return Some((rest.strip_suffix(')')?, scale));
        }
    }
    None
}

/// An integer expression of literals, other constants, `+ - * / <<` and parentheses.
fn eval(
    defs: &BTreeMap<String, Vec<(String, String)>>,
    expr: &str,
    depth: usize,
) -> Result<u128, String> {
    let e = expr.replace([' ', '\n'], "");
    let e = e.trim_start_matches('(').trim_end_matches(')');
    for op in ["+", "-", "<<", "*", "/"] {
        if let Some((a, b)) = e.rsplit_once(op) {
            let (a, b) = (eval(defs, a, depth)?, eval(defs, b, depth)?);
            return Ok(match op {
                "+" => a + b,
                "-" => a - b,
                "<<" => a << b,
                "*" => a * b,
                _ => a / b,
            });
        }
    }
    let e = e.split("as").next().unwrap_or(e);
    let digits: String = e
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '_')
        .filter(|c| *c != '_')
        .collect();
    if e.starts_with(|c: char| c.is_ascii_digit()) {
        return digits.parse().map_err(|_| format!("{expr}: not a number"));
    }
    match constant_value(defs, e, depth + 1)? {
        Value::Plain(n) => Ok(n),
        Value::Micros(_) => Err(format!("{expr}: a time inside arithmetic")),
    }
}
