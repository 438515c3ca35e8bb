-- berth fleet schema, version 4 (issue 38 Build 3): what every host mirrors rather
-- than decides. The fleet's bearer tokens (the SHA-256 of each secret, never the
-- secret; the grant as text the server writes) and the fleet-wide drain, with one
-- version that every change of either raises, so that a host's heartbeat reads one
-- row when nothing changed. A change is announced on berth_fleet as 'shared'.
CREATE TABLE berth_bearer (
  hash text PRIMARY KEY,
  grant_text text NOT NULL,
  host_id text NOT NULL,
  made_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE berth_shared (
  id integer PRIMARY KEY CHECK (id = 1),
  version bigint NOT NULL,
  drain_by text,
  drain_at text,
  drain_reason text,
  drain_host text
);
INSERT INTO berth_shared (id, version) VALUES (1, 0);
-- B4 fleet-wide: each scope's control state and generation, and the receipts of the
-- control requests that made them (a retry by request id gets its receipt back).
CREATE TABLE berth_scope_control (
  scope text PRIMARY KEY,
  control text NOT NULL,
  generation bigint NOT NULL
);
-- C3/C4 fleet-wide: each project's promotion evidence; valid false once a host found
-- it wrong (ports one per line).
CREATE TABLE berth_evidence (
  project text PRIMARY KEY,
  fingerprint text NOT NULL,
  git_commit text,
  ports text NOT NULL,
  run_id text NOT NULL,
  host_id text NOT NULL,
  valid boolean NOT NULL
);
CREATE TABLE berth_scope_receipt (
  scope text NOT NULL,
  request_id text NOT NULL,
  mode text NOT NULL,
  generation bigint NOT NULL,
  control text NOT NULL,
  host_id text NOT NULL,
  PRIMARY KEY (scope, request_id)
);
