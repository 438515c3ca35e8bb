-- berth fleet schema, version 2: a refused claim names the host that holds the key
-- (`key_held`'s detail is `key TAB run TAB host`), so a waiter's reason can say who
-- holds it (issue 33 item 8). The function is otherwise version 1's.
CREATE OR REPLACE FUNCTION berth_claim(p_run text, p_host text, p_gen bigint, p_scope text,
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
        SELECT x.run_id, x.host_id INTO v_run, v_host FROM berth_keys x WHERE x.key = k;
        RAISE EXCEPTION 'key_held'
          USING DETAIL = k || E'\t' || coalesce(v_run, '') || E'\t' || coalesce(v_host, '');
      END IF;
    END LOOP;
  EXCEPTION WHEN raise_exception THEN
    GET STACKED DIAGNOSTICS v_msg = MESSAGE_TEXT, v_detail = PG_EXCEPTION_DETAIL;
    RETURN QUERY SELECT v_msg, 0::bigint, v_detail;
    RETURN;
  END;
  RETURN QUERY SELECT 'taken'::text, v_fence, ''::text;
END $$;
