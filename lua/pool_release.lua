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
--         | released (no usage) | used (ARGV[3..5]) | expired (its tenant hold's lease ran out, or
--         it settled where its usage is not known: charged as held)
-- ARGV[3] prompt tokens used   ARGV[4] output tokens used   ARGV[5] cost (nanos): '' where unknown
--         (charged as held)
-- ARGV[6] the provider scope's idle TTL (ms; 0: none)
--
-- Reply: {1, work ms} when this call took the hold off; {0, 0} when the pool did not hold it.

local how = ARGV[2]
-- (No idle TTL, from a policy that no longer sets provider limits: the scope's TTL stays as its
-- last reserve left it.)
local idle = ARGV[6]
if idle == '0' then
  idle = nil
end
local ending = { how = how, prompt = tonumber(ARGV[3] or ''), output = tonumber(ARGV[4] or ''),
  cost = tonumber(ARGV[5] or ''), idle = idle }
local work = pool_drop(KEYS, ARGV[1], ending, now_ms())
if work then
  return { 1, work }
end
return { 0, 0 }
