//! The SQLite ledger's own unit tests: migrations and the journal chunk codec.

use super::*;

/// Migration 8: a ledger whose journal has a row per entry (version 7) opens with
/// the same entries, byte for byte, in chunks, and numbering goes on after them.
#[test]
fn a_row_per_entry_journal_migrates_to_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    {
        let conn = Connection::open(&path).unwrap();
        for sql in &MIGRATIONS[..7] {
            conn.execute_batch(sql).unwrap();
        }
        conn.execute_batch("PRAGMA user_version = 7").unwrap();
        let mut insert = conn
            .prepare(
                "INSERT INTO journal (seq, kind, run_id, project, line, written_unix_ms)
                 VALUES (?1, ?2, ?3, ?4, ?5, 1)",
            )
            .unwrap();
        insert
            .execute(params![
                1,
                "token_created",
                None::<String>,
                None::<String>,
                "{\"seq\":1}"
            ])
            .unwrap();
        insert
            .execute(params![
                2,
                "queued",
                "r1",
                "acme/web",
                "{\"seq\":2,\"x\":\"a\\tb\"}"
            ])
            .unwrap();
    }
    let mut s = SqliteStore::open(&path).unwrap();
    let got = s.journal(0, 10).unwrap();
    let want = vec![
        JournalEntry {
            seq: 1,
            kind: "token_created".into(),
            run_id: None,
            project: None,
            line: "{\"seq\":1}".into(),
        },
        JournalEntry {
            seq: 2,
            kind: "queued".into(),
            run_id: Some("r1".into()),
            project: Some("acme/web".into()),
            line: "{\"seq\":2,\"x\":\"a\\tb\"}".into(),
        },
    ];
    assert_eq!(got, want);
    assert_eq!(s.load(10).unwrap().journal_last, 2);
    assert_eq!(s.journal_first().unwrap(), 1);
}

/// A field that would break the chunk's record format is refused, not stored.
#[test]
fn a_journal_field_with_a_tab_or_line_end_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = SqliteStore::open(&dir.path().join("ledger.db")).unwrap();
    let bad = [
        ("ki\tnd", Some("r"), "{}"),
        ("kind", Some("r\n"), "{}"),
        ("kind", Some(""), "{}"),
        ("kind", Some("r"), "{\n}"),
    ];
    for (i, (kind, run_id, line)) in bad.into_iter().enumerate() {
        let mut b = Batch::default();
        b.push(Mutation::Journal(std::sync::Arc::new(JournalEntry {
            seq: i as u64 + 1,
            kind: kind.into(),
            run_id: run_id.map(str::to_string),
            project: None,
            line: line.into(),
        })));
        assert!(s.write(&[&b]).is_err(), "{kind:?} {run_id:?} {line:?}");
    }
    assert_eq!(s.load(10).unwrap().journal_last, 0);
}

/// D4: a journal chunk that does not unpack, does not parse, or does not end where
/// its row says, is a corrupt ledger (an error), never a panic, never a guess and
/// never an allocation of the size a corrupt block claims.
#[test]
fn a_malformed_journal_chunk_is_refused_as_corrupt() {
    let huge = {
        let mut b = (u32::MAX).to_le_bytes().to_vec();
        b.extend_from_slice(&pack("k\t\t\t{}\n")[4..]);
        b
    };
    let truncated = pack(&"k\t\t\t{\"seq\":1}\n".repeat(50));
    let not_utf8 = lz4_flex::block::compress_prepend_size(b"k\t\t\t\xff\n");
    let cases: [(&str, Vec<u8>, i64); 6] = [
        ("a record of two fields", pack("kind\tr\n"), 1),
        (
            "two records, the row says one",
            pack("k\t\t\t{}\nk\t\t\t{}\n"),
            1,
        ),
        ("no length", vec![1, 2], 1),
        ("a length of 4 GiB", huge, 1),
        ("a cut block", truncated[..truncated.len() / 2].to_vec(), 50),
        ("not UTF-8", not_utf8, 1),
    ];
    for (what, packed, last) in cases {
        let dir = tempfile::tempdir().unwrap();
        let mut s = SqliteStore::open(&dir.path().join("ledger.db")).unwrap();
        s.conn
            .execute(
                "INSERT INTO journal_chunks (first_seq, last_seq, packed, written_unix_ms)
                 VALUES (1, ?1, ?2, 0)",
                params![last, packed],
            )
            .unwrap();
        match s.journal(0, 10) {
            Err(StoreError::Corrupt(_)) => {}
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// Migration 9: a ledger of text chunks (version 8) opens with the same entries,
/// byte for byte, packed, and numbering goes on after them.
#[test]
fn text_chunks_migrate_to_packed_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger.db");
    let text =
        "queued\tr1\tacme/web\t{\"seq\":4,\"x\":\"a\\tb\"}\ntoken_created\t\t\t{\"seq\":5}\n";
    {
        let conn = Connection::open(&path).unwrap();
        for sql in &MIGRATIONS[..8] {
            conn.execute_batch(sql).unwrap();
        }
        conn.execute_batch("PRAGMA user_version = 8").unwrap();
        conn.execute(
            "INSERT INTO journal_chunks (first_seq, last_seq, entries, written_unix_ms)
             VALUES (4, 5, ?1, 1)",
            params![text],
        )
        .unwrap();
    }
    let mut s = SqliteStore::open(&path).unwrap();
    let lines: Vec<String> = s
        .journal(0, 10)
        .unwrap()
        .into_iter()
        .map(|e| e.line)
        .collect();
    assert_eq!(lines, ["{\"seq\":4,\"x\":\"a\\tb\"}", "{\"seq\":5}"]);
    let got = s.journal(4, 10).unwrap();
    assert_eq!(got[0].kind, "token_created");
    assert_eq!(
        (got[0].run_id.as_deref(), got[0].project.as_deref()),
        (None, None)
    );
    assert_eq!(s.load(10).unwrap().journal_last, 5);
    assert_eq!(s.journal_first().unwrap(), 4);
}

/// One transaction's entries past `CHUNK_TEXT_CUT` become several chunks, each
/// within the bound a read unpacks, read back in order without a gap.
#[test]
fn a_large_transaction_journals_in_several_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = SqliteStore::open(&dir.path().join("ledger.db")).unwrap();
    let line = format!("{{\"pad\":\"{}\"}}", "x".repeat(4_000));
    let n = (3 * CHUNK_TEXT_CUT / line.len()) as u64;
    let mut b = Batch::default();
    for seq in 1..=n {
        b.push(Mutation::Journal(std::sync::Arc::new(JournalEntry {
            seq,
            kind: "queued".into(),
            run_id: Some(format!("r{seq}")),
            project: None,
            line: line.clone(),
        })));
    }
    s.write(&[&b]).unwrap();
    let chunks: i64 = s
        .conn
        .query_row("SELECT COUNT(*) FROM journal_chunks", [], |r| r.get(0))
        .unwrap();
    assert!((3..=4).contains(&chunks), "{chunks} chunks");
    let mut after = 0;
    while after < n {
        let got = s.journal(after, JOURNAL_READ_MAX).unwrap();
        assert!(!got.is_empty());
        for e in got {
            assert_eq!(
                (e.seq, e.run_id),
                (after + 1, Some(format!("r{}", after + 1)))
            );
            after = e.seq;
        }
    }
    assert_eq!(s.load(10).unwrap().journal_last, n);
}

/// Every prune (up to every 10 ms while ended runs pile up) asks what the journal must
/// keep. `MAX(last_seq)` over a column without an index read every retained chunk each
/// time: about 2% of the daemons' CPU in `berth-bench fleet`. Each question now costs
/// the same however long the journal is.
#[test]
fn regression_the_journal_hold_reads_no_whole_table() {
    let dir = tempfile::tempdir().unwrap();
    let s = SqliteStore::open(&dir.path().join("ledger.db")).unwrap();
    let chunks = 5_000;
    s.conn
        .execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO journal_chunks (first_seq, last_seq, packed, written_unix_ms)
             SELECT 2 * i - 1, 2 * i, x'00', i FROM n",
            [chunks],
        )
        .unwrap();
    for sql in journal::HELD_QUERIES
        .into_iter()
        .chain([journal::NEWEST_LAST])
    {
        let mut stmt = s.conn.prepare(sql).unwrap();
        let got: Option<i64> = stmt.query_row([], |r| r.get(0)).unwrap();
        if sql.contains("journal_chunks") {
            assert_eq!(got, Some(2 * chunks), "the newest chunk's last entry");
        }
        let steps = stmt.get_status(rusqlite::StatementStatus::VmStep);
        assert!(steps < 100, "{steps} steps over {chunks} chunks: {sql}");
    }
}
