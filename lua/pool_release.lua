-- pool_release.lua: takes a hold's work off its pool, as much as it holds, and settles what it
-- charged the pool's provider limits by how its request ended (common.lua, provider_settle).
-- Called after the tenant leg commits or releases, and to compensate when the tenant leg refuses.
-- Idempotent: a hold already taken off (or swept after its lease) changes nothing.
--
-- KEYS[1] the pool's state hash     KEYS[2] the pool's holds hash     KEYS[3] the pool's lease index
-- KEYS[4] the pool's waiting hash   KEYS[5..7] its tiers' virtual counters (see pool_reserve.lua)
-- KEYS[8] the pool's provider scope
-- ARGV[1] reservation id
-- ARGV[2] how its request ended: unused (it never reached the backend: its tenant leg refused
--         it, or nobody received its admission; a queue's finish tag is taken back too, common.lua)
--         | released (no usage) | used (ARGV[3..5]) | as_held (its tenant hold's lease ran out,
--         it was admitted unmetered, or it settled where its usage is not known)
-- ARGV[3] prompt tokens used   ARGV[4] output tokens used   ARGV[5] cost (nanos): '' where unknown
--         (charged as held)
--
-- Reply: {1, work ms} when this call took the hold off; {0, 0} when the pool did not hold it.

local ending = { how = ARGV[2], prompt = tonumber(ARGV[3]), output = tonumber(ARGV[4]), cost = tonumber(ARGV[5]) }
local work = pool_drop(KEYS, ARGV[1], ending)
if work then
  return { 1, work }
end
return { 0, 0 }
