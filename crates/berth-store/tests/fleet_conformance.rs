//! F5: the same fleet conformance suite on the SQLite and the PostgreSQL store. The
//! PostgreSQL half needs the server `scripts/test.sh` starts (pg_virtualenv); without
//! one it fails, it does not skip.

use berth_store::fleet::conformance::CHECKS;
use berth_store::fleet::testing::pg_fresh_database;
use berth_store::fleet::{FleetStore, PgFleet, SqliteFleet};

#[test]
fn sqlite_fleet_store_passes_the_conformance_suite() {
    for (name, check) in CHECKS {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet.db").to_string_lossy().into_owned();
        eprintln!("sqlite: {name}");
        check(&|| Box::new(SqliteFleet::open(&path).unwrap()) as Box<dyn FleetStore>);
    }
}

#[test]
fn postgres_fleet_store_passes_the_conformance_suite() {
    for (name, check) in CHECKS {
        let url = pg_fresh_database("conf").unwrap_or_else(|e| panic!("{e}"));
        eprintln!("postgres: {name}");
        check(&|| Box::new(PgFleet::open(&url).unwrap()) as Box<dyn FleetStore>);
    }
}

#[test]
fn a_newer_postgres_schema_is_refused() {
    let url = pg_fresh_database("newer").unwrap_or_else(|e| panic!("{e}"));
    drop(PgFleet::open(&url).unwrap());
    let mut c = postgres::Client::connect(&url, postgres::NoTls).unwrap();
    c.batch_execute("UPDATE berth_fleet_schema SET version = 99")
        .unwrap();
    match PgFleet::open(&url) {
        Err(berth_store::fleet::FleetError::TooNew { found: 99, .. }) => {}
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a newer schema was accepted"),
    }
}

/// Issue 38 Build 5: the store speaks TLS as the URL's `sslmode` says, as libpq does:
/// encrypted by default when the server offers it, in the clear only with `disable`;
/// `verify-full` checks the chain against `sslrootcert` and the host's name,
/// `verify-ca` the chain only; a certificate that does not check out is no connection.
/// (The test server is pg_virtualenv's, with TLS on and Debian's snakeoil certificate,
/// issued to `localhost`.)
#[test]
fn the_store_speaks_tls_as_sslmode_says() {
    use berth_store::fleet::testing::{pg_encrypted, pg_setting};
    assert_eq!(
        pg_setting("ssl").as_deref(),
        Ok("on"),
        "the test server offers no TLS"
    );
    let url = pg_fresh_database("tls").unwrap_or_else(|e| panic!("{e}"));
    assert!(
        url.contains("host=localhost "),
        "{url}: the test needs PGHOST=localhost"
    );
    let by_ip = url.replace("host=localhost ", "host=127.0.0.1 ");
    let snakeoil = "sslrootcert=/etc/ssl/certs/ssl-cert-snakeoil.pem";
    let encrypted = |url: &str, extra: &str| -> Result<bool, String> {
        let store = PgFleet::open(&format!("{url} {extra}")).map_err(|e| e.to_string())?;
        let seen = pg_encrypted(&url.replace(" sslmode=disable", ""), "berth")?;
        drop(store);
        assert_eq!(seen.len(), 1, "{extra}: connections {seen:?}");
        Ok(seen[0])
    };
    assert_eq!(encrypted(&url, ""), Ok(true), "the default (prefer)");
    assert_eq!(encrypted(&url, "sslmode=disable"), Ok(false));
    assert_eq!(encrypted(&url, "sslmode=require"), Ok(true));
    let full = format!("sslmode=verify-full {snakeoil}");
    assert_eq!(encrypted(&url, &full), Ok(true));
    let ca = format!("sslmode=verify-ca {snakeoil}");
    assert_eq!(
        encrypted(&by_ip, &ca),
        Ok(true),
        "verify-ca does not check the name"
    );
    let wrong_name = encrypted(&by_ip, &full).unwrap_err();
    assert!(wrong_name.contains("certificate"), "{wrong_name}");
    let other_roots = "sslmode=verify-full sslrootcert=/etc/ssl/certs/ca-certificates.crt";
    let wrong_root = encrypted(&url, other_roots).unwrap_err();
    assert!(wrong_root.contains("certificate"), "{wrong_root}");
}
