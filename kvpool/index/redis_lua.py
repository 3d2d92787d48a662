"""The index's multi-key steps as Lua scripts, so each is atomic on the Redis server.

NOTE: a script runs with the caller's Redis ACL (every ``redis.call`` is checked): the commands and
keys each script touches are the ``shard`` role's in kvpool.index.redis_acl, kept in step there."""

# ARGV: prefix, events maxlen, then five per entry: chunk key, encoded value, tenant, nbytes, shard.
# Usage is charged twice: the tenant's total ({p}:u:<tenant>, what the quota is checked against)
# and each shard's part ({p}:su:<shard>, with a count of charges in {p}:sv:<shard>), so that SETTLE
# can recompute the total from the parts.
# Returns {0, fresh...} or an error tuple: {-1, tenant, usage, quota, requested} over quota,
# {-2, shard} unknown shard, {-3, tenant} unknown tenant. Nothing is written on an error.
PUBLISH = r"""
local p = ARGV[1]
local maxlen = ARGV[2]
local n = (#ARGV - 2) / 5
local charge, order, fresh, seen = {}, {}, {}, {}
for i = 0, n - 1 do
  local b = 3 + i * 5
  local k, tenant, nb, shard = ARGV[b], ARGV[b + 2], tonumber(ARGV[b + 3]), ARGV[b + 4]
  if redis.call('HEXISTS', p .. ':shards', shard) == 0 then return {-2, shard} end
  if redis.call('EXISTS', p .. ':t:' .. tenant) == 0 then return {-3, tenant} end
  if seen[k] or redis.call('EXISTS', p .. ':c:' .. k) == 1 then
    fresh[i + 1] = 0
  else
    fresh[i + 1] = 1
    seen[k] = true
    if not charge[tenant] then charge[tenant] = 0; order[#order + 1] = tenant end
    charge[tenant] = charge[tenant] + nb
  end
end
for _, tenant in ipairs(order) do
  local q = redis.call('HGET', p .. ':t:' .. tenant, 'quota')
  local usage, quota = tonumber(redis.call('GET', p .. ':u:' .. tenant) or '0'), tonumber(q)
  if usage + charge[tenant] > quota then
    return {-1, tenant, tostring(usage), tostring(q), tostring(charge[tenant])}
  end
end
local part, parts = {}, {}  -- each shard's part of the charge, per tenant (kept for SETTLE)
for i = 0, n - 1 do
  if fresh[i + 1] == 1 then
    local b = 3 + i * 5
    redis.call('SET', p .. ':c:' .. ARGV[b], ARGV[b + 1])
    redis.call('SADD', p .. ':s:' .. ARGV[b + 4], ARGV[b])
    redis.call('XADD', p .. ':events', 'MAXLEN', '~', maxlen, '*',
               'kind', 'stored', 'key', ARGV[b], 'shard', ARGV[b + 4], 'tenant', ARGV[b + 2])
    local st = ARGV[b + 4] .. '\0' .. ARGV[b + 2]
    if not part[st] then part[st] = 0; parts[#parts + 1] = {ARGV[b + 4], ARGV[b + 2], st} end
    part[st] = part[st] + tonumber(ARGV[b + 3])
  end
end
for _, tenant in ipairs(order) do
  redis.call('INCRBY', p .. ':u:' .. tenant, charge[tenant])
end
for _, x in ipairs(parts) do
  redis.call('HINCRBY', p .. ':su:' .. x[1], x[2], part[x[3]])
  redis.call('HINCRBY', p .. ':sv:' .. x[1], x[2], 1)
end
local out = {0}
for i = 1, n do out[i + 1] = fresh[i] end
return out
"""

# ARGV: prefix, events maxlen, shard filter ('' for any), then chunk keys. Returns how many went.
# NOTE: a malformed value (not shard \0 tier \0 msgpack([nbytes, tenant, ...])) must not stop the
# script halfway (Redis keeps what a failed script already wrote): it is removed, whatever the
# filter when its shard cannot be read, and refunds nothing, since what it charged is unknown.
REMOVE = r"""
local p = ARGV[1]
local maxlen = ARGV[2]
local only = ARGV[3]
local removed = 0
local function parse(v)
  local a = string.find(v, '\0', 1, true)
  if not a then return nil end
  local shard = string.sub(v, 1, a - 1)
  local b = string.find(v, '\0', a + 1, true)
  if not b then return shard end
  local ok, rest = pcall(cmsgpack.unpack, string.sub(v, b + 1))
  if not ok or type(rest) ~= 'table' or type(rest[1]) ~= 'number' or type(rest[2]) ~= 'string'
     or rest[1] ~= math.floor(rest[1]) or rest[1] < 1 or rest[1] >= 1099511627776 then
    return shard
  end
  return shard, rest[1], rest[2]
end
for i = 4, #ARGV do
  local k = ARGV[i]
  local v = redis.call('GET', p .. ':c:' .. k)
  if v then
    local shard, nb, tenant = parse(v)
    if shard == nil or only == '' or only == shard then
      redis.call('DEL', p .. ':c:' .. k)
      if shard ~= nil then redis.call('SREM', p .. ':s:' .. shard, k) end
      if tenant == nil then
        shard, tenant = shard or '', ''
      elseif redis.call('EXISTS', p .. ':t:' .. tenant) == 1 then
        redis.call('INCRBY', p .. ':u:' .. tenant, -nb)
        redis.call('HINCRBY', p .. ':su:' .. shard, tenant, -nb)
      end
      redis.call('XADD', p .. ':events', 'MAXLEN', '~', maxlen, '*',
                 'kind', 'removed', 'key', k, 'shard', shard, 'tenant', tenant)
      removed = removed + 1
    end
  end
end
return removed
"""

# ARGV: prefix, shard, n, then n pairs (tenant, bytes): what a reconcile found indexed on this shard,
# then pairs (tenant, charges) of {p}:sv:<shard> as read before that scan. Sets the shard's part of
# each tenant's usage to what was found; where a publish charged the tenant on this shard since
# the read (the count moved), the scan may have missed it, so the part only grows. Then sets every
# tenant's usage to the sum of the registered shards' parts: a forged counter heals. Returns
# {parts changed, usages changed}.
SETTLE = r"""
local p, s, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local su, sv = p .. ':su:' .. s, p .. ':sv:' .. s
local function int(x) return string.format('%.0f', x) end
local found, seen = {}, {}
for i = 0, n - 1 do found[ARGV[4 + 2 * i]] = tonumber(ARGV[5 + 2 * i]) end
for i = 4 + 2 * n, #ARGV, 2 do seen[ARGV[i]] = ARGV[i + 1] end
local cur, names = {}, {}
local flat = redis.call('HGETALL', su)
for i = 1, #flat, 2 do cur[flat[i]] = tonumber(flat[i + 1]) or 0; names[#names + 1] = flat[i] end
for t, _ in pairs(found) do if cur[t] == nil then cur[t] = 0; names[#names + 1] = t end end
local parts = 0
for _, t in ipairs(names) do
  local want = found[t] or 0
  if want < cur[t] and (redis.call('HGET', sv, t) or '') ~= (seen[t] or '') then want = cur[t] end
  if want ~= cur[t] then parts = parts + 1 end
  if want == 0 then redis.call('HDEL', su, t) elseif want ~= cur[t] then redis.call('HSET', su, t, int(want)) end
end
local total = {}
for _, shard in ipairs(redis.call('HKEYS', p .. ':shards')) do
  local f = redis.call('HGETALL', p .. ':su:' .. shard)
  for i = 1, #f, 2 do total[f[i]] = (total[f[i]] or 0) + (tonumber(f[i + 1]) or 0) end
end
-- NOTE: exact integers only (Lua's numbers are doubles): the counter goes to 0 by its own
-- negated text, then up by the sum; a counter that is no integer (INCRBY refuses it) is left.
local usages = 0
for _, t in ipairs(redis.call('SMEMBERS', p .. ':tenants')) do
  local k = p .. ':u:' .. t
  local u, want = redis.pcall('GET', k), int(total[t] or 0)
  if u == false then u = '0' end
  if type(u) == 'string' and u ~= want then
    local back = (u == '0') and {ok = 0} or redis.pcall('INCRBY', k, string.sub(u, 1, 1) == '-' and string.sub(u, 2) or '-' .. u)
    if type(back) == 'number' or back.ok then
      if want ~= '0' then redis.call('INCRBY', k, want) end
      usages = usages + 1
    end
  end
end
return {parts, usages}
"""
