-- pool_throttle.lua: a provider refused a request of this pool (HTTP 429): lower the share of the
-- pool admitted, multiplicatively, and admit nothing new until its Retry-After has passed. The
-- share recovers additively with time (read in pool_reserve.lua), so tollgate stops admitting what
-- the provider will refuse and finds its way back when the provider does.
--
-- KEYS[1] the pool's state hash
-- ARGV[1] the provider's Retry-After (ms; 0: none given)
-- ARGV[2] the factor a refusal multiplies the share by (0 < d <= 1)
-- ARGV[3] the lowest share                     ARGV[4] recovery of the share per ms
-- ARGV[5] cooldown (ms): refusals closer together than this count once (one burst, one decrease)
-- ARGV[6] idle TTL of the pool's keys (ms)
--
-- Pool state fields: tf the share at tt (ms), td the last decrease (ms), tu admit nothing until (ms).
--
-- Reply: {share in thousandths, ms until admission resumes}

local state = KEYS[1]
local retry_after = tonumber(ARGV[1])
local decrease = tonumber(ARGV[2])
local lowest = tonumber(ARGV[3])
local recover = tonumber(ARGV[4])
local cooldown = tonumber(ARGV[5])
local idle = tonumber(ARGV[6])

local now = now_ms()
local v = call('HMGET', state, 'tf', 'tt', 'td', 'tu')
local share = pool_share(v[1], v[2], recover, now)
local last = tonumber(v[3])
if not last or now - last >= cooldown then
  share = max(lowest, share * decrease)
  last = now
end
local resume = max(tonumber(v[4]) or 0, now + retry_after)
call('HSET', state, 'tf', share, 'tt', now, 'td', last, 'tu', resume)
keep_for(state, idle)
return { floor(share * 1000), resume - now }
