-- pool_renew.lua: extends the lease of a pool hold, after its tenant hold was renewed.
--
-- KEYS[1] the pool's state hash     KEYS[2] the pool's holds hash     KEYS[3] the pool's lease index
-- KEYS[4..8] as pool_release.lua's
-- ARGV[1] reservation id            ARGV[2] new lease, from now (ms)  ARGV[3] idle TTL (ms)
--
-- A hold that took from the provider's limits keeps their scope alive with it: a stream renewed
-- past the scope's idle TTL must settle into the scope it took from, not one made since.
--
-- Reply: 1 when renewed; 0 when the pool does not hold it (nothing changes).

local got = call('HMGET', KEYS[2], ARGV[1], ARGV[1] .. '+')
if not got[1] then
  return 0
end
call('ZADD', KEYS[3], now_ms() + tonumber(ARGV[2]), ARGV[1])
for i = 1, 7 do
  keep_for(KEYS[i], tonumber(ARGV[3]))
end
if got[2] then
  keep_for(KEYS[8], provider_charge_read(got[2]).idle)
end
return 1
