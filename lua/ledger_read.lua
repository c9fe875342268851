-- ledger_read.lua: `tollgate ledger` reads one tenant's ledger stream through a consumer group.
-- (Not a protocol phase: it settles nothing, and reads only what the phases appended.)
--
-- KEYS[1] a tenant's ledger stream
-- ARGV[1] the consumer group (made at the stream's start when it does not exist yet)
-- ARGV[2] this consumer
-- ARGV[3] most entries to return
-- ARGV[4] where to read: '0', this consumer's entries read but not acknowledged; '>', entries
--         nobody has read
-- ARGV[5] entries another consumer left unacknowledged this long (ms) become this one's (0: never);
--         looked at with '0' only
--
-- Reply: {entry id, {field, value, ...}, ...}; an entry trimmed after it was read but before it
-- was acknowledged comes with no fields (acknowledge it: it is gone).
-- (XAUTOCLAIM is Redis 7's: it names the entries it found trimmed.)

local stream, group, consumer, count, from, claim = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
if redis.call('EXISTS', stream) == 0 then
  return {}
end
local made = redis.pcall('XGROUP', 'CREATE', stream, group, '0')
if type(made) == 'table' and made.err and not string.find(made.err, 'BUSYGROUP', 1, true) then
  return redis.error_reply(made.err)
end
local out = {}
if from == '0' and claim > 0 then
  -- Redis drops from the group's pending list the entries trimmed away as it claims: they are
  -- answered as trimmed.
  local claimed = redis.call('XAUTOCLAIM', stream, group, consumer, claim, '0-0', 'COUNT', count, 'JUSTID')
  for _, gone in ipairs(claimed[3] or {}) do
    out[#out + 1] = gone
    out[#out + 1] = {}
  end
end
local read = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count, 'STREAMS', stream, from)
if not read then
  return out
end
for _, e in ipairs(read[1][2]) do
  out[#out + 1] = e[1]
  out[#out + 1] = e[2] or {}
end
return out
