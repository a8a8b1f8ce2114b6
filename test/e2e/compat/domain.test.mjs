// Domain mode with the unmodified E2B JS SDK configured by E2B_DOMAIN alone
// (and NODE_EXTRA_CA_CERTS): the SDK calls https://api.<domain> and reaches
// sandboxes at https://<port>-<id>.<domain>, one TLS listener of the route
// with a *.<domain> certificate of the cluster CA. Written against the
// SDK's public API as 1.x and 2.x both have it (run-js.sh runs it against
// each published version). Run by the system harness in domain mode:
//
//	go run ./test/e2e/node/system -domain -- bash test/e2e/compat/run-js.sh e2b@1.13.2 test/e2e/compat/domain.test.mjs
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import tls from 'node:tls'
import { Sandbox, AuthenticationError } from 'e2b'

const domain = process.env.E2B_DOMAIN
const template = process.env.CUBE_E2E_TEMPLATE
assert.ok(domain && template && process.env.CUBE_E2E_DOMAIN_MODE && !process.env.E2B_API_URL && !process.env.E2B_SANDBOX_URL,
  'run through the system harness in domain mode: go run ./test/e2e/node/system -domain -- bash test/e2e/compat/run-js.sh e2b@VERSION test/e2e/compat/domain.test.mjs')
const [host, port] = domain.split(':')

const created = []
after(async () => {
  for (const id of created) await Sandbox.kill(id).catch(() => {})
})
const make = async (opts) => {
  const s = await Sandbox.create(template, opts)
  created.push(s.sandboxId)
  return s
}

// The names resolve (the harness's test resolver), the certificate is
// verified: with the route CA (NODE_EXTRA_CA_CERTS) the handshake is
// authorized; the control, the same handshake against the public roots
// alone, is refused, so trust comes from the CA and nothing else.
const handshake = (servername, ca) => new Promise((resolve) => {
  const s = tls.connect({ host: servername, port: Number(port), servername, ...(ca ? { ca } : {}), rejectUnauthorized: false }, () => {
    resolve({ authorized: s.authorized, error: s.authorizationError && String(s.authorizationError) })
    s.end()
  })
  s.on('error', (err) => resolve({ authorized: false, error: String(err) }))
})

test('TLS: the route presents a certificate for api.<domain> and *.<domain> that the CA verifies', async () => {
  for (const name of [`api.${host}`, `49983-nosuchsandbox.${host}`]) {
    const withCA = await handshake(name)
    assert.equal(withCA.authorized, true, `${name} with the CA: ${withCA.error}`)
    const without = await handshake(name, tls.rootCertificates)
    assert.equal(without.authorized, false, `${name} without the CA was authorized`)
    console.log(`DOMAIN ${name}: authorized with the CA, refused without it (${without.error})`)
  }
})

test('Sandbox.create through https://api.<domain>, commands.run through https://49983-<id>.<domain>', async () => {
  const sbx = await make({ metadata: { suite: 'domain' } })
  const r = await sbx.commands.run('echo hi; echo oops >&2; exit 3').catch((err) => err)
  // 1.x and 2.x throw CommandExitError for a non-zero exit; it carries the result.
  assert.equal(r.exitCode, 3)
  assert.equal(r.stdout, 'hi\n')
  assert.equal(r.stderr, 'oops\n')
  assert.equal(sbx.getHost(49983), `49983-${sbx.sandboxId}.${domain}`)
})

test('files: write, read, list over the domain', async () => {
  const sbx = await make()
  await sbx.files.write('/tmp/domain.txt', 'over TLS\n')
  assert.equal(await sbx.files.read('/tmp/domain.txt'), 'over TLS\n')
  const names = (await sbx.files.list('/tmp')).map((e) => e.name)
  assert.ok(names.includes('domain.txt'), names.join(','))
})

test('getHost: a server in the sandbox reached at https://<port>-<id>.<domain>', async () => {
  const sbx = await make()
  await sbx.commands.run('mkdir -p /tmp/www && echo "served from $(hostname)" > /tmp/www/index.html')
  await sbx.commands.run('busybox httpd -f -p 8000 -h /tmp/www', { background: true })
  const url = `https://${sbx.getHost(8000)}/index.html`
  let body = ''
  for (let i = 0; i < 50; i++) {
    const r = await fetch(url).catch((err) => err)
    if (r.ok) { body = await r.text(); break }
    if (r.arrayBuffer) await r.arrayBuffer()
    await new Promise((resolve) => setTimeout(resolve, 100))
  }
  assert.match(body, /^served from /)
})

test('list, getInfo, setTimeout, kill through the API', async () => {
  const sbx = await make({ metadata: { suite: 'domain', role: 'list' } })
  // 1.x: list() is a Promise of an array; 2.x: a paginator.
  const l = Sandbox.list()
  const items = typeof l.nextItems === 'function' ? await l.nextItems() : await l
  assert.ok(items.some((s) => s.sandboxId === sbx.sandboxId), 'the new sandbox is listed')
  await sbx.setTimeout(120_000)
  if (typeof sbx.getInfo === 'function') {
    const info = await sbx.getInfo()
    assert.equal(info.sandboxId, sbx.sandboxId)
  }
  await sbx.kill()
  assert.equal(await sbx.isRunning(), false)
})

test('create with metadata and envs; getInfo', async () => {
  const sbx = await make({ metadata: { suite: 'domain', role: 'meta' }, envs: { GREETING: 'hello over TLS' } })
  const r = await sbx.commands.run('echo "$GREETING"')
  assert.equal(r.stdout, 'hello over TLS\n')
  const info = typeof sbx.getInfo === 'function' ? await sbx.getInfo() : await Sandbox.getInfo(sbx.sandboxId)
  assert.equal(info.sandboxId, sbx.sandboxId)
  assert.deepEqual(info.metadata, { suite: 'domain', role: 'meta' })
})

test('commands: background, list, kill', async () => {
  const sbx = await make()
  const h = await sbx.commands.run('sleep 600', { background: true })
  assert.ok((await sbx.commands.list()).some((p) => p.pid === h.pid), 'the background command is listed')
  assert.equal(await sbx.commands.kill(h.pid), true)
  await h.wait().catch(() => {})
  assert.ok(!(await sbx.commands.list()).some((p) => p.pid === h.pid), 'the killed command is gone')
})

test('files: watchDir sees a write', async () => {
  const sbx = await make()
  await sbx.files.makeDir('/tmp/watched')
  const seen = []
  const w = await sbx.files.watchDir('/tmp/watched', (ev) => seen.push(ev.name))
  await sbx.files.write('/tmp/watched/new.txt', 'x')
  for (let i = 0; i < 100 && !seen.includes('new.txt'); i++) await new Promise((resolve) => setTimeout(resolve, 50))
  await w.stop()
  assert.ok(seen.includes('new.txt'), `events: ${seen.join(',')}`)
})

test('pause, then connect resumes (pause or betaPause, where the SDK has one)', async (t) => {
  const sbx = await make()
  const pause = sbx.pause ? () => sbx.pause() : sbx.betaPause ? () => sbx.betaPause() : null
  if (!pause) {
    t.skip('this SDK version has no pause')
    return
  }
  await sbx.files.write('/tmp/kept.txt', 'kept')
  await pause()
  // The route answers a paused sandbox's envd 502, the one status the
  // SDKs read as "not running".
  assert.equal(await sbx.isRunning(), false, 'isRunning() of a paused sandbox')
  assert.equal((await Sandbox.getInfo(sbx.sandboxId)).state, 'paused')
  const again = await Sandbox.connect(sbx.sandboxId)
  assert.equal(await again.files.read('/tmp/kept.txt'), 'kept')
})

test('a wrong API key is refused by api.<domain> (401)', async () => {
  // 2.x throws AuthenticationError; 1.x's create a SandboxError "401: …".
  await assert.rejects(Sandbox.create(template, { apiKey: 'e2b_0000000000000000000000000000000000000000' }),
    (err) => err instanceof AuthenticationError || /^401: /.test(err.message))
})
