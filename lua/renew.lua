-- renew.lua: extends the lease of a live hold, for streams that outlive one lease.
--
-- KEYS[1] the reservation record
-- KEYS[2] the tenant's lease index
-- KEYS[3] the tenant's holds hash
-- KEYS[4] the tenant's usage ledger (a hold settled here is entered in it)
-- ARGV[1] reservation id
-- ARGV[2] new lease, from now (ms)
-- ARGV[3] idle TTL of the tenant's keys (ms)
-- ARGV[4] the tenant's settled-bucket prefix (prefix .. period number = a bucket; see common.lua)
-- ARGV[5] retention of settled records (ms): the period of the settled buckets
--
-- Reply: {state, lease remaining ms}
--   state: reserved when renewed; otherwise the record's state (expired, committed, ...) or
--   not_found, and nothing changes but the settlement of a hold whose lease has already passed.
--
-- Every key the hold counts in stays alive with it: the record, the lease index, the holds hash,
-- its idempotency key, and every scope hash it holds a slot in. A stream renewed for an hour keeps
-- its slot for an hour. Safe to run twice: the second run extends the lease from its own now.

local rk = KEYS[1]
local leases = KEYS[2]
local holds = KEYS[3]
local ledger = KEYS[4]
local id = ARGV[1]
local lease = tonumber(ARGV[2])
local idle = tonumber(ARGV[3])
local settled = { prefix = ARGV[4], retention = tonumber(ARGV[5]) }

local now = now_ms()
local r, reply = live_hold(rk, id, leases, holds, now, ledger, settled)
if not r then
  return reply
end

local expiry = now + lease
call('HSET', rk, 'le', expiry)
call('PEXPIRE', rk, idle)
call('ZADD', leases, expiry, id)
keep_alive(split(r.ks), leases, holds, idle)
if r.ik ~= '' then
  call('PEXPIRE', r.ik, lease)
end
return { 'reserved', lease }
