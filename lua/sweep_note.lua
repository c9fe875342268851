-- sweep_note.lua: notes tenants in one shard of the sweeper's index: tenants that may hold
-- something, by when it may first need settling (ms, store clock). Replicas note the tenants they
-- serve; every replica's sweeper takes the tenants that are due (sweep_take.lua), settles them
-- (sweep.lua, on the tenant's own slot) and says when each is next due (sweep_done.lua). Shards
-- carry hash tags of their own, so a Cluster spreads them over its nodes.
--
-- KEYS[1] the shard (sorted set: tenant -> due at, ms)
--
-- ARGV[1] idle TTL of the shard (ms)
-- then pairs: a tenant, and how long from now until it may need settling (its lease, plus the
-- sweeper's period), in ms
--
-- Reply: how many tenants were noted.
--
-- Invariants: a note never brings a tenant's due time forward (a later one replaces an earlier one,
-- never the reverse), and always moves it (by a millisecond when it is already later), so that a
-- sweeper that took the tenant before the note sees it was noted (sweep_done.lua).

local shard = KEYS[1]
local now = now_ms()
local n = 0
for i = 2, #ARGV, 2 do
  local due = now + tonumber(ARGV[i + 1])
  local cur = tonumber(call('ZSCORE', shard, ARGV[i]))
  if not cur or cur < due then
    call('ZADD', shard, due, ARGV[i])
  else
    call('ZADD', shard, cur + 1, ARGV[i])
  end
  n = n + 1
end
keep_for(shard, tonumber(ARGV[1]))
return n
