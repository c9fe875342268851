-- sweep.lua: the background sweeper's work on one tenant: settles a bounded batch of the tenant's
-- holds whose lease has passed (and the leases of replicas that stopped renewing theirs), as the
-- sweep inside reserve does, for a tenant that may never call again.
--
-- KEYS[1] the tenant's lease index     KEYS[2] the tenant's holds hash
-- KEYS[3] the tenant's usage ledger (the holds settled here are entered in it)
--
-- ARGV[1] record key prefix            ARGV[2] sweep batch: most holds settled by this call
-- ARGV[3] the usage ledger's terms, "<max entries> <retention ms>", or '' (for holds whose record
--         ran out of TTL: a record carries its own terms)
-- ARGV[4] the tenant
--
-- Reply: {when the next lease in the index passes (ms, store clock; -1 when none is left), settled
--         hold ids...}
--
-- Invariants: writes only what settling expired holds writes (as reserve's sweep); a hold still
-- live is untouched; safe to run twice, and beside any other phase of the same tenant.

local leases, holds = KEYS[1], KEYS[2]
local now = now_ms()
local settled = sweep(leases, holds, ARGV[1], ARGV[2], now,
  { key = KEYS[3], terms = ARGV[3], tenant = ARGV[4] })
local first = call('ZRANGE', leases, 0, 0, 'WITHSCORES')
local next_due = -1
if #first == 2 then
  next_due = tonumber(first[2])
end
local reply = { next_due }
for _, id in ipairs(settled) do
  reply[#reply + 1] = id
end
return reply
