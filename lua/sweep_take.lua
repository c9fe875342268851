-- sweep_take.lua: takes the tenants of one shard of the sweeper's index that are due now, each
-- claimed for a while (its due time pushed back), so another replica's sweeper leaves it alone
-- meanwhile. (See sweep_note.lua for the index.)
--
-- KEYS[1] the shard (sorted set: tenant -> due at, ms)
--
-- ARGV[1] most tenants taken       ARGV[2] claim (ms): how long a taken tenant is left alone
--
-- Reply: {tenant, the due time it was claimed at, ...}

local shard = KEYS[1]
local now = now_ms()
local claim = now + tonumber(ARGV[2])
local taken = {}
for _, tenant in ipairs(call('ZRANGEBYSCORE', shard, '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))) do
  call('ZADD', shard, claim, tenant)
  taken[#taken + 1] = tenant
  taken[#taken + 1] = claim
end
return taken
