// The unmodified E2B JS SDK (the version pinned in package.json) against a
// whole single-node cube: cubemaster's E2B API, its sandbox route, a real
// cubelet. Run by test/e2e/node/system, which starts the system and sets
// E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and CUBE_E2E_TEMPLATE (a
// template the SDK can drive); see docs/control-plane.md.
//
//	go run ./test/e2e/node/system -- npm --prefix test/e2e/node run test:controlplane
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, AuthenticationError, SandboxNotFoundError, SandboxError } from 'e2b'

const template = process.env.CUBE_E2E_TEMPLATE
assert.ok(template && process.env.E2B_API_URL && process.env.E2B_SANDBOX_URL,
  'run through the system harness: go run ./test/e2e/node/system -- npm --prefix test/e2e/node run test:controlplane')

const created = []
const make = async (...args) => {
  const s = await Sandbox.create(...args)
  created.push(s.sandboxId)
  return s
}
after(async () => {
  for (const id of created) await Sandbox.kill(id).catch(() => {})
})

const tag = `cp-${Date.now()}`

test('Sandbox.create with the default template, then commands.run', async () => {
  // No template: the SDK asks for "base", the master's alias of the default.
  const sbx = await make()
  const r = await sbx.commands.run('echo hi')
  assert.equal(r.stdout, 'hi\n')
  const info = await sbx.getInfo()
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.equal(info.state, 'running')
})

test('Sandbox.create with a named template, metadata and envs', async () => {
  const sbx = await make(template, { metadata: { tag, role: 'named' }, envs: { GREETING: 'hello from envs' }, timeoutMs: 120_000 })
  const r = await sbx.commands.run('echo "$GREETING"')
  assert.equal(r.stdout, 'hello from envs\n')
  const info = await sbx.getInfo()
  assert.equal(info.templateId, template)
  assert.deepEqual(info.metadata, { tag, role: 'named' })
  const left = info.endAt.getTime() - Date.now()
  assert.ok(left > 100_000 && left <= 121_000, `endAt ${info.endAt} is ${left} ms away`)
})

test('list with metadata and state filters, and paging', async () => {
  for (const i of [1, 2, 3]) await make(template, { metadata: { tag, role: 'list', i: String(i) } })
  const byMeta = await Sandbox.list({ query: { metadata: { tag, role: 'list' } } }).nextItems()
  assert.equal(byMeta.length, 3)
  assert.ok(byMeta.every((s) => s.state === 'running' && s.metadata.role === 'list'))

  const pager = Sandbox.list({ query: { metadata: { tag, role: 'list' } }, limit: 2 })
  const first = await pager.nextItems()
  assert.equal(first.length, 2)
  assert.ok(pager.hasNext)
  const second = await pager.nextItems()
  assert.equal(second.length, 1)
  assert.ok(!pager.hasNext)
  assert.equal(new Set([...first, ...second].map((s) => s.sandboxId)).size, 3)

  const paused = await Sandbox.list({ query: { metadata: { tag }, state: ['paused'] } }).nextItems()
  assert.equal(paused.length, 0)
})

test('setTimeout moves the deadline', async () => {
  const sbx = await make(template, { metadata: { tag } })
  await sbx.setTimeout(600_000)
  let left = (await sbx.getInfo()).endAt.getTime() - Date.now()
  assert.ok(left > 590_000, `after setTimeout(600s): ${left} ms`)
  await sbx.setTimeout(30_000) // shorter is allowed too
  left = (await sbx.getInfo()).endAt.getTime() - Date.now()
  assert.ok(left <= 31_000, `after setTimeout(30s): ${left} ms`)
})

test('pause, then connect resumes with memory and processes kept', async () => {
  const sbx = await make(template, { metadata: { tag, role: 'pause' } })
  await sbx.commands.run('echo kept > /tmp/state')
  const bg = await sbx.commands.run('sleep 600', { background: true })
  assert.equal(await sbx.pause(), true)
  assert.equal((await sbx.getInfo()).state, 'paused')
  assert.equal(await Sandbox.pause(sbx.sandboxId), false, 'pausing a paused sandbox reports false (409)')
  const paused = await Sandbox.list({ query: { metadata: { tag, role: 'pause' }, state: ['paused'] } }).nextItems()
  assert.deepEqual(paused.map((s) => s.sandboxId), [sbx.sandboxId])

  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal((await again.getInfo()).state, 'running')
  assert.equal((await again.commands.run('cat /tmp/state')).stdout, 'kept\n')
  const ps = await again.commands.list()
  assert.ok(ps.some((p) => p.pid === bg.pid), 'the background process survived the pause')
  // Connecting to a running sandbox is fine too.
  await Sandbox.connect(sbx.sandboxId)
})

test('kill', async () => {
  const sbx = await make(template, { metadata: { tag } })
  assert.equal(await sbx.kill(), true)
  assert.equal(await Sandbox.kill(sbx.sandboxId), false, 'killing twice reports false (404)')
  await assert.rejects(Sandbox.getInfo(sbx.sandboxId), SandboxNotFoundError)
})

test('a wrong API key is 401', async () => {
  await assert.rejects(Sandbox.create(template, { apiKey: 'e2b_' + '0'.repeat(40) }), AuthenticationError)
  await assert.rejects(Sandbox.list({ apiKey: 'e2b_' + '1'.repeat(40) }).nextItems(), AuthenticationError)
})

test('an unknown sandbox is 404', async () => {
  await assert.rejects(Sandbox.connect('nosuchsandbox'), SandboxNotFoundError)
  await assert.rejects(Sandbox.getInfo('nosuchsandbox'), SandboxNotFoundError)
  assert.equal(await Sandbox.kill('nosuchsandbox'), false)
})

test('an unknown template is 404, a malformed one 400', async () => {
  await assert.rejects(Sandbox.create('no-such-template'), (err) => err instanceof SandboxError && /^404: /.test(err.message))
  await assert.rejects(Sandbox.create('Not a template!'), (err) => err instanceof SandboxError && /^400: /.test(err.message))
})

// envd's port of a sandbox through the route, with token (or none). The
// body is read to the end: fetch's connection pool is shared with the
// SDK, and an unread body holds its connection.
const envd = async (id, path, token) => {
  const r = await fetch(process.env.E2B_SANDBOX_URL + path, {
    headers: { 'E2b-Sandbox-Id': id, 'E2b-Sandbox-Port': '49983', ...(token ? { 'X-Access-Token': token } : {}) },
  })
  await r.arrayBuffer()
  return r
}

// Every SDK sandbox is secure: the node (cubelet) calls its agent with its
// access token (quiesce, reinit), and each clone answers its own token,
// never its source's. CUBE_E2E_RUNTIME is the node's runtime (runc,
// gvisor: memory snapshots, vm: memory snapshots).
test('snapshot, create from snapshot and fork of secure sandboxes', async (t) => {
  const sbx = await make(template, { metadata: { tag } })
  assert.ok(sbx.envdAccessToken, 'an SDK sandbox is secure (has an envd access token)')
  assert.equal((await envd(sbx.sandboxId, '/envs')).status, 401, 'envd without the token')
  assert.equal((await envd(sbx.sandboxId, '/envs', sbx.envdAccessToken)).status, 200, 'envd with the token')
  await sbx.commands.run('echo snap > /tmp/mark')
  let snap
  try {
    snap = await sbx.createSnapshot()
  } catch (err) {
    if (/^501: /.test(err.message)) return t.skip(`node cannot snapshot: ${err.message}`)
    throw err
  }
  const child = await make(snap.snapshotId)
  assert.ok(child.envdAccessToken && child.envdAccessToken !== sbx.envdAccessToken, 'the clone has its own token')
  assert.equal((await child.commands.run('cat /tmp/mark')).stdout, 'snap\n')
  assert.equal((await envd(child.sandboxId, '/envs', sbx.envdAccessToken)).status, 401, "the clone refuses its source's token")
  assert.equal((await envd(child.sandboxId, '/envs')).status, 401, 'the clone refuses no token')
  // The source is still secure and still answers its own token.
  assert.equal((await sbx.commands.run('cat /tmp/mark')).stdout, 'snap\n')
  const forks = await sbx.fork({ count: 2 })
  for (const f of forks) {
    if (f instanceof Error) throw f
    created.push(f.sandboxId)
    assert.ok(f.envdAccessToken && f.envdAccessToken !== sbx.envdAccessToken, 'a fork has its own token')
    assert.equal((await f.commands.run('cat /tmp/mark')).stdout, 'snap\n')
    assert.equal((await envd(f.sandboxId, '/envs', sbx.envdAccessToken)).status, 401, "a fork refuses its source's token")
  }
  await Sandbox.deleteSnapshot(snap.snapshotId)
  console.log(`SNAPSHOTS runtime ${process.env.CUBE_E2E_RUNTIME || 'runc'}: snapshot, create from snapshot, fork x2 of secure sandboxes ok`)
})

// The closing-note figure: Sandbox.create() -> commands.run('echo hi'),
// through the SDK, median of 20 (plus the create alone).
test('latency: create + first command, median of 20', async () => {
  const total = []
  const createOnly = []
  for (let i = 0; i < 20; i++) {
    const t0 = performance.now()
    const sbx = await Sandbox.create(template)
    const t1 = performance.now()
    const r = await sbx.commands.run('echo hi')
    const t2 = performance.now()
    assert.equal(r.stdout, 'hi\n')
    createOnly.push(t1 - t0)
    total.push(t2 - t0)
    await sbx.kill()
  }
  const med = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]
  const p90 = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length * 0.9)]
  console.log(`LATENCY create+run('echo hi'): median ${med(total).toFixed(1)} ms, p90 ${p90(total).toFixed(1)} ms; ` +
    `create alone: median ${med(createOnly).toFixed(1)} ms (n=20, runtime runc)`)
})
