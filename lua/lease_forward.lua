-- lease_forward.lua: hands a Commit, Release or Renew of a leased hold to the replica that holds it.
-- A leased hold lives in its replica's memory; a call that reaches another replica leaves the
-- operation here, and the owner takes it with its next lease call (within one lease window).
--
-- KEYS[1] the owner's forwarded operations (hash: reservation id -> operation)
-- KEYS[2] the owner's lease record
-- ARGV[1] reservation id
-- ARGV[2] the operation: 'commit <prompt|-> <output|-> exact|metered' | 'release' | 'renew <ms>'
-- ARGV[3] TTL of the forwarded operations (ms): the owner's lease
--
-- Reply: forwarded | gone (the owner holds no lease on the tenant: it stopped, and its holds were
-- or will be settled by the sweep as expired)
--
-- The first commit or release forwarded for an id stands (as the first commit of a store hold does);
-- a renew replaces only a renew.

local ops = KEYS[1]
local id = ARGV[1]
local op = ARGV[2]

if not call('HGET', KEYS[2], '@') then
  return 'gone'
end
local earlier = call('HGET', ops, id)
if earlier and string.sub(earlier, 1, 5) ~= 'renew' then
  return 'forwarded'
end
call('HSET', ops, id, op)
keep_for(ops, tonumber(ARGV[3]))
return 'forwarded'
