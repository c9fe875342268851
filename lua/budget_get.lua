-- budget_get.lua: what each of a tenant's scopes has used, holds and has left, for the Budgets
-- API's Get: every limit the scope has, read at the store's clock. Reads only.
--
-- KEYS[1]   the tenant's holds hash (each live hold's charge, day and scopes: what is held)
-- KEYS[2..] the scope hashes: tenant first, then user and model where they apply
-- ARGV[1] count held: 1 to read what live holds hold (every live hold of the tenant is read),
--         0 to leave it 0 (the remaining-budget gauges want only what is left)
-- ARGV[2] record key prefix (prefix .. id = a live hold's record: its output part and hour)
-- ARGV[3] the tenant's time zone: its offset from UTC now, in minutes east (as reserve.lua's)
-- then ten per scope, in KEYS order (see common.lua's scope_limits and limits_of):
--   token capacity, tokens per ms, request capacity, requests per ms, max concurrency, input token
--   capacity, input tokens per ms, output token capacity, output tokens per ms, period budgets
--
-- Reply: per scope, in KEYS order,
--   {tokens in the bucket, ms until it is full, requests in the bucket, ms until it is full,
--    holds in flight, prompt tokens in their bucket, ms until it is full, output tokens in
--    theirs, ms until it is full (0 and 0 for a bucket the scope does not have),
--    {counter, counted, of it held, ms until its period ends, ...} for every budget the scope
--    has (and the tokens and cost of the day and month, which every scope counts)}
--   (held: what live holds charged, not yet settled by a commit, release or expiry; the counts
--    include it. A bucket holds what replicas drew into their slices as used.)

local now = now_ms()
local offset = tonumber(ARGV[3])
local at = periods_at(now, offset)
local FIRST_ARG = 4

-- What live holds hold, by scope key and counter, in the current periods.
local held = {}
local flat = {}
if ARGV[1] == '1' then
  flat = call('HGETALL', KEYS[1])
end
-- One live hold's entry: what it holds in the current periods, by scope and counter.
local function count_held(id, entry)
  local e = split(entry)
  local tokens, day, cost = tonumber(e[1]), tonumber(e[2]), tonumber(e[4]) or 0
  local r = call('HMGET', ARGV[2] .. id, 'oh', 'hr')
  -- (A hold whose record is gone is counted whole as prompt: its output part is unknown.)
  local output = min(tokens, tonumber(r[1]) or 0)
  local n = amounts(tokens, cost, tokens - output, output)
  local hold_at = periods_of(day, tonumber(r[2]))
  for j = 5, #e do
    local h = held[e[j]] or {}
    for _, c in ipairs(COUNTERS) do
      local p = string.sub(c, 1, 1)
      if hold_at[p] and hold_at[p] == at[p] then
        h[c] = (h[c] or 0) + n[string.sub(c, 2, 2)]
      end
    end
    held[e[j]] = h
  end
end

for i = 1, #flat, 2 do
  -- (A hold's detail beside its entry, `<id>+`, is not an entry.)
  if string.sub(flat[i], -1) ~= '+' then
    count_held(flat[i], flat[i + 1])
  end
end

-- A bucket's level (whole units, below zero in debt) and the ms until it is full; 0 and 0 without
-- one.
local function bucket(level, cap, rate)
  if cap <= 0 then
    return 0, 0
  end
  return floor(level), ceil(max(0, cap - level) / rate)
end

local out = {}
for i = 2, #KEYS do
  local l = scope_limits(ARGV, FIRST_ARG + (i - 2) * 10 - 1)
  local s = read_scope(KEYS[i], l, now, at)
  local h = held[KEYS[i]] or {}
  local tokens, tokens_full = bucket(s.t, s.tcap, s.trate)
  local requests, requests_full = bucket(s.r, s.rcap, s.rrate)
  local input, input_full = bucket(s.pt, s.pcap, s.prate)
  local output, output_full = bucket(s.gt, s.gcap, s.grate)
  local budgets = {}
  for _, c in ipairs(COUNTERS) do
    if l.budgets[c] or c == 'du' or c == 'dc' or c == 'mu' or c == 'mc' then
      budgets[#budgets + 1] = c
      budgets[#budgets + 1] = s.used[c] or 0
      budgets[#budgets + 1] = h[c] or 0
      budgets[#budgets + 1] = period_ends(string.sub(c, 1, 1), at, now, offset)
    end
  end
  out[#out + 1] = { tokens, tokens_full, requests, requests_full, s.c, input, input_full, output, output_full, budgets }
end
return out
