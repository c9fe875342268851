-- heartbeat.lua: a replica says it is alive, and learns how many are (for on_store_error: local,
-- which shares each limit among the replicas while the store cannot be reached) and which forms
-- of a reservation record every one of them reads (a reserve writes the compact form only once
-- every replica reads it: see reserve.lua).
--
-- KEYS[1] the replicas: a sorted set of replica ids by when each was last heard (ms), each id as
--         "<replica>#<the newest record form it reads>" ("<replica>" alone: a version from before
--         forms were announced, which is taken to read only the first, the full form)
-- KEYS[2] the oldest record form a replica heard lately reads, when older than a heartbeat's own:
--         remembered for ARGV[4] after the last heartbeat that heard such a replica (a replica
--         is heard until ARGV[2] after its own last heartbeat)
-- ARGV[1] this replica
-- ARGV[2] how long a replica counts after its last heartbeat (ms)
-- ARGV[3] the newest record form this replica reads (1 full, 2 compact)
-- ARGV[4] how long a replica reading an older form is remembered (ms): one that restarts, or that
--         cannot reach the store for a while, is not taken for gone
--
-- Reply: {the replicas heard within that time, this one included; the newest record form every
--         one of them reads, and every replica reading an older one remembered}
local now = now_ms()
local ttl = tonumber(ARGV[2])
local mine = tonumber(ARGV[3])
local form = mine
call('ZADD', KEYS[1], now, ARGV[1] .. '#' .. ARGV[3])
local gone = call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
for _, replica in ipairs(gone) do
  call('ZREM', KEYS[1], replica)
end
call('PEXPIRE', KEYS[1], ttl)
local heard = call('ZRANGE', KEYS[1], 0, -1)
for _, replica in ipairs(heard) do
  form = min(form, tonumber(string.match(replica, '#(%d+)$')) or 1)
end
local oldest = min(form, tonumber(call('GET', KEYS[2])) or form)
if form < mine then
  call('SET', KEYS[2], oldest)
  call('PEXPIRE', KEYS[2], ARGV[4])
end
return { #heard, oldest }
