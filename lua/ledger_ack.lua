-- ledger_ack.lua: acknowledges ledger entries `tollgate ledger` has written out, so that no
-- consumer of the group is given them again.
--
-- KEYS[1] a tenant's ledger stream
-- ARGV[1] the consumer group          ARGV[2..] entry ids
--
-- Reply: how many were pending and are acknowledged now.
--
-- (In batches: Lua's unpack cannot spread more than a few thousand values into one call.)

local acked, batch = 0, 1000
for first = 2, #ARGV, batch do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, first, math.min(#ARGV, first + batch - 1)))
end
return acked
