-- sweep_done.lua: a sweeper settled what was due of a tenant it took (sweep_take.lua): drops the
-- tenant from the index when nothing is left to settle, or moves it to when its next lease passes.
-- A tenant noted since it was taken (its due time moved) is left as the note set it.
--
-- KEYS[1] the shard (sorted set: tenant -> due at, ms)
--
-- ARGV[1] the tenant              ARGV[2] the due time it was claimed at
-- ARGV[3] when its next lease passes (ms, store clock; -1: nothing left)
--
-- Reply: 1 when the tenant was dropped, else 0.
--
-- Invariants: only a sweep that found nothing left drops a tenant, and never one noted after it
-- was taken.

local shard, tenant = KEYS[1], ARGV[1]
local claimed, next_due = tonumber(ARGV[2]), tonumber(ARGV[3])
local cur = tonumber(call('ZSCORE', shard, tenant))
if cur ~= claimed then
  return 0
end
if next_due < 0 then
  call('ZREM', shard, tenant)
  return 1
end
call('ZADD', shard, next_due, tenant)
return 0
