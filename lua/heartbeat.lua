-- heartbeat.lua: a replica says it is alive, and learns how many are (for on_store_error: local,
-- which shares each limit among the replicas while the store cannot be reached).
--
-- KEYS[1] the replicas: a sorted set of replica ids by when each was last heard (ms)
-- ARGV[1] this replica
-- ARGV[2] how long a replica counts after its last heartbeat (ms)
--
-- Reply: the replicas heard within that time, this one included.
local now = now_ms()
local ttl = tonumber(ARGV[2])
call('ZADD', KEYS[1], now, ARGV[1])
local gone = call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
for _, replica in ipairs(gone) do
  call('ZREM', KEYS[1], replica)
end
call('PEXPIRE', KEYS[1], ttl)
return #call('ZRANGE', KEYS[1], 0, -1)
