-- pool_status.lua: what a pool holds and how far its provider's 429s throttle it. Reads only.
--
-- KEYS[1] the pool's state hash
-- ARGV[1] recovery of the share per ms (as pool_throttle.lua)
--
-- Reply: {holds, work (ms), KV tokens, share in thousandths, ms until admission resumes}

local now = now_ms()
local v = call('HMGET', KEYS[1], 'n', 'w', 'kv', 'tf', 'tt', 'tu')
local share = pool_share(v[4], v[5], tonumber(ARGV[1]), now)
return { tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, floor(share * 1000),
  max(0, (tonumber(v[6]) or 0) - now) }
