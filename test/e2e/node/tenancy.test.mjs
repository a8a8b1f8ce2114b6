// Tenancy through the unmodified E2B JS SDK against a whole single-node
// cube: team B's key gets "not found" for everything of team A's (the
// sandbox, its snapshots and their names), the same calls with team A's key
// succeed (the controls), and a team over its quota gets 429, which the SDK
// raises as RateLimitError. Run by test/e2e/node/system, which makes the
// teams and sets CUBE_E2E_TEAM_A_KEY, CUBE_E2E_TEAM_B_KEY and
// CUBE_E2E_QUOTA_KEY (a team whose quota is one sandbox).
//
//	go run ./test/e2e/node/system -- npm --prefix test/e2e/node run test:tenancy
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, SandboxNotFoundError, SandboxError, RateLimitError } from 'e2b'

const template = process.env.CUBE_E2E_TEMPLATE
const A = { apiKey: process.env.CUBE_E2E_TEAM_A_KEY }
const B = { apiKey: process.env.CUBE_E2E_TEAM_B_KEY }
const Q = { apiKey: process.env.CUBE_E2E_QUOTA_KEY }
assert.ok(template && A.apiKey && B.apiKey && Q.apiKey,
  'run through the system harness: go run ./test/e2e/node/system -- npm --prefix test/e2e/node run test:tenancy')

const created = [] // [sandboxId, opts of its team]
const make = async (tmpl, opts) => {
  const s = await Sandbox.create(tmpl, opts)
  created.push([s.sandboxId, opts])
  return s
}
after(async () => {
  for (const [id, opts] of created) await Sandbox.kill(id, opts).catch(() => {})
})

const tag = `tenancy-${Date.now()}`
const notFound404 = (err) => err instanceof SandboxError && /^404: /.test(err.message)

test("team B cannot list, get, connect to, pause, kill, time out, snapshot or fork team A's sandbox", async (t) => {
  const a = await make(template, { ...A, metadata: { tag } })
  const id = a.sandboxId
  await a.commands.run('echo mine > /tmp/owner')

  const listedB = await Sandbox.list({ ...B, query: { metadata: { tag } } }).nextItems()
  t.diagnostic(`team B lists ${listedB.length} sandboxes tagged ${tag}`)
  assert.equal(listedB.length, 0)
  const listedA = await Sandbox.list({ ...A, query: { metadata: { tag } } }).nextItems()
  assert.deepEqual(listedA.map((s) => s.sandboxId), [id], 'control: team A lists its sandbox')

  await assert.rejects(Sandbox.getInfo(id, B), SandboxNotFoundError)
  await assert.rejects(Sandbox.connect(id, B), SandboxNotFoundError)
  await assert.rejects(Sandbox.setTimeout(id, 60_000, B), SandboxNotFoundError)
  await assert.rejects(Sandbox.pause(id, B), SandboxNotFoundError)
  await assert.rejects(Sandbox.createSnapshot(id, { ...B, name: `${tag}-stolen` }), SandboxNotFoundError)
  await assert.rejects(Sandbox.fork(id, { ...B, count: 1 }), SandboxNotFoundError)
  assert.equal(await Sandbox.kill(id, B), false, "team B's kill reports not found")

  // Controls: the same calls with team A's key, on a sandbox that is
  // still there, running and untouched.
  const info = await Sandbox.getInfo(id, A)
  assert.equal(info.state, 'running')
  await Sandbox.setTimeout(id, 300_000, A)
  const again = await Sandbox.connect(id, A)
  assert.equal((await again.commands.run('cat /tmp/owner')).stdout, 'mine\n')
  assert.equal(await Sandbox.pause(id, A), true)
  await Sandbox.connect(id, A) // resumes
  assert.equal((await Sandbox.getInfo(id, A)).state, 'running')
  assert.equal(await Sandbox.kill(id, A), true)
})

test("team B cannot see, resolve, create from or delete team A's snapshots", async (t) => {
  const a = await make(template, { ...A, metadata: { tag } })
  await a.commands.run('echo snap > /tmp/mark')
  const name = `${tag}-golden`
  let snap
  try {
    snap = await Sandbox.createSnapshot(a.sandboxId, { ...A, name })
  } catch (err) {
    if (/^501: /.test(err.message)) return t.skip(`node cannot snapshot: ${err.message}`)
    throw err
  }
  t.diagnostic(`team A snapshot ${snap.snapshotId} named ${name}`)

  const snapsB = await Sandbox.listSnapshots(B).nextItems()
  assert.ok(!snapsB.some((s) => s.snapshotId === snap.snapshotId), "team B lists team A's snapshot")
  const snapsA = await Sandbox.listSnapshots(A).nextItems()
  assert.ok(snapsA.some((s) => s.snapshotId === snap.snapshotId), 'control: team A lists its snapshot')

  await assert.rejects(Sandbox.create(name, B), notFound404, "team B resolves team A's snapshot name")
  await assert.rejects(Sandbox.create(snap.snapshotId, B), notFound404, "team B creates from team A's snapshot ID")
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, B), false, "team B's delete reports not found")

  // Controls: team A creates from its snapshot by name, and forks.
  const child = await make(name, A)
  assert.equal((await child.commands.run('cat /tmp/mark')).stdout, 'snap\n')
  const forks = await Sandbox.fork(a.sandboxId, { ...A, count: 1 })
  for (const f of forks) {
    if (f instanceof Error) throw f
    created.push([f.sandboxId, A])
  }
  assert.equal(await Sandbox.deleteSnapshot(snap.snapshotId, A), true)
})

test('a team over its quota gets 429 (RateLimitError)', async (t) => {
  const first = await make(template, Q)
  const err = await Sandbox.create(template, Q).then(() => null, (e) => e)
  t.diagnostic(`second create of a team with max_sandboxes=1: ${err}`)
  assert.ok(err instanceof RateLimitError, `want RateLimitError, got ${err}`)
  assert.match(err.message, /quota/)
  // Control: once its sandbox is gone the team may create again.
  assert.equal(await Sandbox.kill(first.sandboxId, Q), true)
  await make(template, Q)
})
