-- pool_reserve.lua: the capacity leg of admission. Settles a bounded batch of the pool's expired
-- holds, predicts when the new request would start and finish, and either refuses it or holds its
-- work. Runs before the tenant leg (reserve.lua), so a tenant is never charged for a request the
-- pool refuses; see src/admission/reserve.rs for the ordering across the two key spaces.
--
-- KEYS[1] the pool's state hash
-- KEYS[2] the pool's holds hash
-- KEYS[3] the pool's lease index
--
-- ARGV[1]  reservation id
-- ARGV[2]  work: this request's predicted slot time (ms)
-- ARGV[3]  KV-cache tokens this request holds (prompt + output)
-- ARGV[4]  lease (ms)                 ARGV[5] idle TTL of the pool's keys (ms)
-- ARGV[6]  sweep batch                ARGV[7] slots of the whole pool
-- ARGV[8]  slots this request's tier may fill before it queues
-- ARGV[9]  max queue delay (ms)
-- ARGV[10] KV tokens this tier may fill (0: the pool sets no KV limit)
-- ARGV[11] deadline, ms from now (0: none)
-- ARGV[12] recovery per ms of the share its provider's 429s left (see pool_throttle.lua)
-- ARGV[13] finish: this request's own predicted slot time when it runs long (ms), which its
--          deadline is judged by (the work held, ARGV[2], is what it takes on average)
-- ARGV[14] tier (critical | standard | sheddable)
-- ARGV[15] tenant                     ARGV[16] the tenant's weight in its tier (thousandths)
--
-- Reply, admitted: {1, predicted start delay ms, holds outstanding, work outstanding (ms)}
--   (run twice with the same id, as a client re-sending after a lost reply does, the second run
--    finds the hold and answers with the pool as it stands: the work is held once)
-- Reply, denied:   {0, reason, retry after ms, predicted start delay ms}
--   reason: deadline | queue_full | throttled (the provider's Retry-After has not passed) |
--           fair_share (the tier is contended and the tenant holds its share of it already)
--
-- The model, fluid and conservative: the pool drains outstanding work at one slot-ms per slot per
-- ms. A request starts at once while fewer holds than slots are outstanding, otherwise after the
-- outstanding work spread over the slots: ceil(w / slots). A tier sees only its share of the slots,
-- so lower tiers queue (and are refused) first and the rest is headroom they cannot borrow. Work
-- leaves the pool when its hold is committed, released or expires, and as a live stream reports
-- its progress (pool_progress.lua), never by time alone.
-- While the provider behind the pool refuses (429), the pool counts as only the share of its slots
-- that pool_throttle.lua left it.
--
-- Fair shares within a tier: while a request would queue at its tier (the tier is contended), a
-- tenant that already holds work there may hold at most its weight's share of the tier's work
-- (its weight over the weights of every tenant holding work there, itself included); past it the
-- request is refused, so the tier's slots go to the tenants below their share, whatever each
-- sends. A tenant holding nothing at the tier is always let in (up to the tier's queue), and an
-- uncontended tier admits everyone: the pool never idles for fairness' sake.

local state, holds, leases = KEYS[1], KEYS[2], KEYS[3]
local id = ARGV[1]
local work = tonumber(ARGV[2])
local kv = tonumber(ARGV[3])
local lease = tonumber(ARGV[4])
local idle = tonumber(ARGV[5])
local batch = tonumber(ARGV[6])
local slots = tonumber(ARGV[7])
local tier_slots = tonumber(ARGV[8])
local max_delay = tonumber(ARGV[9])
local tier_kv = tonumber(ARGV[10])
local deadline = tonumber(ARGV[11])
local recover = tonumber(ARGV[12])
local finish = tonumber(ARGV[13])
local tier, tenant, weight = ARGV[14], ARGV[15], tonumber(ARGV[16])

local now = now_ms()

-- 0. A re-sent call: this id already holds its work.
if redis.call('HGET', holds, id) then
  local v = redis.call('HMGET', state, 'n', 'w')
  return { 1, 0, tonumber(v[1]) or 0, tonumber(v[2]) or 0 }
end

-- 1. Expiry: holds whose lease ran out leave the pool, a bounded batch at a time.
for _, due in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, batch)) do
  pool_drop(state, holds, leases, due)
end

-- 2. Predict; nothing is written yet.
local v = redis.call('HMGET', state, 'n', 'w', 'kv', 'tf', 'tt', 'tu')
local n, w, used_kv = tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0
local resume = tonumber(v[6]) or 0
if now < resume then
  return { 0, 'throttled', resume - now, 0 }
end
local share = pool_share(v[4], v[5], recover, now)
if share < 1 then
  slots = math.max(1, math.floor(slots * share))
  tier_slots = math.max(1, math.floor(tier_slots * share))
end

local function start_delay(over_slots)
  if n < over_slots then
    return 0
  end
  return math.ceil(w / over_slots)
end

local delay = start_delay(slots)
if deadline > 0 and delay + finish > deadline then
  return { 0, 'deadline', 0, delay }
end
if start_delay(tier_slots) > max_delay then
  -- Until the pool, draining at its full rate, is down to what this tier may queue behind.
  return { 0, 'queue_full', math.max(1, math.ceil((w - max_delay * tier_slots) / slots)), delay }
end
if n >= tier_slots then
  local tier_work, weights, mine, my_weight, my_holds = fair_read(state, tier, tenant, weight)
  if my_holds > 0 then
    local fair = my_weight / math.max(weights, my_weight) * (tier_work + work)
    if mine + work > fair then
      return { 0, 'fair_share', math.max(1, math.ceil((mine + work - fair) / tier_slots)), delay }
    end
  end
end
if tier_kv > 0 and used_kv + kv > tier_kv then
  return { 0, 'queue_full', math.max(1, math.ceil(w / slots)), delay }
end

-- 3. Hold (its tenant's share first: it reads before it writes, so nothing is half written).
fair_add(state, tier, tenant, weight, work, 1)
redis.call('HSET', state, 'n', n + 1, 'w', w + work, 'kv', used_kv + kv)
-- Integers, never `..` on numbers: Lua prints those with 14 digits, and a hold must leave the
-- pool exactly as it came.
redis.call('HSET', holds, id, string.format('%d %d %s %s', work, kv, tier, tenant))
redis.call('ZADD', leases, now + lease, id)
for _, k in ipairs(KEYS) do
  keep_for(k, idle)
end
return { 1, delay, n + 1, w + work }
