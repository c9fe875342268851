-- common.lua: helpers shared by every phase. scripts.rs puts this file at the top of the
-- protocol's function library (on Redis: run once, when the library loads, so nothing at its top
-- level may call a library function) and before each phase script (the embedded store), so each
-- phase is still one atomic call, and the helpers exist once.
--
-- Reservation record (a hash, one per reservation, key built by keys.rs):
--   st  state: reserved | committed | released | expired | late_committed
--   h   tokens held at admission            ch  tokens currently charged to the buckets
--   sl  1 while the hold occupies a concurrency slot in every scope
--   le  lease expiry (ms, Redis clock)      at  attempts of its idempotency key when it was made
--   dy  day number the hold was charged to, in its tenant's zone (its week and month are those
--       of that day)         hr  its hour number, when a scope counts hours
--   zo  the zone's offset from UTC when it was made (minutes east; absent: UTC)
--   kc  what it charged beside ALWAYS, per scope (see charged_counters; absent: nothing)
--   ks  the scope hashes it charged, space separated
--   xp  expired-usage policy: charge | refund
--   ik  its idempotency key, or empty       rt  how long it waits for a late commit once expired (ms)
--   it  idle TTL (ms) of the tenant's keys: every phase that touches a hold keeps its keys alive
--   oh  the output part of the hold         es  1 when that came from the output estimate
--   us rf  commit result: tokens used; refunded by a release
--   mx  1 when the commit's counts were metered by tollgate, not reported by the response
--   ok  output-estimate hash commit teaches (empty: the tenant does not learn)
--   oq  the quantile that estimate tracks
--   md  the model the request named
--   pi po  the model's price per input and output token (nanos of the policy's currency)
--   hc  the cost held at admission           cc  the cost currently charged (as h and ch)
--   cw  weighted tokens' terms, "<cache read weight> <cache write weight> <cache read price>
--       <cache write price> <reasoning weight> <reasoning price>" (weights in thousandths of a
--       whole token, prices in nanos); absent: every token whole, at its side's price
--   tn ur tr  the tenant, the user ('' when none) and the tier the request was admitted for
--   ra  when it was reserved (ms)
--   lg  the usage ledger's terms, "<max entries> <retention ms>", or empty when there is none
--   tm  in a compact record, in place of xp, rt, it and oq: those terms at the positions the
--       reserve's terms string has them (reserve.lua's ARGV[12]: 2 it, 3 rt, 4 xp, 9 oq), '-'
--       elsewhere; such a record also leaves out ik and ok when empty, and ch, sl, at
--       and es as a new hold has them (h, 1, 1, 0). A replica of a version before the compact
--       form could not read it (it would find no sl, xp or rt): a reserve writes it only when
--       its terms say every replica sharing the store reads it (heartbeat.lua tells each
--       replica), and load reads both forms.
-- Once committed or released the record is gone: what a repeat is answered with moves to its
-- tenant's settled buckets (below). An expired record keeps every field until its retention (`rt`)
-- passes: a late commit reconciles against it.
-- A hold given back because nobody received its reserve's answer (see release.lua) leaves a note
-- at its record key, the one field `st` = `settled`, until the end of the settled period after
-- the give-back (as long as the entry that give-back files answers): a re-send of that reserve, which
-- may still arrive, looks in the settled buckets only then (see reserve.lua). Every other
-- settlement follows an answer its reserve gave, and the Redis client re-sends a call only before
-- it has answered, so no re-send of that reserve comes after it. A note reads as no record (load).
--
-- Settled buckets (a hash per tenant and period of the settled-record retention R, at
-- `<settled prefix><period number>`, kept until the end of the next period): for every hold
-- committed or released in that period, what a repeated commit, release or renew is answered
-- with, and a re-sent reserve whose hold a give-back settled (see the note above), as one short
-- value (see file_settled). A repeat looks in the current period's
-- bucket and the one before, so a settled hold answers repeats for at least R and at most 2R.
-- One bucket entry costs about a third of a record of its own (no key, no TTL, no field names).
-- Beside the entries, the field `ttl` (never a hold's: those are hex) marks a bucket that has its
-- TTL, so only the filing that makes a bucket sets it (see file_settled).
-- Beside each bucket, `<bucket>e` keeps the endings its entries do not imply (see file_settled).
-- (A repeat after a bucket is gone is a new call: a commit, release or renew answers not_found
-- and changes nothing; a re-sent reserve, which only the Redis client makes and within its
-- command timeout, would make a new hold.)
--
-- Holds hash (one per tenant, beside its lease index, sharing its TTL): for every live hold,
--   id -> "<tokens charged> <day> <expired-usage policy> <cost charged> <scope keys...>"
--   and, for a hold with a bucket of one side or a counter beside ALWAYS,
--   id .. '+' -> "<output part> <hour, -1 when none> <kc>"
-- what the sweep needs to settle the hold. A record can run out of TTL before a sweep that has
-- fallen behind reaches it; its entry here cannot, so no slot and no token is ever left behind.
--
-- Replica lease (a hash, one per tenant and replica, at record prefix .. '@' .. replica; indexed in the
-- lease index under '@' .. replica like a hold): scope key -> concurrency slots the replica holds
-- in that scope, and '@' -> 1 while the replica is there. Tokens and request permits a replica draws are charged to the scopes when drawn;
-- the record only carries what settling a replica that stopped calling takes (see lease.lua).
--
-- Idempotency key (a hash, one per key): fp the request it was first used for (user, model, size),
-- n the reserves it has made, id its latest hold, lc the last call answered with a replay.
--
-- Scope hash (one per tenant / user / model scope):
--   t tt tc tr  token bucket: tokens, last refill (ms), capacity, refill per ms
--   r rt        request bucket: permits, last refill (ms)
--   c           holds in flight
--   pt ptt ptc ptr, gt gtt gtc gtr   buckets of prompt tokens and of output tokens, as t tt tc tr
--   h d w mo    period markers, in the tenant's zone: hour, day, week (from Monday) and month
--               (year x 12 + month - 1) numbers
--   <period><measure>  what the period counted: period h d w m, measure u (tokens), c (cost,
--               nanos), p (prompt tokens), g (output tokens); e.g. du, mc, wg (see PERIODS);
--               written only with its period's marker, never without it (read_scope looks for
--               counters only in the periods that have one)
--   kx          a time before which the hash cannot expire (see lasting)
--   lk          in a tenant's scope: a time before which neither its lease index nor its holds
--               hash can expire (see reserve.lua); absent after a lease call or a renew gave one
--               of them a TTL it lacked
--
-- Usage ledger (a stream, one per tenant, beside its lease index): one entry per settled hold,
-- appended by the very script that settles it, so what billing reads and what the counters
-- charged cannot disagree. Fields:
--   id tenant user model tier   the hold and who it was for
--   cost_nanos reserved_cost_nanos   what the hold charges, and held, in money (nanos)
--   outcome   committed | late_committed | released | expired
--   usage     exact (the response's counts) | metered (counted by tollgate) | held (what the hold
--             charged stands for what was not counted) | none (nothing charged)
--   prompt_tokens output_tokens   what the commit charged for each ('' when not committed)
--   cache_read_tokens cache_write_tokens   of the prompt, what the response said its provider
--             read from its cache and wrote to it (charged at their weights); '' when it did not say
--   reasoning_tokens   of the output, what the response said went to reasoning ('' when it did not)
--   reserved_tokens charged_tokens   the hold, and what the hold charges in the end
--   reserved_at_ms settled_at_ms  (store clock)
--   ending    how the request ended: completed (its counts reported) | metered |
--             metered_capped (metered, held to the most output the request allowed) | as_held |
--             client_left | upstream_refused | upstream_error | released | expired
-- A reservation id appears once, or twice when a commit came after its lease: then the
-- late_committed entry supersedes the expired one.

-- The standard functions the phases call most, as locals. Redis gives a function's calls the
-- standard globals only through the metatable of an empty globals table (a global named in a call
-- costs a missed lookup, a metamethod and a second lookup), and runs a library's top level with
-- none of them in reach: so they are bound when a phase is called (scripts.rs puts `bind()` first).
local function standard()
  return redis.call, tonumber, ipairs, pairs, unpack, math.floor, math.max, math.min, math.ceil, string.format
end
local call, tonumber, ipairs, pairs, unpack, floor, max, min, ceil, format
-- The writes a batch of commits gathers (commit_many.lua, see gather), or nil outside one. (Set
-- back to nil as every phase starts: on Redis the library's locals outlive a call, even one that
-- failed half way.)
local gathered = nil

local function bind()
  if not call then
    call, tonumber, ipairs, pairs, unpack, floor, max, min, ceil, format = standard()
  end
  gathered = nil
end

local DAY_MS = 86400000

-- The UTC calendar month of a day number (days since 1970-01-01), as year x 12 + month - 1; and
-- the day number a month starts on. (Days from and to the civil calendar, after H. Hinnant.)
-- (The last day asked and its month are kept: a phase asks for the same day again and again, and
-- on Redis the library's locals outlive a call. The answer is the arithmetic's either way.)
local last_day, last_month
local function month_of(day)
  if day == last_day then
    return last_month
  end
  local z = day + 719468
  local era = floor(z / 146097)
  local doe = z - era * 146097
  local yoe = floor((doe - floor(doe / 1460) + floor(doe / 36524) - floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + floor(yoe / 4) - floor(yoe / 100))
  local mp = floor((5 * doy + 2) / 153)
  local m = mp + 3
  if mp >= 10 then
    m = mp - 9
  end
  local y = yoe + era * 400
  if m <= 2 then
    y = y + 1
  end
  last_day, last_month = day, y * 12 + m - 1
  return last_month
end

local function month_start(month)
  local y, m = floor(month / 12), month % 12 + 1
  if m <= 2 then
    y = y - 1
  end
  local era = floor(y / 400)
  local yoe = y - era * 400
  local mp = m + 9
  if m > 2 then
    mp = m - 3
  end
  local doy = floor((153 * mp + 2) / 5)
  local doe = yoe * 365 + floor(yoe / 4) - floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- The store's clock as the phase read it, in ms (`ms`), and as text once a command needs it.
local clock = {}
local function now_ms()
  local t = call('TIME')
  clock.ms, clock.text = t[1] * 1000 + floor(t[2] / 1000), nil
  return clock.ms
end

-- A number for redis.call: a whole one as '%d' text, a fraction as it is. (Redis 7.0 writes a
-- number a script gives a command with 17 significant digits, about 2,900 instructions for a
-- time in ms; a time the phase gives several commands, its clock's, is written once.)
local function text(n)
  if n == clock.ms then
    clock.text = clock.text or format('%d', n)
    return clock.text
  end
  if n % 1 ~= 0 then
    return n
  end
  return format('%d', n)
end

-- A number the scripts wrote (a record's, a scope hash's), read with one parse where tonumber
-- makes two; nil for a missing field (nil, or false from HMGET). Anything else is an error.
local function number(v)
  if v then
    return v + 0
  end
end

-- A table whose first 24 places are made at once: a write's field-value list grows there without
-- the table being made again at every power of two (Lua 5.1 has no table.new; a constructor of
-- nils sizes the array part). Read it back with its count (unpack(t, 1, n)).
local function places()
  return { nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil,
    nil, nil, nil }
end

local function split(s)
  local out = {}
  for w in string.gmatch(s, '%S+') do
    out[#out + 1] = w
  end
  return out
end

-- What changes only with the policy (a hold's terms, a scope's limits) may reach a phase as one
-- string, read once per distinct string: on Redis the library's locals outlive a call, so a busy
-- tenant's terms are parsed once, not at every call (the embedded store runs the library anew at
-- every call, and parses them every time). What `parse` makes of a string is shared by every call
-- that sends the same one: read only. At most 4,096 are kept; past that the cache starts afresh.
-- (`parsed[parse][s]`, and `parsed.n` entries in all.)
local parsed = { n = 0 }
local function parsed_once(s, parse)
  if parsed.n >= 4096 then
    parsed = { n = 0 }
  end
  local by = parsed[parse]
  if not by then
    by = {}
    parsed[parse] = by
  end
  local v = by[s]
  if v == nil then
    v = parse(s)
    by[s], parsed.n = v, parsed.n + 1
  end
  return v
end

-- The readers parsed_once is given, one a kind of string (in a table: a chunk has at most 200
-- locals, and the embedded store runs this file and a phase as one).
local PARSE = {}

-- The terms a compact record keeps in `tm`, at the positions of the reserve's terms string (see
-- reserve.lua's ARGV[12] and PARSE.hold_terms), as the fields a record of the full form has:
-- {xp, rt, it, oq}. Read by position, whatever the others hold, once per distinct string.
function PARSE.record_terms(s)
  local t = split(s)
  return { t[4], t[3], t[2], t[9] }
end

-- A record's state when its key holds only the note a give-back leaves (see above).
local SETTLED_NOTE = 'settled'

-- Reads a record into a table; returns nil when it does not exist (or is a give-back's note).
-- (One HGETALL: a record has only the fields its hold uses, and naming every field it might have
-- costs Redis more.)
local function load(rk)
  local v = call('HGETALL', rk)
  local r = {}
  for i = 1, #v, 2 do
    r[v[i]] = v[i + 1]
  end
  if not r.st or r.st == SETTLED_NOTE then
    return nil
  end
  -- A compact record keeps the terms it was made under as one string (`tm`), and leaves out
  -- what every new hold starts with (no idempotency key, no estimate to teach, charged as held,
  -- holding its slot, first attempt, not estimated): they read as the full form's fields.
  if r.tm then
    local t = parsed_once(r.tm, PARSE.record_terms)
    r.xp, r.rt, r.it, r.oq = r.xp or t[1], r.rt or t[2], r.it or t[3], r.oq or t[4]
    r.ik, r.ok, r.ch, r.sl, r.at, r.es = r.ik or '', r.ok or '', r.ch or r.h, r.sl or '1', r.at or '1', r.es or '0'
  end
  r.h = number(r.h)
  r.ch = number(r.ch)
  r.le = number(r.le)
  r.at = number(r.at)
  r.dy = number(r.dy)
  r.hr = number(r.hr)
  r.zo = number(r.zo) or 0
  r.rt = number(r.rt)
  r.it = number(r.it)
  r.pi = number(r.pi) or 0
  r.po = number(r.po) or 0
  r.hc = number(r.hc) or 0
  r.cc = number(r.cc) or 0
  -- Weighted tokens: weights in thousandths of a whole token, prices; without 'cw', a cached
  -- token is an input token and a reasoning token an output token.
  r.wr, r.ww, r.pr, r.pw, r.wt, r.pt = 1000, 1000, r.pi, r.pi, 1000, r.po
  if r.cw then
    local cw = split(r.cw)
    r.wr, r.ww = tonumber(cw[1]) or 1000, tonumber(cw[2]) or 1000
    r.pr, r.pw = tonumber(cw[3]) or r.pi, tonumber(cw[4]) or r.pi
    r.wt, r.pt = tonumber(cw[5]) or 1000, tonumber(cw[6]) or r.po
  end
  return r
end

-- What `prompt` and `output` tokens charge hold `r`, `read` and `written` of the prompt read
-- from the provider's cache or written to it and `reasoning` of the output spent reasoning:
-- tokens (a weighted token at its weight, rounded up), their cost, at the terms the hold was
-- made with, and the tokens of each side (input, output) apart. Reads first, then writes, each capped at what the prompt has left; reasoning capped
-- at the output. src/hold/charge.rs's `charge` is the same arithmetic. Exact in doubles: counts
-- are at most 1e9, weights 1e4, prices 1e6 nanos.
local function charged_for(r, prompt, output, read, written, reasoning)
  read = min(read, prompt)
  written = min(written, prompt - read)
  local plain = prompt - read - written
  reasoning = min(reasoning, output)
  local answer = output - reasoning
  local function weighted(n, w)
    return floor((n * w + 999) / 1000)
  end
  local input = plain + weighted(read, r.wr) + weighted(written, r.ww)
  local output_tokens = answer + weighted(reasoning, r.wt)
  local cost = plain * r.pi + read * r.pr + written * r.pw + answer * r.po + reasoning * r.pt
  return input + output_tokens, cost, input, output_tokens
end

-- A bucket's level at `now`: its level at its last write plus the refill since, never above its
-- capacity. A bucket never written (its level nil, or false where HMGET read a missing field) is
-- full.
local function refilled(level, at, cap, rate, now)
  if not level then
    return cap
  end
  return min(cap, level + rate * max(0, now - at))
end

-- Keeps `key` alive for at least `ms` more, never for less than it already has: a key that holds
-- many holds (a scope, a lease index, a holds hash, a pool's) keeps the TTL its longest-lived hold
-- needs, so a reload that shortens the lease or the idle TTL leaves the holds made before it their
-- own terms. (A key without a TTL gets one; a missing key is left missing.)
-- (One call where the key has a TTL shorter than `ms`, as every key tollgate writes has from the
-- call that made it: GT lengthens a TTL and never gives one, so a key without any is given its
-- first after PTTL tells.)
-- `fresh`: the key was likely made by this call, so has no TTL yet: asking NX first makes that
-- one call too (either order is right for any key; the hint only saves calls).
-- True when the key had no TTL and was given its first here.
local function keep_for(key, ms, fresh)
  ms = text(ms)
  if fresh then
    if call('PEXPIRE', key, ms, 'NX') == 0 then
      call('PEXPIRE', key, ms, 'GT')
      return false
    end
    return true
  elseif call('PEXPIRE', key, ms, 'GT') == 0 and call('PTTL', key) == -1 then
    call('PEXPIRE', key, ms)
    return true
  end
  return false
end

-- A scope hash keeps its TTL lazily. Its field `kx` is a time before which it cannot expire (the
-- TTL a call last gave it, which no call shortens); a write that needs it alive for `idle` ms
-- more lengthens the TTL only when `kx` falls short, and then by a sixteenth more, so a busy
-- scope's TTL is set about once in every sixteenth of its idle time rather than at every call.
-- The new `kx` to write, or nil when the one it has will do.
local function lasting(kx, idle, now)
  local until_ms = number(kx)
  if until_ms and until_ms >= now + idle then
    return nil
  end
  return now + idle + floor(idle / 16)
end

-- Period budgets. A scope counts usage per calendar period (h hour, d day, w week from Monday,
-- m month) and measure (u tokens, c cost, p prompt tokens, g output tokens): its counter is named
-- by the two letters (`du`, `wg`), and each period's counters share one marker field, the period's
-- number (PERIOD_MARKERS), so a counter counts while its marker is the current period's and a
-- new period starts all of them at zero. Periods are numbered in the tenant's time zone, given as
-- its offset from UTC in minutes: local time = now + offset. A scope always counts tokens and
-- cost per day and month (ALWAYS: the counters IS_ALWAYS names, du dc mu mc), whatever budgets
-- it has, and goes on counting whatever it has counted while its hash lives.
local HOUR_MS = 3600000
local PERIODS = { 'h', 'd', 'w', 'm' }
local PERIOD_MARKERS = { h = 'h', d = 'd', w = 'w', m = 'mo' }
local MEASURES = { 'u', 'c', 'p', 'g' }
-- Every counter, in this order wherever order shows (which budget a refusal names); each
-- counter's period and measure; and the counters of each period by measure (COUNTER_OF.d.u = 'du').
local COUNTERS, PERIOD_OF, MEASURE_OF, COUNTER_OF = {}, {}, {}, {}
-- (Numeric loops: this runs when Redis loads the library, where no library function exists.)
for i = 1, #PERIODS do
  local p = PERIODS[i]
  COUNTER_OF[p] = {}
  for j = 1, #MEASURES do
    local c = p .. MEASURES[j]
    COUNTERS[#COUNTERS + 1] = c
    PERIOD_OF[c], MEASURE_OF[c], COUNTER_OF[p][MEASURES[j]] = p, MEASURES[j], c
  end
end
local IS_ALWAYS = { du = true, dc = true, mu = true, mc = true }
-- Each counter's place in COUNTERS; and each period's counters beside ALWAYS, the ones a scope
-- counts only when a budget names them or its hash has counted them.
local PLACE, BESIDE = {}, {}
for i = 1, #COUNTERS do
  local c = COUNTERS[i]
  PLACE[c] = i
  if not IS_ALWAYS[c] then
    local p = PERIOD_OF[c]
    BESIDE[p] = BESIDE[p] or {}
    BESIDE[p][#BESIDE[p] + 1] = c
  end
end

-- What a hold charged beside ALWAYS, per scope, as its record keeps it (`kc`): for each scope in
-- `ks` order, the other counters its reserve charged, comma-separated, scopes separated by '|'
-- ('' when no scope charged any: the record then has no `kc`). A refund goes only to what the
-- hold charged, so a budget a reload added after it is never credited with what it never held.
local function charged_counters(scopes)
  local any = false
  for _, s in ipairs(scopes) do
    for c in pairs(s.used) do
      any = any or not IS_ALWAYS[c]
    end
  end
  if not any then
    return ''
  end
  local all = {}
  for i, s in ipairs(scopes) do
    local mine = {}
    for _, c in ipairs(COUNTERS) do
      if s.used[c] ~= nil and not IS_ALWAYS[c] then
        mine[#mine + 1] = c
      end
    end
    all[i] = table.concat(mine, ',')
  end
  return table.concat(all, '|')
end

-- `kc` read back: per scope index, the set of counters a refund may go to (ALWAYS, and what the
-- hold charged beside them).
local function refundable(kc)
  local sets = {}
  local i = 0
  for part in string.gmatch((kc or '') .. '|', '([^|]*)|') do
    i = i + 1
    local set = { du = true, dc = true, mu = true, mc = true }
    for c in string.gmatch(part, '[^,]+') do
      set[c] = true
    end
    sets[i] = set
  end
  return sets
end

-- The hour, day, week and month numbers of `day` (and `hour`, when known) in a zone: the periods
-- a hold charged. (Week 0 began on Monday 1969-12-29.)
local function periods_of(day, hour)
  return { h = hour, d = day, w = floor((day + 3) / 7), m = month_of(day) }
end

-- The periods `now` falls in, in the zone `offset` minutes east of UTC.
local function periods_at(now, offset)
  local t = now + offset * 60000
  return periods_of(floor(t / DAY_MS), floor(t / HOUR_MS))
end

-- Ms from `now` until period `p` of `at` (numbered in the zone `offset` minutes east) ends.
local function period_ends(p, at, now, offset)
  local ends
  if p == 'h' then
    ends = (at.h + 1) * HOUR_MS
  elseif p == 'd' then
    ends = (at.d + 1) * DAY_MS
  elseif p == 'w' then
    ends = ((at.w + 1) * 7 - 3) * DAY_MS
  else
    ends = month_start(at.m + 1) * DAY_MS
  end
  return ends - offset * 60000 - now
end

-- A hash as a table of its fields.
local function fields_of(key)
  local flat = call('HGETALL', key)
  local f = {}
  for i = 1, #flat, 2 do
    f[flat[i]] = flat[i + 1]
  end
  return f
end

-- Runs `f` (which writes keys no other part of a batch reads): at once, or in a batch of commits
-- at its end, in the order asked, before the writes to the keys the batch shares (a record an
-- expiry rewrote is then dropped, as in a single commit). See gather.
local function at_batch_end(f)
  if gathered then
    gathered.later[#gathered.later + 1] = f
  else
    f()
  end
end

-- A scope hash's fields as adjust reads them: from the store, or in a batch of commits as the
-- batch has left them (read once, the batch's writes kept in them).
local function scope_fields(key)
  if not gathered then
    return fields_of(key)
  end
  local f = gathered.scopes[key]
  if not f then
    f = fields_of(key)
    gathered.scopes[key] = f
  end
  return f
end

-- In a batch, gathers the first `nw` places of `w` (field, value, ...) for scope hash `key`: into
-- its fields (see scope_fields), all written once at the batch's end.
local function gather_scope_writes(key, w, nw)
  local f, dirty = scope_fields(key), gathered.dirty[key]
  if not dirty then
    dirty = {}
    gathered.dirty[key] = dirty
    gathered.dirty[#gathered.dirty + 1] = key
  end
  for j = 1, nw, 2 do
    f[w[j]], dirty[w[j]] = w[j + 1], w[j + 1]
  end
end

-- keep_for of a scope hash: at once, or in a batch once its writes are made (the longest asked).
local function keep_scope(key, ms)
  if not gathered then
    keep_for(key, ms)
    return
  end
  local kept = gathered.kept
  if not kept[key] then
    kept[#kept + 1] = key
  end
  kept[key] = max(kept[key] or 0, ms)
end

-- A scope's limits: token capacity, tokens per ms, request capacity, requests per ms, max
-- concurrency, input token capacity, input tokens per ms, output token capacity, output tokens
-- per ms (0 meaning no such limit), and its period budgets as "<counter>:<limit> ..." (money in
-- nanos; '' when none), a soft one written "~<counter>:<limit>" (past it a request is admitted all
-- the same, and marked).
local function limits_of(tcap, trate, rcap, rrate, cmax, pcap, prate, gcap, grate, budgets)
  local l = {
    tcap = tonumber(tcap),
    trate = tonumber(trate),
    rcap = tonumber(rcap),
    rrate = tonumber(rrate),
    cmax = tonumber(cmax),
    pcap = tonumber(pcap),
    prate = tonumber(prate),
    gcap = tonumber(gcap),
    grate = tonumber(grate),
    budgets = {},
    soft = {},
  }
  for mark, c, n in string.gmatch(budgets, '(~?)(%a%a):(%d+)') do
    if mark == '~' then
      l.soft[c], l.any_soft = tonumber(n), true
    else
      l.budgets[c] = tonumber(n)
      -- (`named`: the budgets' counters in COUNTERS order, as a refusal names them.)
      l.named = l.named or {}
      local named, i = l.named, #l.named + 1
      while i > 1 and PLACE[named[i - 1]] > PLACE[c] do
        named[i] = named[i - 1]
        i = i - 1
      end
      named[i] = c
    end
  end
  return l
end

-- A scope's limits from ten ARGV after `b` (see limits_of).
local function scope_limits(args, b)
  return limits_of(args[b + 1], args[b + 2], args[b + 3], args[b + 4], args[b + 5], args[b + 6], args[b + 7],
    args[b + 8], args[b + 9], args[b + 10])
end

-- A scope's limits from one string, the ten of limits_of space separated, the budgets last (as
-- reserve.lua gets them), read once per distinct string (parsed_once).
function PARSE.limits(s)
  local t = split(s)
  if #t < 9 then
    error('a scope\'s limits have ' .. #t .. ' fields, not at least 9: ' .. s)
  end
  return limits_of(t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], table.concat(t, ' ', 10))
end
local function packed_scope_limits(s)
  return parsed_once(s, PARSE.limits)
end

-- A hold's terms, as reserve.lua gets them in one string (see its header), read once per distinct
-- string (parsed_once). What the record keeps as it came stays a string.
function PARSE.hold_terms(s)
  local t = split(s)
  if #t ~= 23 then
    error('a hold\'s terms have ' .. #t .. ' fields, not 23: ' .. s)
  end
  local terms = { lease = tonumber(t[1]), idle = t[2], late_commit_wait = t[3], policy = t[4],
    batch = t[5], attempt_limit = tonumber(t[6]), concurrency_wait_cap = tonumber(t[7]),
    min_samples = tonumber(t[8]), quantile = t[9], shadow = t[10] == '1', price_in = tonumber(t[11]),
    price_out = tonumber(t[12]), retention = tonumber(t[13]), offset = tonumber(t[14]), ledger = '', cache = '',
    compact = t[23] == '2' }
  if t[15] ~= '-' then
    terms.ledger = t[15] .. ' ' .. t[16]
  end
  if t[17] ~= '-' then
    terms.cache = table.concat(t, ' ', 17, 22)
  end
  -- What a compact record keeps of them (`tm`): the four it needs, at the positions this string
  -- has them, '-' elsewhere, so that a record stays under Redis's 64 bytes a listpack value
  -- (the whole string would turn its hash into a table, twice the memory).
  terms.record = table.concat({ '-', t[2], t[3], t[4], '-', '-', '-', '-', t[9] }, ' ')
  return terms
end
local function hold_terms(s)
  return parsed_once(s, PARSE.hold_terms)
end

-- A scope as the admission scripts see it: its limits `l` (scope_limits, or packed_scope_limits:
-- then shared with other calls, so read only), its buckets refilled to `now`, and what each
-- counter it counts has used in the current period of `at` (periods_at). Reads; writes nothing.
local function read_scope(key, l, now, at)
  local f = fields_of(key)
  -- Which periods the hash counts already (its marker is the current one: `current`), and every
  -- counter the scope counts: ALWAYS, its budgets, and what its hash has counted (a counter is
  -- written only with its period's marker, so only a period with a marker can have counted any).
  -- (Each table is made with the keys it gets, so that it is not made again as it grows: `used`
  -- with ALWAYS's counters, the ones IS_ALWAYS names.)
  local used, current = { du = 0, dc = 0, mu = 0, mc = 0 }, { h = false, d = false, w = false, m = false }
  for i = 1, #PERIODS do
    local p = PERIODS[i]
    local marker = f[PERIOD_MARKERS[p]]
    current[p] = at[p] ~= nil and number(marker) == at[p]
    if marker then
      local beside = BESIDE[p]
      for j = 1, #beside do
        local c = beside[j]
        if f[c] then
          used[c] = 0
        end
      end
    end
  end
  for c in pairs(l.budgets) do
    used[c] = 0
  end
  for c in pairs(l.soft) do
    used[c] = 0
  end
  for c in pairs(used) do
    if current[PERIOD_OF[c]] then
      used[c] = number(f[c]) or 0
    end
  end
  return { key = key, l = l, tcap = l.tcap, trate = l.trate, rcap = l.rcap, rrate = l.rrate, cmax = l.cmax,
    pcap = l.pcap, prate = l.prate, gcap = l.gcap, grate = l.grate,
    t = l.tcap > 0 and refilled(f.t, f.tt, l.tcap, l.trate, now) or nil,
    pt = l.pcap > 0 and refilled(f.pt, f.ptt, l.pcap, l.prate, now) or nil,
    gt = l.gcap > 0 and refilled(f.gt, f.gtt, l.gcap, l.grate, now) or nil,
    r = l.rcap > 0 and refilled(f.r, f.rt, l.rcap, l.rrate, now) or nil,
    c = number(f.c) or 0, f = f, used = used, current = current }
end

-- When `need` more slots of scope `s` free, in ms from now, or `cap` when that is later or not
-- known: the lease ends, oldest first, in the lease index `leases` of the holds holding a slot
-- there (each names its scopes in the holds hash `holds`, "<hold> <day> <policy> <cost> <scope
-- keys…>"; a replica's lease, `@…`, is renewed while it lives and frees nothing). A commit
-- usually frees a slot far sooner than a lease ends, and when, nobody can say: `cap` is the
-- back-off for that.
local function slot_frees(s, need, leases, holds, cap, now)
  local found, from, page_size = 0, 0, 32
  local wanted = ' ' .. s.key .. ' '
  while true do
    local page = call('ZRANGE', leases, from, from + page_size - 1, 'WITHSCORES')
    for i = 1, #page, 2 do
      local ms = tonumber(page[i + 1]) - now
      if ms >= cap then
        return cap
      end
      local e = string.sub(page[i], 1, 1) ~= '@' and call('HGET', holds, page[i])
      if e and string.find(' ' .. e .. ' ', wanted, 1, true) then
        found = found + 1
        if found >= need then
          return max(1, ms)
        end
      end
    end
    if #page < 2 * page_size then
      return cap
    end
    from = from + page_size
  end
end

-- How long until a bucket of scope `s` at `level` now holds `need`: the least whole ms after which
-- read_scope, reading its stored level (field `k`, written at field `kt`), finds it there (its
-- arithmetic decides, not this division's rounding). A tier's part of a scope reads shifted
-- levels: the division alone.
local function refill_wait(s, level, need, cap, rate, k, kt, now)
  local ms = max(1, ceil((need - level) / rate))
  local stored = not s.part and s.f[k]
  if not stored then
    return ms
  end
  local function holds_then(t)
    return refilled(stored, s.f[kt], cap, rate, now + t) >= need
  end
  for _ = 1, 3 do
    if holds_then(ms) then
      break
    end
    ms = ms + 1
  end
  for _ = 1, 3 do
    if ms <= 1 or not holds_then(ms - 1) then
      break
    end
    ms = ms - 1
  end
  return ms
end

-- Calls `deny(reason, ms)` for every limit of scope `s` that taking `n` more ({u tokens, c cost,
-- p prompt tokens, g output tokens}), `requests` and `slots` would break, with how long until it
-- would not. `at`: the current periods, in the zone `offset` minutes east of UTC. Budgets are
-- named `budget:<counter>`. A concurrency slot: slot_frees over the tenant's lease index and holds
-- hash (`leases`, `holds`), at most `wait_cap`.
local function check_scope(s, n, requests, slots, leases, holds, wait_cap, now, at, offset, deny)
  if s.tcap > 0 and n.u > 0 and s.t < n.u then
    deny('token_rate', refill_wait(s, s.t, n.u, s.tcap, s.trate, 't', 'tt', now))
  end
  if s.pcap > 0 and n.p > 0 and s.pt < n.p then
    deny('input_rate', refill_wait(s, s.pt, n.p, s.pcap, s.prate, 'pt', 'ptt', now))
  end
  if s.gcap > 0 and n.g > 0 and s.gt < n.g then
    deny('output_rate', refill_wait(s, s.gt, n.g, s.gcap, s.grate, 'gt', 'gtt', now))
  end
  if s.rcap > 0 and requests > 0 and s.r < requests then
    deny('request_rate', refill_wait(s, s.r, requests, s.rcap, s.rrate, 'r', 'rt', now))
  end
  if s.cmax > 0 and slots > 0 and s.c + slots > s.cmax then
    deny('concurrency', slot_frees(s, s.c + slots - s.cmax, leases, holds, wait_cap, now))
  end
  local named = s.l.named
  if not named then
    return
  end
  for i = 1, #named do
    local c = named[i]
    local limit, amount = s.l.budgets[c], n[MEASURE_OF[c]]
    if limit > 0 and amount > 0 and s.used[c] + amount > limit then
      deny('budget:' .. c, period_ends(PERIOD_OF[c], at, now, offset))
    end
  end
end

-- True when `n` ({u, c, p, g}, as check_scope) is more than one of scope `s`'s budgets, or one of
-- its buckets of one side, could ever hold.
local function beyond_budgets(s, n)
  if (s.pcap > 0 and n.p > s.pcap) or (s.gcap > 0 and n.g > s.gcap) then
    return true
  end
  for c, limit in pairs(s.l.budgets) do
    if limit > 0 and n[MEASURE_OF[c]] > limit then
      return true
    end
  end
  return false
end

-- True when `n` is more than scope `s`'s token bucket, one of its buckets of one side or one of
-- its budgets could ever hold: no wait can help.
local function never_fits(s, n)
  return (s.tcap > 0 and n.u > s.tcap) or beyond_budgets(s, n)
end

-- What a tier may use of scope `s` (as read_scope left it): `part` of each bucket, counted from the
-- top (what the tiers above keep is never its to take), and of each budget (at least 1: a budget
-- of 0 would read as none). The rest reads through to `s`.
local function scope_part(s, part)
  local keep, budgets = 1 - part, {}
  for c, limit in pairs(s.l.budgets) do
    budgets[c] = max(1, floor(limit * part))
  end
  return setmetatable({
    part = true,
    t = s.t and s.t - s.tcap * keep, tcap = s.tcap * part,
    pt = s.pt and s.pt - s.pcap * keep, pcap = s.pcap * part,
    gt = s.gt and s.gt - s.gcap * keep, gcap = s.gcap * part,
    r = s.r and s.r - s.rcap * keep, rcap = s.rcap * part,
    l = { budgets = budgets, named = s.l.named },
  }, { __index = s })
end

-- Gives `n` requests back to scope `key`'s request bucket (capacity `cap`, refill `rate` a ms),
-- never above its capacity. `only_existing`: not to a scope whose bucket is gone (its hash ran out
-- of its TTL: an idle bucket is full anyway). True when it wrote.
local function give_requests(key, n, cap, rate, now, only_existing)
  local v = call('HMGET', key, 'r', 'rt')
  if only_existing and not v[1] then
    return false
  end
  call('HSET', key, 'r', min(cap, refilled(v[1], v[2], cap, rate, now) + n), 'rt', now)
  return true
end

-- The first soft budget (in COUNTERS order) of `scopes` that taking `n` more leaves passed: its
-- counter and the ms until its period ends, or '' and 0 when none is.
local function soft_passed(scopes, n, now, at, offset)
  for _, s in ipairs(scopes) do
    if s.l.any_soft then
      for i = 1, #COUNTERS do
        local c = COUNTERS[i]
        local limit = s.l.soft[c]
        if limit and s.used[c] + n[MEASURE_OF[c]] > limit then
          return c, period_ends(PERIOD_OF[c], at, now, offset)
        end
      end
    end
  end
  return '', 0
end

-- A token bucket's fields in a scope hash, by the measure it counts: its level, last refill (ms),
-- capacity and refill per ms.
local TOKEN_FIELDS = { 'u', 't', 'tt', 'tc', 'tr' }
local PROMPT_FIELDS = { 'p', 'pt', 'ptt', 'ptc', 'ptr' }
local OUTPUT_FIELDS = { 'g', 'gt', 'gtt', 'gtc', 'gtr' }

-- Appends to `f` (`k` entries so far; returns the count after) the fields that take `amount` from a
-- bucket at `level` (refilled to `now`) with capacity `cap` and refill `rate` write, `stored` the
-- scope's fields as read: its level and time, and its terms when a reload changed them.
local function put_bucket(f, k, stored, fields, level, cap, rate, amount, now)
  f[k + 1], f[k + 2], f[k + 3], f[k + 4], k = fields[2], text(max(level - amount, -cap)), fields[3], text(now), k + 4
  if number(stored[fields[4]]) ~= cap or number(stored[fields[5]]) ~= rate then
    f[k + 1], f[k + 2], f[k + 3], f[k + 4], k = fields[4], text(cap), fields[5], text(rate), k + 4
  end
  return k
end

-- Takes `n` ({u, c, p, g}), `requests` and `slots` from scope `s` (as read_scope left it, in the
-- periods of `at`) and keeps the scope alive for `idle` ms. Writes only what moves, and the slots
-- count (always there once a scope has taken): a counter that counts more, every counter of a
-- period that starts now (with its marker: one left unwritten would count on from the period
-- before), its buckets refilled to now and taken from, and a bucket's terms when a reload changed
-- them; and `lk`, when given (reserve.lua), in the same write.
local function take(s, n, requests, slots, at, now, idle, lk)
  local f, k = places(), 0
  if lk then
    f[1], f[2], k = 'lk', text(lk), 2
  end
  if slots ~= 0 or not s.f.c then
    f[k + 1], f[k + 2], k = 'c', text(s.c + slots), k + 2
  end
  local starts = nil
  for c, used in pairs(s.used) do
    local p, amount = PERIOD_OF[c], n[MEASURE_OF[c]]
    if not s.current[p] then
      starts = starts or {}
      starts[p] = true
    end
    if amount ~= 0 or not s.current[p] then
      f[k + 1], f[k + 2], k = c, text(used + amount), k + 2
    end
  end
  if starts then
    for p in pairs(starts) do
      f[k + 1], f[k + 2], k = PERIOD_MARKERS[p], text(at[p]), k + 2
    end
  end
  -- A checked take leaves the buckets at zero or above; a shadowed one (reserve.lua) may go into
  -- debt, never below minus the capacity, as with adjust below.
  if s.tcap > 0 then
    k = put_bucket(f, k, s.f, TOKEN_FIELDS, s.t, s.tcap, s.trate, n.u, now)
  end
  if s.pcap > 0 then
    k = put_bucket(f, k, s.f, PROMPT_FIELDS, s.pt, s.pcap, s.prate, n.p, now)
  end
  if s.gcap > 0 then
    k = put_bucket(f, k, s.f, OUTPUT_FIELDS, s.gt, s.gcap, s.grate, n.g, now)
  end
  if s.rcap > 0 then
    f[k + 1], f[k + 2], f[k + 3], f[k + 4], k = 'r', text(max(s.r - requests, -s.rcap)), 'rt', text(now), k + 4
  end
  local kx = lasting(s.f.kx, number(idle), now)
  if kx then
    f[k + 1], f[k + 2], k = 'kx', text(kx), k + 2
  end
  if k > 0 then
    call('HSET', s.key, unpack(f, 1, k))
  end
  if kx then
    keep_for(s.key, kx - now, next(s.f) == nil)
  end
end

-- The scope with the least left in one kind of bucket after taking `take` (level, capacity and
-- refill fields of a scope as read_scope names them: t tcap trate, r rcap rrate, pt pcap prate,
-- gt gcap grate): remaining, limit and ms to full; -1 when no scope has that bucket.
local function tightest(scopes, level, cap, rate, take)
  local rem, lim, reset = -1, -1, -1
  for _, s in ipairs(scopes) do
    if s[cap] > 0 and (rem == -1 or s[level] - take < rem) then
      rem = max(0, s[level] - take)
      lim = s[cap]
      reset = ceil((s[cap] - rem) / s[rate])
    end
  end
  return floor(rem), lim, reset
end

-- The tightest token and request windows after taking `take_tokens` and `take_requests`, for
-- the rate-limit headers: remaining, limit and ms to full, tokens then requests (-1: none).
local function headroom(scopes, take_tokens, take_requests)
  local rem, lim, reset = tightest(scopes, 't', 'tcap', 'trate', take_tokens)
  local rrem, rlim, rreset = tightest(scopes, 'r', 'rcap', 'rrate', take_requests)
  return rem, lim, reset, rrem, rlim, rreset
end

-- The tightest input and output windows after taking `prompt` and `output`, as headroom's:
-- remaining, limit and ms to full for prompt tokens, then for output tokens.
local function side_headroom(scopes, prompt, output)
  local irem, ilim, ireset = tightest(scopes, 'pt', 'pcap', 'prate', prompt)
  local orem, olim, oreset = tightest(scopes, 'gt', 'gcap', 'grate', output)
  return irem, ilim, ireset, orem, olim, oreset
end

-- The buckets adjust moves (fields as TOKEN_FIELDS).
local BUCKET_FIELDS = { TOKEN_FIELDS, PROMPT_FIELDS, OUTPUT_FIELDS }

-- Gives `slots` back to a scope holding `c` (never below zero): the write, first in `w`, and how
-- many of `w`'s places it fills (none when nothing is given back or the scope counts none).
local function free_slots(w, c, slots)
  if slots > 0 and c and c > 0 then
    w[1], w[2] = 'c', text(max(0, c - slots))
    return 2
  end
  return 0
end

-- The number of period `p` that `amount` of counter `name` counts in (see adjust): the hold's for
-- a refund, where `may_refund` allows it, now's for debt; nil when it counts in none.
local function period_for(p, amount, name, hold_at, now_at, may_refund)
  if amount < 0 then
    return may_refund[name] and hold_at[p] or nil
  end
  return now_at[p]
end

-- Appends to `w` (`nw` places filled; returns the count after) the writes that move period `p`'s
-- counters in a scope hash read as `f` by `n`, as adjust says. Only what moves is written.
local function move_period(w, nw, f, p, n, hold_at, now_at, may_refund)
  local marker = PERIOD_MARKERS[p]
  local was = number(f[marker])
  -- (A period the hash has no marker for counts nothing here.)
  if not was then
    return nw
  end
  local names, from, newer = COUNTER_OF[p], nw, false
  -- Most moves count in the period counted, or debt in an older one: each counter on its own.
  for x = 1, #MEASURES do
    local m = MEASURES[x]
    local amount = n[m]
    if amount ~= 0 then
      local name = names[m]
      local at = period_for(p, amount, name, hold_at, now_at, may_refund)
      local count = at and f[name]
      if count then
        if at == was or (amount > 0 and at < was) then
          w[nw + 1], w[nw + 2], nw = name, text(max(0, count + amount)), nw + 2
        elseif amount > 0 then
          newer = true
          break
        end
      end
    end
  end
  if not newer then
    return nw
  end
  -- Debt in a newer period: the measures again in order, from the writes before this period's,
  -- the period's count started afresh at the first such debt.
  nw = from
  local u, moved = { at = was }, {}
  for x = 1, #MEASURES do
    local m = MEASURES[x]
    u[m] = number(f[names[m]])
  end
  for x = 1, #MEASURES do
    local m = MEASURES[x]
    local amount = n[m]
    local at = period_for(p, amount, names[m], hold_at, now_at, may_refund)
    if u[m] and amount ~= 0 and at then
      if u.at == at or (amount > 0 and at < u.at) then
        u[m], moved[m] = max(0, u[m] + amount), true
      elseif amount > 0 then
        for y = 1, #MEASURES do
          local other = MEASURES[y]
          if u[other] then
            u[other], moved[other] = 0, true
          end
        end
        u.at, u[m], moved[m] = at, amount, true
      end
    end
  end
  if u.at ~= was then
    w[nw + 1], w[nw + 2], nw = marker, text(u.at), nw + 2
  end
  for x = 1, #MEASURES do
    local m = MEASURES[x]
    if moved[m] then
      w[nw + 1], w[nw + 2], nw = names[m], text(u[m]), nw + 2
    end
  end
  return nw
end

-- Moves each scope by `n` ({u, c, p, g}: debt when positive, a refund when negative) and frees
-- `slots` concurrency slots there (nil: none), one read and one write a scope. A bucket moves from
-- its level now: refilled first, so a full bucket's refill (which it could not hold) never pays
-- debt; never above its capacity, never below minus it. A period's counters move when they count
-- the period `hold_at` (a refund: what the hold was charged to, given back only while it is
-- current, and only to the counters `kc` says it charged: see charged_counters) or `now_at`
-- (debt: the current one) names; debt in a new period starts its count, and debt for a period
-- older than the one counted (a zone's offset that moved since) counts in the newer one: a
-- marker never goes back. Only counters the scope has move, and a scope hash that has expired
-- (idle longer than its TTL) is not recreated: an idle bucket is full anyway.
local function adjust(keys, n, hold_at, now_at, now, kc, slots, idle)
  slots = slots or 0
  idle = number(idle)
  local moves = n.u ~= 0 or n.c ~= 0 or n.p ~= 0 or n.g ~= 0
  local allowed = nil
  if moves and kc and kc ~= '' then
    allowed = refundable(kc)
  end
  for i, k in ipairs(keys) do
    local w, nw, kx = places(), 0, nil
    if not moves and not gathered then
      -- Only slots: one field read, one written.
      local f = call('HMGET', k, 'c', 'kx')
      nw, kx = free_slots(w, number(f[1]), slots), f[2]
    else
      local may_refund = (allowed and allowed[i]) or IS_ALWAYS
      local f = scope_fields(k)
      nw, kx = free_slots(w, number(f.c), slots), f.kx
      for j = 1, #BUCKET_FIELDS do
        local b = BUCKET_FIELDS[j]
        local amount, cap = n[b[1]], number(f[b[4]])
        if amount ~= 0 and f[b[2]] and cap then
          local level = refilled(f[b[2]], f[b[3]], cap, number(f[b[5]]) or 0, now) - amount
          w[nw + 1], w[nw + 2], w[nw + 3], w[nw + 4], nw =
            b[2], text(max(-cap, min(cap, level))), b[3], text(now), nw + 4
        end
      end
      for j = 1, #PERIODS do
        nw = move_period(w, nw, f, PERIODS[j], n, hold_at, now_at, may_refund)
      end
    end
    -- A hash that has expired is not made again for its TTL's sake: only a write keeps it.
    local until_ms = idle and lasting(kx, idle, now)
    if until_ms and nw > 0 then
      w[nw + 1], w[nw + 2], nw = 'kx', text(until_ms), nw + 2
    end
    -- (Only `nw` places: a period's writes that move_period took back may lie past them.)
    if nw > 0 and gathered then
      gather_scope_writes(k, w, nw)
    elseif nw > 0 then
      call('HSET', k, unpack(w, 1, nw))
    end
    if until_ms then
      keep_scope(k, until_ms - now)
    end
  end
end

-- Amounts by measure: tokens, cost, prompt tokens, output tokens.
local function amounts(u, c, p, g)
  return { u = u, c = c, p = p, g = g }
end

-- Gives `n` ({u, c, p, g}) back: to each bucket, and to the periods of `hold_at` while they are
-- the current ones, in the counters `kc` says the hold charged; and frees `slots` slots (nil: none).
-- With `idle`, keeps each scope it writes alive that long (see lasting). True when it wrote.
local function refund(keys, n, hold_at, now, kc, slots, idle)
  if n.u > 0 or n.c > 0 or n.p > 0 or n.g > 0 then
    adjust(keys, amounts(-n.u, -n.c, -n.p, -n.g), hold_at, hold_at, now, kc, slots, idle)
  elseif slots and slots > 0 then
    adjust(keys, amounts(0, 0, 0, 0), hold_at, hold_at, now, kc, slots, idle)
  else
    return false
  end
  return true
end

-- Charges `n` beyond the hold as debt, to the periods of `now_at`: a bucket may go negative, down
-- to minus its capacity, and the debt is repaid by refill (it shows in the next Retry-After).
local function charge(keys, n, now_at, now)
  if n.u > 0 or n.c > 0 or n.p > 0 or n.g > 0 then
    adjust(keys, n, now_at, now_at, now)
  end
end

-- Moves a settled hold from what it has charged to what it should, `n` the differences: each a
-- refund to the hold's own periods (`hold_at`) when negative, a charge to the current ones
-- (`now_at`) when positive; and frees `slots` slots (nil: none). With `idle`, keeps each scope
-- it writes alive that long (see lasting). True when it wrote.
local function settle(keys, n, hold_at, now_at, now, kc, slots, idle)
  if n.u ~= 0 or n.c ~= 0 or n.p ~= 0 or n.g ~= 0 or (slots and slots > 0) then
    adjust(keys, n, hold_at, now_at, now, kc, slots, idle)
    return true
  end
  return false
end

-- What a hold's record has charged, by measure: all it held, or nothing once an expiry refunded it.
local function charged_of(r)
  local output = 0
  if r.ch > 0 then
    output = min(r.ch, tonumber(r.oh) or 0)
  end
  return amounts(r.ch, r.cc, r.ch - output, output)
end

-- Keeps scope hashes alive for another idle TTL (nil: as they are), as a call that moves them.
local function keep_scopes(keys, idle)
  if not idle then
    return
  end
  for _, k in ipairs(keys) do
    keep_scope(k, idle)
  end
end

-- Keeps a live hold's keys alive for another idle TTL: every scope it counts in, the lease index
-- and the holds hash. A renewed stream may outlive many TTLs; its slot must not vanish with them.
-- (A hold that settles needs only its scopes kept: the index and the holds hash keep the TTL the
-- holds still in them were given.) An index or holds hash that had no TTL (made anew beside a
-- replica's lease: see reserve.lua) is given one here that may fall short of what the tenant's
-- scope, the first of `keys`, notes in `lk`: the note goes.
local function keep_alive(keys, leases, holds, idle)
  if not idle then
    return
  end
  keep_scopes(keys, idle)
  local index_new = keep_for(leases, idle)
  if keep_for(holds, idle) or index_new then
    call('HDEL', keys[1], 'lk')
  end
end

-- Ends a record's hold: off the lease index and the holds hash, its idempotency key no longer
-- pointing at it (the key keeps counting attempts until its own TTL).
local function close(id, r, leases, holds)
  if gathered then
    local g = gathered.closed
    g.leases, g.holds = leases, holds
    g.ids[#g.ids + 1], g.fields[#g.fields + 1], g.fields[#g.fields + 2] = id, id, id .. '+'
  else
    call('ZREM', leases, id)
    call('HDEL', holds, id, id .. '+')
  end
  if r.ik and r.ik ~= '' then
    at_batch_end(function()
      if call('HGET', r.ik, 'id') == id then
        call('HDEL', r.ik, 'id')
      end
    end)
  end
end

local SETTLED_STATES = { c = 'committed', l = 'late_committed', r = 'released' }
local SETTLED_CODES = { committed = 'c', late_committed = 'l', released = 'r' }
-- How a hold's request ended (src/hold/outcome.rs, `Ending`), one letter in a settled entry.
local ENDINGS = { c = 'completed', m = 'metered', k = 'metered_capped', h = 'as_held', l = 'client_left',
  r = 'upstream_refused', e = 'upstream_error', g = 'released', x = 'expired' }
local ENDING_CODES = { completed = 'c', metered = 'm', metered_capped = 'k', as_held = 'h', client_left = 'l',
  upstream_refused = 'r', upstream_error = 'e', released = 'g', expired = 'x' }

-- A hold's field in its tenant's settled bucket: the last 80 of its id's 128 random bits, the 20
-- hex digits before the replica's '@' or the end (the tenant is the bucket's; the random part
-- alone tells holds apart). Two holds of one tenant settled within two periods share a field
-- with a chance of n^2 / 2^81 for n holds: about 1e-14 at 120,000. A short field fits Redis's
-- smallest string allocation, and taking it is a substring, not a conversion.
local function settled_field(id)
  local stop = (string.find(id, '@', 1, true) or (#id + 1)) - 1
  return string.sub(id, stop - 19, stop)
end

-- How a hold's request ended when its settled entry says nothing more: what its state and its
-- metered flag imply.
local function implied_ending(state, metered)
  if state == 'released' then
    return 'released'
  end
  if tostring(metered) == '1' then
    return 'metered'
  end
  return 'completed'
end

-- Files a hold settled now (`state`: committed | late_committed | released) in the current
-- period's bucket of `settled` ({prefix, retention}), as
--   "<state code><metered> <held> <attempts> <output held> <used or refunded> <cost>"
-- (state code c | l | r; metered 0 | 1; output held -1 when unknown; the estimated flag rides on
-- the attempts as a sign), and drops its record. How its request ended (`ending`) goes, under the
-- same field, in the bucket's companion `<bucket>e` (one letter, ENDINGS) only when the entry
-- does not imply it (implied_ending): most holds add nothing, and the entry keeps the form every
-- tollgate reads.
local function file_settled(rk, id, r, settled, now, state, result, cost, metered, ending)
  local period = floor(now / settled.retention)
  local bucket = settled.prefix .. period
  local attempts = r.at or 1
  if r.es == '1' then
    attempts = -attempts
  end
  local field = settled_field(id)
  local expires = (period + 2) * settled.retention - now
  -- (The bucket's field `ttl` is written with its TTL, in one script, so a bucket that has it has
  -- its TTL: the write says whether it had, as the count of fields it added. A bucket without it
  -- that has the entry already can only be an older version's, which gave it its TTL.)
  local entry = format('%s%d %d %d %d %d %d', SETTLED_CODES[state], metered, r.h, attempts,
    tonumber(r.oh) or -1, result, cost)
  if gathered then
    local g = gathered.filed
    local b = g[bucket]
    if not b then
      b = { expires = expires, n = 0 }
      g[bucket] = b
      g[#g + 1] = bucket
    end
    b[#b + 1], b[#b + 2], b.n = field, entry, b.n + 1
    gathered.dropped[rk] = true
    gathered.dropped[#gathered.dropped + 1] = rk
  else
    if call('HSET', bucket, field, entry, 'ttl', '1') ~= 1 then
      call('PEXPIRE', bucket, expires)
    end
    call('DEL', rk)
  end
  if ending and ENDING_CODES[ending] and ending ~= implied_ending(state, metered) then
    at_batch_end(function()
      call('HSET', bucket .. 'e', field, ENDING_CODES[ending])
      call('PEXPIRE', bucket .. 'e', expires)
    end)
  end
end

-- A settled hold as file_settled filed it, read as load reads a record (st h at oh es mx, and us
-- and cc, or rf; md empty; en how its request ended), or nil when neither bucket a repeat looks
-- in has it.
local function load_settled(id, settled, now)
  local period = floor(now / settled.retention)
  local field = settled_field(id)
  local bucket = settled.prefix .. period
  local v = call('HGET', bucket, field)
  if not v then
    bucket = settled.prefix .. (period - 1)
    v = call('HGET', bucket, field)
  end
  if not v then
    return nil
  end
  local code, metered, h, at, oh, result, cost =
    string.match(v, '^(%a)(%d) (%-?%d+) (%-?%d+) (%-?%d+) (%-?%d+) (%-?%d+)$')
  local r = { st = SETTLED_STATES[code], h = tonumber(h), at = math.abs(tonumber(at)), oh = oh, md = '',
    mx = metered, cc = tonumber(cost), es = '0' }
  r.en = ENDINGS[call('HGET', bucket .. 'e', field) or ''] or implied_ending(r.st, metered)
  if tonumber(at) < 0 then
    r.es = '1'
  end
  if r.st == 'released' then
    r.rf = result
  else
    r.us = result
  end
  return r
end

-- Leaves at a record key the note of a hold given back because nobody received its reserve's
-- answer (see the record, above), for as long as a bucket filed now keeps its entry; only where
-- the record is gone (an expired record, kept for a late commit, answers a re-send itself).
local function leave_settled_note(rk, settled, now)
  if call('HGET', rk, 'st') then
    return
  end
  call('HSET', rk, 'st', SETTLED_NOTE)
  call('PEXPIRE', rk, (floor(now / settled.retention) + 2) * settled.retention - now)
end

-- A hold's record, or what its settled bucket kept once it settled, or nil.
local function load_hold(rk, id, settled, now)
  return load(rk) or load_settled(id, settled, now)
end

-- Appends one entry (`fields`, a flat list of names and values) to the tenant's ledger `stream`,
-- under the terms it was made with ("<max entries> <retention ms>"; nothing when empty): trimmed to
-- about that many entries and to that age, the whole stream gone after that long without an entry.
local function ledger_write(stream, terms, fields, now)
  if not stream or not terms or terms == '' then
    return
  end
  local t = split(terms)
  local max_len, retention = t[1], tonumber(t[2])
  call('XADD', stream, 'MAXLEN', '~', max_len, '*', unpack(fields))
  call('XTRIM', stream, 'MINID', '~', max(0, now - retention))
  call('PEXPIRE', stream, retention)
end

-- Appends one settled hold to the tenant's ledger `stream` (see ledger_write).
local function ledger_append(stream, terms, e, now)
  ledger_write(stream, terms, { 'id', e.id, 'tenant', e.tenant or '', 'user', e.user or '',
    'model', e.model or '', 'tier', e.tier or '', 'outcome', e.outcome, 'usage', e.usage,
    'prompt_tokens', e.prompt or '', 'output_tokens', e.output or '', 'cache_read_tokens', e.cache_read or '',
    'cache_write_tokens', e.cache_write or '', 'reasoning_tokens', e.reasoning or '', 'reserved_tokens', e.reserved or '',
    'charged_tokens', e.charged, 'cost_nanos', e.cost or '', 'reserved_cost_nanos', e.reserved_cost or '',
    'reserved_at_ms', e.reserved_at or '', 'settled_at_ms', now, 'ending', e.ending or '' }, now)
end

-- Whether the hold's record names ledger terms: it was made where a ledger keeps settled holds (a
-- record made without one, or by a version before the ledger, has none).
local function has_ledger(r)
  return r.lg ~= nil and r.lg ~= ''
end

-- The ledger entry of a hold settled from its record.
local function ledger_entry(id, r, outcome, usage, charged, cost, ending)
  return { id = id, tenant = r.tn, user = r.ur, model = r.md, tier = r.tr, outcome = outcome, usage = usage,
    reserved = r.h, charged = charged, cost = cost, reserved_cost = r.hc, reserved_at = r.ra, ending = ending }
end

-- Settles a hold whose lease ran out, from what the holds hash (or its record) says it charged:
-- the slot is freed; the tokens and their cost stay charged (charge) or come back (refund).
-- Missing usage is not zero usage, so charge is the default policy. Returns the tokens and cost
-- still charged.
local function settle_expired(keys, charged, hold_at, policy, now, kc)
  if policy == 'refund' then
    refund(keys, charged, hold_at, now, kc, 1)
    return 0, 0
  end
  adjust(keys, amounts(0, 0, 0, 0), hold_at, hold_at, now, kc, 1)
  return charged.u, charged.c
end

-- Settles a live hold whose lease ran out, and enters it in the `ledger` stream (nil: the caller
-- settles it further in the same script and enters that instead).
local function expire(rk, id, r, leases, holds, now, ledger)
  local keys = split(r.ks)
  if r.sl == '1' then
    r.ch, r.cc = settle_expired(keys, charged_of(r), periods_of(r.dy, r.hr), r.xp, now, r.kc)
  end
  r.st = 'expired'
  r.sl = '0'
  local charged, cost, waits = r.ch, r.cc, r.rt
  at_batch_end(function()
    call('HSET', rk, 'st', 'expired', 'sl', 0, 'ch', charged, 'cc', cost)
    call('PEXPIRE', rk, waits)
  end)
  close(id, r, leases, holds)
  local usage = 'held'
  if r.ch == 0 then
    usage = 'none'
  end
  if ledger and has_ledger(r) then
    ledger_append(ledger, r.lg, ledger_entry(id, r, 'expired', usage, r.ch, r.cc, 'expired'), now)
  end
end

-- Settles the lease of a replica that stopped renewing it (it died, or lost the store for a whole
-- lease): the concurrency slots it held are freed. Its tokens and request permits stay charged:
-- what its in-flight requests used is unknown, and missing usage is not zero usage.
local function settle_lease(rk, leases, member)
  local flat = call('HGETALL', rk)
  for i = 1, #flat, 2 do
    if flat[i] ~= '@' then
      local c = tonumber(call('HGET', flat[i], 'c'))
      if c then
        call('HSET', flat[i], 'c', max(0, c - tonumber(flat[i + 1])))
      end
    end
  end
  call('DEL', rk)
  call('ZREM', leases, member)
end

-- Settles one expired hold from its record, or from the holds hash when the record ran out of TTL
-- before the sweep came (entered in the ledger under the caller's terms, with what the entry
-- knows). Returns true when it settled a live hold.
local function sweep_hold(rk, due, leases, holds, now, ledger)
  local r = load(rk)
  if r and r.st == 'reserved' then
    expire(rk, due, r, leases, holds, now, ledger.key)
    return true
  end
  local entry = call('HGET', holds, due)
  local settled = false
  if entry and not r then
    local e = split(entry)
    -- (An entry written before holds carried a cost has its first key where the cost is now.)
    local cost, first = tonumber(e[4]), 5
    if not cost then
      cost, first = 0, 4
    end
    local keys = {}
    for i = first, #e do
      keys[#keys + 1] = e[i]
    end
    -- Its detail, where the hold has one: its output part, hour and what it charged beside
    -- ALWAYS (see reserve.lua).
    local d = split(call('HGET', holds, due .. '+') or '')
    local tokens, output, hour = tonumber(e[1]), tonumber(d[1]) or 0, tonumber(d[2])
    if hour == -1 then
      hour = nil
    end
    output = min(tokens, output)
    local charged, cost_left = settle_expired(keys, amounts(tokens, cost, tokens - output, output),
      periods_of(tonumber(e[2]), hour), e[3], now, d[3])
    local usage = 'held'
    if charged == 0 then
      usage = 'none'
    end
    ledger_append(ledger.key, ledger.terms, { id = due, tenant = ledger.tenant, outcome = 'expired', usage = usage,
      reserved = e[1], charged = charged, cost = cost_left, reserved_cost = cost, ending = 'expired' }, now)
    settled = true
  end
  call('ZREM', leases, due)
  call('HDEL', holds, due, due .. '+')
  return settled
end

-- Settles, a bounded batch at a time, the holds of a tenant whose lease has run out, and the leases
-- of replicas that stopped renewing theirs ('@' ids). Returns the hold ids it settled, so that the
-- caller can take their pool legs (another slot) off their pools. `ledger`: {key, terms, tenant} of
-- the tenant's ledger, for the holds settled without a record.
local function sweep(leases, holds, prefix, batch, now, ledger)
  local settled = {}
  for _, due in ipairs(call('ZRANGEBYSCORE', leases, '-inf', text(now), 'LIMIT', '0', batch)) do
    if string.sub(due, 1, 1) == '@' then
      settle_lease(prefix .. due, leases, due)
    elseif sweep_hold(prefix .. due, due, leases, holds, now, ledger) then
      settled[#settled + 1] = due
    end
  end
  return settled
end

-- Loads a hold that is still live. Otherwise returns nil and the reply to send: not_found, the
-- state it was settled in, or expired (settling it now when its lease has passed unswept).
local function live_hold(rk, id, leases, holds, now, ledger, settled)
  local r = load_hold(rk, id, settled, now)
  if not r then
    return nil, { 'not_found', 0 }
  end
  if r.st ~= 'reserved' then
    return nil, { r.st, 0 }, r
  end
  if now >= r.le then
    expire(rk, id, r, leases, holds, now, ledger)
    return nil, { 'expired', 0 }
  end
  return r
end

-- Pool state hash (one per backend pool, its own hash tag):
--   n  holds outstanding      w  their predicted slot time (ms)      kv  their KV-cache tokens
--   f…  fair shares within a tier (below)
-- Pool holds hash: reservation id -> "<work> <kv> <tier> <tenant> <cost> <ends>": its cost in its
-- tier's queue (0 in a pool that queues at the backend) and its predicted end (ms); holds made by
-- older replicas lack the last two, or (before fair shares) all but "<work> <kv>". A live stream's
-- work shrinks, and its end moves, as it reports progress (pool_progress.lua). Beside
-- it, in a pool with provider limits, `<id>+` -> what the hold charged them (provider_charge).
-- Provider scope (one per pool with provider limits): a scope hash as a tenant's (above), shared
-- by every tenant whose model the pool serves; its periods are UTC's.

-- The share of a pool admitted, as its provider's 429s left it (see pool_throttle.lua): the share
-- written at `at`, recovered since at `recover` per ms, never above the whole pool.
local function pool_share(share, at, recover, now)
  share = tonumber(share)
  if not share then
    return 1
  end
  return min(1, share + recover * max(0, now - tonumber(at)))
end

-- Fair shares within a tier (pool state hash fields; weights in thousandths):
--   f<tier>           "<work> <weights>": the work every tenant holds at the tier, and the sum of
--                     the weights of the tenants holding any
--   f<tier>:<tenant>  "<work> <weight> <holds>": one tenant's, with the weight it came with
-- A hold's entry in the holds hash names its tier and tenant ("<work> <kv> <tier> <tenant>"), so
-- whatever takes it off the pool takes it off its tenant's share too.
local function fair_read(state, tier, tenant, weight)
  local v = call('HMGET', state, 'f' .. tier, 'f' .. tier .. ':' .. tenant)
  local t, m = split(v[1] or '0 0'), split(v[2] or ('0 ' .. weight .. ' 0'))
  return tonumber(t[1]), tonumber(t[2]), tonumber(m[1]), tonumber(m[2]), tonumber(m[3])
end

-- Adds `work` (may be negative) and `holds` (+1, -1 or 0) to a tenant's share of a tier. A new
-- hold brings the tenant's weight now (`weight`; 0 from a caller that does not know it): a reload
-- that changed it takes effect at once, and the tier's sum of weights follows.
local function fair_add(state, tier, tenant, weight, work, holds)
  local tw, ws, mw, w, mh = fair_read(state, tier, tenant, weight)
  if mh == 0 and holds > 0 then
    ws = ws + w
  elseif mh > 0 and weight > 0 and weight ~= w then
    ws, w = ws - w + weight, weight
  end
  mw, mh, tw = max(0, mw + work), mh + holds, max(0, tw + work)
  local mine = 'f' .. tier .. ':' .. tenant
  if mh <= 0 then
    call('HDEL', state, mine)
    ws = max(0, ws - w)
  else
    call('HSET', state, mine, string.format('%d %d %d', mw, w, mh))
  end
  if tw == 0 and ws == 0 then
    call('HDEL', state, 'f' .. tier)
  else
    call('HSET', state, 'f' .. tier, string.format('%d %d', tw, ws))
  end
end

-- When a pool hold predicted to take `span` ms from `now` (its start and its work; or, live, the
-- work it has left) is predicted to end: then, give or take the tenth its pool's speeds may be
-- off, and at least 50 ms for its commit to reach the store. A retry hint counts on this end.
local function pool_ends(now, span)
  return now + span + max(ceil(span / 10), 50)
end

-- An order for table.sort of records by their `field`, then their `id` (every replica sorts
-- alike).
local function by_then_id(field)
  return function(a, b)
    if a[field] ~= b[field] then
      return a[field] < b[field]
    end
    return a.id < b.id
  end
end

-- A binary min-heap of numbers in a table: push, and pop the least (nil when empty).
local function heap_push(heap, x)
  local i = #heap + 1
  heap[i] = x
  while i > 1 do
    local up = floor(i / 2)
    if heap[up] <= heap[i] then
      break
    end
    heap[up], heap[i] = heap[i], heap[up]
    i = up
  end
end

local function heap_pop(heap)
  local top, last = heap[1], #heap
  if not top then
    return nil
  end
  local moved = heap[last]
  heap[last] = nil
  if last == 1 then
    return top
  end
  heap[1] = moved
  local i = 1
  while true do
    local l, least = 2 * i, i
    if heap[l] and heap[l] < heap[least] then
      least = l
    end
    if heap[l + 1] and heap[l + 1] < heap[least] then
      least = l + 1
    end
    if least == i then
      return top
    end
    heap[i], heap[least] = heap[least], heap[i]
    i = least
  end
end

-- Tier ranks in a pool's queue (below, "Waiting for a slot"), and what a request of `work` ms
-- adds to its tenant's finish tag at its `weight` (thousandths).
local TIER_RANK = { critical = 0, standard = 1, sheddable = 2 }

local function cost_of(work, weight)
  return ceil(work * 1000 / max(1, weight))
end

-- An empty pool with nobody waiting drops every fair share field, its virtual times and its
-- tiers' finish tags: whatever a hold taken off without its share (by a replica from before fair
-- shares, in a rolling update) left behind does not outlive the pool's next idle moment, and an
-- idle pool has no contention to remember. `keys`: the pool scripts' KEYS (state, holds, leases,
-- waiting, finish tags of each tier, the provider scope, which keeps counting); `n`: the holds it
-- has now.
local function pool_forget_if_idle(keys, n)
  if n == 0 and call('HLEN', keys[4]) == 0 then
    local all = call('HGETALL', keys[1])
    for i = 1, #all, 2 do
      local f = string.sub(all[i], 1, 1)
      if f == 'f' or f == 'v' then
        call('HDEL', keys[1], all[i])
      end
    end
    for i = 5, 7 do
      call('DEL', keys[i])
    end
  end
end

-- A pool hold's charge of its provider's limits, its `<id>+` entry beside it in the pool holds
-- hash: what it took (`n`, {u, c, p, g}), the periods it took it in (`at`), the provider scope's
-- idle TTL, the scope's request bucket terms (a request given back refills by them), and the
-- counters it charged beside ALWAYS (`kc`, charged_counters).
local function provider_charge(n, at, idle, s, kc)
  return string.format('%d %d %d %d %d %d %d %d %.17g %s', n.u, n.c, n.p, n.g, at.d, at.h, idle, s.rcap,
    s.rrate, kc)
end

-- A charge as provider_charge wrote it.
local function provider_charge_read(charge)
  local c = split(charge)
  return { held = amounts(tonumber(c[1]), tonumber(c[2]), tonumber(c[3]), tonumber(c[4])),
    at = periods_of(tonumber(c[5]), tonumber(c[6])), idle = tonumber(c[7]), rcap = tonumber(c[8]),
    rrate = tonumber(c[9]), kc = c[10] }
end

-- How a pool hold's request ended, where that settles its provider charge (pool_release.lua).
local SETTLES_CHARGE = { unused = true, released = true, used = true }

-- Settles a pool hold's provider charge (`c`, provider_charge_read) in scope `key` by how its
-- request ended, `ending`: {how, prompt, output, cost} (counts nil: as held). `unused` (it never
-- reached the backend: the tenant leg refused it, or nobody received the admission) gives all of
-- it back, its request too; `released` (it ended with no usage) its tokens and money, the request
-- having reached the provider; `used` moves it to the counts, refunding what was held beyond
-- them and charging an overrun as debt, as a tenant's commit does. (Any other ending leaves it
-- charged as held: missing usage is not zero usage.)
local function provider_settle(key, c, ending, now)
  local held = c.held
  if ending.how == 'used' then
    local p, g = ending.prompt or held.p, ending.output or held.g
    local n = amounts(p + g - held.u, (ending.cost or held.c) - held.c, p - held.p, g - held.g)
    settle({ key }, n, c.at, periods_at(now, 0), now, c.kc, nil, c.idle)
    return
  end
  refund({ key }, held, c.at, now, c.kc, nil, c.idle)
  if ending.how == 'unused' and c.rcap > 0 then
    give_requests(key, 1, c.rcap, c.rrate, now, true)
  end
end

-- Takes one hold off a pool with the work it holds by then; returns that work, or nil if the pool
-- does not hold it (already released, or swept after its lease). A request still waiting for a
-- slot (pool_reserve.lua's queue) leaves the queue here too. Either way, a pool left empty forgets.
-- `ending` (nil: its lease ran out) says how its request ended, which settles its provider charge
-- (provider_settle); `unused` there also means the request never reached the backend, so the
-- finish tag its admission added (its entry's `<cost>`) is taken back: its tenant
-- is not queued as if served.
local function pool_drop(keys, id, ending)
  local state, holds, leases = keys[1], keys[2], keys[3]
  local unused = ending and ending.how == 'unused'
  local h = call('HGET', holds, id)
  call('ZREM', leases, id)
  if call('HDEL', keys[4], id) == 1 and not h then
    -- The last one waiting for an empty pool leaves.
    pool_forget_if_idle(keys, tonumber(call('HGET', state, 'n')) or 0)
  end
  if not h then
    return nil
  end
  local parts = split(h)
  local work, kv = tonumber(parts[1]), tonumber(parts[2])
  local charge = ending and SETTLES_CHARGE[ending.how] and call('HGET', holds, id .. '+')
  call('HDEL', holds, id, id .. '+')
  if charge then
    provider_settle(keys[8], provider_charge_read(charge), ending, now_ms())
  end
  if parts[4] then
    fair_add(state, parts[3], parts[4], 0, -work, -1)
  end
  if unused and (tonumber(parts[5]) or 0) > 0 then
    local tags, tenant = keys[5 + TIER_RANK[parts[3]]], parts[4]
    local tag = tonumber(call('ZSCORE', tags, tenant))
    if tag then
      local virtual = tonumber(call('HGET', state, 'v' .. parts[3])) or 0
      local back = tag - tonumber(parts[5])
      if back > virtual then
        call('ZADD', tags, back, tenant)
      else
        call('ZREM', tags, tenant)
      end
    end
  end
  local v = call('HMGET', state, 'n', 'w', 'kv')
  local n = max(0, (tonumber(v[1]) or 0) - 1)
  call('HSET', state, 'n', n, 'w', max(0, (tonumber(v[2]) or 0) - work), 'kv',
    max(0, (tonumber(v[3]) or 0) - kv))
  pool_forget_if_idle(keys, n)
  return work
end

-- Waiting for a slot (pool_reserve.lua, a pool that queues in tollgate). The pool's waiting hash:
--   reservation id -> "<tier rank> <tenant> <work> <arrival ms> <expires ms> <weight>"
-- tier ranks: critical 0, standard 1, sheddable 2. An entry lives while its caller polls (each
-- call moves `expires` on by the waiter TTL), so a replica that dies leaves nobody blocking.
--
-- Order within a tier: start-time fair queueing by tenant (a virtual token counter). Each tier has
-- a virtual time (the state's `v<tier>`: the highest start tag admitted there) and each tenant a
-- finish tag (its tier's sorted set: member tenant, score the tag). A tenant's waiting requests,
-- in arrival order, start at max(virtual time, its finish tag) and each adds its cost, work (ms)
-- over its weight, for the next: so a tenant is served in proportion to its weight while others
-- wait, and one back from quiet starts at the virtual time, with no credit for its quiet. Tags
-- are computed from the entries as they stand, and written only when a request is admitted, so
-- a request refused or given up changes no one's place. Tags at or below the virtual time mean
-- the virtual time and are dropped.
-- The waiting hash's live entries (expired ones removed), parsed.
local function waiters_of(waiting, now)
  local all, live = call('HGETALL', waiting), {}
  for i = 1, #all, 2 do
    local p = split(all[i + 1])
    if tonumber(p[5]) <= now then
      call('HDEL', waiting, all[i])
    else
      live[#live + 1] = { id = all[i], rank = tonumber(p[1]), tenant = p[2], work = tonumber(p[3]),
        arrival = tonumber(p[4]), weight = tonumber(p[6]) }
    end
  end
  return live
end

-- Start tags of `entries` (one tier's), in place, from the tier's virtual time and tenants' finish
-- tags in `tags`.
local function start_tags(entries, tags, virtual)
  table.sort(entries, by_then_id('arrival'))
  local next_start = {}
  for _, e in ipairs(entries) do
    local s = next_start[e.tenant]
    if not s then
      s = max(virtual, tonumber(call('ZSCORE', tags, e.tenant)) or virtual)
    end
    e.start = s
    next_start[e.tenant] = s + cost_of(e.work, e.weight)
  end
end

-- Output-length estimate (one hash per tenant and model, learned from commits):
--   n     samples (halved whenever it passes the window, so the estimate follows drift)
--   b<i>  samples whose output fell in bucket i: (1.05^(i-1), 1.05^i] tokens; b0 holds 0 and 1
--   q     the tracked quantile, as the upper edge of its bucket (rounding up: a hold errs large)
--   qb qc the bucket q is the edge of, and the samples at or below it
--   us ov all tokens used, and all tokens used beyond their hold, since the estimate began

local GROWTH = 1.05

local function bucket_of(tokens)
  if tokens <= 1 then
    return 0
  end
  return ceil(math.log(tokens) / math.log(GROWTH) - 1e-9)
end

-- The quantile from every bucket: the first bucket, in order, at which the samples so far reach
-- quantile x n. Halves every bucket first when n has passed the window. Returns n.
local function recompute(key, n, quantile, window)
  local flat = call('HGETALL', key)
  local buckets = {}
  for i = 1, #flat, 2 do
    if string.sub(flat[i], 1, 1) == 'b' then
      buckets[#buckets + 1] = { tonumber(string.sub(flat[i], 2)), tonumber(flat[i + 1]) }
    end
  end
  if n > window then
    n = 0
    for _, b in ipairs(buckets) do
      b[2] = floor(b[2] / 2)
      if b[2] == 0 then
        call('HDEL', key, 'b' .. b[1])
      else
        call('HSET', key, 'b' .. b[1], b[2])
      end
      n = n + b[2]
    end
    call('HSET', key, 'n', n)
  end
  table.sort(buckets, function(x, y)
    return x[1] < y[1]
  end)
  local need, seen, q, qb = quantile * n, 0, 1, 0
  for _, b in ipairs(buckets) do
    seen = seen + b[2]
    q, qb = ceil(GROWTH ^ b[1] - 1e-9), b[1]
    if seen >= need then
      break
    end
  end
  call('HSET', key, 'q', q, 'qb', qb, 'qc', seen)
end

-- Teaches the estimate one output length. A sample moves the quantile only when the samples
-- below q's bucket now reach quantile x n, or those at or below it no longer do: only then is it
-- recomputed from every bucket (and when the window halves them); otherwise it stands, with the
-- very value a recomputation would give.
local function learn(key, output, used, overrun, quantile, window, ttl)
  local b = bucket_of(output)
  local in_b = call('HINCRBY', key, 'b' .. b, 1)
  local n = call('HINCRBY', key, 'n', 1)
  call('HINCRBY', key, 'us', used)
  call('HINCRBY', key, 'ov', overrun)
  call('PEXPIRE', key, ttl)
  local at = call('HMGET', key, 'qb', 'qc')
  local qb, qc = tonumber(at[1]), tonumber(at[2])
  if n <= window and qb and qc then
    if b <= qb then
      qc = qc + 1
    end
    local in_qb = in_b
    if b ~= qb then
      in_qb = tonumber(call('HGET', key, 'b' .. qb)) or 0
    end
    local need = quantile * n
    if in_qb > 0 and qc >= need and qc - in_qb < need then
      call('HSET', key, 'qc', qc)
      return
    end
  end
  recompute(key, n, quantile, window)
end

-- A batch of commits gathers its writes, and makes them at its end (make_gathered): the rest in
-- order (see at_batch_end), then those to the keys its commits share, once each (every scope
-- hash's fields, read once, see scope_fields; the lease index's and the holds hash's removals;
-- the settled bucket's entries; the records dropped). What a commit reads of these it reads as
-- the batch left them (the scopes), or after make_gathered: a record the batch has dropped is
-- loaded again only after (see commit_many.lua). So a script error before the batch's end (Redis
-- undoes nothing) has written nothing of the commits gathered since the last make_gathered (the
-- batch's start, unless a repeat inside it made them), and those can each be made again alone.
local function gather()
  gathered = { scopes = {}, dirty = {}, kept = {}, closed = { ids = {}, fields = {} }, filed = {}, dropped = {},
    later = {} }
end

-- Makes the writes gathered since gather, and gathers no more.
local function make_gathered()
  local g = gathered
  gathered = nil
  if not g then
    return
  end
  for _, f in ipairs(g.later) do
    f()
  end
  for _, key in ipairs(g.dirty) do
    local w, n = places(), 0
    for field, value in pairs(g.dirty[key]) do
      w[n + 1], w[n + 2], n = field, value, n + 2
    end
    call('HSET', key, unpack(w, 1, n))
  end
  for _, key in ipairs(g.kept) do
    keep_for(key, g.kept[key])
  end
  local closed = g.closed
  if #closed.ids > 0 then
    call('ZREM', closed.leases, unpack(closed.ids))
    call('HDEL', closed.holds, unpack(closed.fields))
  end
  for _, bucket in ipairs(g.filed) do
    local b = g.filed[bucket]
    b[#b + 1], b[#b + 2] = 'ttl', '1'
    -- (As file_settled: a bucket that had its mark has its TTL.)
    if call('HSET', bucket, unpack(b)) ~= b.n then
      call('PEXPIRE', bucket, b.expires)
    end
  end
  if #g.dropped > 0 then
    call('DEL', unpack(g.dropped))
  end
end

-- The commit phase of one hold (commit.lua; commit_many.lua runs it for each of a batch): `rk` its
-- record, `t` its tenant's terms now ({estimate_ttl, window, settled, zone}: ARGV 4, 5, 7, 8 and
-- 13 of commit.lua), `c` the commit ({id, prompt, output, measure, read, written, reasoning,
-- ending}: ARGV 1, 2, 3, 6, 9, 10, 11 and 12). Returns commit.lua's reply.
local function commit_hold(rk, leases, holds, ledger, t, c, now)
  local id, ending, settled = c.id, c.ending, t.settled
  local metered = c.measure == 'metered'
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
  local prompt = tonumber(c.prompt) or (r.h - output_held)
  local output = tonumber(c.output) or output_held

  if r.st == 'reserved' and now >= r.le then
    -- Entered in the ledger once, as the late commit below.
    expire(rk, id, r, leases, holds, now, nil)
  end

  local keys = split(r.ks)
  -- Cached and reasoning tokens count at their weight and price only beside reported counts.
  local read, written, reasoning = tonumber(c.read), tonumber(c.written), tonumber(c.reasoning)
  if metered or c.prompt == '' then
    read, written, reasoning = nil, nil, nil
  end
  local used, cost, used_in, used_out = charged_for(r, prompt, output, read or 0, written or 0, reasoning or 0)
  local slots = 0
  if r.sl == '1' then
    slots = 1
  end
  local had = charged_of(r)
  local now_at = periods_at(now, tonumber(t.zone) or r.zo)
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
  if c.output == '' then
    usage = 'held'
  elseif metered then
    usage = 'metered'
  elseif c.prompt == '' then
    usage = 'held'
  end
  if has_ledger(r) then
    local entry = ledger_entry(id, r, state, usage, used, cost, ending)
    entry.prompt, entry.output = prompt, output
    entry.cache_read, entry.cache_write, entry.reasoning = read, written, reasoning
    at_batch_end(function()
      ledger_append(ledger, r.lg, entry, now)
    end)
  end
  if r.ok and r.ok ~= '' and t.window > 0 and not metered then
    at_batch_end(function()
      learn(r.ok, output, used, overrun, tonumber(r.oq), t.window, t.estimate_ttl)
    end)
  end
  return { state, 0, used, r.h, refunded, overrun, mx, r.md or '', tonumber(r.oh) or -1, cost, ending }
end
