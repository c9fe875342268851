-- reserve.lua: the admission phase. Settles a bounded batch of the tenant's expired holds, then
-- refills and checks every scope, reading every counter before it mutates any, then holds.
--
-- KEYS[1]   the tenant's lease index (sorted set: reservation id by lease expiry)
-- KEYS[2]   the new reservation record
-- KEYS[3]   the idempotency key (a placeholder of the same tenant when ARGV[5] is empty)
-- KEYS[4]   the output-length estimate of this tenant and model (read when the terms' adaptive samples are above 0)
-- KEYS[5]   the tenant's holds hash (what the sweep needs to settle each live hold)
-- KEYS[6]   the tenant's usage ledger (a stream; see common.lua)
-- KEYS[7..] the scope hashes: tenant first, then user and model where they apply
--
-- ARGV[1]  reservation id            ARGV[2]  record key prefix (prefix .. id = record key)
-- ARGV[3]  prompt tokens             ARGV[4]  output ceiling: the request's max_tokens, or the model's
-- ARGV[5]  what a repeat of the idempotency key means: '' (no key) | same (the caller lost the
--          answer: return its live hold) | new (a retried request: a new attempt, its own hold)
-- ARGV[6]  the request's fingerprint (user, model, size): a key reused for another is refused
-- ARGV[7]  the model the request names (kept on the record: commit reports it)
-- ARGV[8]  the tenant          ARGV[9]  the user ('' when none)          ARGV[10] the tier
-- ARGV[11] the tenant's settled-bucket prefix (prefix .. period number = a bucket; see common.lua)
-- ARGV[12] the hold's terms, what changes only with the policy (and the record form every
--          replica reads), in one string (read once per
--          distinct string: common.lua's parsed_once), space separated, in order:
--            lease (ms); idle TTL of scope hashes, index and live records (ms); how long an
--            expired record waits for a late commit (ms); expired-usage policy, charge | refund;
--            sweep batch, the most expired holds settled by this call; the most reserves one
--            idempotency key may make; cap on the concurrency Retry-After (ms); adaptive output,
--            the samples the estimate needs before it is used (0: always the ceiling); adaptive
--            output, the quantile the estimate tracks (kept on the record for commit); shadow, 1
--            when the tenant's limits are only measured (a request they would refuse is held and
--            charged all the same, and the reply says why it would have been refused); the
--            model's price per input token and per output token (nanos; 0: free); retention of
--            settled records (ms), the period of the settled buckets; the tenant's time zone, its
--            offset from UTC now in minutes east (its budgets' hours, days, weeks and months are
--            numbered in it; kept on the record); the usage ledger's terms, "<max entries>
--            <retention ms>", or "- -" when there is none (kept on the record: the hold is entered
--            under the terms it was made with); the model's terms for weighted tokens, kept on the
--            record for commit, "<cache read weight> <cache write weight> <cache read price>
--            <cache write price> <reasoning weight> <reasoning price>" (thousandths of a whole
--            token; nanos), or six "-" when every token counts whole at its side's price; the
--            form of the record to write, 1 full | 2 compact (every replica sharing the store
--            reads it: see common.lua's load)
-- then one per scope, in KEYS order: the scope's limits, the ten of common.lua's limits_of space
--   separated (token capacity, tokens per ms, request capacity, requests per ms, max concurrency,
--   input token capacity, input tokens per ms, output token capacity, output tokens per ms, 0
--   meaning "no such limit"; then the period budgets, "<counter>:<limit> ...", du:100000 wg:5000,
--   money in nanos), read once per distinct string
--
-- Reply, admitted: {1, id, held, attempts, remaining tokens, token limit, token reset ms,
--                   remaining requests, request limit, request reset ms, output held, estimated,
--                   replayed, sides (six), soft (two), shadow (three), slots left, then the lists}
--   (sides: remaining, limit and reset ms of the tightest bucket of prompt tokens, then of output
--    tokens, each -1 when no scope has one)
--   (soft: the counter of the first soft budget this hold leaves past (an earlier hold answered
--    again: that its scope is past now) and the ms until its period ends, or '' and 0 when none is)
--   (output held: the output part of the hold; estimated: 1 when it came from the estimate;
--    replayed: 1 when an idempotency key returned its earlier live hold, which charged nothing new)
--   (remaining / limit / reset describe the scope with the fewest tokens (requests) left; -1 when no
--    scope limits them)
--   (shadow: '', 0, 0 when the limits admit the hold; else the reason, scope index and retry after
--    ms a denial would have said: a shadowed hold may take a scope past its limit, into debt that
--    later refills repay)
--   (slots left: the fewest concurrency slots a scope capping them has left with this hold, -1 when
--    no scope caps them: the gateway commits at once what frees a slot its tenant is short of)
-- Reply, denied:   {0, reason, scope index (1-based), retry after ms, remaining tokens, token limit,
--                   token reset ms, then the lists}
--   (the lists, ending every reply, flat (a nested table costs Redis more to answer than its
--    fields): the number of scopes; per scope, in KEYS order, what its daily token budget has left
--    after this call, -1 when it has none (the share a replica admits locally should the store
--    become unreachable is a share of what remains); then, to the end, the ids of the expired
--    holds this call settled, whose pool legs the caller takes off their pools)
--   reason: token_rate | input_rate | output_rate | request_rate | concurrency | budget:<counter>
--           | attempts | conflict | unsatisfiable
--   (unsatisfiable: the hold, or its cost, or its prompt or output alone, is larger than a
--    scope's whole capacity or budget, so no wait can help; budget:<counter>: the period budget
--    that counter counts, its retry to the period's end;
--    attempts: the idempotency key has made its most reserves; conflict: the key was first used for
--    a different request)
--
-- Invariants: a denial writes nothing but the settlement of already-expired holds (in shadow,
-- the limits' refusals are not denials: the hold is made); one call either
-- charges every scope or none; a bucket never refills above its capacity. Run twice with the same
-- id (a client re-sending after a lost reply), it answers as the first run did and charges nothing
-- more.

local leases = KEYS[1]
local holds = KEYS[5]
local id = ARGV[1]
local prefix = ARGV[2]
local prompt = tonumber(ARGV[3])
-- (Values written as they came are kept as the strings they came as: Redis would format a number
-- again. The terms a phase uses once are read from `terms` where used: a chunk has at most 200
-- locals, and the embedded store runs common.lua and this file as one, close to that bound at the
-- deepest point of this file: a new local at the top level of either wants one given up there.)
local ceiling = tonumber(ARGV[4])
local key_use = ARGV[5]
local fingerprint = ARGV[6]
local model = ARGV[7]
local tenant, user, tier = ARGV[8], ARGV[9], ARGV[10]
local terms = hold_terms(ARGV[12])
local idle, min_samples, offset = terms.idle, terms.min_samples, terms.offset
local ledger = { key = KEYS[6], terms = terms.ledger, tenant = tenant }
local price_in, price_out = terms.price_in, terms.price_out
local settled = { prefix = ARGV[11], retention = terms.retention }
local FIRST_SCOPE, FIRST_LIMITS = 7, 13

local now = now_ms()
local at = periods_at(now, offset)

-- 0. A re-sent call (its first run made this hold, or was answered with its key's hold) changes
-- nothing, not even the sweep: it answers as the first run did, below, even when the hold has
-- been given back since (only a give-back can settle a hold before its reserve is answered: its
-- note sends the re-send to the settled buckets). (A new id has no record: one field tells,
-- before the whole record is read.)
local mine = nil
local state = call('HGET', KEYS[2], 'st')
if state == SETTLED_NOTE then
  mine = load_settled(id, settled, now)
elseif state then
  mine = load(KEYS[2])
end
local resent = mine ~= nil or (key_use ~= '' and call('HGET', KEYS[3], 'lc') == id)

-- 1. Expiry: settle holds whose lease has run out, a bounded batch at a time.
local swept = {}
if not resent then
  swept = sweep(leases, holds, prefix, terms.batch, now, ledger)
end

-- 2. Read and refill every scope; nothing is written yet.
local scopes = {}
for i = FIRST_SCOPE, #KEYS do
  scopes[#scopes + 1] = read_scope(KEYS[i], packed_scope_limits(ARGV[FIRST_LIMITS + i - FIRST_SCOPE]), now, at)
end

-- `reply` with the lists every reply ends with (see the header), what each scope's daily token
-- budget has left once `taken` more is charged.
local function with_lists(reply, taken)
  local k = #reply + 1
  reply[k] = #scopes
  for i, s in ipairs(scopes) do
    local left = -1
    local budget = s.l.budgets.du or 0
    if budget > 0 then
      left = max(0, budget - s.used.du - taken)
    end
    reply[k + i] = left
  end
  k = k + #scopes
  for i = 1, #swept do
    reply[k + i] = swept[i]
  end
  return reply
end

-- The reply admitting hold `hold_id` (`shadow`: what a denial would have said, or {}), and the
-- windows, slots and budgets as they are once `n` ({u, c, p, g}) and `requests` more (each with
-- its slot) are taken.
local function admitted(hold_id, held, attempts, output_held, estimated, replayed, shadow, n, requests)
  local rem, lim, reset, rrem, rlim, rreset = headroom(scopes, n.u, requests)
  local irem, ilim, ireset, orem, olim, oreset = side_headroom(scopes, n.p, n.g)
  local soft, soft_ends = soft_passed(scopes, n, now, at, offset)
  local slots = -1
  for _, s in ipairs(scopes) do
    if s.cmax > 0 and (slots == -1 or s.cmax - s.c - requests < slots) then
      slots = max(0, s.cmax - s.c - requests)
    end
  end
  return with_lists({ 1, hold_id, held, attempts, rem, lim, reset, rrem, rlim, rreset, output_held, estimated,
    replayed, irem, ilim, ireset, orem, olim, oreset, soft, soft_ends, shadow[1] or '', shadow[2] or 0,
    shadow[3] or 0, slots }, n.u)
end

-- An earlier hold answered again: charges nothing.
local function again(hold_id, r, attempts, replayed)
  return admitted(hold_id, r.h, attempts, tonumber(r.oh) or -1, tonumber(r.es) or 0, replayed, {},
    amounts(0, 0, 0, 0), 0)
end

-- The reply refusing for `reason` in scope `where` (1 when no scope is at fault), `wait` ms
-- until a retry may pass (0: none will).
local function refuse(reason, where, wait)
  local rem, lim, reset = headroom(scopes, 0, 0)
  return with_lists({ 0, reason, where or 1, wait or 0, rem, lim, reset }, 0)
end

-- 3. A re-sent call whose first run made the hold: answer as that run did.
if mine then
  return again(id, mine, mine.at, 0)
end

-- 4. Idempotency. A key groups the reserves made for one request and bounds them; a repeat in
-- `same` mode returns the key's live hold, charging nothing new.
local attempts = 1
if key_use ~= '' then
  local k = call('HMGET', KEYS[3], 'fp', 'n', 'id', 'lc')
  if k[1] then
    if k[1] ~= fingerprint then
      return refuse('conflict')
    end
    local made = tonumber(k[2])
    if key_use == 'same' and k[3] then
      local r = load(prefix .. k[3])
      if r and r.st == 'reserved' and r.le > now then
        if k[4] == id then
          return again(k[3], r, made, 1)
        end
        if made >= terms.attempt_limit then
          return refuse('attempts')
        end
        call('HSET', KEYS[3], 'n', text(made + 1), 'lc', id)
        return again(k[3], r, made + 1, 1)
      end
    end
    if made >= terms.attempt_limit then
      return refuse('attempts')
    end
    attempts = made + 1
  end
end

-- 5. What to hold: the prompt, and for the output either the ceiling or, once the tenant's
-- estimate for this model has enough samples, its quantile (never above the ceiling).
local output, estimated = ceiling, 0
if min_samples > 0 then
  local e = call('HMGET', KEYS[4], 'n', 'q')
  local samples, q = tonumber(e[1]) or 0, tonumber(e[2])
  if samples >= min_samples and q then
    output, estimated = max(1, min(ceiling, q)), 1
  end
end
local hold = prompt + output
local cost = prompt * price_in + output * price_out
local n = amounts(hold, cost, prompt, output)
local would_refuse = {}
for i, s in ipairs(scopes) do
  if never_fits(s, n) then
    if not terms.shadow then
      return with_lists({ 0, 'unsatisfiable', i, 0, -1, -1, -1 }, 0)
    end
    would_refuse = { 'unsatisfiable', i, 0 }
    break
  end
end

-- 6. Decide. Every failing limit is considered; the one that frees last is the reason.
local reason, where, wait = nil, 0, -1
local function deny(why, i, ms)
  ms = max(1, ceil(ms))
  if ms > wait then
    reason, where, wait = why, i, ms
  end
end
if #would_refuse == 0 then
  for i, s in ipairs(scopes) do
    check_scope(s, n, 1, 1, leases, holds, terms.concurrency_wait_cap, now, at, offset, function(why, ms)
      deny(why, i, ms)
    end)
  end
end
if reason and not terms.shadow then
  return refuse(reason, where, wait)
end
if reason then
  would_refuse = { reason, where, wait }
end

-- 7. Hold: charge every scope, write the record, index its lease.
-- The lease index and the holds hash keep their TTL lazily, as a scope does (see lasting): the
-- tenant's scope keeps in `lk` a time before which neither can expire, and only a hold that finds
-- it falling short of the idle TTL from now lengthens theirs (and writes `lk`). A tenant with no
-- live hold before this one (c == 0) may have neither key (the last settlement emptied them, and
-- Redis deleted them): this call makes both and gives them their TTL, which is at least any `lk`
-- an earlier call wrote with the same idle TTL, so `lk` is written only where a reload shortened
-- that. (A key made anew while c > 0 can only be the holds hash beside a replica's lease, and it
-- has no TTL until `lk` falls short; a renew or a lease call that gives the index or the holds
-- hash a TTL it lacked takes `lk` away.)
local first = scopes[1].c == 0
local lk, keys_until = nil, nil
if first then
  keys_until = lasting(nil, tonumber(idle), now)
  if (tonumber(scopes[1].f.lk) or 0) > keys_until then
    lk = keys_until
  end
else
  lk = lasting(scopes[1].f.lk, tonumber(idle), now)
  keys_until = lk
end
local names = {}
local hourly = false
for i, s in ipairs(scopes) do
  take(s, n, 1, 1, at, now, idle, i == 1 and lk or nil)
  names[#names + 1] = s.key
  hourly = hourly or s.used.hu ~= nil or s.used.hc ~= nil or s.used.hp ~= nil or s.used.hg ~= nil
end

local expiry = text(now + terms.lease)
local ik = ''
if key_use ~= '' then
  ik = KEYS[3]
  call('HSET', ik, 'fp', fingerprint, 'n', text(attempts), 'id', id, 'lc', id)
  call('PEXPIRE', ik, text(terms.lease))
end
local learn_into = ''
if min_samples > 0 then
  learn_into = KEYS[4]
end
local ks = table.concat(names, ' ')
local held, output_held, estimate_flag = text(hold), ARGV[4], '0'
if estimated == 1 then
  output_held, estimate_flag = output, '1'
end
local record
local function also(...)
  for _, v in ipairs({ ... }) do
    record[#record + 1] = v
  end
end
if terms.compact then
  -- The terms the record needs in one string, and of what a new hold starts with only what
  -- differs (see load).
  record = { 'st', 'reserved', 'h', held, 'le', expiry, 'dy', text(at.d), 'ks', ks, 'tm', terms.record,
    'oh', output_held, 'md', model }
  if ik ~= '' then
    also('ik', ik)
  end
  if learn_into ~= '' then
    also('ok', learn_into)
  end
  if attempts ~= 1 then
    also('at', text(attempts))
  end
  if estimate_flag ~= '0' then
    also('es', estimate_flag)
  end
else
  record = { 'st', 'reserved', 'h', held, 'ch', held, 'sl', '1', 'le', expiry, 'at', text(attempts), 'dy', text(at.d),
    'ks', ks, 'xp', terms.policy, 'ik', ik, 'rt', terms.late_commit_wait, 'it', idle, 'ok', learn_into,
    'oq', terms.quantile, 'oh', output_held, 'es', estimate_flag, 'md', model }
end
-- Who the hold is for, only where a ledger will enter it; its prices, only where it has any (a
-- record without them reads as free: see load).
if ledger.terms ~= '' then
  also('tn', tenant, 'ur', user, 'tr', tier, 'ra', text(now), 'lg', ledger.terms)
end
if price_in > 0 or price_out > 0 then
  also('pi', text(price_in), 'po', text(price_out), 'hc', text(cost), 'cc', text(cost))
end
if terms.cache ~= '' then
  also('cw', terms.cache)
end
if hourly then
  also('hr', text(at.h))
end
if offset ~= 0 then
  also('zo', text(offset))
end
local kc = charged_counters(scopes)
if kc ~= '' then
  also('kc', kc)
end
call('HSET', KEYS[2], unpack(record))
call('PEXPIRE', KEYS[2], idle)
call('ZADD', leases, expiry, id)
-- The holds hash's entry, and beside it the hold's detail where it has one (one write).
local entry = { id, format('%d %d %s %d %s', hold, at.d, terms.policy, cost, ks) }
local sided = false
for _, s in ipairs(scopes) do
  sided = sided or s.pcap > 0 or s.gcap > 0
end
if kc ~= '' or sided then
  local hour = -1
  if hourly then
    hour = at.h
  end
  entry[3], entry[4] = id .. '+', format('%d %d %s', output, hour, kc)
end
call('HSET', holds, unpack(entry))
if keys_until then
  keep_for(leases, keys_until - now, first)
  keep_for(holds, keys_until - now, first)
end

return admitted(id, hold, attempts, output, estimated, 0, would_refuse, n, 1)
