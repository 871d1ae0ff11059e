-- Apply one host's event batch atomically, if it is next in the host's order.
-- ARGV[6] hid, [7] mode ('c': check the host cursor here, single node;
-- 'g': the client checked it, skip groups whose group cursor already shows
-- this batch, Redis Cluster), [8] new cursor "epoch:seq", [9] cursor that
-- makes this batch next ("epoch:seq-1", or ""), [10] epoch, [11] seq,
-- [12] "1" if a host without cursor takes it, [13] counter key,
-- [14] n covered groups ('g'), then the groups, then the events:
-- 's'|'r', rank, keys (8 bytes each, concatenated)  or  'c'.
-- Returns {status (1 applied, 2 duplicate, 3 gap), blocks applied, cursor}.
local hs = ARGV[6]
local hid = tonumber(hs)
local mode = ARGV[7]
local new_cursor = ARGV[8]
local ngroups = tonumber(ARGV[14])
local delta = {[0] = 0, [1] = 0, [2] = 0}
local blocks = 0

local covered = {}
local skip = {}
if mode == 'c' then
  local ckey = PFX .. 'cur'
  local cur = call('HGET', ckey, hid)
  if not cur then
    if ARGV[12] ~= '1' then return {3, 0, false} end
  elseif cur ~= ARGV[9] then
    local sep = string.find(cur, ':', 1, true)
    if sub(cur, 1, sep - 1) == ARGV[10] and dec_ge(sub(cur, sep + 1), ARGV[11]) then
      return {2, 0, cur}
    end
    return {3, 0, cur}
  end
  call('HSET', ckey, hid, new_cursor)
  for g = 0, 2 ^ GROUP_BITS - 1 do covered[#covered + 1] = g end
else
  for j = 15, 14 + ngroups do
    local g = tonumber(ARGV[j])
    if call('HGET', group_key(g, 'gc'), hid) == new_cursor then
      skip[g] = true
    else
      covered[#covered + 1] = g
    end
  end
end

local i = 15 + ngroups
local n_args = #ARGV
while i <= n_args do
  local kind = ARGV[i]
  if kind == 'c' then
    for _, g in ipairs(covered) do clear_group(hid, hs, g, delta) end
    i = i + 1
  else
    local rank = tonumber(ARGV[i + 1])
    local keys = ARGV[i + 2]
    local op = (kind == 's') and store or remove
    for j = 1, #keys, 8 do
      local k = sub(keys, j, j + 7)
      local t = top32(k)
      if not skip[group_of(t)] then
        op(hid, hs, k, t, rank, delta)
        blocks = blocks + 1
      end
    end
    i = i + 3
  end
end

if mode ~= 'c' then
  for _, g in ipairs(covered) do call('HSET', group_key(g, 'gc'), hid, new_cursor) end
end
flush_counters(ARGV[13], delta)
return {1, blocks, new_cursor}
