// Volumes through the unmodified E2B JS SDK against a whole single-node
// cube: Volume.create/list/getInfo/destroy and Sandbox.create volumeMounts.
// A file written in sandbox A is read in sandbox B after A is killed; team
// B sees nothing of team A's volume (team A's calls are the controls); a
// volume in use is not deleted. Run by test/e2e/node/system (which sets the
// team keys), in the controlplane script:
//
//	go run ./test/e2e/node/system -- npm --prefix test/e2e/node run test:controlplane
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox, Volume, SandboxError } from 'e2b'

const template = process.env.CUBE_E2E_TEMPLATE
const A = { apiKey: process.env.CUBE_E2E_TEAM_A_KEY }
const B = { apiKey: process.env.CUBE_E2E_TEAM_B_KEY }
assert.ok(template && A.apiKey && B.apiKey,
  'run through the system harness: go run ./test/e2e/node/system -- npm --prefix test/e2e/node run test:controlplane')

const sandboxes = []
const volumes = []
after(async () => {
  for (const id of sandboxes) await Sandbox.kill(id, A).catch(() => {})
  for (const id of volumes) await Volume.destroy(id, A).catch(() => {})
})
const make = async (opts) => {
  const s = await Sandbox.create(template, { ...A, ...opts })
  sandboxes.push(s.sandboxId)
  return s
}

test('a volume persists across sandboxes and belongs to its team', async (t) => {
  const vol = await Volume.create(`js-${Date.now()}`, A)
  volumes.push(vol.volumeId)
  assert.ok((await Volume.list(A)).some((v) => v.volumeId === vol.volumeId), 'team A lists its volume')
  assert.ok(!(await Volume.list(B)).some((v) => v.volumeId === vol.volumeId), 'team B lists team A\'s volume')
  await assert.rejects(Volume.getInfo(vol.volumeId, B), 'team B gets team A\'s volume')
  assert.equal((await Volume.getInfo(vol.volumeId, A)).name, vol.name, 'control: team A gets it')

  const a = await make({ volumeMounts: { '/mnt/vol': vol } })
  await a.files.write('/mnt/vol/note.txt', 'from A')
  await assert.rejects(Volume.destroy(vol.volumeId, A), /mounted by sandbox/, 'a volume in use was deleted')
  await assert.rejects(Sandbox.create(template, { ...A, volumeMounts: { '/v': vol.name } }),
    (err) => err instanceof SandboxError && /mounted by sandbox/.test(err.message), 'a second holder')
  await Sandbox.kill(a.sandboxId, A)

  const b = await make({ volumeMounts: { '/data': vol.name } })
  assert.equal(await b.files.read('/data/note.txt'), 'from A')
  await Sandbox.kill(b.sandboxId, A)

  assert.equal(await Volume.destroy(vol.volumeId, B), false, 'team B deleted team A\'s volume')
  assert.equal(await Volume.destroy(vol.volumeId, A), true)
  volumes.pop()
  t.diagnostic(`volume ${vol.volumeId}: written in ${a.sandboxId}, read in ${b.sandboxId}, deleted`)
})
