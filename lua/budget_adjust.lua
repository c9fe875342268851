-- budget_adjust.lua: credits, debits or resets one period budget of one scope, once per request
-- id, and enters it in the tenant's usage ledger with who asked and why (the Budgets API's Adjust).
--
-- KEYS[1] the scope hash
-- KEYS[2] the adjustment's key: what its request id did, for a repeat
-- KEYS[3] the tenant's usage ledger
-- ARGV[1] the budget: tokens_per_day | tokens_per_month | cost_per_day | cost_per_month
-- ARGV[2] the credit: what to take off what the period has counted (below zero: a debit, added)
-- ARGV[3] reset: 1 to take all the period has counted off it (the credit is then 0)
-- ARGV[4] the request's fingerprint (scope, budget, credit, reset): its request id reused for
--         another adjustment is refused
-- ARGV[5] how long the request id is remembered (ms)
-- ARGV[6] idle TTL of the scope hash (ms): an adjusted scope lives at least this long
-- ARGV[7] the usage ledger's terms, "<max entries> <retention ms>", or '' when there is none
-- ARGV[8] the ledger entry: request id, tenant, user, model, who asked, why (tab-separated)
--
-- Reply: {state, counted before, counted after}
--   state: adjusted | repeated (the request id's first answer, nothing changed again) | conflict
--   (the request id was first used for another adjustment; nothing changed)
--
-- What the period counted never goes below zero: a credit past it leaves zero. A count of a past
-- day (month) is the new period's zero, as a reserve would read it. Live holds settle against the
-- adjusted count as they would have against the old: a refund past zero leaves zero.

local scope, done, ledger = KEYS[1], KEYS[2], KEYS[3]
local budget, credit, reset = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local fingerprint, remember, idle = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])

local first = redis.call('HMGET', done, 'fp', 'before', 'after')
if first[1] then
  if first[1] ~= fingerprint then
    return { 'conflict', 0, 0 }
  end
  return { 'repeated', tonumber(first[2]), tonumber(first[3]) }
end

local now = now_ms()
local today = math.floor(now / DAY_MS)
local month = month_of(today)
-- The period's marker, the counter adjusted, and the period's other counter (zeroed with it when
-- the period turns).
local periods = {
  tokens_per_day = { 'd', today, 'du', 'dc' },
  cost_per_day = { 'd', today, 'dc', 'du' },
  tokens_per_month = { 'mo', month, 'mu', 'mc' },
  cost_per_month = { 'mo', month, 'mc', 'mu' },
}
local p = periods[budget]
local v = redis.call('HMGET', scope, p[1], p[3], p[4])
local before, other = 0, 0
if tonumber(v[1]) == p[2] then
  before, other = tonumber(v[2]) or 0, tonumber(v[3]) or 0
end
local after = math.max(0, before - credit)
if reset then
  after = 0
end
redis.call('HSET', scope, p[1], p[2], p[3], after, p[4], other)
keep_for(scope, idle)
redis.call('HSET', done, 'fp', fingerprint, 'before', before, 'after', after)
redis.call('PEXPIRE', done, remember)

local e = {}
for f in string.gmatch(ARGV[8] .. '\t', '([^\t]*)\t') do
  e[#e + 1] = f
end
ledger_write(ledger, ARGV[7], { 'id', 'adjust:' .. e[1], 'tenant', e[2], 'user', e[3], 'model', e[4],
  'outcome', 'adjusted', 'usage', 'none', 'budget', budget, 'counted_before', before, 'counted_after', after,
  'adjusted_by', e[5], 'reason', e[6], 'settled_at_ms', now }, now)
return { 'adjusted', before, after }
