-- commit_many.lua: the reconcile phase for a batch of one tenant's holds, in one call: each
-- commit as commit.lua would make it alone, in order, at one time (common.lua's commit_hold), so
-- a batch charges exactly what its commits made one by one would. The gateway batches the commits
-- it makes from responses (store.commit_window_ms): one call settles a few, where each would pay
-- for a call of its own; and the writes to the keys they share (their scopes, the lease index,
-- the holds hash, the settled bucket, the records dropped) are made once, at the end (common.lua's
-- gather).
--
-- KEYS[1] the tenant's lease index      KEYS[2] the tenant's holds hash
-- KEYS[3] the tenant's usage ledger     KEYS[4..] the reservation records, one per commit
-- ARGV[1] TTL of the output estimate these commits teach (ms)
-- ARGV[2] samples the estimate keeps before it halves them all (0: the tenant no longer learns)
-- ARGV[3] the tenant's settled-bucket prefix          ARGV[4] retention of settled records (ms)
-- ARGV[5] the tenant's time zone: its offset from UTC now, in minutes east ('' when the policy no
--         longer has the tenant)
-- then eight per commit, in KEYS order: reservation id, prompt tokens used, output tokens used,
--   exact | metered, cache reads, cache writes, reasoning tokens, how the request ended (each as
--   commit.lua's ARGV 1, 2, 3, 6, 9, 10, 11 and 12)
--
-- Reply: each commit's commit.lua reply, in KEYS order, one after the other in one flat list (its
--   eleven fields a commit: a nested table would cost Redis more to answer than its fields).

local FIRST_RECORD, FIRST_ARG, PER_COMMIT = 4, 5, 8
local terms = { estimate_ttl = tonumber(ARGV[1]), window = tonumber(ARGV[2]),
  settled = { prefix = ARGV[3], retention = tonumber(ARGV[4]) }, zone = ARGV[5] }
local now = now_ms()
local replies = {}
gather()
for i = FIRST_RECORD, #KEYS do
  local b = FIRST_ARG + (i - FIRST_RECORD) * PER_COMMIT
  local c = { id = ARGV[b + 1], prompt = ARGV[b + 2], output = ARGV[b + 3], measure = ARGV[b + 4],
    read = ARGV[b + 5], written = ARGV[b + 6], reasoning = ARGV[b + 7], ending = ARGV[b + 8] }
  -- (A record the batch dropped already: its commit is a repeat, read once the batch's writes are
  -- made, as a commit after it would read them.)
  if gathered.dropped[KEYS[i]] then
    make_gathered()
    gather()
  end
  local reply = commit_hold(KEYS[i], KEYS[1], KEYS[2], KEYS[3], terms, c, now)
  local k = #replies
  for j = 1, #reply do
    replies[k + j] = reply[j]
  end
end
make_gathered()
return replies
