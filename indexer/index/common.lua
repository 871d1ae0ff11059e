-- Shared prelude of the index scripts (docs/index.md, "Lua scripts").
-- ARGV[1..5]: key prefix ("{p}:idx:"), key_bits, host_bits, group_bits,
-- and the "layout|incarnation" value the caller expects in {p}:idx:layout
-- ("" to skip the check, on cluster nodes that do not hold that key).
-- A different or missing value means Redis lost the index (a restart) or
-- was reset: the caller's cached host ids may be stale, so nothing runs.
-- Block keys arrive as 8-byte big-endian strings, concatenated in one
-- argument (one Redis argument instead of one per key); only their top 32
-- bits are ever turned into (exact) Lua numbers, to name buckets.
local PFX = ARGV[1]
if ARGV[5] ~= '' and redis.call('GET', PFX .. 'layout') ~= ARGV[5] then
  return redis.error_reply('KVINDEX_STALE index incarnation changed')
end
local KEY_BITS = tonumber(ARGV[2])
local HOST_BITS = tonumber(ARGV[3])
local GROUP_BITS = tonumber(ARGV[4])
local GDIV = 2 ^ (32 - GROUP_BITS)
local floor, ceil, byte, char, sub = math.floor, math.ceil, string.byte, string.char, string.sub
local call = redis.call

-- Key names (no string.format on the hot path):
--   PFX .. '{' .. tag(G) .. '}:f:' .. F        PFX .. '{' .. tag(G) .. '}:r:' .. hid .. ':' .. R
-- tag(G): the group in base 64, least significant digit first, digits '0'..'o'
-- (never a brace, so the hash tag is exactly the group); F and R: the key's top
-- key_bits / host_bits bits as raw big-endian bytes, low bits of a partial last
-- byte cleared.
local GCH = math.max(1, ceil(GROUP_BITS / 6))
local KB = ceil(KEY_BITS / 8)
local KMOD = 2 ^ (8 * KB - KEY_BITS)
local HB = ceil(HOST_BITS / 8)
local HMOD = 2 ^ (8 * HB - HOST_BITS)

local function top32(k)
  local a, b, c, d = byte(k, 1, 4)
  return ((a * 256 + b) * 256 + c) * 256 + d
end

local function group_of(t)
  return floor(t / GDIV)
end

local function tag(g)
  if GCH == 1 then return char(48 + g) end
  if GCH == 2 then return char(48 + g % 64, 48 + floor(g / 64)) end
  if GCH == 3 then return char(48 + g % 64, 48 + floor(g / 64) % 64, 48 + floor(g / 4096)) end
  return char(48 + g % 64, 48 + floor(g / 64) % 64, 48 + floor(g / 4096) % 64, 48 + floor(g / 262144))
end

local function top_bytes(k, nb, mod)
  if mod == 1 then return sub(k, 1, nb) end
  local last = byte(k, nb)
  return sub(k, 1, nb - 1) .. char(last - last % mod)
end

-- A bucket id v (already shifted to a whole number of bytes) as nb big-endian bytes.
local function id_bytes(v, nb)
  if nb == 0 then return '' end
  if nb == 1 then return char(v) end
  if nb == 2 then return char(floor(v / 256), v % 256) end
  return char(floor(v / 65536), floor(v / 256) % 256, v % 256)
end

local function fwd_key(k, t)
  return PFX .. '{' .. tag(floor(t / GDIV)) .. '}:f:' .. top_bytes(k, KB, KMOD)
end

local function rev_key(hs, k, t)
  return PFX .. '{' .. tag(floor(t / GDIV)) .. '}:r:' .. hs .. ':' .. top_bytes(k, HB, HMOD)
end

local function group_key(g, kind)
  return PFX .. '{' .. tag(g) .. '}:' .. kind
end

-- A holder is 3 bytes, big-endian hid * 4 + medium rank (memoized: one host per call).
local holders = {}
local function holder(hid, rank)
  local v = hid * 4 + rank
  local h = holders[v]
  if not h then
    h = char(floor(v / 65536), floor(v / 256) % 256, v % 256)
    holders[v] = h
  end
  return h
end

-- Position and rank of host hid's holder in a forward value, or nil.
local function find_holder(val, hid)
  local ha, hb, hc = floor(hid / 16384), floor(hid / 64) % 256, (hid % 64) * 4
  for i = 1, #val, 3 do
    local a, b, c = byte(val, i, i + 2)
    if a == ha and b == hb and c - c % 4 == hc then
      return i, c % 4
    end
  end
  return nil
end

-- Drop host hid from block k's forward entry (k on the reverse side says it is there).
local function drop_forward(hid, k, t)
  local f = fwd_key(k, t)
  local val = call('HGET', f, k)
  if not val then return end
  local pos = find_holder(val, hid)
  if not pos then return end
  if #val == 3 then
    call('HDEL', f, k)
  else
    call('HSET', f, k, sub(val, 1, pos - 1) .. sub(val, pos + 3))
  end
end

-- Remove every entry of host hid (hs: as a string) in group g; counts go to delta[rank].
local function clear_group(hid, hs, g, delta)
  local per = 2 ^ (HOST_BITS - GROUP_BITS)
  local head = PFX .. '{' .. tag(g) .. '}:r:' .. hs .. ':'
  local removed = 0
  for r = g * per, (g + 1) * per - 1 do
    local rk = head .. id_bytes(r * HMOD, HB)
    local items = call('HGETALL', rk)
    if #items > 0 then
      for i = 1, #items, 2 do
        local k = items[i]
        drop_forward(hid, k, top32(k))
        local rank = tonumber(items[i + 1])
        delta[rank] = delta[rank] - 1
        removed = removed + 1
      end
      call('DEL', rk)
    end
  end
  return removed
end

-- Host hid (hs) now holds block k on medium rank (a move if it held it elsewhere).
local function store(hid, hs, k, t, rank, delta)
  local f = fwd_key(k, t)
  if call('HSETNX', f, k, holder(hid, rank)) == 0 then
    local val = call('HGET', f, k)
    local pos, old = find_holder(val, hid)
    if not pos then
      call('HSET', f, k, val .. holder(hid, rank))
    elseif old == rank then
      return
    else
      call('HSET', f, k, sub(val, 1, pos - 1) .. holder(hid, rank) .. sub(val, pos + 3))
      delta[old] = delta[old] - 1
    end
  end
  call('HSET', rev_key(hs, k, t), k, rank)
  delta[rank] = delta[rank] + 1
end

-- Host hid (hs) no longer holds block k on medium rank (no-op if elsewhere or absent).
local function remove(hid, hs, k, t, rank, delta)
  local f = fwd_key(k, t)
  local val = call('HGET', f, k)
  if not val then return end
  local pos, old = find_holder(val, hid)
  if not pos or old ~= rank then return end
  if #val == 3 then
    call('HDEL', f, k)
  else
    call('HSET', f, k, sub(val, 1, pos - 1) .. sub(val, pos + 3))
  end
  call('HDEL', rev_key(hs, k, t), k)
  delta[rank] = delta[rank] - 1
end

local function flush_counters(counter_key, delta)
  for rank = 0, 2 do
    if delta[rank] ~= 0 then
      call('HINCRBY', counter_key, rank, delta[rank])
    end
  end
end

-- Decimal strings without leading zeros: a >= b, without Lua numbers.
local function dec_ge(a, b)
  if #a ~= #b then return #a > #b end
  for i = 1, #a do
    local x, y = byte(a, i), byte(b, i)
    if x ~= y then return x > y end
  end
  return true
end
