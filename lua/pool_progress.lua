-- pool_progress.lua: a live stream's remaining work. The commit from the response counts the
-- tokens that pass and says how much slot time the stream still needs; the pool's outstanding
-- work shrinks by what was done, so the queue estimate frees as generation proceeds, not only at
-- commit. Work only ever shrinks here (an update that arrives late, after a smaller one, changes
-- nothing; its predicted end moves to now + what it has left all the same), and the hold leaves the pool (pool_release, expiry) with what it holds by then: the
-- pool's work stays the sum of its holds' work (and each tenant's share of its tier, the sum of
-- its holds' there).
--
-- KEYS[1] the pool's state hash     KEYS[2] the pool's holds hash
-- ARGV[1] reservation id            ARGV[2] the work it has left (ms)
--
-- Reply: {1, work it holds now (ms)}; {0, 0} when the pool does not hold it (nothing changes).

local state, holds, id = KEYS[1], KEYS[2], ARGV[1]
local left = tonumber(ARGV[2])
local h = call('HGET', holds, id)
if not h then
  return { 0, 0 }
end
local parts = split(h)
local work = tonumber(parts[1])
if parts[6] then
  parts[6] = string.format('%d', pool_ends(now_ms(), left))
end
if left >= work then
  if parts[6] then
    call('HSET', holds, id, table.concat(parts, ' '))
  end
  return { 1, work }
end
local w = tonumber(call('HGET', state, 'w')) or 0
call('HSET', state, 'w', max(0, w - (work - left)))
parts[1] = string.format('%d', left)
call('HSET', holds, id, table.concat(parts, ' '))
if parts[4] then
  fair_add(state, parts[3], parts[4], 0, left - work, 0)
end
return { 1, left }
