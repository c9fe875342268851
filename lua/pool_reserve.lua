-- pool_reserve.lua: the capacity leg of admission. Settles a bounded batch of the pool's expired
-- holds, predicts when the new request would start and finish, and either refuses it or holds its
-- work. Runs before the tenant leg (reserve.lua), so a tenant is never charged for a request the
-- pool refuses; see src/admission/reserve.rs for the ordering across the two key spaces.
--
-- KEYS[1] the pool's state hash
-- KEYS[2] the pool's holds hash
-- KEYS[3] the pool's lease index
-- KEYS[4] the pool's waiting hash   KEYS[5..7] the tenants' finish tags at its critical, standard and
--                                   sheddable tiers (common.lua, "Waiting for a slot")
-- KEYS[8] the pool's provider scope (common.lua; read where the pool sets provider limits)
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
-- ARGV[17] where the pool queues: backend (admitted requests queue at the backend) | tollgate
--          (a request that cannot start at once waits here for a slot, in order)
-- ARGV[18] how long the caller may still wait for its slot (ms), queueing in tollgate
-- ARGV[19] waiter TTL: how long (ms) a waiting place lives without its caller's next call
-- then, only where the pool sets provider limits, fifteen: the tier's part of the provider's
--   limits (thousandths: the rest is headroom for the tiers above it), prompt tokens, output
--   tokens held, cost (nanos) of both, the provider scope's idle TTL (ms: the pool's idle TTL, or
--   longer where a full refill of its buckets, or its longest budget's period and a day, is), and
--   the provider's limits as a scope's ten (common.lua's scope_limits): token capacity, tokens per
--   ms, request capacity, requests per ms, max concurrency (unused), input token capacity, input
--   tokens per ms, output token capacity, output tokens per ms, period budgets
--
-- Reply, admitted: {1, predicted start delay ms, holds outstanding, work outstanding (ms)}
--   (run twice with the same id, as a client re-sending after a lost reply does, the second run
--    finds the hold and answers with the pool as it stands: the work is held once)
-- Reply, waiting:  {2, predicted start delay ms, holds outstanding, work outstanding (ms)}: call
--   again (same id) to take the slot when it comes; pool_release.lua gives the place up
-- Reply, denied:   {0, reason, retry after ms (0: no wait helps), predicted start delay ms, 1 when
--   no time can be predicted (the retry is then the soonest it could be, 0 when nothing bounds it:
--   the caller backs off at least that long)}
--   reason: deadline | queue_full | throttled (the provider's Retry-After has not passed) |
--           fair_share (the tier is contended and the tenant holds its share of it already) |
--           provider:<limit> (the provider's limits, as the tier may use them, cannot take the
--           request yet: provider:token_rate, provider:input_rate, provider:output_rate,
--           provider:request_rate, provider:budget:<counter>, with the wait; or
--           provider:unsatisfiable, larger than the tier's share of one of them could ever be)
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
-- Each hold keeps its predicted end (admission + predicted start + its work; a live stream's
-- progress moves it to then + the work it has left; either with common.lua's pool_ends margin). A refusal's retry is the earliest time at
-- which the same request, sent again with nothing else arriving, would be admitted by the checks
-- below: the pool's holds leaving at their predicted ends (the work each holds counts in full
-- until then), its share recovering, the provider's buckets refilling. A hold already past its
-- predicted end (or one with none) ends when nobody can say: a retry that waits on one is not
-- predicted, and the reply says so (the caller backs off).
--
-- The provider's limits (ARGV[20] on, where the pool sets them): the account's token, request and side rates and its period
-- budgets, shared by every tenant whose model this pool serves, kept in a scope hash of the
-- pool's own (KEYS[8]) and read, checked and taken as a tenant's scope is (common.lua). They are
-- checked once the pool would start or queue the request, atomically with its hold, and taken
-- with it: a request waiting in tollgate's queue holds none of them. A tier below critical sees
-- only its share of each (its share of the bucket, counted from the top: what the tiers above keep
-- is never its to take; its share of a budget), as with slots; while the provider's 429s throttle
-- the pool, every bucket refills at that share of its rate: the tighter of the two wins. The
-- hold's charge is kept beside it (`<id>+`) and settled when it leaves (pool_release.lua).
--
-- Fair shares within a tier: while a request would queue at its tier (the tier is contended), a
-- tenant that already holds work there may hold at most its weight's share of the tier's work
-- (its weight over the weights of every tenant holding work there, itself included); past it the
-- request is refused, so the tier's slots go to the tenants below their share, whatever each
-- sends. A tenant holding nothing at the tier is always let in (up to the tier's queue), and an
-- uncontended tier admits everyone: the pool never idles for fairness' sake.
--
-- Queueing in tollgate (ARGV[17] tollgate): the backend is never given more requests than a tier
-- may run. A request starts at once while its tier has a free slot that nobody waiting before it
-- will take (holds + those waiting before it < the tier's slots, and the tier's KV room); otherwise
-- it waits here, and each call answers again. Order: higher tiers first; within a tier, the tenant
-- with the earlier start tag (start-time fair queueing by tenant, a virtual token counter: see
-- common.lua, "Waiting for a slot"), then arrival. Its predicted start: as many holds as must end before it
-- (holds + those before it - the tier's slots + 1): the holds end at their predicted ends (one past
-- its end, at once), and each request before it, once started, holds its slot for its work.
-- Refused when that start (plus its finish) passes its deadline, or passes what the caller may
-- still wait (queue_full); the retry is then when, sent again, it would wait no longer than that.
-- Fair shares by held work (above) apply only to a pool that queues at the backend: in tollgate
-- the order is the share.

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
local in_tollgate = ARGV[17] == 'tollgate'
local wait, waiter_ttl = tonumber(ARGV[18]) or 0, tonumber(ARGV[19]) or 0
local waiting, rank = KEYS[4], TIER_RANK[tier]
local tags = KEYS[5 + rank]
-- (A tier's part of the provider's limits, and below the throttle's share of the pool: two
-- different fractions.)
local tier_part = (tonumber(ARGV[20]) or 0) / 1000

local now = now_ms()

-- 0. A re-sent call: this id already holds its work.
if call('HGET', holds, id) then
  call('HDEL', waiting, id)
  local v = call('HMGET', state, 'n', 'w')
  return { 1, 0, tonumber(v[1]) or 0, tonumber(v[2]) or 0 }
end

-- 1. Expiry: holds whose lease ran out leave the pool, a bounded batch at a time.
for _, due in ipairs(call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, batch)) do
  pool_drop(KEYS, due)
end

-- 2. Predict; nothing is written yet.
local v = call('HMGET', state, 'n', 'w', 'kv', 'tf', 'tt', 'tu')
local n, w, used_kv = tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0
local resume = tonumber(v[6]) or 0
-- A refusal: this request's place, if it had one, is given up; and a pool left with nobody (its
-- place gone, or expired places read away) forgets, as pool_drop's does.
-- `retry` nil: no time can be predicted, and `at_least` (ms, when given) is as soon as it could be.
local function refuse(reason, retry, delay, at_least)
  call('HDEL', waiting, id)
  pool_forget_if_idle(KEYS, n)
  if not retry then
    return { 0, reason, at_least or 0, delay, 1 }
  end
  return { 0, reason, retry, delay, 0 }
end
-- The slots of the pool and of this request's tier `at` ms from now, as the throttle's share
-- recovers.
local all_slots, all_tier_slots = slots, tier_slots
local function slots_at(at)
  local share = pool_share(v[4], v[5], recover, now + at)
  if share < 1 then
    return max(1, floor(all_slots * share)), max(1, floor(all_tier_slots * share))
  end
  return all_slots, all_tier_slots
end
local share = pool_share(v[4], v[5], recover, now)
slots, tier_slots = slots_at(0)

-- The provider's limits, read (nothing written): the scope, the tier's part of it, and what this
-- request would take from them. While the throttle holds the pool below its whole, every bucket
-- refills at that share of its rate.
local provider, provider_part, provider_n, provider_at = nil, nil, nil, nil
if tier_part > 0 then
  local l = scope_limits(ARGV, 24)
  l.trate, l.rrate, l.prate, l.grate = l.trate * share, l.rrate * share, l.prate * share, l.grate * share
  provider_at = periods_at(now, 0)
  provider = read_scope(KEYS[8], l, now, provider_at)
  provider_part = scope_part(provider, tier_part)
  local p, g = tonumber(ARGV[21]), tonumber(ARGV[22])
  provider_n = amounts(p + g, tonumber(ARGV[23]), p, g)
end

-- What the provider's limits say to this request: nil when they can take it now; else the limit
-- that frees last and when (ms), or 'unsatisfiable' (larger than the tier's part of one could
-- ever be). `budgets_only`: a request about to wait for a slot, refused only for what no wait for
-- a slot helps (that, or a spent budget); its rates are checked when it starts. (Validation
-- leaves every tier at least one request a minute.)
local function provider_wait(budgets_only)
  if not provider then
    return nil
  end
  local part, ask = provider_part, provider_n
  if never_fits(part, ask) then
    return 'unsatisfiable', 0
  end
  local limit, retry = nil, 0
  check_scope(part, ask, 1, 0, leases, holds, 0, now, provider_at, 0, function(why, ms)
    ms = max(1, ceil(ms))
    local counts = not budgets_only or string.sub(why, 1, 7) == 'budget:'
    if counts and ms > retry then
      limit, retry = why, ms
    end
  end)
  return limit, retry
end

-- The provider's refusal of this request (`delay`: its predicted start), or nil when its limits
-- can take it now.
local function provider_refusal(delay, budgets_only)
  local limit, retry = provider_wait(budgets_only)
  if limit then
    return refuse('provider:' .. limit, retry, delay)
  end
  return nil
end

-- The pool's holds by their predicted ends: those still ahead of them ({id, work, kv, tier,
-- tenant, ends}, sorted by end, then id), and how many are past their end or have none (`late`:
-- when they end, nobody can say).
local function holds_by_end()
  local all, ahead, late = call('HGETALL', holds), {}, 0
  for i = 1, #all, 2 do
    local key = all[i]
    if string.sub(key, -1) ~= '+' then
      local p = split(all[i + 1])
      local ends = tonumber(p[6])
      if ends and ends > now then
        ahead[#ahead + 1] = { id = key, work = tonumber(p[1]), kv = tonumber(p[2]), tier = p[3], tenant = p[4],
          ends = ends }
      else
        late = late + 1
      end
    end
  end
  table.sort(ahead, by_then_id('ends'))
  return ahead, late
end

-- When a request starts (ms from now) behind `held` holds of `held_work` ms over `over` slots:
-- at once while a slot is free, else after the work spread over them.
local function start_over(held, held_work, over)
  if held < over then
    return 0
  end
  return ceil(held_work / over)
end

-- Queueing in tollgate: when this request would start (ms from now) behind `before` (the works of
-- the requests waiting before it, in their order), with `free` slots of its tier free now, as
-- `late` holds end now and those `ahead` at their ends, and each request before it, once started,
-- holds its slot for its work. Nil when more holds must end than that.
local function start_behind(ahead, late, before, free)
  local heap, at = {}, now
  for _ = 1, late do
    heap_push(heap, now)
  end
  for _, h in ipairs(ahead) do
    heap_push(heap, h.ends)
  end
  local function slot()
    while free <= 0 do
      local e = heap_pop(heap)
      if not e then
        return false
      end
      at, free = max(at, e), free + 1
    end
    free = free - 1
    return true
  end
  for _, before_work in ipairs(before) do
    if not slot() then
      return nil
    end
    heap_push(heap, pool_ends(at, before_work))
  end
  if not slot() then
    return nil
  end
  return at - now
end

-- Holds this request's work: its tenant's share first (it reads before it writes, so nothing is
-- half written), then the pool, then, queueing in tollgate, its tenant's finish tag and its tier's
-- virtual time (`start`: its start tag).
local function hold(delay, start)
  fair_add(state, tier, tenant, weight, work, 1)
  call('HSET', state, 'n', n + 1, 'w', w + work, 'kv', used_kv + kv)
  -- Integers, never `..` on numbers: Lua prints those with 14 digits, and a hold must leave the
  -- pool exactly as it came.
  call('ZADD', leases, now + lease, id)
  -- Queueing in tollgate, its cost (0 otherwise): a release of a request that never ran takes it
  -- back off the tag. Then its predicted end.
  local cost = start and cost_of(work, weight) or 0
  local entry = string.format('%d %d %s %s %d %d', work, kv, tier, tenant, cost, pool_ends(now, delay + work))
  if provider then
    local idle_ms = tonumber(ARGV[24])
    take(provider, provider_n, 1, 0, provider_at, now, idle_ms)
    local charge = provider_charge(provider_n, provider_at, idle_ms, provider, charged_counters({ provider }))
    call('HSET', holds, id, entry, id .. '+', charge)
  else
    call('HSET', holds, id, entry)
  end
  if start then
    call('HDEL', waiting, id)
    local finish_tag = start + cost
    local had = tonumber(call('ZSCORE', tags, tenant)) or 0
    call('ZADD', tags, max(had, finish_tag), tenant)
    local virtual = tonumber(call('HGET', state, 'v' .. tier)) or 0
    if start > virtual then
      call('HSET', state, 'v' .. tier, start)
      for _, t in ipairs(call('ZRANGEBYSCORE', tags, '-inf', start, 'LIMIT', 0, batch)) do
        call('ZREM', tags, t)
      end
    end
  end
  for i = 1, 7 do
    keep_for(KEYS[i], idle)
  end
  return { 1, delay, n + 1, w + work }
end

if in_tollgate then
  if now < resume then
    return refuse('throttled', resume - now, 0)
  end
  -- Who waits before this request: every live entry of a higher tier (in order of tier, then
  -- arrival), then each of its own tier with an earlier start tag (then arrival, then id).
  -- Its place, unless it lapsed (its caller did not ask again in time): then it starts anew.
  local mine = split(call('HGET', waiting, id) or '')
  local kept = mine[5] and tonumber(mine[5]) > now
  local me = { id = id, rank = rank, tenant = tenant, work = work, weight = weight,
    arrival = kept and tonumber(mine[4]) or now }
  local others, same = {}, { me }
  for _, e in ipairs(waiters_of(waiting, now)) do
    if e.id ~= id and e.rank <= rank then
      others[#others + 1] = e
      if e.rank == rank then
        same[#same + 1] = e
      end
    end
  end
  start_tags(same, tags, tonumber(call('HGET', state, 'v' .. tier)) or 0)
  -- The order they start in: tier, then (its own tier's) start tag, then arrival and id.
  local function starts_first(a, b)
    if a.rank ~= b.rank then
      return a.rank < b.rank
    end
    if a.rank == rank and a.start ~= b.start then
      return a.start < b.start
    end
    if a.arrival ~= b.arrival then
      return a.arrival < b.arrival
    end
    return a.id < b.id
  end
  local before = {}
  for _, e in ipairs(others) do
    if starts_first(e, me) then
      before[#before + 1] = e
    end
  end
  local before_work = 0
  for _, e in ipairs(before) do
    before_work = before_work + e.work
  end
  -- More KV than its tier may ever hold: no wait would help.
  if tier_kv > 0 and kv > tier_kv then
    return refuse('queue_full', 0, 0)
  end
  local kv_room = tier_kv == 0 or used_kv + kv <= tier_kv
  local starts = n + #before < tier_slots and kv_room
  -- Where it cannot start: the holds by their ends, and the works of those before it in the order
  -- they start.
  local ahead, late, before_works = nil, 0, {}
  -- Its predicted start: a hold past its predicted end is taken to end now (each ask looks again).
  -- Short of KV room, not before the first hold ends.
  local delay = 0
  if not starts then
    ahead, late = holds_by_end()
    table.sort(before, starts_first)
    for i, e in ipairs(before) do
      before_works[i] = e.work
    end
    delay = start_behind(ahead, late, before_works, tier_slots - n)
    if delay and not kv_room and late == 0 and ahead[1] then
      delay = max(delay, ahead[1].ends - now)
    end
  end
  -- A refusal's retry: when, sent again, it would wait no longer than it may and finish within its
  -- deadline, its start predicted by the holds still ahead of their ends alone, and not before
  -- they free the KV it needs (nil: it waits on one past its end, or on more holds than the pool
  -- knows ends of; 0: no wait helps).
  local function retry()
    if deadline > 0 and finish > deadline then
      return 0
    end
    local at = start_behind(ahead, 0, before_works, tier_slots - n)
    if at and not kv_room then
      local freed, room = 0, nil
      for _, h in ipairs(ahead) do
        freed = freed + h.kv
        if used_kv - freed + kv <= tier_kv then
          room = h.ends - now
          break
        end
      end
      at = room and max(at, room)
    end
    if not at then
      return nil
    end
    local sent = at
    if wait > 0 then
      sent = at - wait
    end
    if deadline > 0 then
      sent = max(sent, at + finish - deadline)
    end
    return max(1, sent)
  end
  if not delay then
    return refuse('queue_full', nil, 0)
  end
  if deadline > 0 and delay + finish > deadline then
    return refuse('deadline', retry(), delay)
  end
  if starts then
    return provider_refusal(0) or hold(0, me.start)
  end
  local never = provider_refusal(delay, true)
  if never then
    return never
  end
  if delay > wait or wait <= 0 then
    return refuse('queue_full', retry(), delay)
  end
  call('HSET', waiting, id,
    string.format('%d %s %d %d %d %d', rank, tenant, work, me.arrival, now + waiter_ttl, weight))
  keep_for(waiting, idle)
  return { 2, delay, n, w + before_work }
end

-- The weight this tenant holds work at its tier with (fair_read's), once the tier is contended.
local weight_held = weight

-- Queueing at the backend: the checks, on the pool as `p` holds it ({n, w, kv, and for fair shares
-- tw, ws, mine, holds: the tier's work, its weights, this tenant's work and holds there}), `at` ms
-- from now: nil when they admit the request, else why not.
local function refusal_at(p, at)
  local s, ts = slots_at(at)
  if deadline > 0 and start_over(p.n, p.w, s) + finish > deadline then
    return 'deadline'
  end
  if start_over(p.n, p.w, ts) > max_delay then
    -- Past what this tier may queue behind.
    return 'queue_full'
  end
  if p.n >= ts and p.holds > 0 then
    local fair = weight_held / max(p.ws, weight_held) * (p.tw + work)
    if p.mine + work > fair then
      return 'fair_share'
    end
  end
  if tier_kv > 0 and p.kv + kv > tier_kv then
    return 'queue_full'
  end
  return nil
end

-- The earliest time (ms from now, at least `from`) at which the checks admit the request, its
-- holds leaving at their predicted ends and the throttle's share recovering: nil when none (it
-- waits on a hold past its end, or on one the pool knows no end of).
local function earliest(p, from)
  local ahead = holds_by_end()
  local events = { { at = from } }
  for _, h in ipairs(ahead) do
    events[#events + 1] = { at = max(from, h.ends - now), hold = h }
  end
  if recover > 0 and share < 1 then
    -- The moments the share gives the pool, or the tier, a slot more.
    for _, full in ipairs({ all_slots, all_tier_slots }) do
      local s0, at0 = tonumber(v[4]), tonumber(v[5])
      for k = max(1, floor(full * share)) + 1, full do
        local t = max(from, ceil((k / full - s0) / recover - (now - at0)))
        for _ = 1, 3 do
          if floor(full * pool_share(v[4], v[5], recover, now + t)) >= k then
            break
          end
          t = t + 1
        end
        events[#events + 1] = { at = t }
      end
    end
  end
  table.sort(events, function(a, b)
    return a.at < b.at
  end)
  -- The tier's tenants' weights and holds there, for those whose last hold there may leave.
  local weights, counts = {}, {}
  if p.holds > 0 then
    for _, h in ipairs(ahead) do
      if h.tier == tier and not weights[h.tenant] then
        local f = split(call('HGET', state, 'f' .. tier .. ':' .. h.tenant) or '0 0 0')
        weights[h.tenant], counts[h.tenant] = tonumber(f[2]), tonumber(f[3])
      end
    end
  end
  local i = 1
  while i <= #events do
    local at = events[i].at
    while i <= #events and events[i].at == at do
      local h = events[i].hold
      if h then
        p.n, p.w, p.kv = p.n - 1, max(0, p.w - h.work), max(0, p.kv - h.kv)
        if h.tier == tier then
          p.tw = max(0, p.tw - h.work)
          if p.holds > 0 then
            counts[h.tenant] = counts[h.tenant] - 1
            if counts[h.tenant] == 0 then
              p.ws = max(0, p.ws - weights[h.tenant])
            end
          end
          if h.tenant == tenant then
            p.mine, p.holds = max(0, p.mine - h.work), p.holds - 1
          end
        end
      end
      i = i + 1
    end
    if not refusal_at(p, at) then
      return max(1, at)
    end
  end
  return nil
end

local delay = start_over(n, w, slots)
local pool = { n = n, w = w, kv = used_kv, tw = 0, ws = 0, mine = 0, holds = 0 }
if n >= tier_slots then
  pool.tw, pool.ws, pool.mine, weight_held, pool.holds = fair_read(state, tier, tenant, weight)
end
local resumes = max(0, resume - now)
local why = refusal_at(pool, 0)
if resumes > 0 then
  why = 'throttled'
end
if why then
  -- No wait helps: a deadline shorter than its own finish, more KV than its tier may hold, more
  -- than the provider's limits ever take.
  if deadline > 0 and finish > deadline then
    return refuse('deadline', 0, delay)
  end
  if tier_kv > 0 and kv > tier_kv then
    return refuse('queue_full', 0, delay)
  end
  local limit, ms = provider_wait(false)
  if limit == 'unsatisfiable' then
    return refuse('provider:unsatisfiable', 0, delay)
  end
  -- Throttled alone, the pool admits it once the provider's Retry-After passes; else walk the
  -- holds' ends.
  local at = resumes
  if resumes == 0 or refusal_at(pool, resumes) then
    at = earliest(pool, resumes)
  end
  if not at then
    return refuse(why, nil, delay, max(resumes, ms or 0))
  end
  -- Where the provider's limits free later still, theirs is the wait (and the reason).
  if limit and ms > at then
    return refuse('provider:' .. limit, ms, delay)
  end
  return refuse(why, at, delay)
end
return provider_refusal(delay) or hold(delay, nil)
