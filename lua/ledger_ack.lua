-- ledger_ack.lua: acknowledges ledger entries `tollgate ledger` has written out, so that no
-- consumer of the group is given them again.
--
-- KEYS[1] a tenant's ledger stream
-- ARGV[1] the consumer group          ARGV[2..] entry ids
--
-- Reply: how many were pending and are acknowledged now.

return redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
