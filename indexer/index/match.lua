-- Longest cached prefix per host of a chain of block keys, in one call.
-- ARGV[6]: the chain's keys in order, 8 bytes each, concatenated. A host's
-- prefix ends at the first key it does not hold; the walk stops once no
-- host can extend its match.
-- Returns a flat array: hid, blocks, on hbm, on dram, on ssd, ... per host.
--
-- seen[h] == i marks "h holds key i" without a new table per key. A value
-- equal to the previous key's (Lua strings are interned: O(1) compare) has
-- the same holders on the same media, so such runs are only counted and
-- credited to the surviving hosts when the run ends.
local chain = ARGV[6]
local alive, done, n_alive = {}, {}, 0
local seen, rank_of = {}, {}
local prev, run = nil, 0

local function credit()
  if run == 0 then return end
  for h, st in pairs(alive) do
    local r = 2 + rank_of[h]
    st[1] = st[1] + run
    st[r] = st[r] + run
  end
  run = 0
end

for i = 1, #chain, 8 do
  local k = sub(chain, i, i + 7)
  local val = call('HGET', fwd_key(k, top32(k)), k)
  if not val then break end
  if val == prev then
    run = run + 1
  else
    credit()
    prev = val
    for j = 1, #val, 3 do
      local a, b, c = byte(val, j, j + 2)
      local h = (a * 256 + b) * 64 + floor(c / 4)
      seen[h] = i
      rank_of[h] = c % 4
    end
    if i == 1 then
      for h in pairs(seen) do
        local st = {1, 0, 0, 0}
        st[2 + rank_of[h]] = 1
        alive[h] = st
        n_alive = n_alive + 1
      end
    else
      for h, st in pairs(alive) do
        if seen[h] == i then
          local r = 2 + rank_of[h]
          st[1] = st[1] + 1
          st[r] = st[r] + 1
        else
          done[h] = st
          alive[h] = nil
          n_alive = n_alive - 1
        end
      end
    end
    if n_alive == 0 then break end
  end
end
credit()

local out = {}
for _, set in ipairs({alive, done}) do
  for h, st in pairs(set) do
    out[#out + 1] = h
    out[#out + 1] = st[1]
    out[#out + 1] = st[2]
    out[#out + 1] = st[3]
    out[#out + 1] = st[4]
  end
end
return out
