"""The index's multi-key steps as Lua scripts, so each is atomic on the Redis server.

NOTE: a script runs with the caller's Redis ACL (every ``redis.call`` is checked): the commands and
keys each script touches are the ``shard`` role's in kvpool.index.redis_acl, kept in step there."""

# ARGV: prefix, events maxlen, then five per entry: chunk key, encoded value, tenant, nbytes, shard.
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
for i = 0, n - 1 do
  if fresh[i + 1] == 1 then
    local b = 3 + i * 5
    redis.call('SET', p .. ':c:' .. ARGV[b], ARGV[b + 1])
    redis.call('SADD', p .. ':s:' .. ARGV[b + 4], ARGV[b])
    redis.call('XADD', p .. ':events', 'MAXLEN', '~', maxlen, '*',
               'kind', 'stored', 'key', ARGV[b], 'shard', ARGV[b + 4], 'tenant', ARGV[b + 2])
  end
end
for _, tenant in ipairs(order) do
  redis.call('INCRBY', p .. ':u:' .. tenant, charge[tenant])
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
      end
      redis.call('XADD', p .. ':events', 'MAXLEN', '~', maxlen, '*',
                 'kind', 'removed', 'key', k, 'shard', shard, 'tenant', tenant)
      removed = removed + 1
    end
  end
end
return removed
"""
