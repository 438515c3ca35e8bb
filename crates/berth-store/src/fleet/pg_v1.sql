-- berth fleet store, version 1 (F1-F3). Times are the server's clock.
CREATE SEQUENCE berth_fence;

CREATE TABLE berth_hosts (
  host_id text PRIMARY KEY,
  gen bigint NOT NULL,
  address text NOT NULL,
  version text NOT NULL,
  load text NOT NULL DEFAULT '{}',
  beat_at timestamptz NOT NULL,
  alive boolean NOT NULL,
  declared_by text
);
-- One row per declared (host, generation): the primary key is what makes a
-- declaration happen exactly once.
CREATE TABLE berth_dead (
  host_id text NOT NULL,
  gen bigint NOT NULL,
  declared_by text NOT NULL,
  declared_at timestamptz NOT NULL,
  PRIMARY KEY (host_id, gen)
);
CREATE TABLE berth_runs (
  run_id text PRIMARY KEY,
  host_id text NOT NULL,
  gen bigint NOT NULL,
  fence bigint NOT NULL UNIQUE
);
CREATE INDEX berth_runs_host ON berth_runs (host_id, gen);
-- A harness's fleet-wide limit (frozen by its first claim) and how many tokens it
-- holds; the CHECK is the database's own guard of B2's bound.
CREATE TABLE berth_harness (
  scope text NOT NULL,
  harness text NOT NULL,
  lim integer NOT NULL,
  held integer NOT NULL,
  PRIMARY KEY (scope, harness),
  CHECK (held >= 0 AND held <= lim)
);
CREATE TABLE berth_tokens (
  scope text NOT NULL,
  owner text NOT NULL,
  harness text NOT NULL,
  host_id text NOT NULL,
  gen bigint NOT NULL,
  lapsed boolean NOT NULL DEFAULT false,
  PRIMARY KEY (scope, owner)
);
CREATE INDEX berth_tokens_host ON berth_tokens (host_id, gen);
CREATE TABLE berth_keys (
  key text PRIMARY KEY,
  run_id text NOT NULL,
  host_id text NOT NULL,
  gen bigint NOT NULL
);
CREATE INDEX berth_keys_run ON berth_keys (run_id);
CREATE INDEX berth_keys_host ON berth_keys (host_id, gen);
CREATE TABLE berth_threads (
  thread_key text PRIMARY KEY,
  owner_gen text NOT NULL,
  owner_fence bigint NOT NULL,
  run_id text NOT NULL,
  host_id text NOT NULL,
  live boolean NOT NULL
);

-- Register a host under a new generation. If its previous generation was alive (a
-- restart before anyone declared it dead) its claims move to the new generation; if
-- it was declared dead, its runs are forgotten (their fences stay refused: no row is
-- "not current") and nothing it held comes back.
CREATE FUNCTION berth_register(p_host text, p_address text, p_version text)
RETURNS TABLE (new_gen bigint, resumed boolean) LANGUAGE plpgsql AS $$
DECLARE
  v_old bigint;
  v_alive boolean;
  v_gen bigint;
BEGIN
  SELECT h.gen, h.alive INTO v_old, v_alive FROM berth_hosts h WHERE h.host_id = p_host FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO berth_hosts VALUES (p_host, 1, p_address, p_version, '{}', clock_timestamp(), true, NULL);
    RETURN QUERY SELECT 1::bigint, true;
    RETURN;
  END IF;
  v_gen := v_old + 1;
  UPDATE berth_hosts h SET gen = v_gen, address = p_address, version = p_version,
         beat_at = clock_timestamp(), alive = true, declared_by = NULL
   WHERE h.host_id = p_host;
  IF v_alive THEN
    UPDATE berth_runs r SET gen = v_gen WHERE r.host_id = p_host AND r.gen = v_old;
    UPDATE berth_keys k SET gen = v_gen WHERE k.host_id = p_host AND k.gen = v_old;
    UPDATE berth_tokens t SET gen = v_gen WHERE t.host_id = p_host AND t.gen = v_old AND NOT t.lapsed;
  ELSE
    DELETE FROM berth_runs r WHERE r.host_id = p_host AND r.gen < v_gen;
  END IF;
  RETURN QUERY SELECT v_gen, v_alive;
END $$;

-- A run's fleet-wide claim, all or nothing: run id, fence, budget token, keys.
CREATE FUNCTION berth_claim(p_run text, p_host text, p_gen bigint, p_scope text,
                            p_harness text, p_limit integer, p_keys text[])
RETURNS TABLE (outcome text, fence bigint, detail text) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
  v_fence bigint;
  v_host text;
  v_gen bigint;
  v_lim integer;
  v_held integer;
  v_run text;
  k text;
  v_msg text;
  v_detail text;
BEGIN
  PERFORM 1 FROM berth_hosts h WHERE h.host_id = p_host AND h.gen = p_gen AND h.alive FOR SHARE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'host_dead'::text, 0::bigint, ''::text;
    RETURN;
  END IF;
  SELECT r.host_id, r.gen, r.fence INTO v_host, v_gen, v_fence FROM berth_runs r WHERE r.run_id = p_run;
  IF FOUND THEN
    IF v_host = p_host AND v_gen = p_gen THEN
      RETURN QUERY SELECT 'taken'::text, v_fence, ''::text;
    ELSE
      RETURN QUERY SELECT 'run_id_taken'::text, 0::bigint, v_host;
    END IF;
    RETURN;
  END IF;
  BEGIN
    v_fence := nextval('berth_fence');
    INSERT INTO berth_runs VALUES (p_run, p_host, p_gen, v_fence) ON CONFLICT DO NOTHING;
    IF NOT FOUND THEN
      SELECT r.host_id INTO v_host FROM berth_runs r WHERE r.run_id = p_run;
      RAISE EXCEPTION 'run_id_taken' USING DETAIL = coalesce(v_host, '');
    END IF;
    IF p_scope IS NOT NULL THEN
      INSERT INTO berth_harness VALUES (p_scope, p_harness, p_limit, 0) ON CONFLICT DO NOTHING;
      UPDATE berth_harness b SET held = b.held + 1
       WHERE b.scope = p_scope AND b.harness = p_harness AND b.lim = p_limit AND b.held < b.lim;
      IF NOT FOUND THEN
        SELECT b.lim, b.held INTO v_lim, v_held FROM berth_harness b
         WHERE b.scope = p_scope AND b.harness = p_harness;
        IF v_lim <> p_limit THEN
          RAISE EXCEPTION 'budget_conflict' USING DETAIL = v_lim::text;
        END IF;
        RAISE EXCEPTION 'budget_full' USING DETAIL = v_held::text || '/' || v_lim::text;
      END IF;
      INSERT INTO berth_tokens VALUES (p_scope, p_run, p_harness, p_host, p_gen, false)
        ON CONFLICT DO NOTHING;
      IF NOT FOUND THEN
        RAISE EXCEPTION 'token_lapsed' USING DETAIL = p_scope;
      END IF;
    END IF;
    FOREACH k IN ARRAY p_keys LOOP
      INSERT INTO berth_keys VALUES (k, p_run, p_host, p_gen) ON CONFLICT DO NOTHING;
      IF NOT FOUND THEN
        SELECT x.run_id INTO v_run FROM berth_keys x WHERE x.key = k;
        RAISE EXCEPTION 'key_held' USING DETAIL = k || E'\t' || coalesce(v_run, '');
      END IF;
    END LOOP;
  EXCEPTION WHEN raise_exception THEN
    GET STACKED DIAGNOSTICS v_msg = MESSAGE_TEXT, v_detail = PG_EXCEPTION_DETAIL;
    RETURN QUERY SELECT v_msg, 0::bigint, v_detail;
    RETURN;
  END;
  RETURN QUERY SELECT 'taken'::text, v_fence, ''::text;
END $$;

-- End a run's claim (only by the generation that holds it).
CREATE FUNCTION berth_end(p_run text, p_host text, p_gen bigint, p_lapsed boolean)
RETURNS boolean LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
  k text;
  s text;
  h text;
BEGIN
  DELETE FROM berth_runs WHERE run_id = p_run AND host_id = p_host AND gen = p_gen;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  FOR k IN DELETE FROM berth_keys WHERE run_id = p_run AND host_id = p_host AND gen = p_gen
           RETURNING key LOOP
    PERFORM pg_notify('berth_fleet', 'key ' || k);
  END LOOP;
  IF p_lapsed THEN
    UPDATE berth_tokens SET lapsed = true WHERE owner = p_run AND host_id = p_host AND gen = p_gen;
  ELSE
    FOR s, h IN DELETE FROM berth_tokens
                 WHERE owner = p_run AND host_id = p_host AND gen = p_gen AND NOT lapsed
                 RETURNING scope, harness LOOP
      UPDATE berth_harness SET held = held - 1 WHERE scope = s AND harness = h;
      PERFORM pg_notify('berth_fleet', 'token ' || s || '/' || h);
    END LOOP;
  END IF;
  RETURN true;
END $$;

-- B3: an operator frees a lapsed owner's token.
CREATE FUNCTION berth_reconcile(p_scope text, p_owner text)
RETURNS boolean LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
  h text;
BEGIN
  DELETE FROM berth_tokens WHERE scope = p_scope AND owner = p_owner AND lapsed
    RETURNING harness INTO h;
  IF NOT FOUND THEN
    RETURN false;
  END IF;
  UPDATE berth_harness SET held = held - 1 WHERE scope = p_scope AND harness = h;
  PERFORM pg_notify('berth_fleet', 'token ' || p_scope || '/' || h);
  RETURN true;
END $$;

-- F2: declare lapsed hosts dead, each generation exactly once (the conditional update
-- and berth_dead's key), and free what each rule frees. Only a live host declares.
CREATE FUNCTION berth_declare_dead(p_me text, p_lapse_ms bigint)
RETURNS TABLE (dead_host text, dead_gen bigint) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
  d record;
  k text;
BEGIN
  PERFORM 1 FROM berth_hosts WHERE host_id = p_me AND alive;
  IF NOT FOUND THEN
    RETURN;
  END IF;
  FOR d IN UPDATE berth_hosts SET alive = false, declared_by = p_me
            WHERE alive AND host_id <> p_me
              AND beat_at < clock_timestamp() - p_lapse_ms * interval '1 millisecond'
            RETURNING host_id, gen LOOP
    INSERT INTO berth_dead VALUES (d.host_id, d.gen, p_me, clock_timestamp());
    FOR k IN DELETE FROM berth_keys WHERE host_id = d.host_id RETURNING key LOOP
      PERFORM pg_notify('berth_fleet', 'key ' || k);
    END LOOP;
    UPDATE berth_tokens SET lapsed = true WHERE host_id = d.host_id AND NOT lapsed;
    UPDATE berth_threads SET live = false WHERE host_id = d.host_id;
    dead_host := d.host_id;
    dead_gen := d.gen;
    RETURN NEXT;
  END LOOP;
END $$;
