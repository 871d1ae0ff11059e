-- Replace a host's entries with a snapshot.
-- ARGV[6] hid, [7] mode ('c' single node: check and set the host cursor
-- here; 'g' cluster: the client checked it), [8] cursor "epoch:seq",
-- [9] epoch, [10] seq, [11] counter key, [12] n covered groups ('g'), the
-- groups, then per medium: rank, keys (8 bytes each, concatenated).
-- Returns {1 replaced | 0 stale (older than the cursor of the same epoch), entries}.
local hs = ARGV[6]
local hid = tonumber(hs)
local mode = ARGV[7]
local new_cursor = ARGV[8]
local ngroups = tonumber(ARGV[12])
local delta = {[0] = 0, [1] = 0, [2] = 0}
local covered = {}
if mode == 'c' then
  local ckey = PFX .. 'cur'
  local cur = call('HGET', ckey, hid)
  if cur then
    local sep = string.find(cur, ':', 1, true)
    local cur_seq = sub(cur, sep + 1)
    if sub(cur, 1, sep - 1) == ARGV[9] and cur_seq ~= ARGV[10] and dec_ge(cur_seq, ARGV[10]) then
      return {0, 0}
    end
  end
  call('HSET', ckey, hid, new_cursor)
  for g = 0, 2 ^ GROUP_BITS - 1 do covered[#covered + 1] = g end
else
  for j = 13, 12 + ngroups do
    local g = tonumber(ARGV[j])
    covered[#covered + 1] = g
    call('HSET', group_key(g, 'gc'), hid, new_cursor)
  end
end
for _, g in ipairs(covered) do clear_group(hid, hs, g, delta) end

local i = 13 + ngroups
local n_args = #ARGV
local entries = 0
while i <= n_args do
  local rank = tonumber(ARGV[i])
  local keys = ARGV[i + 1]
  for j = 1, #keys, 8 do
    local k = sub(keys, j, j + 7)
    store(hid, hs, k, top32(k), rank, delta)
  end
  entries = entries + #keys / 8
  i = i + 2
end
flush_counters(ARGV[11], delta)
return {1, entries}
