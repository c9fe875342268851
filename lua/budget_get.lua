-- budget_get.lua: what each of a tenant's scopes has used, holds and has left, for the Budgets
-- API's Get: every limit the scope has, read at the store's clock. Reads only.
--
-- KEYS[1]   the tenant's holds hash (each live hold's charge, day and scopes: what is held)
-- KEYS[2..] the scope hashes: tenant first, then user and model where they apply
-- ARGV[1] count held: 1 to read what live holds hold (every live hold of the tenant is read),
--         0 to leave it 0 (the remaining-budget gauges want only what is left)
-- then nine numbers per scope, in KEYS order, 0 meaning "no such limit" (as reserve.lua's):
--   token capacity, tokens per ms, request capacity, requests per ms, max concurrency, daily budget,
--   monthly budget, daily cost budget, monthly cost budget (nanos)
--
-- Reply: per scope, in KEYS order,
--   {tokens in the bucket, ms until it is full, requests in the bucket, ms until it is full (0 and 0
--    for a bucket the scope does not have), holds in flight, the day's tokens, of them held, the month's
--    tokens, of them held, the day's cost, of it held, the month's cost, of it held, ms until the
--    day ends, ms until the month ends}
--   (held: what live holds charged, not yet settled by a commit, release or expiry; the day's and
--    the month's counts include it. A bucket holds what replicas drew into their slices as used.)

local now = now_ms()
local today = math.floor(now / DAY_MS)
local month = month_of(today)

-- What live holds hold, by scope key: tokens and cost charged today and this month.
local held = {}
local flat = {}
if ARGV[1] == '1' then
  flat = redis.call('HGETALL', KEYS[1])
end
for i = 1, #flat, 2 do
  local e = split(flat[i + 1])
  local tokens, day, cost = tonumber(e[1]), tonumber(e[2]), tonumber(e[4])
  for j = 5, #e do
    local h = held[e[j]] or { dt = 0, dc = 0, mt = 0, mc = 0 }
    if day == today then
      h.dt, h.dc = h.dt + tokens, h.dc + cost
    end
    if month_of(day) == month then
      h.mt, h.mc = h.mt + tokens, h.mc + cost
    end
    held[e[j]] = h
  end
end

-- A bucket's level (whole units, below zero in debt) and the ms until it is full; 0 and 0 without
-- one.
local function bucket(level, cap, rate)
  if cap <= 0 then
    return 0, 0
  end
  return math.floor(level), math.ceil(math.max(0, cap - level) / rate)
end

local day_ends = (today + 1) * DAY_MS - now
local month_ends = month_start(month + 1) * DAY_MS - now
local out = {}
for i = 2, #KEYS do
  local b = 1 + (i - 2) * 9
  local s = read_scope(KEYS[i], ARGV, b, now, today, month, b + 6)
  local h = held[KEYS[i]] or { dt = 0, dc = 0, mt = 0, mc = 0 }
  local tokens, tokens_full = bucket(s.t, s.tcap, s.trate)
  local requests, requests_full = bucket(s.r, s.rcap, s.rrate)
  out[#out + 1] = { tokens, tokens_full, requests, requests_full, s.c, s.du, h.dt, s.mu, h.mt, s.dc, h.dc, s.mc, h.mc,
    day_ends, month_ends }
end
return out
