-- berth fleet schema, version 5 (issue 38): berth_batch answers a plain claim (no
-- budget token, no key) itself, without berth_claim's exception block (a subtransaction
-- per claim): 66 and 79 us of the server's CPU per lifecycle against 73 and 87 in
-- alternated runs of berth-bench fleet. And it refuses new claims while a fleet drain
-- is in force ('draining'), under a shared advisory lock that the drain's start takes
-- exclusively (berth_shared's drain lock, 1650815605): a batch that began before the
-- drain commits first, and one that begins after it sees the drain, so once a drain is
-- committed no host takes a new claim, whenever it reads the drain. Everything else is
-- version 3's.
CREATE OR REPLACE FUNCTION berth_batch(p_host text, p_kind text[], p_run text[], p_gen bigint[],
                            p_scope text[], p_harness text[], p_limit integer[],
                            p_nkeys integer[], p_keys text[])
RETURNS TABLE (j integer, outcome text, fence bigint, detail text) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
  n integer := coalesce(array_length(p_kind, 1), 0);
  used integer := 0;
  lock_id integer;
  v_fence bigint;
  v_host text;
  v_gen bigint;
  v_draining boolean := false;
BEGIN
  IF 'claim' = ANY (p_kind) THEN
    PERFORM pg_advisory_xact_lock_shared(1650815605);
    SELECT s.drain_by IS NOT NULL INTO v_draining FROM berth_shared s WHERE s.id = 1;
  END IF;
  -- Every key and budget harness the batch may touch is locked first, in one order
  -- fleet-wide (the lock ids, ascending). Two hosts' batches then never wait on each
  -- other in a cycle: without it, one holding key a (an uncommitted insert) and
  -- waiting for key b could meet another holding b and waiting for a, and the
  -- server's deadlock check would abort one of them a second later.
  FOR lock_id IN
    SELECT DISTINCT x.id FROM (
      SELECT hashtext('key ' || k) AS id FROM unnest(p_keys) AS k
      UNION ALL
      SELECT hashtext('key ' || bk.key) FROM berth_keys bk
       WHERE bk.host_id = p_host AND bk.run_id = ANY (p_run)
      UNION ALL
      SELECT hashtext('token ' || s || '/' || h) FROM unnest(p_scope, p_harness) AS t(s, h)
       WHERE s IS NOT NULL
      UNION ALL
      SELECT hashtext('token ' || bt.scope || '/' || bt.harness) FROM berth_tokens bt
       WHERE bt.host_id = p_host AND bt.owner = ANY (p_run)
    ) x ORDER BY x.id
  LOOP
    PERFORM pg_advisory_xact_lock(1650815604, lock_id);
  END LOOP;
  FOR i IN 1 .. n LOOP
    -- A fleet drain: no new claim anywhere; one this generation holds already (a retry
    -- whose answer was lost) is answered with its fence.
    IF p_kind[i] = 'claim' AND v_draining THEN
      SELECT r.fence INTO v_fence FROM berth_runs r
       WHERE r.run_id = p_run[i] AND r.host_id = p_host AND r.gen = p_gen[i];
      IF FOUND THEN
        RETURN QUERY SELECT i, 'taken'::text, v_fence, ''::text;
      ELSE
        RETURN QUERY SELECT i, 'draining'::text, 0::bigint, ''::text;
      END IF;
      used := used + p_nkeys[i];
      CONTINUE;
    END IF;
    -- A plain claim (no budget token, no key) cannot be refused but for a dead host or
    -- a run id another host holds: answered here without berth_claim's exception
    -- block, whose subtransaction was most of a plain claim's cost on the server.
    IF p_kind[i] = 'claim' AND p_scope[i] IS NULL AND p_nkeys[i] = 0 THEN
      PERFORM 1 FROM berth_hosts h
       WHERE h.host_id = p_host AND h.gen = p_gen[i] AND h.alive FOR SHARE;
      IF NOT FOUND THEN
        RETURN QUERY SELECT i, 'host_dead'::text, 0::bigint, ''::text;
        CONTINUE;
      END IF;
      INSERT INTO berth_runs AS r VALUES (p_run[i], p_host, p_gen[i], nextval('berth_fence'))
        ON CONFLICT (run_id) DO NOTHING RETURNING r.fence INTO v_fence;
      IF NOT FOUND THEN
        -- Claimed before: by this generation (a retry whose answer was lost) it is
        -- answered again with its fence, as berth_claim does; else the id is taken.
        SELECT r.host_id, r.gen, r.fence INTO v_host, v_gen, v_fence
          FROM berth_runs r WHERE r.run_id = p_run[i];
        IF v_host IS DISTINCT FROM p_host OR v_gen IS DISTINCT FROM p_gen[i] THEN
          RETURN QUERY SELECT i, 'run_id_taken'::text, 0::bigint, coalesce(v_host, '');
          CONTINUE;
        END IF;
      END IF;
      RETURN QUERY SELECT i, 'taken'::text, v_fence, ''::text;
    ELSIF p_kind[i] = 'claim' THEN
      RETURN QUERY SELECT i, c.outcome, c.fence, c.detail
        FROM berth_claim(p_run[i], p_host, p_gen[i], p_scope[i], p_harness[i], p_limit[i],
                         coalesce(p_keys[used + 1 : used + p_nkeys[i]], '{}')) c;
      used := used + p_nkeys[i];
    ELSIF p_kind[i] = 'refence' THEN
      UPDATE berth_runs r SET fence = nextval('berth_fence')
       WHERE r.run_id = p_run[i] AND r.host_id = p_host AND r.gen = p_gen[i]
         AND EXISTS (SELECT 1 FROM berth_hosts h
                      WHERE h.host_id = p_host AND h.gen = p_gen[i] AND h.alive)
      RETURNING r.fence INTO v_fence;
      IF FOUND THEN
        RETURN QUERY SELECT i, 'taken'::text, v_fence, ''::text;
      ELSE
        RETURN QUERY SELECT i, 'host_dead'::text, 0::bigint, ''::text;
      END IF;
    ELSE
      RETURN QUERY SELECT i, CASE WHEN berth_end(p_run[i], p_host, p_gen[i], p_kind[i] = 'lapse')
                                  THEN 'ended' ELSE 'none' END, 0::bigint, ''::text;
    END IF;
  END LOOP;
END $$;
