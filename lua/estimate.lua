-- estimate.lua: reads a tenant's output-length estimate for one model, and its error so far.
--
-- KEYS[1] the output-estimate hash
--
-- Reply: {samples, reserved quantile (tokens; 0 before the first sample), tokens used, tokens used
--         beyond their hold}
local v = call('HMGET', KEYS[1], 'n', 'q', 'us', 'ov')
return { tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0 }
