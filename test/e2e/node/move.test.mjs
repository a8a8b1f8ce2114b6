// The unmodified E2B JS SDK across a node drain, in two runs that the
// cluster test (test/cluster, case e2b-sdk-drain) puts around the drain:
//
//	CUBE_MOVE_PHASE=pause    create a sandbox, write a file, pause it; the
//	                         sandbox ID goes to the file CUBE_MOVE_OUT
//	(the test drains the sandbox's node)
//	CUBE_MOVE_PHASE=connect  Sandbox.connect(CUBE_MOVE_ID) resumes it where
//	                         it is now, under the same ID, with the file
//
// Environment as for controlplane.test.mjs (E2B_API_URL, E2B_SANDBOX_URL,
// E2B_API_KEY, CUBE_E2E_TEMPLATE).
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { writeFileSync } from 'node:fs'
import { Sandbox } from 'e2b'

const phase = process.env.CUBE_MOVE_PHASE
const template = process.env.CUBE_E2E_TEMPLATE
assert.ok(template && process.env.E2B_API_URL && process.env.E2B_SANDBOX_URL, 'run by test/cluster (case e2b-sdk-drain)')
const note = 'written before the drain\n'

if (phase === 'pause') {
  test('create, write a file, pause', async () => {
    const sbx = await Sandbox.create(template, { timeoutMs: 600_000 })
    await sbx.files.write('/home/user/note', note)
    assert.equal(await sbx.files.read('/home/user/note'), note)
    assert.equal(await sbx.pause(), true)
    assert.equal((await sbx.getInfo()).state, 'paused')
    writeFileSync(process.env.CUBE_MOVE_OUT, sbx.sandboxId)
  })
} else if (phase === 'connect') {
  test('Sandbox.connect resumes the drained sandbox with its file', async () => {
    const id = process.env.CUBE_MOVE_ID
    const sbx = await Sandbox.connect(id)
    assert.equal(sbx.sandboxId, id)
    const info = await sbx.getInfo()
    assert.equal(info.state, 'running')
    assert.equal(await sbx.files.read('/home/user/note'), note)
    assert.equal((await sbx.commands.run('cat /home/user/note')).stdout, note)
    assert.equal(await sbx.kill(), true)
  })
} else {
  assert.fail(`CUBE_MOVE_PHASE=${phase}: want pause or connect`)
}
