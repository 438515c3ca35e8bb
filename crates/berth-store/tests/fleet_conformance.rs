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
