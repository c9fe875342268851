-- budget_adjust.lua: credits, debits or resets one period budget of one scope, once per request
-- id, and enters it in the tenant's usage ledger with who asked and why (the Budgets API's Adjust).
--
-- KEYS[1] the scope hash
-- KEYS[2] the adjustment's key: what its request id did, for a repeat
-- KEYS[3] the tenant's usage ledger
-- ARGV[1] the budget's counter (du, wg, mc: see common.lua's PERIODS)
-- ARGV[2] the credit: what to take off what the period has counted (below zero: a debit, added)
-- ARGV[3] reset: 1 to take all the period has counted off it (the credit is then 0)
-- ARGV[4] the request's fingerprint (scope, budget, credit, reset): its request id reused for
--         another adjustment is refused
-- ARGV[5] how long the request id is remembered (ms)
-- ARGV[6] idle TTL of the scope hash (ms): an adjusted scope lives at least this long
-- ARGV[7] the usage ledger's terms, "<max entries> <retention ms>", or '' when there is none
-- ARGV[8] the ledger entry: request id, tenant, user, model, who asked, why, the budget's name
--         (tab-separated)
-- ARGV[9] the tenant's time zone: its offset from UTC now, in minutes east
--
-- Reply: {state, counted before, counted after}
--   state: adjusted | repeated (the request id's first answer, nothing changed again) | conflict
--   (the request id was first used for another adjustment; nothing changed)
--
-- What the period counted never goes below zero: a credit past it leaves zero. A count of a past
-- period is the new period's zero, as a reserve would read it (and the period's other counters
-- start at zero with it). Live holds settle against the adjusted count as they would have against
-- the old: a refund past zero leaves zero.

local scope, done, ledger = KEYS[1], KEYS[2], KEYS[3]
local counter, credit, reset = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local fingerprint, remember, idle = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])

local first = call('HMGET', done, 'fp', 'before', 'after')
if first[1] then
  if first[1] ~= fingerprint then
    return { 'conflict', 0, 0 }
  end
  return { 'repeated', tonumber(first[2]), tonumber(first[3]) }
end

local now = now_ms()
local at = periods_at(now, tonumber(ARGV[9]))
local p = string.sub(counter, 1, 1)
local marker = PERIOD_MARKERS[p]
local f = fields_of(scope)
local w = { marker, at[p] }
local before = 0
if tonumber(f[marker]) == at[p] then
  before = tonumber(f[counter]) or 0
else
  for _, m in ipairs(MEASURES) do
    if f[p .. m] then
      w[#w + 1], w[#w + 2] = p .. m, 0
    end
  end
end
local after = max(0, before - credit)
if reset then
  after = 0
end
w[#w + 1], w[#w + 2] = counter, after
call('HSET', scope, unpack(w))
keep_for(scope, idle)
call('HSET', done, 'fp', fingerprint, 'before', before, 'after', after)
call('PEXPIRE', done, remember)

local e = {}
for v in string.gmatch(ARGV[8] .. '\t', '([^\t]*)\t') do
  e[#e + 1] = v
end
ledger_write(ledger, ARGV[7], { 'id', 'adjust:' .. e[1], 'tenant', e[2], 'user', e[3], 'model', e[4],
  'outcome', 'adjusted', 'usage', 'none', 'budget', e[7], 'counted_before', before, 'counted_after', after,
  'adjusted_by', e[5], 'reason', e[6], 'settled_at_ms', now }, now)
return { 'adjusted', before, after }
