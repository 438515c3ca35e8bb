//! Issue 16, item 4: the two TOML files berth reads, fuzzed against their real parsers:
//! `berth.toml` (`berth serve`'s configuration, `serve::build_config`) and a worktree's
//! `.berth.toml` (the runtime contract, C1, `berth_server::contract::read`), with valid
//! documents mutated (keys dropped, added and retyped, odd strings and numbers, nested
//! tables, byte-level damage) and raw bytes. Each must never panic; a refusal must name
//! the file and, for a document that is TOML at all, one of its keys; a document that is
//! accepted must pass the parser's own validation again and read the same way twice.
//!
//! The short run is part of `cargo test`; the long run is one command:
//!
//!     BERTH_FUZZ_CASES=100000 cargo test --release -p berth --test fuzz_config -- --nocapture
//!
//! (`BERTH_FUZZ_SEED=N` picks another seed.) Each test prints one line,
//! `fuzz-toml: cases=N refused=M file=berth.toml` (or `file=.berth.toml`).

mod fuzz_support;

// `berth serve`'s configuration is built in the binary's own `serve.rs` (the `berth`
// crate has no library to link), so the test compiles that source in, with the module
// it uses (`args.rs`) and a stand-in for the one it only asks for a default state dir
// (`client`): the test always names its state dir, so the real parser is what runs.
#[allow(dead_code)]
#[path = "../src/args.rs"]
mod args;
#[allow(dead_code)]
#[path = "../src/serve.rs"]
mod serve;
mod client {
    pub fn default_state_dir() -> std::path::PathBuf {
        unreachable!("the fuzz test always names its state dir")
    }
}

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use proptest::collection::vec;
use proptest::prelude::*;

/// Cases of each parser in the short run (~1 s each in the dev profile).
const CASES_DEFAULT: u32 = 2_000;

/// A valid `berth.toml` using every key it knows.
const SERVE_TOML: &str = r#"listen = "127.0.0.1:7420"
slots_max = 3
memory_total = "6GiB"
cpu_total = 8
disk_total = "100GiB"
memory_reserve = "1GiB"
cpu_reserve = 1
disk_reserve = "10GiB"
window = 64
starvation_guard = "30s"
reconnect_window = "30s"
insecure_no_auth = false
no_memory_sampling = true
stop_grace = "10s"
no_cgroups = true
diagnostics_run_bytes = "1MiB"
diagnostics_total_bytes = "256MiB"
default_cpus = 0.5
default_memory = "1GiB"
retain_ended = 10000
retain_ended_for = "7d"
thread_idle_after = "30m"
thread_ttl = "7d"
thread_grace = "60s"
thread_disk_free_min = "1GiB"
port_range = "30000-30999"
[resources]
gpu = 2
fpga = 1
"#;

/// A valid `.berth.toml` using every key and port field it knows.
const CONTRACT_TOML: &str = r#"concurrency = "parallel"
singletons = ["postgres", "redis"]
fleet_singletons = ["gpu_pool"]
[[port]]
name = "web"
launch = { command = "python3", args = ["-m", "http.server"], cwd = "site", env = { MODE = "dev" } }
ready = { http = "/health", expect_status = 204, timeout_s = 30, interval_ms = 100 }
build = { command = "make", args = ["assets"], timeout_s = 120 }
[[port]]
name = "db_2"
launch = { command = "pg" }
ready = { tcp = true }
"#;

/// One fuzz case: how the document is made (`mode`: raw bytes, TOML-ish text, or the
/// valid document mutated), the mutations of its tree (`kind`, `at`, `pick`) and of its
/// bytes, and the raw bytes.
type Plan = (u8, Vec<(u8, u16, u16)>, Vec<(u8, u16, u16)>, Vec<u8>);

fn plans() -> impl Strategy<Value = Plan> {
    (
        0u8..16,
        vec((0u8..4, any::<u16>(), any::<u16>()), 0..5),
        // Mostly none: byte-level damage makes most documents plain syntax errors.
        vec((0u8..8, any::<u16>(), any::<u16>()), 0..2),
        vec(any::<u8>(), 0..200),
    )
}

/// The document a plan makes from `base`.
fn document(base: &str, plan: &Plan) -> Vec<u8> {
    let (mode, tree_ops, text_ops, raw) = plan;
    let mut bytes = match mode {
        0 => return raw.clone(),
        // Bytes mapped onto TOML's own punctuation and a few words' letters: text that
        // gets further into the TOML parser than noise does.
        1 => {
            const ALPHABET: &[u8] = b"[]{}=\"'.,#\n -_0123456789abcdeglmnoprstuxy";
            return raw
                .iter()
                .map(|b| ALPHABET[*b as usize % ALPHABET.len()])
                .collect();
        }
        _ => {
            let mut table: toml::Table = base.parse().expect("the base document is TOML");
            for op in tree_ops {
                mutate_tree(&mut table, *op);
            }
            // A tree toml cannot write (none is known) is fuzzed as its debug text.
            toml::to_string(&table)
                .unwrap_or_else(|e| format!("{table:?} {e}"))
                .into_bytes()
        }
    };
    for op in text_ops {
        mutate_text(&mut bytes, *op);
    }
    bytes
}

/// A place in a TOML tree: keys and array indexes from the root.
#[derive(Clone, Debug)]
enum Seg {
    Key(String),
    Idx(usize),
}

/// Every place in `table`, parents before children.
fn places(table: &toml::Table) -> Vec<Vec<Seg>> {
    fn walk(v: &toml::Value, at: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
        out.push(at.clone());
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    at.push(Seg::Key(k.clone()));
                    walk(v, at, out);
                    at.pop();
                }
            }
            toml::Value::Array(a) => {
                for (i, v) in a.iter().enumerate() {
                    at.push(Seg::Idx(i));
                    walk(v, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(
        &toml::Value::Table(table.clone()),
        &mut Vec::new(),
        &mut out,
    );
    out
}

fn place_mut<'a>(v: &'a mut toml::Value, at: &[Seg]) -> Option<&'a mut toml::Value> {
    let Some((first, rest)) = at.split_first() else {
        return Some(v);
    };
    let child = match (first, v) {
        (Seg::Key(k), toml::Value::Table(t)) => t.get_mut(k)?,
        (Seg::Idx(i), toml::Value::Array(a)) => a.get_mut(*i)?,
        _ => return None,
    };
    place_mut(child, rest)
}

/// One tree mutation at place `at`: 0 drops it, 1 replaces it with an odd value, 2 adds
/// a key (known or not) beside or under it, 3 wraps it in an array or a table.
fn mutate_tree(table: &mut toml::Table, (kind, at, pick): (u8, u16, u16)) {
    let all = places(table);
    let place = &all[at as usize % all.len()];
    let mut root = toml::Value::Table(std::mem::take(table));
    match (kind, place.split_last()) {
        (0, Some((last, parent))) => match (last, place_mut(&mut root, parent)) {
            (Seg::Key(k), Some(toml::Value::Table(t))) => drop(t.remove(k)),
            (Seg::Idx(i), Some(toml::Value::Array(a))) => drop(a.remove(*i)),
            _ => {}
        },
        (1, _) => {
            if let Some(v) = place_mut(&mut root, place) {
                *v = odd_value(pick);
            }
        }
        (2, _) => match place_mut(&mut root, place) {
            Some(toml::Value::Table(t)) => {
                t.insert(odd_key(pick), odd_value(pick / 7));
            }
            Some(toml::Value::Array(a)) => a.push(odd_value(pick)),
            _ => {}
        },
        (3, Some(_)) => {
            if let Some(v) = place_mut(&mut root, place) {
                let inner = std::mem::replace(v, toml::Value::Boolean(false));
                *v = if pick % 2 == 0 {
                    toml::Value::Array(vec![inner])
                } else {
                    toml::Value::Table([(odd_key(pick / 2), inner)].into_iter().collect())
                };
            }
        }
        _ => {}
    }
    if let toml::Value::Table(t) = root {
        *table = t;
    }
}

/// Keys berth knows somewhere (in the wrong place, they are unknown there) and keys it
/// never knows.
fn odd_key(pick: u16) -> String {
    const KEYS: &[&str] = &[
        "slots_max",
        "memory_total",
        "resources",
        "listen",
        "port_range",
        "default_cpus",
        "concurrency",
        "singletons",
        "fleet_singletons",
        "port",
        "name",
        "launch",
        "ready",
        "build",
        "command",
        "args",
        "cwd",
        "env",
        "http",
        "tcp",
        "expect_status",
        "timeout_s",
        "interval_ms",
        "gpu",
        "ports",
        "slots",
        "memory",
        "cpu",
        "cpu_millis",
        "disk",
        "colour",
        "",
        " ",
        "a b",
        "é",
        "🦀",
        "BERTH_FENCE",
        "MODE",
        "lower",
        "9lives",
        "a.b",
        "fleet:x",
        "\u{0}",
    ];
    match KEYS.get(pick as usize % (KEYS.len() + 1)) {
        Some(k) => k.to_string(),
        None => "k".repeat(200),
    }
}

/// Values every rule of the two files has an edge at: sizes, durations, ranges,
/// addresses, words, paths, names, numbers at each limit, and every TOML type.
fn odd_value(pick: u16) -> toml::Value {
    use toml::Value::{Array, Boolean, Float, Integer, String as S};
    const STRINGS: &[&str] = &[
        "",
        " ",
        "0",
        "-1",
        "1",
        "1.5GiB",
        "0.0001KiB",
        "99999999999999999999GiB",
        "18446744073709551615",
        "9007199254740992",
        "1e3",
        "5x",
        "∞",
        "0s",
        "1d",
        "10ms",
        "-5s",
        "1.5s",
        "100000000000000000000d",
        "30000-30999",
        "0-0",
        "5-3",
        "70000-70001",
        "a-b",
        "1-",
        "-",
        "127.0.0.1:0",
        "[::1]:7420",
        "localhost:7420",
        "999.0.0.1:1",
        "serial",
        "parallel",
        "disabled",
        "sometimes",
        "/health",
        "health",
        "/a b",
        "../up",
        "/etc",
        "a/../../b",
        "./site",
        "é🦀",
        "\u{0}",
        "\n",
        "\t",
        "\u{202e}",
        "BERTH_FENCE",
        "web",
        "Web",
        "9a",
        "a/b",
        "postgres",
        "fleet:x",
    ];
    let p = pick as usize;
    match p % 6 {
        0 | 1 => S(STRINGS[p / 6 % STRINGS.len()].to_string()),
        2 => Integer(
            [
                0,
                -1,
                1,
                2,
                49,
                50,
                99,
                100,
                599,
                600,
                601,
                3600,
                3601,
                4096,
                10_001,
                65_535,
                65_536,
                1 << 53,
                i64::MAX,
                i64::MIN,
            ][p / 6 % 20],
        ),
        3 => Float(
            [
                0.0,
                -0.0,
                0.5,
                1e-9,
                4096.0,
                4096.0001,
                f64::NAN,
                f64::INFINITY,
                f64::NEG_INFINITY,
                1e300,
                -2.5,
            ][p / 6 % 11],
        ),
        4 => match p / 6 % 6 {
            0 => Boolean(true),
            1 => Boolean(false),
            2 => Array(vec![]),
            3 => Array(vec![S("a/b".into()), Integer(1)]),
            4 => toml::Value::Datetime("1979-05-27T07:32:00Z".parse().expect("a datetime")),
            _ => Array(vec![S("ok".into()), S("ok".into())]),
        },
        _ => match p / 6 % 3 {
            0 => toml::Value::Table(toml::Table::new()),
            1 => S("x".repeat(300)),
            _ => S("x".repeat(70_000)),
        },
    }
}

/// One byte-level mutation at `at`: truncate, insert a significant byte, delete a
/// byte, duplicate a line (a key given twice), prepend a BOM, swap lines, append a
/// second `[resources]`, or turn line ends into CRLF.
fn mutate_text(bytes: &mut Vec<u8>, (kind, at, pick): (u8, u16, u16)) {
    const SPECIAL: &[u8] = b"[]=\"'\n#.,{}\\\0\xff\r\t -";
    let pos = if bytes.is_empty() {
        0
    } else {
        at as usize % bytes.len()
    };
    let lines =
        |b: &[u8]| -> Vec<Vec<u8>> { b.split(|c| *c == b'\n').map(<[u8]>::to_vec).collect() };
    match kind {
        0 => bytes.truncate(pos),
        1 => bytes.insert(pos, SPECIAL[pick as usize % SPECIAL.len()]),
        2 if !bytes.is_empty() => drop(bytes.remove(pos)),
        3 | 5 => {
            let mut l = lines(bytes);
            let (i, j) = (at as usize % l.len(), pick as usize % l.len());
            if kind == 3 {
                let copy = l[i].clone();
                l.insert(j, copy);
            } else {
                l.swap(i, j);
            }
            *bytes = l.join(&b'\n');
        }
        4 => bytes.splice(0..0, "\u{feff}".bytes()).for_each(drop),
        6 => bytes.extend_from_slice(b"\n[resources]\ngpu = 3\n"),
        _ => {
            *bytes = lines(bytes).join(&b"\r\n"[..]);
        }
    }
}

/// Every key of a TOML document, at any depth.
fn keys_of(table: &toml::Table) -> Vec<String> {
    places(table)
        .into_iter()
        .filter_map(|p| match p.last() {
            Some(Seg::Key(k)) => Some(k.clone()),
            _ => None,
        })
        .collect()
}

/// How much of a line `berth.toml`'s errors quote (`ERROR_LINE_CHARS_MAX` in serve.rs).
const QUOTED_LINE_CHARS: usize = 120;

/// A refusal of a document that is TOML must name one of its keys (the one it refuses,
/// as far as a test can tell without knowing which). Syntax errors have no key to name,
/// nor has a file over the reader's size limit (`bytes_max`): it is refused unread.
fn names_a_key(err: &str, text: &[u8], bytes_max: u64) -> Result<(), String> {
    if text.len() as u64 > bytes_max {
        return Ok(());
    }
    let Some(table) = std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse::<toml::Table>().ok())
    else {
        return Ok(());
    };
    let keys = keys_of(&table);
    // A key is named as written or quoted (`unknown key "\0"`).
    let named =
        |k: &String| (!k.is_empty() && err.contains(k.as_str())) || err.contains(&format!("{k:?}"));
    // Or quoted with its line, as the file writes it (`"\u0000" = []`).
    let quoted = std::str::from_utf8(text)
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let quote: String = l.trim().chars().take(QUOTED_LINE_CHARS).collect();
            l.contains('=') && err.contains(&quote)
        });
    if quoted || keys.iter().any(named) {
        return Ok(());
    }
    Err(format!(
        "the refusal names none of the document's keys {keys:?}: {err}"
    ))
}

/// `berth.toml` read by `berth serve`'s own `build_config`: a refusal names the file
/// (or the configuration rule) and a key; an accepted file gives a configuration the
/// engine validates again, and the same one twice.
fn serve_case(dir: &Path, text: &[u8], refused: &Cell<u64>) -> Result<(), String> {
    let path = dir.join("berth.toml");
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    let args = || serve::ServeArgs {
        state_dir: Some(dir.to_path_buf()),
        config: Some(path.clone()),
        ..Default::default()
    };
    let first = catch_unwind(AssertUnwindSafe(|| serve::build_config(args())))
        .map_err(|p| format!("build_config panicked: {}", panic_text(&p)))?;
    let cfg = match first {
        Err(e) => {
            refused.set(refused.get() + 1);
            let err = format!("{e:#}");
            if !(err.contains("berth.toml") || err.starts_with("configuration: ")) {
                return Err(format!("the refusal does not name berth.toml: {err}"));
            }
            return names_a_key(&err, text, berth_server::private::TRUSTED_FILE_BYTES_MAX);
        }
        Ok(cfg) => cfg,
    };
    cfg.engine
        .validate()
        .map_err(|e| format!("accepted, but the engine refuses it: {e}"))?;
    berth_core::Engine::new(cfg.engine.clone(), 0)
        .map_err(|e| format!("accepted, but no engine starts on it: {e}"))?;
    let (lo, hi) = cfg.port_range;
    if lo == 0 || lo > hi {
        return Err(format!("accepted the port range {lo}-{hi}"));
    }
    let again =
        serve::build_config(args()).map_err(|e| format!("refused the second time: {e:#}"))?;
    if format!("{again:?}") != format!("{cfg:?}") {
        return Err(format!("read two ways: {cfg:?} and {again:?}"));
    }
    Ok(())
}

/// A worktree's `.berth.toml` read by the daemon's own `contract::read`: a refusal names
/// the file and a key; an accepted contract reads the same twice, and its canonical
/// form (what its fingerprint is the digest of) reads back to the same contract.
fn contract_case(wt: &Path, text: &[u8], refused: &Cell<u64>) -> Result<(), String> {
    let path = wt.join(".berth.toml");
    std::fs::write(&path, text).map_err(|e| e.to_string())?;
    let read = || {
        catch_unwind(|| berth_server::contract::read(wt))
            .map_err(|p| format!("contract::read panicked: {}", panic_text(&p)))
    };
    let contract = match read()? {
        Err(e) => {
            refused.set(refused.get() + 1);
            if !e.starts_with("worktree .berth.toml: ") {
                return Err(format!("the refusal does not name .berth.toml: {e}"));
            }
            return names_a_key(&e, text, berth_server::contract::CONTRACT_BYTES_MAX);
        }
        Ok(None) => return Err("a contract that exists read as none".into()),
        Ok(Some(c)) => c,
    };
    if read()? != Ok(Some(contract.clone())) {
        return Err("the same contract read two ways".into());
    }
    for s in &contract.singletons {
        let name = s
            .strip_prefix(berth_core::FLEET_SINGLETON_PREFIX)
            .unwrap_or(s);
        berth_core::validate::resource_name(name)
            .map_err(|e| format!("accepted singleton {s:?}: {e}"))?;
    }
    let table: toml::Table = std::str::from_utf8(text)
        .map_err(|_| "accepted a contract that is not UTF-8".to_string())?
        .parse()
        .map_err(|e| format!("accepted a contract that is not TOML: {e}"))?;
    let canonical = toml::to_string(&table).map_err(|e| e.to_string())?;
    std::fs::write(&path, &canonical).map_err(|e| e.to_string())?;
    match read()? {
        Ok(Some(c)) if c == contract => Ok(()),
        other => Err(format!(
            "its canonical form {canonical:?} reads as {other:?}, not as {contract:?}"
        )),
    }
}

/// At most `CLIP_CHARS` of a failure's text: a case may hold 70 KB of one letter.
fn clip(s: &str) -> String {
    const CLIP_CHARS: usize = 2_000;
    match s.char_indices().nth(CLIP_CHARS) {
        Some((at, _)) => format!("{}… ({} bytes in all)", &s[..at], s.len()),
        None => s.to_string(),
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(not a string)".into())
}

/// Runs `case` over documents made from `base`, and prints the count for `file`.
fn fuzz(file: &str, base: &str, case: impl Fn(&[u8], &Cell<u64>) -> Result<(), String>) {
    let cases = fuzz_support::cases(CASES_DEFAULT);
    let (tried, refused) = (Cell::new(0u64), Cell::new(0u64));
    let result = fuzz_support::runner(cases).run(&plans(), |plan| {
        tried.set(tried.get() + 1);
        let text = document(base, &plan);
        case(&text, &refused).map_err(|why| {
            TestCaseError::fail(format!(
                "{}\ndocument: {}",
                clip(&why),
                clip(&format!("{:?}", String::from_utf8_lossy(&text)))
            ))
        })
    });
    fuzz_support::report(
        "fuzz-toml",
        tried.get(),
        refused.get(),
        &format!(" file={file}"),
    );
    fuzz_support::verdict("fuzz-toml", result);
}

#[test]
fn fuzz_berth_toml() {
    let dir = tempfile::tempdir().unwrap();
    fuzz("berth.toml", SERVE_TOML, |text, refused| {
        serve_case(dir.path(), text, refused)
    });
}

#[test]
fn fuzz_contract_toml() {
    let wt = tempfile::tempdir().unwrap();
    fuzz(".berth.toml", CONTRACT_TOML, |text, refused| {
        contract_case(wt.path(), text, refused)
    });
}

/// The two base documents are valid: the fuzz starts from what each parser accepts.
#[test]
fn the_base_documents_are_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let refused = Cell::new(0);
    serve_case(dir.path(), SERVE_TOML.as_bytes(), &refused).unwrap();
    contract_case(dir.path(), CONTRACT_TOML.as_bytes(), &refused).unwrap();
    assert_eq!(refused.get(), 0, "a base document was refused");
}

/// What `berth serve` says of a `berth.toml` it refuses.
fn serve_refusal(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("berth.toml");
    std::fs::write(&path, text).unwrap();
    let args = serve::ServeArgs {
        state_dir: Some(dir.path().to_path_buf()),
        config: Some(path),
        ..Default::default()
    };
    match serve::build_config(args) {
        Ok(cfg) => panic!("{text:?} was accepted: {cfg:?}"),
        Err(e) => format!("{e:#}"),
    }
}

/// Found by this fuzz: a value of the wrong type in `berth.toml` was refused without
/// its key ("invalid type: integer `600`, expected a string": toml's message says what
/// is wrong, not where). The refusal now quotes the line it points at.
#[test]
fn regression_a_berth_toml_type_error_names_its_key() {
    for (text, key, line) in [
        (
            "slots_max = 3\ndefault_memory = 600\n",
            "default_memory = 600",
            "line 2",
        ),
        ("slots_max = \"3\"\n", "slots_max = \"3\"", "line 1"),
        ("[resources]\ngpu = []\n", "gpu = []", "line 2"),
    ] {
        let e = serve_refusal(text);
        assert!(
            e.contains("berth.toml") && e.contains(key) && e.contains(line),
            "{text:?}: {e}"
        );
    }
}

/// Found by this fuzz: a named resource with an empty name and a count over the S7
/// bound was refused as "configuration:  must be at most 9007199254740991 (S7)", naming
/// nothing (the bound was checked before the name). Names are now checked first.
#[test]
fn regression_an_empty_resource_name_is_refused_by_its_name() {
    let e = serve_refusal("[resources]\n\"\" = 9223372036854775807\n");
    assert!(e.contains("named resource \"\" is not a valid name"), "{e}");
    // A valid name over the bound is still refused by the bound, naming it.
    let e = serve_refusal("[resources]\ngpu = 9223372036854775807\n");
    assert!(e.contains("gpu must be at most"), "{e}");
}
