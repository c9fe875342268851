-- release.lua: gives a hold back without usage, for a request that never reached the model.
-- The slot is freed and every held token refunded; the request permit stays spent.
--
-- KEYS[1] the reservation record
-- KEYS[2] the tenant's lease index
-- KEYS[3] the tenant's holds hash
-- KEYS[4] the tenant's usage ledger (a hold settled here is entered in it)
-- ARGV[1] reservation id
-- ARGV[2] the tenant's settled-bucket prefix (prefix .. period number = a bucket; see common.lua)
-- ARGV[3] retention of settled records (ms): the period of the settled buckets
-- ARGV[4] how the request ended: released (its caller gave it back) | upstream_refused |
--         upstream_error (the backend answered with no output)
-- ARGV[5] whether the reserve went unanswered: 1 when nobody received the answer of the reserve
--         that made the hold (a re-send of that reserve may still arrive), and a hold settled, now
--         or before, then leaves a note at its record key for it (see common.lua's record); ''
--         (or absent, from an older replica) otherwise
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
local settled = { prefix = ARGV[2], retention = tonumber(ARGV[3]) }
local ending = ARGV[4]
local unanswered = ARGV[5] == '1'

local now = now_ms()
local r, reply, done = live_hold(rk, id, leases, holds, now, ledger, settled)
if not r then
  if unanswered and reply[1] ~= 'not_found' then
    leave_settled_note(rk, settled, now)
  end
  if reply[1] == 'released' then
    return { 'released', tonumber(done.rf) or 0, 1 }
  end
  return { reply[1], 0, 0 }
end

local keys = split(r.ks)
if not refund(keys, charged_of(r), periods_of(r.dy, r.hr), now, r.kc, 1, r.it) then
  keep_scopes(keys, r.it)
end
close(id, r, leases, holds)
file_settled(rk, id, r, settled, now, 'released', r.ch, 0, 0, ending)
if unanswered then
  leave_settled_note(rk, settled, now)
end
if has_ledger(r) then
  ledger_append(ledger, r.lg, ledger_entry(id, r, 'released', 'none', 0, 0, ending), now)
end
return { 'released', r.ch, 0 }
