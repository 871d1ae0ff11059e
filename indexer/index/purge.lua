-- Remove every entry of a host, its group cursors and (single node) its cursor.
-- ARGV[6] hid, [7] mode ('c' single node: every group, and the host cursor;
-- 'g' cluster: the listed groups), [8] counter key, [9] n groups, the groups.
-- Cost: O(the host's reverse buckets + its entries); no keyspace scan.
-- Returns the number of entries removed.
local hs = ARGV[6]
local hid = tonumber(hs)
local delta = {[0] = 0, [1] = 0, [2] = 0}
local groups = {}
if ARGV[7] == 'c' then
  call('HDEL', PFX .. 'cur', hid)
  for g = 0, 2 ^ GROUP_BITS - 1 do groups[#groups + 1] = g end
else
  for j = 10, 9 + tonumber(ARGV[9]) do groups[#groups + 1] = tonumber(ARGV[j]) end
end
local removed = 0
for _, g in ipairs(groups) do
  removed = removed + clear_group(hid, hs, g, delta)
  call('HDEL', group_key(g, 'gc'), hid)
end
flush_counters(ARGV[8], delta)
return removed
