-- lease.lua: a replica's lease on one tenant's scopes (leasing; see src/admission/lease/). A
-- replica draws slices of a scope's token bucket, request bucket and concurrency slots here, then
-- decides from them in its own memory. What it draws is charged to the scope at once, exactly as
-- holds are, so the scope's counters always include every slice: leasing can refuse a request
-- that a single store would have admitted (while another replica sits on a slice), never admit
-- one it would have refused.
--
-- One call, atomically: settle the tenant's expired holds and dead leases (the sweep); take back
-- what the replica returns; set the slots it holds; then draw, all or nothing against what the
-- request that asked needs. The returns apply whatever the call decides: the replica stopped
-- using them when it sent the call. Slots are stated absolutely.
--
-- Safe to run twice: each call carries the replica's sequence number, and the store keeps what the
-- last call answered (KEYS[6]). A re-send of that call (the client lost its reply) changes nothing
-- and answers as the first run did, so a replica that does not know whether its call ran sends the
-- same call again until it has the answer. The forwarded operations a call hands over are kept
-- with its answer, so a re-send hands them over again: a lost reply delays them, never loses them.
-- (A replica sends a new call only once it has applied the last one's answer.)
--
-- KEYS[1]   the tenant's lease index        KEYS[2] the tenant's holds hash
-- KEYS[3]   this replica's lease record     KEYS[4] operations forwarded to this replica
-- KEYS[5]   the tenant's usage ledger (for holds the sweep settles)
-- KEYS[6]   this replica's last lease call on the tenant: sq (its sequence number), out (what it
--           granted or why it refused), dy (the day it ran on), sw (the holds its sweep settled),
--           op (the forwarded operations it handed over)
-- KEYS[7..] the scope hashes
--
-- ARGV[1] the replica's member in the lease index ('@' .. replica)
-- ARGV[2] record key prefix (for the sweep)       ARGV[3] lease (ms): how long the record lives unrenewed
-- ARGV[4] idle TTL of scope hashes and index (ms)  ARGV[5] sweep batch
-- ARGV[6] cap on the concurrency Retry-After (ms)
-- ARGV[7] end | keep: end drops the record when the replica holds no slot (it is leaving the tenant)
-- ARGV[8] the call's sequence number: a re-send carries the number of the call it repeats
-- ARGV[9] the usage ledger's terms, "<max entries> <retention ms>", or '' when there is none
-- ARGV[10] ledger entries of the leased holds the replica settled since its last call, one a line,
--          fields tab-separated (%, tab and newline written %25, %09, %0A): id, tenant, user,
--          model, tier, outcome, usage, prompt tokens, output tokens, reserved tokens, charged
--          tokens, cost, reserved cost, reserved at, settled at (the replica's clock), then cache
--          reads, cache writes and reasoning tokens ('' or absent when unsaid), how the request
--          ended (absent from a replica from before endings were kept); appended
--          once (a re-send appends nothing), as the scripts that settle store holds append theirs
-- then twenty-eight per scope, in KEYS order:
--   its limits, ten (see common.lua's scope_limits and limits_of: token capacity,
--   tokens per ms, request capacity, requests per ms, max concurrency, input token capacity, input
--   tokens per ms, output token capacity, output tokens per ms, period budgets; leasing takes only
--   tenants with no bucket of one side and no budget but tokens and money per UTC day and month);
--   tokens returned (negative: debt charged), cost returned (nanos; negative: debt charged), the
--   day they were drawn on, earlier tokens returned, earlier cost returned, the earlier day
--   (refunds of holds drawn on an earlier day than the slice's: back to the bucket, and to that
--   day's and month's usage while they are the current ones), tokens charged today, cost charged
--   today (what the replica's holds used of what the scope does not lease, and debt they ran up
--   once the slice's day had passed: charged as debt is), requests returned, slots held after the
--   return (absolute);
--   tokens needed, cost needed, requests needed, slots needed; tokens wanted, cost wanted,
--   requests wanted, slots wanted.
--
-- Reply: {granted (1|0), reason, scope index (1-based), retry after ms, day,
--         remaining tokens, token limit, token reset ms, remaining requests, request limit,
--         request reset ms, {tokens, cost, requests, slots granted per scope}, {id, op, ...}, swept,
--         the store's clock (ms): the replica's slices end with the store's day, not its own)
--   (reason '' when granted; a refusal grants nothing: it writes the returns (a scope they wrote
--    keeps a TTL), the sweep, the record, the ledger entries and its own answer, and takes
--    nothing; the ops are what other replicas forwarded for this replica's holds, now handed over;
--    a re-send answers the first run's grants, day, ops and swept, with the headroom as it is now)

local leases = KEYS[1]
local holds = KEYS[2]
local record = KEYS[3]
local forwarded = KEYS[4]
local member = ARGV[1]
local prefix = ARGV[2]
local lease = tonumber(ARGV[3])
local idle = tonumber(ARGV[4])
local batch = ARGV[5]
local wait_cap = tonumber(ARGV[6])
local ending = ARGV[7] == 'end'
local last_call = KEYS[6]
local seq = ARGV[8]
local FIRST_SCOPE, FIRST_ARG, PER_SCOPE = 7, 11, 28

local now = now_ms()
local at = periods_at(now, 0)
local today = at.d
local n = #KEYS - FIRST_SCOPE + 1

local function read_scopes()
  local scopes = {}
  for i = 1, n do
    local b = FIRST_ARG + (i - 1) * PER_SCOPE - 1
    scopes[i] = read_scope(KEYS[FIRST_SCOPE + i - 1], scope_limits(ARGV, b), now, at)
  end
  return scopes
end

-- The least a scope's limits leave, from {limit, what it leaves} pairs (limit 0: no such limit);
-- nil when none of them limits it.
local function least_left(limits)
  local have = nil
  for _, l in ipairs(limits) do
    if l[1] > 0 then
      have = min(have or math.huge, l[2])
    end
  end
  return have
end

-- 0. A re-send of the last call: its answer again, and nothing changed. An older call still (a
-- first sending that arrived after its re-send was answered and the replica moved on) changes
-- nothing either: nobody waits for its answer.
local last = call('HMGET', last_call, 'sq', 'out', 'dy', 'sw', 'op')
if tonumber(last[1]) and tonumber(seq) < tonumber(last[1]) then
  error('lease: call ' .. seq .. ' is older than the last one answered (' .. last[1] .. ')')
end
if last[1] == seq then
  local day = tonumber(last[3])
  local out = split(last[2])
  local ok, reason, where, wait, granted = 1, '', 0, -1, {}
  if out[1] == 'refused' then
    ok, reason, where, wait = 0, out[2], tonumber(out[3]), tonumber(out[4])
  end
  for i = 1, n do
    local g = {}
    for j = 1, 4 do
      g[j] = tonumber(out[1 + (i - 1) * 4 + j]) or 0
    end
    granted[i] = ok == 1 and g or { 0, 0, 0, 0 }
  end
  local ops = {}
  for line in string.gmatch(last[5] or '', '[^\n]+') do
    ops[#ops + 1] = line
  end
  local rem, lim, reset, rrem, rlim, rreset = headroom(read_scopes(), 0, 0)
  return { ok, reason, where, wait, day, rem, lim, reset, rrem, rlim, rreset, granted, ops,
    split(last[4] or ''), now }
end

-- (A hold without a record is entered under no terms: leasing runs without a ledger.)
local swept = sweep(leases, holds, prefix, batch, now, { key = KEYS[5], terms = '' })
-- Handed over: kept below with this call's answer, for a re-send of it.
local ops = call('HGETALL', forwarded)
if #ops > 0 then
  call('DEL', forwarded)
end

-- 1. Returns. (`touched`: the scopes a write here may have made again, had they run out of their
-- TTL while the replica was away.)
local args = {}
local touched = {}
for i = 1, n do
  local key = KEYS[FIRST_SCOPE + i - 1]
  local b = FIRST_ARG + (i - 1) * PER_SCOPE
  local a = {}
  for j = 0, PER_SCOPE - 1 do
    a[j] = tonumber(ARGV[b + j])
  end
  args[i] = a
  local back_tokens, back_cost, back_day = a[10], a[11], a[12]
  local earlier_tokens, earlier_cost, earlier_day = a[13], a[14], a[15]
  local charge_tokens, charge_cost, back_requests, held = a[16], a[17], a[18], a[19]
  -- What comes back goes to the day it was drawn on, debt to today; tokens and cost may go
  -- different ways (a refund of tokens, debt in money at another price).
  settle({ key }, amounts(-back_tokens, -back_cost, 0, 0), periods_of(back_day), at, now)
  refund({ key }, amounts(earlier_tokens, earlier_cost, 0, 0), periods_of(earlier_day), now)
  charge({ key }, amounts(charge_tokens, charge_cost, 0, 0), at, now)
  if back_requests > 0 and a[2] > 0 then
    give_requests(key, back_requests, a[2], a[3], now)
    touched[i] = key
  end
  local had = tonumber(call('HGET', record, key)) or 0
  if had ~= held then
    local c = tonumber(call('HGET', key, 'c')) or 0
    call('HSET', key, 'c', max(0, c - had + held))
    touched[i] = key
  end
end

-- 2. Read every scope as the returns left it, and check what the asking request needs.
local scopes = read_scopes()
local reason, where, wait = '', 0, -1
for i = 1, n do
  local s = scopes[i]
  local a = args[i]
  check_scope(s, amounts(a[20], a[21], 0, 0), a[22], a[23], leases, holds, wait_cap, now, at, 0, function(why, ms)
    ms = max(1, ceil(ms))
    if ms > wait then
      reason, where, wait = why, i, ms
    end
  end)
end

-- 3. Draw: each scope gives what is wanted, as far as it has it, and never less than is needed.
local granted = {}
local slots = {}
for i, s in ipairs(scopes) do
  local a = args[i]
  local tokens, cost, requests, taken = 0, 0, 0, 0
  if reason == '' then
    local need_tokens, need_cost, need_requests, need_slots = a[20], a[21], a[22], a[23]
    local want_tokens, want_cost, want_requests, want_slots = a[24], a[25], a[26], a[27]
    local left = { u = { { s.tcap, floor(s.t or 0) } }, c = {} }
    for c, limit in pairs(s.l.budgets) do
      local by = left[string.sub(c, 2, 2)]
      if by then
        by[#by + 1] = { limit, limit - s.used[c] }
      end
    end
    local have = least_left(left.u)
    if have then
      tokens = max(need_tokens, min(want_tokens, have))
    end
    have = least_left(left.c)
    if have then
      cost = max(need_cost, min(want_cost, have))
    end
    if s.rcap > 0 then
      requests = max(need_requests, min(want_requests, floor(s.r)))
    end
    if s.cmax > 0 then
      taken = max(need_slots, min(want_slots, s.cmax - s.c))
    end
    take(s, amounts(tokens, cost, 0, 0), requests, taken, at, now, idle)
  end
  granted[#granted + 1] = { tokens, cost, requests, taken }
  slots[i] = a[19] + taken
end

-- A refused call takes nothing, so the take's TTL never comes: a scope the returns made again
-- (it had run out of its TTL) gets the idle TTL here, or it would live forever. (A scope that
-- was there has its TTL: a read, no write.)
if reason ~= '' then
  for _, key in pairs(touched) do
    if call('PTTL', key) == -1 then
      call('PEXPIRE', key, idle)
    end
  end
end

-- 4. The record: the slots this replica holds, renewed for another lease.
local holding = false
for i = 1, n do
  local key = KEYS[FIRST_SCOPE + i - 1]
  if slots[i] > 0 then
    call('HSET', record, key, slots[i])
    holding = true
  else
    call('HDEL', record, key)
  end
end
if ending and not holding and call('HLEN', record) <= 1 then
  call('DEL', record)
  call('ZREM', leases, member)
else
  call('HSET', record, '@', 1)
  call('PEXPIRE', record, idle)
  call('ZADD', leases, now + lease, member)
  -- (An index this call made anew gets its first TTL here: the tenant's scope's `lk` (see
  -- reserve.lua) no longer says how long it lives. The tenant's scope is one of the call's.)
  if keep_for(leases, idle) then
    for i = FIRST_SCOPE, #KEYS do
      call('HDEL', KEYS[i], 'lk')
    end
  end
end

-- 5. The ledger entries of the leased holds the replica settled, under the terms of the call.
if ARGV[9] ~= '' then
  local function unescape(v)
    return (string.gsub(v, '%%(%x%x)', function(h)
      return string.char(tonumber(h, 16))
    end))
  end
  for line in string.gmatch(ARGV[10], '[^\n]+') do
    local f = {}
    for v in string.gmatch(line .. '\t', '([^\t]*)\t') do
      f[#f + 1] = unescape(v)
    end
    local e = { id = f[1], tenant = f[2], user = f[3], model = f[4], tier = f[5], outcome = f[6], usage = f[7],
      prompt = f[8], output = f[9], reserved = f[10], charged = f[11], cost = f[12], reserved_cost = f[13],
      reserved_at = f[14], cache_read = f[16], cache_write = f[17], reasoning = f[18], ending = f[19] }
    ledger_append(KEYS[5], ARGV[9], e, tonumber(f[15]) or now)
  end
end

-- 6. What this call answered, for a re-send of it.
local out
if reason == '' then
  local flat = { 'granted' }
  for _, g in ipairs(granted) do
    -- As integers: Lua's own number format keeps only 14 digits.
    flat[#flat + 1] = string.format('%d %d %d %d', g[1], g[2], g[3], g[4])
  end
  out = table.concat(flat, ' ')
else
  out = 'refused ' .. reason .. ' ' .. where .. ' ' .. wait
end
call('HSET', last_call, 'sq', seq, 'out', out, 'dy', today, 'sw', table.concat(swept, ' '), 'op',
  table.concat(ops, '\n'))
call('PEXPIRE', last_call, idle)

local rem, lim, reset, rrem, rlim, rreset = headroom(scopes, 0, 0)
local ok = 1
if reason ~= '' then
  ok = 0
end
return { ok, reason, where, wait, today, rem, lim, reset, rrem, rlim, rreset, granted, ops, swept, now }
