-- pool_release.lua: takes a hold's work off its pool, as much as it holds. Called after the
-- tenant leg commits or releases, and to compensate when the tenant leg refuses. Idempotent: a
-- hold already taken off (or swept after its lease) changes nothing.
--
-- KEYS[1] the pool's state hash     KEYS[2] the pool's holds hash     KEYS[3] the pool's lease index
-- KEYS[4] the pool's waiting hash   KEYS[5..7] its tiers' virtual counters (see pool_reserve.lua)
-- ARGV[1] reservation id
-- ARGV[2] unused: 1 when the request never reached the backend (its tenant leg refused it, or
--         nobody received its admission): a queue's finish tag is taken back too (common.lua)
--
-- Reply: {1, work ms} when this call took the hold off; {0, 0} when the pool did not hold it.

local work = pool_drop(KEYS, ARGV[1], ARGV[2] == '1')
if work then
  return { 1, work }
end
return { 0, 0 }
