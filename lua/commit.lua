-- commit.lua: the reconcile phase. Charges what generation actually used against what the hold
-- charged: the difference is refunded, or charged as debt when usage overran the hold.
--
-- KEYS[1] the reservation record
-- KEYS[2] the tenant's lease index
-- KEYS[3] the tenant's holds hash
-- KEYS[4] the tenant's usage ledger (the commit is entered in it when the hold's terms say so)
-- ARGV[1] reservation id
-- ARGV[2] prompt tokens used, or empty when the response did not say: the prompt held is charged
-- ARGV[3] output tokens used, or empty when they could not be counted: the output held is charged
-- ARGV[4] TTL of the output estimate this commit teaches (ms)
-- ARGV[5] samples the estimate keeps before it halves them all (0: the tenant no longer learns)
-- ARGV[6] exact | metered: whether the counts were reported or metered by tollgate
-- ARGV[7] the tenant's settled-bucket prefix (prefix .. period number = a bucket; see common.lua)
-- ARGV[8] retention of settled records (ms): the period of the settled buckets
-- ARGV[9] cache reads: of the prompt, tokens the provider read from its cache ('' when unsaid)
-- ARGV[10] cache writes: of the prompt, tokens written to the provider's cache ('' when unsaid)
-- ARGV[11] reasoning tokens: of the output ('' when unsaid; charged at their weight and price)
-- ARGV[12] how the request ended: completed | metered | metered_capped | as_held | client_left |
--          upstream_refused | upstream_error (kept with the settled hold, entered in the ledger)
-- ARGV[13] the tenant's time zone: its offset from UTC now, in minutes east ('' when the policy no
--          longer has the tenant: the offset the hold was made with); debt counts in its periods
--
-- Reply: {state, duplicate (0|1), used, held, refunded, overrun, metered (0|1), model, output held,
--         cost (nanos, at the prices the hold was made with), ending}
--   (ending: how the request ended, as the commit that settled it said; '' when unknown)
--   (used: the tokens charged, cached and reasoning tokens at the weights the hold was made with)
--   (model: the one the request named, '' for a hold made before records kept it; output held: the
--    output part of the hold, -1 when unknown)
--   state: committed | late_committed, or not_found | released when nothing was charged
--   A commit of an already committed id returns the first commit's result with duplicate = 1: a
--   caller that commits twice, or a client that re-sends after a lost reply, charges once.
--
-- A hold that learns (its record names an estimate) teaches it the output length, once, and only
-- an exact one: a metered length would teach the estimate the meter's error.
--
-- Invariants: each record is charged for usage at most once; a hold whose lease has passed is
-- settled as expired first (whether or not a sweep reached it), then late-committed, so the
-- outcome does not depend on when the sweep ran; debt is charged against the bucket as it stands
-- now (refilled first), so a full bucket's discarded refill never pays it.

-- (The phase itself is common.lua's commit_hold, which commit_many.lua runs for a batch.)
local terms = { estimate_ttl = tonumber(ARGV[4]), window = tonumber(ARGV[5]),
  settled = { prefix = ARGV[7], retention = tonumber(ARGV[8]) }, zone = ARGV[13] }
local c = { id = ARGV[1], prompt = ARGV[2], output = ARGV[3], measure = ARGV[6], read = ARGV[9],
  written = ARGV[10], reasoning = ARGV[11], ending = ARGV[12] }
return commit_hold(KEYS[1], KEYS[2], KEYS[3], KEYS[4], terms, c, now_ms())
