-- common.lua: helpers shared by every phase. scripts.rs prepends this file to each phase script, so
-- each phase is still one script, run atomically, and the helpers exist once.
--
-- Reservation record (a hash, one per reservation, key built by keys.rs):
--   st  state: reserved | committed | released | expired | late_committed
--   h   tokens held at admission            ch  tokens currently charged to the buckets
--   sl  1 while the hold occupies a concurrency slot in every scope
--   le  lease expiry (ms, Redis clock)      at  attempts (idempotent replays + 1)
--   dy  day number (UTC) the hold was charged to
--   ks  the scope hashes it charged, space separated
--   xp  expired-usage policy: charge | refund
--   ik  idempotency key name, or empty      rt  retention (ms) once settled
--   pt ot us rf ov  commit result: prompt, output, used, refunded, overrun tokens
--   ok  output-estimate hash commit teaches (empty: the tenant does not learn)
--   oq  the quantile that estimate tracks
--
-- Scope hash (one per tenant / user / model scope):
--   t tt tc  token bucket: tokens, last refill (ms), capacity
--   r rt     request bucket: permits, last refill (ms)
--   c        holds in flight
--   d du     day number and tokens charged that day

local DAY_MS = 86400000

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function split(s)
  local out = {}
  for w in string.gmatch(s, '%S+') do
    out[#out + 1] = w
  end
  return out
end

local RECORD_FIELDS = { 'st', 'h', 'ch', 'sl', 'le', 'at', 'dy', 'ks', 'xp', 'ik', 'rt', 'pt', 'ot', 'us', 'rf', 'ov',
  'ok', 'oq' }

-- Reads a record into a table; returns nil when it does not exist.
local function load(rk)
  local v = redis.call('HMGET', rk, unpack(RECORD_FIELDS))
  if not v[1] then
    return nil
  end
  local r = {}
  for i, f in ipairs(RECORD_FIELDS) do
    r[f] = v[i]
  end
  r.h = tonumber(r.h)
  r.ch = tonumber(r.ch)
  r.le = tonumber(r.le)
  r.at = tonumber(r.at)
  r.dy = tonumber(r.dy)
  r.rt = tonumber(r.rt)
  return r
end

-- Frees the concurrency slot a hold occupies in each of its scopes.
local function free_slots(keys)
  for _, k in ipairs(keys) do
    local c = tonumber(redis.call('HGET', k, 'c'))
    if c and c > 0 then
      redis.call('HSET', k, 'c', c - 1)
    end
  end
end

-- Gives tokens back: to each token bucket (never above its capacity), and to the day's usage when
-- the hold was charged to the current day.
local function refund(keys, amount, day)
  if amount <= 0 then
    return
  end
  for _, k in ipairs(keys) do
    local v = redis.call('HMGET', k, 't', 'tc', 'd', 'du')
    if v[1] then
      local t = tonumber(v[1]) + amount
      local cap = tonumber(v[2])
      if cap and t > cap then
        t = cap
      end
      redis.call('HSET', k, 't', t)
    end
    if v[3] and tonumber(v[3]) == day then
      local du = tonumber(v[4]) - amount
      if du < 0 then
        du = 0
      end
      redis.call('HSET', k, 'du', du)
    end
  end
end

-- Charges tokens beyond the hold as debt: a bucket may go negative, down to minus its capacity, and
-- the debt is repaid by refill (it shows in the next Retry-After). A scope hash that has already
-- expired (idle longer than its TTL) is not recreated: an idle bucket is full anyway.
local function charge(keys, amount, now)
  if amount <= 0 then
    return
  end
  local today = math.floor(now / DAY_MS)
  for _, k in ipairs(keys) do
    local v = redis.call('HMGET', k, 't', 'tc', 'd', 'du')
    if v[1] then
      local t = tonumber(v[1]) - amount
      local cap = tonumber(v[2])
      if cap and t < -cap then
        t = -cap
      end
      redis.call('HSET', k, 't', t)
    end
    if v[3] and tonumber(v[3]) == today then
      redis.call('HSET', k, 'du', tonumber(v[4]) + amount)
    elseif v[3] then
      redis.call('HSET', k, 'd', today, 'du', amount)
    end
  end
end

-- Ends a record's hold: off the lease index, its idempotency key dropped, kept for `rt` ms so that
-- a repeated commit or release can still be answered.
local function close(rk, id, r, leases)
  redis.call('ZREM', leases, id)
  if r.ik and r.ik ~= '' and redis.call('GET', r.ik) == id then
    redis.call('DEL', r.ik)
  end
  redis.call('PEXPIRE', rk, r.rt)
end

-- Settles a hold whose lease ran out: the slot is freed; the tokens stay charged (charge) or come
-- back (refund). Missing usage is not zero usage, so charge is the default policy.
local function expire(rk, id, r, leases)
  local keys = split(r.ks)
  if r.sl == '1' then
    free_slots(keys)
  end
  if r.xp == 'refund' then
    refund(keys, r.ch, r.dy)
    r.ch = 0
  end
  r.st = 'expired'
  r.sl = '0'
  redis.call('HSET', rk, 'st', 'expired', 'sl', 0, 'ch', r.ch)
  close(rk, id, r, leases)
end

-- Loads a hold that is still live. Otherwise returns nil and the reply to send: not_found, the
-- state it was settled in, or expired (settling it now when its lease has passed unswept).
local function live_hold(rk, id, leases, now)
  local r = load(rk)
  if not r then
    return nil, { 'not_found', 0 }
  end
  if r.st ~= 'reserved' then
    return nil, { r.st, 0 }
  end
  if now >= r.le then
    expire(rk, id, r, leases)
    return nil, { 'expired', 0 }
  end
  return r
end

-- Pool state hash (one per backend pool, its own hash tag):
--   n  holds outstanding      w  their predicted slot time (ms)      kv  their KV-cache tokens
-- Pool holds hash: reservation id -> "<work> <kv>".

-- Takes one hold off a pool, exactly as it was added; returns its work, or nil if the pool does
-- not hold it (already released, or swept after its lease).
local function pool_drop(state, holds, leases, id)
  local h = redis.call('HGET', holds, id)
  redis.call('ZREM', leases, id)
  if not h then
    return nil
  end
  local parts = split(h)
  local work, kv = tonumber(parts[1]), tonumber(parts[2])
  redis.call('HDEL', holds, id)
  local v = redis.call('HMGET', state, 'n', 'w', 'kv')
  redis.call('HSET', state, 'n', math.max(0, (tonumber(v[1]) or 0) - 1), 'w',
    math.max(0, (tonumber(v[2]) or 0) - work), 'kv', math.max(0, (tonumber(v[3]) or 0) - kv))
  return work
end

-- Output-length estimate (one hash per tenant and model, learned from commits):
--   n     samples (halved whenever it passes the window, so the estimate follows drift)
--   b<i>  samples whose output fell in bucket i: (1.05^(i-1), 1.05^i] tokens; b0 holds 0 and 1
--   q     the tracked quantile, as the upper edge of its bucket (rounding up: a hold errs large)
--   us ov all tokens used, and all tokens used beyond their hold, since the estimate began

local GROWTH = 1.05

local function bucket_of(tokens)
  if tokens <= 1 then
    return 0
  end
  return math.ceil(math.log(tokens) / math.log(GROWTH) - 1e-9)
end

-- Teaches the estimate one output length, and recomputes its quantile.
local function learn(key, output, used, overrun, quantile, window, ttl)
  redis.call('HINCRBY', key, 'b' .. bucket_of(output), 1)
  local n = redis.call('HINCRBY', key, 'n', 1)
  redis.call('HINCRBY', key, 'us', used)
  redis.call('HINCRBY', key, 'ov', overrun)
  local flat = redis.call('HGETALL', key)
  local buckets = {}
  for i = 1, #flat, 2 do
    if string.sub(flat[i], 1, 1) == 'b' then
      buckets[#buckets + 1] = { tonumber(string.sub(flat[i], 2)), tonumber(flat[i + 1]) }
    end
  end
  if n > window then
    n = 0
    for _, b in ipairs(buckets) do
      b[2] = math.floor(b[2] / 2)
      if b[2] == 0 then
        redis.call('HDEL', key, 'b' .. b[1])
      else
        redis.call('HSET', key, 'b' .. b[1], b[2])
      end
      n = n + b[2]
    end
    redis.call('HSET', key, 'n', n)
  end
  table.sort(buckets, function(x, y)
    return x[1] < y[1]
  end)
  local need, seen, q = quantile * n, 0, 1
  for _, b in ipairs(buckets) do
    seen = seen + b[2]
    q = math.ceil(GROWTH ^ b[1] - 1e-9)
    if seen >= need then
      break
    end
  end
  redis.call('HSET', key, 'q', q)
  redis.call('PEXPIRE', key, ttl)
end
