-- release.lua: gives a hold back without usage, for a request that never reached the model.
-- The slot is freed and every held token refunded; the request permit stays spent.
--
-- KEYS[1] the reservation record
-- KEYS[2] the tenant's lease index
-- KEYS[3] the tenant's holds hash
-- KEYS[4] the tenant's usage ledger (a hold settled here is entered in it)
-- ARGV[1] reservation id
--
-- Reply: {state, refunded tokens, repeated (0|1)}
--   state: released when the hold is released (repeated = 1 when an earlier call released it:
--   the refund is that call's, given once); otherwise the record's state or not_found, and
--   nothing changes but the settlement of a hold whose lease has already passed.

local rk = KEYS[1]
local leases = KEYS[2]
local holds = KEYS[3]
local ledger = KEYS[4]
local id = ARGV[1]

local now = now_ms()
local r, reply = live_hold(rk, id, leases, holds, now, ledger)
if not r then
  if reply[1] == 'released' then
    return { 'released', tonumber(redis.call('HGET', rk, 'rf')) or 0, 1 }
  end
  return { reply[1], 0, 0 }
end

local keys = split(r.ks)
free_slots(keys)
refund(keys, r.ch, r.cc, r.dy, now)
keep_alive(keys, leases, holds, r.it)
settled_record(rk, r, { 'st', 'released', 'rf', r.ch })
close(rk, id, r, leases, holds)
ledger_append(ledger, r.lg, ledger_entry(id, r, 'released', 'none', 0, 0), now)
return { 'released', r.ch, 0 }
