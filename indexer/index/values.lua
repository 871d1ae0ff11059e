-- The forward values of the given block keys (false where absent), for a
-- client that combines answers from several cluster nodes into prefixes.
-- ARGV[6]: block keys, 8 bytes each, concatenated, all in groups served by this node.
local out = {}
local keys = ARGV[6]
for i = 1, #keys, 8 do
  local k = sub(keys, i, i + 7)
  out[#out + 1] = call('HGET', fwd_key(k, top32(k)), k)
end
return out
