// The unmodified E2B JS SDK's Template builder (e2b, pinned in
// package.json) against a whole single-node cube: a template built from the
// Debian base through the build API (apt-get and pip steps, a file copied
// through the SDK's upload flow, a start command with a ready check), a
// sandbox from it running what the steps installed, and the same
// definition built again from the cache. Each build's time is printed.
// Run by test/e2e/node/system -template-builds (a network-agent whose
// allow list admits the package mirrors; docs/templates.md):
//
//	go run ./test/e2e/node/system -template-builds -- npm --prefix test/e2e/node run test:templatebuild
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { Template, Sandbox, waitForURL, BuildError } from 'e2b'

assert.ok(process.env.CUBE_E2E_TEMPLATE_BUILDS && process.env.E2B_API_URL,
  'run through the system harness: go run ./test/e2e/node/system -template-builds -- npm --prefix test/e2e/node run test:templatebuild')

const ctxDir = fs.mkdtempSync(path.join(os.tmpdir(), 'cube-template-'))
fs.writeFileSync(path.join(ctxDir, 'greeting.txt'), 'hello from the template\n')
after(() => fs.rmSync(ctxDir, { recursive: true, force: true }))

const name = `e2e-built-${process.pid}`

function definition () {
  return Template({ fileContextPath: ctxDir })
    .fromDebianImage('stable')
    .aptInstall(['jq', 'python3-pip'], { noInstallRecommends: true })
    // Debian marks its Python as externally managed (PEP 668).
    .setEnvs({ PIP_BREAK_SYSTEM_PACKAGES: '1' })
    .pipInstall(['cowsay'])
    .copy('greeting.txt', '/srv/site/')
    .setWorkdir('/srv/site')
    .setStartCmd('python3 -m http.server 8080 --directory /srv/site', waitForURL('http://127.0.0.1:8080/greeting.txt'))
}

async function build (label) {
  const lines = []
  const t0 = performance.now()
  let ok = false
  try {
    await Template.build(definition(), name, {
      onBuildLogs: (entry) => { lines.push(`${entry.level} ${entry.message}`) }
    })
    ok = true
  } finally {
    const ms = performance.now() - t0
    console.log(`TEMPLATE BUILD (${label}): ${ok ? 'ready' : 'FAILED'} in ${(ms / 1000).toFixed(1)} s`)
    for (const l of lines) console.log(`  ${l}`)
  }
  return { ms: performance.now() - t0, lines }
}

let first
test('Template.build: Debian base, apt-get, pip, copy, start command', { timeout: 20 * 60_000 }, async () => {
  first = await build('first')
  assert.ok(first.lines.some((l) => l.includes('[1/') && l.includes('apt-get')), 'the apt-get step ran')
})

test('a sandbox from the built template runs what the steps installed', { timeout: 5 * 60_000 }, async () => {
  assert.ok(await Template.exists(name))
  const sbx = await Sandbox.create(name)
  try {
    const jq = await sbx.commands.run(`echo '{"a": 41}' | jq '.a + 1'`)
    assert.equal(jq.stdout.trim(), '42')
    const cow = await sbx.commands.run('cowsay -t built')
    assert.match(cow.stdout, /built/)
    // The start command serves the copied file (its ready check passed
    // before the create returned).
    const got = await sbx.commands.run('curl -s http://127.0.0.1:8080/greeting.txt')
    assert.equal(got.stdout, 'hello from the template\n')
    // setWorkdir made the directory the later steps ran in, and the
    // sandbox's commands start there (E2B's template workdir), as root too.
    const ls = await sbx.commands.run('pwd && cat greeting.txt')
    assert.equal(ls.stdout, '/srv/site\nhello from the template\n')
    assert.equal((await sbx.commands.run('pwd', { user: 'root' })).stdout, '/srv/site\n')
    const url = `http://${sbx.getHost(8080)}/greeting.txt`
    console.log(`  served at ${url}`)
  } finally {
    await sbx.kill()
  }
})

test('the same definition again: every step from the cache', { timeout: 10 * 60_000 }, async () => {
  const second = await build('second, cached')
  const cached = second.lines.filter((l) => l.includes('CACHED'))
  assert.equal(cached.length, 5, `every step cached:\n${second.lines.join('\n')}`)
  assert.ok(second.lines.some((l) => l.includes('unchanged')), 'the template image is unchanged')
  assert.ok(second.ms < first.ms / 5, `second build ${second.ms} ms, first ${first.ms} ms`)
  assert.ok(second.lines.some((l) => l.includes("Skipping upload of 'greeting.txt', already cached")))
})

test('a failing step: BuildError naming it, with its output in the log', { timeout: 10 * 60_000 }, async () => {
  const lines = []
  const bad = Template().fromDebianImage('stable').runCmd('echo about-to-fail; exit 7')
  await assert.rejects(
    Template.build(bad, `${name}-bad`, { onBuildLogs: (e) => lines.push(e.message) }),
    (err) => {
      assert.ok(err instanceof BuildError, String(err))
      assert.match(err.message, /step 1: .*exit status 7/)
      return true
    })
  assert.ok(lines.includes('about-to-fail'), lines.join('\n'))
  assert.equal(await Template.exists(`${name}-bad`), false)
})

test('fromImage of an image this system does not have: a clear 400', async () => {
  await assert.rejects(Template.build(Template().fromImage('python:3.12').runCmd('true'), `${name}-py`),
    (err) => { assert.match(err.message, /pull no registry image/); return true })
})

test('the build sandbox reaches the package mirrors and nothing else', { timeout: 10 * 60_000 }, async () => {
  // Control: a mirror on the allow list answers from a build step.
  const ok = []
  await Template.build(
    Template().fromDebianImage('stable').skipCache()
      .runCmd('curl -sS -m 20 -o /dev/null -w "mirror %{http_code}\\n" http://deb.debian.org/debian/dists/bookworm/Release'),
    `${name}-net-ok`, { onBuildLogs: (e) => ok.push(e.message) })
  assert.ok(ok.includes('mirror 200'), ok.join('\n'))
  // The same request to a host off the list: the node's resolver does
  // not answer the name, and the step fails.
  const denied = []
  await assert.rejects(
    Template.build(
      Template().fromDebianImage('stable').skipCache()
        .runCmd('curl -sS -m 20 -o /dev/null -w "other %{http_code}\\n" https://github.com/'),
      `${name}-net-denied`, { onBuildLogs: (e) => denied.push(e.message) }),
    (err) => { assert.ok(err instanceof BuildError, String(err)); return true })
  console.log(`  allowed: ${ok.filter((l) => l.startsWith('mirror')).join(' ')}; denied: ${denied.filter((l) => l.includes('curl')).join(' ')}`)
  // curl prints 000 when no connection was made.
  assert.ok(denied.includes('other 000') && denied.some((l) => l.includes('Could not resolve host: github.com')), denied.join('\n'))
})
