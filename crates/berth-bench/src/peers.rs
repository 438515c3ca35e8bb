//! `berth-bench peers`: berth beside what a team would otherwise reach for, in one run.
//!
//! The unit of work is the same everywhere: a fenced lease acquired durably (fsynced
//! before it is acknowledged), then released (fsynced too), by one client that waits for
//! each answer before the next request (a closed loop). Each client has a key of its own,
//! so nothing waits on a holder and every server is measured at its own speed:
//!
//! - **berth**: `POST /v1/runs` (workspace made, ledger committed) then
//!   `POST /v1/runs/{id}/release`; `berth-lease` is the same with `"workspace": false`.
//! - **redis** (`appendonly yes`, `appendfsync always`): `INCR fence`, `SET lock:C F NX
//!   PX 30000`, `DEL lock:C`.
//! - **postgres** (fsync on, synchronous_commit on): `INSERT … nextval('fence')
//!   RETURNING fence`, then `DELETE … WHERE key AND fence`, each its own transaction.
//! - **etcd** (its JSON gateway; every write fsynced by its WAL): lease grant, a txn that
//!   puts the key with the lease only if it does not exist (its revision is the fence),
//!   delete, lease revoke: what `etcdctl lock` does.
//!
//! Every server is started here, on loopback, with a fresh data dir, and stopped by its
//! pid when its runs are done. `scripts/peers.sh` installs the missing ones with apt.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use crate::http::{acquire_body, field_u64, pct, release_body, Conn};

/// Load before the measurement starts (connections open, berth's workspace pool fills).
const WARMUP: Duration = Duration::from_secs(2);
/// How long a server may take to answer after it was started.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Every peer is asked for this lease length; none of them lapses during a run.
const LEASE_TTL_S: u64 = 30;

/// The servers, in the order they are measured. The floors are not peers but bounds:
/// berth's HTTP stack doing nothing (`floor.rs`).
pub const PEERS: [&str; 7] = [
    "berth",
    "berth-lease",
    "redis",
    "postgres",
    "etcd",
    "floor-http",
    "floor-http-ws",
];

/// A server this benchmark started: its process, where it listens, and its data dir.
struct Server {
    child: Child,
    port: u16,
    /// berth's admin bearer header; empty for the others.
    auth: String,
    /// Drives run against it so far.
    drives: AtomicU64,
    _dir: tempfile::TempDir,
}

impl Server {
    /// A peer that asks for no credentials.
    fn new(child: Child, port: u16, dir: tempfile::TempDir) -> Server {
        Server {
            child,
            port,
            auth: String::new(),
            drives: AtomicU64::new(0),
            _dir: dir,
        }
    }
}

impl Drop for Server {
    /// Stopped by pid: SIGTERM, then SIGKILL if it has not exited within 10 s.
    fn drop(&mut self) {
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().unwrap().port()
}

/// Waits until something accepts connections on `port`, or panics naming `what`.
fn wait_listening(what: &str, child: &mut Child, port: u16) {
    let deadline = Instant::now() + START_TIMEOUT;
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(st)) = child.try_wait() {
            panic!("{what} exited before serving: {st}");
        }
        assert!(Instant::now() < deadline, "{what} did not listen on {port}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A binary beside this one (`target/release/berth` for `berth-bench`).
fn sibling(name: &str) -> PathBuf {
    let me = std::env::current_exe().expect("current exe");
    me.with_file_name(name)
}

fn start_berth() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = Command::new(sibling("berth"))
        .args(["serve", "--state-dir"])
        .arg(dir.path().join("state"))
        .args(["--listen", &format!("127.0.0.1:{port}")])
        // Room for every client at once, as in `berth-bench http`.
        .args([
            "--slots-max",
            "4096",
            "--memory-total",
            "1TiB",
            "--memory-reserve",
            "0",
        ])
        .args(["--cpu-total", "64", "--cpu-reserve", "0"])
        .args([
            "--disk-total",
            "16TiB",
            "--disk-reserve",
            "0",
            "--no-memory-sampling",
        ])
        .env("BERTH_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("berth (build it: cargo build --release -p berth)");
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert!(line.starts_with("listening on"), "berth said {line:?}");
    let token = std::fs::read_to_string(dir.path().join("state/admin.token")).unwrap();
    Server {
        child,
        port,
        auth: format!("Bearer {}", token.trim()),
        drives: AtomicU64::new(0),
        _dir: dir,
    }
}

fn start_redis() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut child = Command::new("redis-server")
        .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
        .arg("--dir")
        .arg(dir.path())
        .args([
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
        ])
        .args(["--daemonize", "no", "--loglevel", "warning"])
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server (scripts/peers.sh installs it)");
    wait_listening("redis-server", &mut child, port);
    Server::new(child, port, dir)
}

/// PostgreSQL refuses to run as root: as root, the cluster belongs to `postgres`.
fn pg_user() -> Option<(u32, u32)> {
    if !rustix::process::getuid().is_root() {
        return None;
    }
    let out = Command::new("id").args(["-u", "postgres"]).output().ok()?;
    let uid = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    let out = Command::new("id").args(["-g", "postgres"]).output().ok()?;
    let gid = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
    Some((uid, gid))
}

/// `/usr/lib/postgresql/<newest>/bin/<name>`.
fn pg_bin(name: &str) -> PathBuf {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL (scripts/peers.sh installs it)")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    versions.sort();
    versions
        .last()
        .expect("a PostgreSQL version")
        .join("bin")
        .join(name)
}

fn as_pg_user(cmd: &mut Command) -> &mut Command {
    if let Some((uid, gid)) = pg_user() {
        use std::os::unix::process::CommandExt;
        cmd.uid(uid).gid(gid);
    }
    cmd
}

fn start_postgres() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    if let Some((uid, gid)) = pg_user() {
        std::os::unix::fs::chown(dir.path(), Some(uid), Some(gid)).unwrap();
        std::os::unix::fs::chown(&data, Some(uid), Some(gid)).unwrap();
    }
    let st = as_pg_user(Command::new(pg_bin("initdb")).arg("-D").arg(&data))
        .args(["-U", "bench", "--auth=trust", "--no-sync"])
        .stdout(Stdio::null())
        .status()
        .expect("initdb");
    assert!(st.success(), "initdb failed");
    let port = free_port();
    let mut child = as_pg_user(Command::new(pg_bin("postgres")).arg("-D").arg(&data))
        .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
        .arg("-c")
        .arg(format!("unix_socket_directories={}", dir.path().display()))
        // Durable as berth is: every commit fsynced before it is acknowledged.
        .args(["-c", "fsync=on", "-c", "synchronous_commit=on"])
        .args(["-c", "max_connections=200"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("postgres");
    wait_listening("postgres", &mut child, port);
    Server::new(child, port, dir)
}

fn start_etcd() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let (port, peer) = (free_port(), free_port());
    let client_url = format!("http://127.0.0.1:{port}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let mut child = Command::new("etcd")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("default={peer_url}")])
        .args(["--log-level", "warn", "--logger", "zap"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("etcd (scripts/peers.sh installs it)");
    wait_listening("etcd", &mut child, port);
    Server::new(child, port, dir)
}

/// One client's connection to the server being measured.
enum Client {
    Berth {
        conn: Conn,
        auth: String,
        lease_only: bool,
    },
    Redis(BufReader<TcpStream>),
    Postgres(Pg),
    Etcd(Conn),
}

struct Pg {
    client: tokio_postgres::Client,
    insert: tokio_postgres::Statement,
    delete: tokio_postgres::Statement,
}

impl Client {
    async fn open(peer: &str, port: u16, auth: &str) -> Client {
        let url = format!("http://127.0.0.1:{port}");
        match peer {
            "berth" | "berth-lease" | "floor-http" | "floor-http-ws" => Client::Berth {
                conn: Conn::open(&url).await,
                auth: auth.to_string(),
                lease_only: peer == "berth-lease",
            },
            "redis" => {
                let s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
                s.set_nodelay(true).unwrap();
                Client::Redis(BufReader::new(s))
            }
            "postgres" => Client::Postgres(Pg::open(port).await),
            _ => Client::Etcd(Conn::open(&url).await),
        }
    }

    /// One acquire -> release lifecycle for client `c`'s key; the lease's fence.
    async fn lifecycle(&mut self, c: usize, i: u64) -> Result<u64, String> {
        match self {
            Client::Berth {
                conn,
                auth,
                lease_only,
            } => berth_lifecycle(conn, auth, *lease_only, c, i).await,
            Client::Redis(r) => redis_lifecycle(r, c).await,
            Client::Postgres(pg) => pg.lifecycle(c).await,
            Client::Etcd(conn) => etcd_lifecycle(conn, c).await,
        }
    }
}

async fn berth_lifecycle(
    conn: &mut Conn,
    auth: &str,
    lease_only: bool,
    c: usize,
    i: u64,
) -> Result<u64, String> {
    let id = format!("c{c}-{i}");
    let mut body = acquire_body(c, &id, false);
    if lease_only {
        body.pop();
        body.push_str(r#","workspace":false}"#);
    }
    let (status, resp) = conn
        .post("/v1/runs", auth, &body)
        .await
        .ok_or("acquire: connection lost")?;
    if status != 201 {
        return Err(format!("acquire: {status} {resp}"));
    }
    let fence = field_u64(&resp, "\"fence\":").ok_or("acquire: no fence")?;
    let path = format!("/v1/runs/{id}/release");
    match conn.post(&path, auth, &release_body(fence)).await {
        Some((200, _)) => Ok(fence),
        other => Err(format!("release: {other:?}")),
    }
}

/// One RESP command (an array of bulk strings); the reply's first line.
async fn redis_call(r: &mut BufReader<TcpStream>, args: &[&str]) -> Result<String, String> {
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    r.get_mut()
        .write_all(req.as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    r.read_line(&mut line).await.map_err(|e| e.to_string())?;
    // Only integer and simple-string replies are asked for here.
    match line.as_bytes().first() {
        Some(b':') | Some(b'+') => Ok(line[1..].trim_end().to_string()),
        _ => Err(format!("redis said {line:?}")),
    }
}

async fn redis_lifecycle(r: &mut BufReader<TcpStream>, c: usize) -> Result<u64, String> {
    let fence = redis_call(r, &["INCR", "fence"]).await?;
    let key = format!("lock:{c}");
    let ttl_ms = (LEASE_TTL_S * 1000).to_string();
    let set = redis_call(r, &["SET", &key, &fence, "NX", "PX", &ttl_ms]).await?;
    if set != "OK" {
        return Err(format!("SET NX: {set}"));
    }
    let del = redis_call(r, &["DEL", &key]).await?;
    if del != "1" {
        return Err(format!("DEL: {del}"));
    }
    fence.parse().map_err(|_| format!("INCR: {fence}"))
}

impl Pg {
    async fn open(port: u16) -> Pg {
        let conf = format!("host=127.0.0.1 port={port} user=bench dbname=postgres");
        let (client, connection) = tokio_postgres::connect(&conf, tokio_postgres::NoTls)
            .await
            .expect("connect to postgres");
        tokio::spawn(connection);
        let insert = client
            .prepare(
                "INSERT INTO leases (key, fence) VALUES ($1, nextval('fence')) RETURNING fence",
            )
            .await
            .unwrap();
        let delete = client
            .prepare("DELETE FROM leases WHERE key = $1 AND fence = $2")
            .await
            .unwrap();
        Pg {
            client,
            insert,
            delete,
        }
    }

    /// The schema, once per server: the key is the primary key (one holder). The
    /// server listens before it accepts sessions ("the database system is starting
    /// up"): connecting is tried again until START_TIMEOUT.
    async fn schema(port: u16) {
        let conf = format!("host=127.0.0.1 port={port} user=bench dbname=postgres");
        let deadline = Instant::now() + START_TIMEOUT;
        let (client, connection) = loop {
            match tokio_postgres::connect(&conf, tokio_postgres::NoTls).await {
                Ok(c) => break c,
                Err(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("connect to postgres: {e}"),
            }
        };
        tokio::spawn(connection);
        client
            .batch_execute(
                "CREATE SEQUENCE fence; CREATE TABLE leases (key text PRIMARY KEY, fence bigint NOT NULL)",
            )
            .await
            .unwrap();
    }

    async fn lifecycle(&mut self, c: usize) -> Result<u64, String> {
        let key = format!("bench-{c}");
        let row = self
            .client
            .query_one(&self.insert, &[&key])
            .await
            .map_err(|e| e.to_string())?;
        let fence: i64 = row.get(0);
        let n = self
            .client
            .execute(&self.delete, &[&key, &fence])
            .await
            .map_err(|e| e.to_string())?;
        if n != 1 {
            return Err(format!("DELETE removed {n} rows"));
        }
        Ok(fence as u64)
    }
}

/// The gateway's keys and values are base64; these are ASCII and short.
fn base64(s: &str) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = s.as_bytes();
    let mut out = String::new();
    for chunk in b.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (k, &x)| n | (x as u32) << (16 - 8 * k));
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(A[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A quoted JSON string field (etcd writes 64-bit numbers as strings).
pub(crate) fn field_str<'a>(json: &'a str, key: &str) -> Option<&'a str> {
    let at = json.find(key)? + key.len();
    let rest = json[at..].trim_start_matches([' ', ':', '"']);
    rest.split('"').next()
}

async fn etcd_post(conn: &mut Conn, path: &str, body: &str) -> Result<String, String> {
    match conn.request("POST", path, "", body).await {
        Some((200, resp)) => Ok(resp),
        other => Err(format!("etcd {path}: {other:?}")),
    }
}

async fn etcd_lifecycle(conn: &mut Conn, c: usize) -> Result<u64, String> {
    let grant = etcd_post(
        conn,
        "/v3/lease/grant",
        &format!(r#"{{"TTL":{LEASE_TTL_S}}}"#),
    )
    .await?;
    let lease = field_str(&grant, "\"ID\"")
        .ok_or("lease grant: no ID")?
        .to_string();
    let key = base64(&format!("lock/bench-{c}"));
    let txn = format!(
        r#"{{"compare":[{{"key":"{key}","target":"CREATE","result":"EQUAL","create_revision":"0"}}],"success":[{{"request_put":{{"key":"{key}","value":"{}","lease":"{lease}"}}}}]}}"#,
        base64("held")
    );
    let put = etcd_post(conn, "/v3/kv/txn", &txn).await?;
    if !put.contains("\"succeeded\":true") {
        return Err(format!("txn: {put}"));
    }
    let fence = field_str(&put, "\"revision\"")
        .and_then(|r| r.parse().ok())
        .ok_or("txn: no revision")?;
    etcd_post(conn, "/v3/kv/deleterange", &format!(r#"{{"key":"{key}"}}"#)).await?;
    etcd_post(conn, "/v3/lease/revoke", &format!(r#"{{"ID":"{lease}"}}"#)).await?;
    Ok(fence)
}

/// What one measured run gives.
struct Figures {
    lifecycles_per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
    /// Fences that were not above the client's previous one (must be 0).
    fences_back: u64,
}

struct Tally {
    /// Where this drive's lifecycle numbers start.
    first_lifecycle: u64,
    measuring: AtomicBool,
    stop: AtomicBool,
    count: AtomicU64,
    errors: AtomicU64,
    fences_back: AtomicU64,
    lifecycle_ms: Mutex<Vec<f64>>,
}

/// `clients` closed loops against `server` for WARMUP, then `seconds` measured. The
/// clients are tasks on one thread (epoll), as in `berth-bench http`: the load
/// generator shares the two cores with the server and must cost it little.
fn drive(peer: &'static str, server: &Server, clients: usize, seconds: u64) -> Figures {
    rustix::fs::sync();
    let tally = Arc::new(Tally {
        first_lifecycle: server.drives.fetch_add(1, Ordering::Relaxed) << 40,
        measuring: AtomicBool::new(false),
        stop: AtomicBool::new(false),
        count: AtomicU64::new(0),
        errors: AtomicU64::new(0),
        fences_back: AtomicU64::new(0),
        lifecycle_ms: Mutex::new(Vec::new()),
    });
    let (port, auth) = (server.port, server.auth.clone());
    let t = tally.clone();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let tasks: Vec<_> = (0..clients)
                .map(|c| tokio::spawn(client_loop(peer, port, auth.clone(), c, t.clone())))
                .collect();
            for task in tasks {
                task.await.unwrap();
            }
        })
    });
    std::thread::sleep(WARMUP);
    let started = Instant::now();
    tally.measuring.store(true, Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(seconds));
    tally.measuring.store(false, Ordering::Relaxed);
    let secs = started.elapsed().as_secs_f64();
    tally.stop.store(true, Ordering::Relaxed);
    thread.join().unwrap();
    let mut ms = std::mem::take(&mut *tally.lifecycle_ms.lock().unwrap());
    ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Figures {
        lifecycles_per_s: tally.count.load(Ordering::Relaxed) as f64 / secs,
        p50_ms: pct(&ms, 0.5),
        p99_ms: pct(&ms, 0.99),
        errors: tally.errors.load(Ordering::Relaxed),
        fences_back: tally.fences_back.load(Ordering::Relaxed),
    }
}

async fn client_loop(peer: &str, port: u16, auth: String, c: usize, tally: Arc<Tally>) {
    let mut client = Client::open(peer, port, &auth).await;
    let (mut last_fence, mut mine) = (0u64, Vec::new());
    // Lifecycle numbers go on from the server's previous drive (berth refuses a run id
    // it has seen: L7).
    let mut i = tally.first_lifecycle;
    while !tally.stop.load(Ordering::Relaxed) {
        i += 1;
        let t = Instant::now();
        let result = client.lifecycle(c, i).await;
        let counted = tally.measuring.load(Ordering::Relaxed);
        match result {
            Ok(fence) => {
                if fence <= last_fence {
                    tally.fences_back.fetch_add(1, Ordering::Relaxed);
                }
                last_fence = fence;
                if counted {
                    mine.push(t.elapsed().as_secs_f64() * 1000.0);
                    tally.count.fetch_add(1, Ordering::Relaxed);
                }
            }
            Err(e) => {
                if tally.errors.fetch_add(1, Ordering::Relaxed) < 3 {
                    eprintln!("{peer} client {c}: {e}");
                }
                client = Client::open(peer, port, &auth).await;
            }
        }
    }
    tally.lifecycle_ms.lock().unwrap().extend(mine);
}

fn start(peer: &str) -> Server {
    match peer {
        "berth" | "berth-lease" => start_berth(),
        "redis" => start_redis(),
        "postgres" => {
            let s = start_postgres();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(Pg::schema(s.port));
            s
        }
        "etcd" => start_etcd(),
        floor => start_floor(floor == "floor-http-ws"),
    }
}

/// A floor (`floor.rs`): this binary as `floor-daemon`, with directories to rename
/// when `workspaces`.
fn start_floor(workspaces: bool) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let mut cmd = Command::new(std::env::current_exe().expect("current exe"));
    cmd.args(["floor-daemon", "--port", &port.to_string()]);
    if workspaces {
        cmd.arg("--workspaces").arg(dir.path());
    }
    let mut child = cmd.stdout(Stdio::null()).spawn().expect("floor-daemon");
    wait_listening("floor-daemon", &mut child, port);
    Server::new(child, port, dir)
}

/// Runs every peer at every client count, one server at a time; one JSON line each,
/// then berth's ratios to each peer.
pub fn main(peers: &[String], clients: &[usize], seconds: u64) {
    let mut rates: Vec<(String, usize, f64, f64)> = Vec::new();
    for peer in PEERS.iter().filter(|p| peers.iter().any(|q| q == *p)) {
        let server = start(peer);
        for &n in clients {
            let f = drive(peer, &server, n, seconds);
            println!(
                "{{\"peer\":\"{peer}\",\"clients\":{n},\"seconds\":{seconds},\"lifecycles_per_s\":{:.0},\"lifecycle_p50_ms\":{:.3},\"lifecycle_p99_ms\":{:.3},\"errors\":{},\"fences_not_increasing\":{}}}",
                f.lifecycles_per_s, f.p50_ms, f.p99_ms, f.errors, f.fences_back
            );
            rates.push((peer.to_string(), n, f.lifecycles_per_s, f.p50_ms));
        }
        drop(server);
    }
    print_ratios(&rates, clients);
}

/// `berth/PEER` for throughput and `PEER/berth` for p50 (above 1: berth is better).
fn print_ratios(rates: &[(String, usize, f64, f64)], clients: &[usize]) {
    for ours in ["berth", "berth-lease", "floor-http", "floor-http-ws"] {
        for &n in clients {
            let Some(b) = rates.iter().find(|r| r.0 == ours && r.1 == n) else {
                continue;
            };
            let mut line = format!("{{\"ratios_of\":\"{ours}\",\"clients\":{n}");
            for r in rates
                .iter()
                .filter(|r| r.1 == n && !r.0.starts_with("berth") && !r.0.starts_with("floor"))
            {
                line.push_str(&format!(
                    ",\"throughput_vs_{}\":{:.2},\"p50_vs_{}\":{:.2}",
                    r.0,
                    b.2 / r.2.max(1e-9),
                    r.0,
                    r.3 / b.3.max(1e-9)
                ));
            }
            println!("{line}}}");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_is_the_standard_alphabet_with_padding() {
        assert_eq!(super::base64("lock/bench-1"), "bG9jay9iZW5jaC0x");
        assert_eq!(super::base64("held"), "aGVsZA==");
        assert_eq!(super::base64("ab"), "YWI=");
    }

    #[test]
    fn etcd_fields_are_read_from_its_answers() {
        let grant = r#"{"header":{"revision":"7"},"ID":"7587848807587160114","TTL":"30"}"#;
        assert_eq!(
            super::field_str(grant, "\"ID\""),
            Some("7587848807587160114")
        );
        assert_eq!(super::field_str(grant, "\"revision\""), Some("7"));
    }
}
