-- commit.lua: the reconcile phase. Charges what generation actually used against what the hold
-- charged: the difference is refunded, or charged as debt when usage overran the hold.
--
-- KEYS[1] the reservation record
-- KEYS[2] the tenant's lease index
-- KEYS[3] the tenant's holds hash
-- KEYS[4] the tenant's usage ledger (the commit is entered in it when the hold's terms say so)
-- ARGV[1] reservation id
-- ARGV[2] prompt tokens used, or empty when the response did not say: the prompt held is charged
-- ARGV[3] output tokens used, or empty when they could not be counted: the output held is charged
-- ARGV[4] TTL of the output estimate this commit teaches (ms)
-- ARGV[5] samples the estimate keeps before it halves them all (0: the tenant no longer learns)
-- ARGV[6] exact | metered: whether the counts were reported or metered by tollgate
-- ARGV[7] the tenant's settled-bucket prefix (prefix .. period number = a bucket; see common.lua)
-- ARGV[8] retention of settled records (ms): the period of the settled buckets
-- ARGV[9] cache reads: of the prompt, tokens the provider read from its cache ('' when unsaid)
-- ARGV[10] cache writes: of the prompt, tokens written to the provider's cache ('' when unsaid)
-- ARGV[11] reasoning tokens: of the output ('' when unsaid; charged at their weight and price)
-- ARGV[12] how the request ended: completed | metered | metered_capped | as_held | client_left |
--          upstream_refused | upstream_error (kept with the settled hold, entered in the ledger)
-- ARGV[13] the tenant's time zone: its offset from UTC now, in minutes east ('' when the policy no
--          longer has the tenant: the offset the hold was made with); debt counts in its periods
--
-- Reply: {state, duplicate (0|1), used, held, refunded, overrun, metered (0|1), model, output held,
--         cost (nanos, at the prices the hold was made with), ending}
--   (ending: how the request ended, as the commit that settled it said; '' when unknown)
--   (used: the tokens charged, cached and reasoning tokens at the weights the hold was made with)
--   (model: the one the request named, '' for a hold made before records kept it; output held: the
--    output part of the hold, -1 when unknown)
--   state: committed | late_committed, or not_found | released when nothing was charged
--   A commit of an already committed id returns the first commit's result with duplicate = 1: a
--   caller that commits twice, or a client that re-sends after a lost reply, charges once.
--
-- A hold that learns (its record names an estimate) teaches it the output length, once, and only
-- an exact one: a metered length would teach the estimate the meter's error.
--
-- Invariants: each record is charged for usage at most once; a hold whose lease has passed is
-- settled as expired first (whether or not a sweep reached it), then late-committed, so the
-- outcome does not depend on when the sweep ran; debt is charged against the bucket as it stands
-- now (refilled first), so a full bucket's discarded refill never pays it.

local rk = KEYS[1]
local leases = KEYS[2]
local holds = KEYS[3]
local ledger = KEYS[4]
local id = ARGV[1]
local estimate_ttl = tonumber(ARGV[4])
local window = tonumber(ARGV[5])
local metered = ARGV[6] == 'metered'
local settled = { prefix = ARGV[7], retention = tonumber(ARGV[8]) }
local ending = ARGV[12]

local now = now_ms()
local r = load_hold(rk, id, settled, now)
if not r then
  return { 'not_found', 0, 0, 0, 0, 0, 0, '', -1, 0, '' }
end
if r.st == 'committed' or r.st == 'late_committed' then
  local us = tonumber(r.us)
  return { r.st, 1, us, r.h, max(0, r.h - us), max(0, us - r.h), tonumber(r.mx) or 0, r.md or '',
    tonumber(r.oh) or -1, r.cc, r.en or '' }
end
if r.st == 'released' then
  return { 'released', 0, 0, r.h, 0, 0, 0, r.md or '', tonumber(r.oh) or -1, 0, r.en or '' }
end
local output_held = min(r.h, tonumber(r.oh) or 0)
local prompt = tonumber(ARGV[2]) or (r.h - output_held)
local output = tonumber(ARGV[3]) or output_held

if r.st == 'reserved' and now >= r.le then
  -- Entered in the ledger once, as the late commit below.
  expire(rk, id, r, leases, holds, now, nil)
end

local keys = split(r.ks)
-- Cached and reasoning tokens count at their weight and price only beside reported counts.
local read, written, reasoning = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
if metered or ARGV[2] == '' then
  read, written, reasoning = nil, nil, nil
end
local used, cost, used_in, used_out = charged_for(r, prompt, output, read or 0, written or 0, reasoning or 0)
local slots = 0
if r.sl == '1' then
  slots = 1
end
local had = charged_of(r)
local now_at = periods_at(now, tonumber(ARGV[13]) or r.zo)
if not settle(keys, amounts(used - had.u, cost - had.c, used_in - had.p, used_out - had.g), periods_of(r.dy, r.hr),
  now_at, now, r.kc, slots, r.it) then
  keep_scopes(keys, r.it)
end

local state = 'committed'
if r.st == 'expired' then
  state = 'late_committed'
end
local refunded = max(0, r.h - used)
local overrun = max(0, used - r.h)
local mx = 0
if metered then
  mx = 1
end
close(id, r, leases, holds)
file_settled(rk, id, r, settled, now, state, used, cost, mx, ending)
-- How the charge was counted: the output is what is metered, so a commit without it stands on
-- the hold; a metered one charges the prompt held.
local usage = 'exact'
if ARGV[3] == '' then
  usage = 'held'
elseif metered then
  usage = 'metered'
elseif ARGV[2] == '' then
  usage = 'held'
end
if has_ledger(r) then
  local entry = ledger_entry(id, r, state, usage, used, cost, ending)
  entry.prompt, entry.output = prompt, output
  entry.cache_read, entry.cache_write, entry.reasoning = read, written, reasoning
  ledger_append(ledger, r.lg, entry, now)
end
if r.ok and r.ok ~= '' and window > 0 and not metered then
  learn(r.ok, output, used, overrun, tonumber(r.oq), window, estimate_ttl)
end
return { state, 0, used, r.h, refunded, overrun, mx, r.md or '', tonumber(r.oh) or -1, cost, ending }
