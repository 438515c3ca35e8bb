-- berth fleet schema, version 3 (issue 38 Build 1): a host's claims, re-fences and
-- endings sent together, as one statement and one transaction. Op j is
-- p_kind[j] ('claim', 'refence', 'end' or 'lapse') of run p_run[j] under p_host's
-- generation p_gen[j]; a claim's budget token is p_scope[j], p_harness[j], p_limit[j]
-- (NULL scope: none) and its keys the next p_nkeys[j] entries of p_keys. Answers come
-- one row per op: j, then the outcome words of berth_claim ('ended' / 'none' for
-- endings).
CREATE FUNCTION berth_batch(p_host text, p_kind text[], p_run text[], p_gen bigint[],
                            p_scope text[], p_harness text[], p_limit integer[],
                            p_nkeys integer[], p_keys text[])
RETURNS TABLE (j integer, outcome text, fence bigint, detail text) LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
  n integer := coalesce(array_length(p_kind, 1), 0);
  used integer := 0;
  lock_id integer;
  v_fence bigint;
BEGIN
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
    IF p_kind[i] = 'claim' THEN
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
