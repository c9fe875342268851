-- release.lua: gives a hold back without usage, for a request that never reached the model.
-- The slot is freed and every held token refunded; the request permit stays spent.
--
-- KEYS[1] the reservation record
-- KEYS[2] the tenant's lease index
-- ARGV[1] reservation id
--
-- Reply: {state, refunded tokens}
--   state: released when this call released it; otherwise the record's state or not_found, and
--   nothing changes but the settlement of a hold whose lease has already passed.

local rk = KEYS[1]
local leases = KEYS[2]
local id = ARGV[1]

local r, reply = live_hold(rk, id, leases, now_ms())
if not r then
  return reply
end

local keys = split(r.ks)
free_slots(keys)
refund(keys, r.ch, r.dy)
redis.call('HSET', rk, 'st', 'released', 'ch', 0, 'sl', 0)
close(rk, id, r, leases)
return { 'released', r.ch }
