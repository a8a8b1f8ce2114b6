// Egress through the unmodified E2B JS SDK (the version pinned in
// package.json): DNS in every sandbox, E2B's network options with domains
// and wildcards, the node's egress proxy (names checked against the
// resolver's answers, live updates, credential injection from E2B's
// network.rules) and its audit log, against a fake internet. Run by
// test/e2e/node/system -egress, which starts cube with network-agent and a
// world in its own namespace (a DNS server and HTTP/HTTPS servers with
// test-CA certificates on three addresses) and describes it in
// CUBE_E2E_EGRESS; see docs/network.md.
//
//	go run ./test/e2e/node/system -egress -- npm --prefix test/e2e/node run test:egress
//	go run ./test/e2e/node/system -egress -runtime gvisor -- npm --prefix test/e2e/node run test:egress
//
// In the sandbox the client is egressprobe (uploaded through the SDK; a
// static binary, so every runtime runs it): `dns NAME` asks the
// sandbox's resolver, `get` makes one request (forging the TLS server name
// or the address where a row needs it), `hold` keeps one connection busy.
// Every refusal has a control: the same probe answered where the one
// control in question is absent (another policy, or the default one).
// gVisor runs take the resolver, domain policy, precedence and DNS rate
// rows, VM runs the first three; the proxy's rows run with runc (the proxy
// and the forwarder are the same for every runtime: they live in the slot,
// outside the sandbox).
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { readFileSync, existsSync, readdirSync, readlinkSync, renameSync } from 'node:fs'
import { createHash, randomBytes } from 'node:crypto'
import { Sandbox, ALL_TRAFFIC } from 'e2b'

const world = process.env.CUBE_E2E_EGRESS && JSON.parse(process.env.CUBE_E2E_EGRESS)
assert.ok(world && process.env.E2B_API_URL,
  'run through the system harness: go run ./test/e2e/node/system -egress -- npm --prefix test/e2e/node run test:egress')
const runtime = process.env.CUBE_E2E_RUNTIME || 'runc'
const proxyRows = runtime === 'runc'
const ip = world.names // name -> address
// The allowed names' neighbour: evil.test's address, which no allowed name
// resolves to.
const neighbour = ip['evil.test']
const PROBE = '/tmp/egressprobe'
const CA = '/tmp/world-ca.pem'
const probeBin = readFileSync(world.probe)
const caPEM = readFileSync(world.ca, 'utf8')

const created = []
after(async () => {
  for (const id of created) await Sandbox.kill(id).catch(() => {})
})

// make creates a sandbox with opts and uploads the probe and the world's CA.
const make = async (opts = {}) => {
  const sbx = await Sandbox.create(process.env.CUBE_E2E_TEMPLATE, { timeoutMs: 600_000, ...opts })
  created.push(sbx.sandboxId)
  await sbx.files.write(PROBE, new Blob([probeBin]), { user: 'root' })
  await sbx.files.write(CA, caPEM, { user: 'root' })
  await sbx.commands.run(`chmod 755 ${PROBE}`, { user: 'root' })
  return sbx
}

// probe runs egressprobe and returns its JSON line (a failed get exits 1
// and still prints one).
const probe = async (sbx, args, opts = {}) => {
  const r = await sbx.commands.run(`${PROBE} ${args}`, { timeoutMs: 30_000, ...opts }).catch((e) => e)
  const line = (r.stdout || '').trim().split('\n').pop()
  try {
    return JSON.parse(line)
  } catch {
    throw new Error(`egressprobe ${args}: ${r.stdout} ${r.stderr} ${r.message || ''}`)
  }
}
const dns = (sbx, name) => probe(sbx, `dns ${name}`)
const get = (sbx, url, flags = '') => probe(sbx, `get -timeout 4s -ca ${CA} ${flags} ${url}`)

// Row helpers: what was tried, what stopped it (or let it through).
const refused = async (what, p) => {
  const r = await p
  assert.equal(r.ok, false, `${what}: expected a refusal, got ${JSON.stringify(r)}`)
  console.log(`  refused: ${what}: ${r.err}`)
  return r
}
const answered = async (what, p, host) => {
  const r = await p
  assert.equal(r.ok, true, `${what}: ${JSON.stringify(r)}`)
  assert.equal(r.status, 200, what)
  if (host) assert.match(r.body, new RegExp(`^host=${host.replace(/\./g, '\\.')} `), what)
  console.log(`  answered: ${what}: ${r.body}`)
  return r
}

const audit = (id) => {
  const f = `${world.auditDir}/${id}.jsonl`
  if (!existsSync(f)) return []
  return readFileSync(f, 'utf8').trim().split('\n').filter(Boolean).map((l) => JSON.parse(l))
}
// auditHas waits for an event matching want (connect events are written
// when the connection ends).
const auditHas = async (id, want, ms = 10_000) => {
  const end = Date.now() + ms
  for (;;) {
    const evs = audit(id)
    const ev = evs.find((e) => Object.entries(want).every(([k, v]) => (typeof v === 'function' ? v(e[k]) : e[k] === v)))
    if (ev) return ev
    if (Date.now() > end) assert.fail(`no audit event ${JSON.stringify(want, (k, v) => (typeof v === 'function' ? String(v) : v))} for ${id}; have:\n${evs.map((e) => JSON.stringify(e)).join('\n')}`)
    await new Promise((r) => setTimeout(r, 200))
  }
}
const seen = async () => (await fetch(world.requests)).json()

// The default policy: the internet (the world) open, every name resolved.
let open
// E2B's domain filter: the listed names, nothing else.
let filtered
const filter = { allowOut: ['api.allowed.test', 'cdn.allowed.test', '*.wild.test'], denyOut: [ALL_TRAFFIC] }

before(async () => {
  open = await make()
  filtered = await make({ network: filter })
})

test('resolver: resolv.conf names the slot forwarder, which answers the world names', async () => {
  const conf = await open.commands.run('cat /etc/resolv.conf')
  assert.match(conf.stdout, /^nameserver 169\.254\.0\.22$/m)
  const r = await dns(open, 'api.allowed.test')
  assert.equal(r.rcode, 'NOERROR', JSON.stringify(r))
  assert.deepEqual(r.addrs, [ip['api.allowed.test']])
  // The image's own resolver library (busybox nslookup) too.
  const ns = await open.commands.run('nslookup cdn.allowed.test')
  assert.match(ns.stdout, new RegExp(ip['cdn.allowed.test'].replace(/\./g, '\\.')))
  await answered('http by name under the default policy', get(open, 'http://api.allowed.test/'), 'api.allowed.test')
  await auditHas(open.sandboxId, { kind: 'dns', name: 'api.allowed.test', verdict: 'allowed' })
})

test('domain policy: allowed name and wildcard answered; other names refused at DNS (control: the default policy)', async () => {
  await answered('https api.allowed.test (exact allowOut entry)', get(filtered, 'https://api.allowed.test/'), 'api.allowed.test')
  await answered('https pkg.wild.test (*.wild.test)', get(filtered, 'https://pkg.wild.test/'), 'pkg.wild.test')
  for (const name of ['evil.test', 'wild.test']) {
    const r = await dns(filtered, name)
    assert.equal(r.rcode, 'REFUSED', `${name}: ${JSON.stringify(r)}`)
    console.log(`  refused: dns ${name} under the filter: rcode ${r.rcode}`)
    await auditHas(filtered.sandboxId, { kind: 'dns', name, verdict: 'denied' })
  }
  const c = await dns(open, 'evil.test')
  assert.equal(c.rcode, 'NOERROR', `control: ${JSON.stringify(c)}`)
  await refused('https evil.test under the filter', get(filtered, 'https://evil.test/'))
  await answered('control: https evil.test under the default policy', get(open, 'https://evil.test/'), 'evil.test')
  await auditHas(filtered.sandboxId, { kind: 'dns', name: 'api.allowed.test', verdict: 'allowed', rule: 'api.allowed.test' })
  await auditHas(filtered.sandboxId, { kind: 'dns', name: 'pkg.wild.test', verdict: 'allowed', rule: '*.wild.test' })
})

test('precedence as E2B: a deny CIDR beats the default allow; allowOut beats denyOut', async () => {
  const denyOne = await make({ network: { denyOut: [`${neighbour}/32`] } })
  await refused(`http ${neighbour} with denyOut ${neighbour}/32`, get(denyOne, `http://${neighbour}/`, '-timeout 3s'))
  await answered('control: http api.allowed.test from the same sandbox', get(denyOne, 'http://api.allowed.test/'), 'api.allowed.test')
  await denyOne.kill() // few sandboxes at once: a TCG node runs each on a shared core
  const allowOne = await make({ allowInternetAccess: false, network: { allowOut: [neighbour] } })
  await answered(`http ${neighbour} with allowOut ${neighbour}, internet off`, get(allowOne, `http://${neighbour}/`))
  await refused(`http ${ip['api.allowed.test']} from the same sandbox (not allowed)`, get(allowOne, `http://${ip['api.allowed.test']}/`, '-timeout 3s'))
  await allowOne.kill()
  const both = await make({ network: { allowOut: [neighbour], denyOut: [ALL_TRAFFIC] } })
  await answered(`http ${neighbour} in allowOut and in denyOut ${ALL_TRAFFIC}: allow wins`, get(both, `http://${neighbour}/`))
  await both.kill()
})

test('UDP follows the address rules: DNS straight to an outside server dropped (control: the default policy)', { skip: !proxyRows && 'runs with runc' }, async () => {
  const server = `${neighbour}:53` // the world's DNS server, past the forwarder
  const r = await probe(filtered, `dns -server ${server} api.allowed.test`)
  assert.ok(r.err && !r.rcode, `a query straight to ${server} under the filter: ${JSON.stringify(r)}`)
  console.log(`  refused: udp dns straight to ${server} under the filter: ${r.err}`)
  const c = await probe(open, `dns -server ${server} api.allowed.test`)
  assert.equal(c.rcode, 'NOERROR', `control: ${JSON.stringify(c)}`)
  console.log(`  answered: control: udp dns straight to ${server} under the default policy: ${c.addrs}`)
})

test('DNS query rate per sandbox: a burst past the bucket is dropped (control: a burst within it is answered)', { skip: runtime === 'vm' && 'a TCG guest cannot send a burst faster than the bucket refills' }, async () => {
  const sbx = await make()
  const small = await probe(sbx, 'dnsburst -n 50 api.allowed.test')
  assert.equal(small.answered, 50, `control: 50 queries in 50 ms: ${JSON.stringify(small)}`)
  await new Promise((res) => setTimeout(res, 3000)) // the bucket refills (100 at 50/s)
  // 400 a millisecond apart: the bucket's 100 and what refilled (50/s)
  // while they went out (plus half a second for their way to the
  // forwarder) pass, the rest is dropped.
  const big = await probe(sbx, 'dnsburst -n 400 api.allowed.test')
  const most = 100 + Math.ceil((50 * (big.sendingMs + 500)) / 1000)
  assert.ok(big.answered >= 90 && big.answered <= most && big.answered < 400, `400 queries, at most ${most} answered: ${JSON.stringify(big)}`)
  await sbx.kill()
  console.log(`  limited: 400 queries in ${big.sendingMs} ms, ${big.answered} answered (at most ${most}; 50 of 50 within the bucket)`)
})

test('names are checked against the resolver: forged SNI, --resolve, IP literals, a neighbour (control: the default policy)', { skip: !proxyRows && 'the proxy rows run with runc' }, async () => {
  const api = ip['api.allowed.test']
  const cdn = ip['cdn.allowed.test']
  // The filtered sandbox resolved both names above (its resolved set holds
  // both addresses, so the slot's address rules alone pass them).
  await dns(filtered, 'cdn.allowed.test')
  const rows = [
    [`forged SNI evil.test to api's address ${api}`, 'https://evil.test/', `-connect ${api}:443`],
    [`--resolve api.allowed.test:443:${cdn} (cdn's address)`, 'https://api.allowed.test/', `-connect ${cdn}:443`],
    [`an IP literal https://${api}/ (no SNI)`, `https://${api}/`, '-insecure'],
    [`Host evil.test over plain http to ${api}`, 'http://evil.test/', `-connect ${api}:80`],
    [`the neighbour ${neighbour} as api.allowed.test`, 'https://api.allowed.test/', `-connect ${neighbour}:443`],
  ]
  for (const [what, url, flags] of rows) {
    await refused(`${what} under the filter`, get(filtered, url, flags))
    await answered(`control: ${what} under the default policy`, get(open, url, flags))
  }
  await answered('control: the allowed name on its own address through the proxy', get(filtered, 'https://api.allowed.test/', `-connect ${api}:443`), 'api.allowed.test')
  // The audit line of each refusal: what the connection claimed, where it went.
  for (const want of [
    { name: 'evil.test', addr: `${api}:443`, mode: 'sni' },
    { name: 'api.allowed.test', addr: `${cdn}:443`, mode: 'sni' },
    { name: undefined, addr: `${api}:443`, mode: 'sni' },
    { name: 'evil.test', addr: `${api}:80`, mode: 'http' },
    { name: 'api.allowed.test', addr: `${neighbour}:443`, mode: 'sni' },
  ]) {
    const ev = await auditHas(filtered.sandboxId, { kind: 'connect', verdict: 'denied', ...want })
    console.log(`  audit: ${JSON.stringify(ev)}`)
  }
  await auditHas(filtered.sandboxId, { kind: 'connect', verdict: 'allowed', name: 'api.allowed.test', mode: 'sni' })
})

test('updateNetwork cuts an open connection to a newly denied name; one to a still-allowed name carries on', { skip: !proxyRows && 'the proxy rows run with runc' }, async () => {
  const sbx = await make({ network: filter })
  const outs = { api: '', cdn: '' }
  const holds = {}
  for (const [k, name] of [['api', 'api.allowed.test'], ['cdn', 'cdn.allowed.test']]) {
    holds[k] = await sbx.commands.run(`${PROBE} hold -ca ${CA} -every 200ms -for 40s https://${name}/`, {
      background: true, timeoutMs: 60_000, onStdout: (d) => { outs[k] += d },
    })
  }
  const until = async (what, cond, ms = 15_000) => {
    const end = Date.now() + ms
    while (!cond()) {
      if (Date.now() > end) throw new Error(`timed out waiting for ${what}: ${JSON.stringify(outs)}`)
      await new Promise((r) => setTimeout(r, 100))
    }
  }
  await until('both connections answering', () => /"n":3,/.test(outs.api) && /"n":3,/.test(outs.cdn))
  await sbx.updateNetwork({ allowOut: ['cdn.allowed.test'], denyOut: [ALL_TRAFFIC] })
  await until('the api connection cut', () => /"ok":false/.test(outs.api))
  const cdnBefore = (outs.cdn.match(/"ok":true/g) || []).length
  await until('the cdn connection still answering', () => (outs.cdn.match(/"ok":true/g) || []).length >= cdnBefore + 5)
  assert.doesNotMatch(outs.cdn, /"ok":false/)
  console.log(`  cut: ${outs.api.trim().split('\n').pop()}; cdn carried on (${(outs.cdn.match(/"ok":true/g) || []).length} answers)`)
  await holds.cdn.kill()
  await holds.api.wait().catch(() => {})
  await auditHas(sbx.sandboxId, { kind: 'cut', name: 'api.allowed.test' })
  // A new connection to the dropped name: refused at DNS now.
  assert.equal((await dns(sbx, 'api.allowed.test')).rcode, 'REFUSED')
})

test('credential injection from network.rules: the upstream sees the header, the sandbox never holds it', { skip: !proxyRows && 'the proxy rows run with runc' }, async () => {
  const secret = `sk-e2e-${randomBytes(12).toString('hex')}`
  const marker = `marker-${randomBytes(12).toString('hex')}`
  const sbx = await make({
    envs: { CUBE_E2E_MARKER: marker },
    network: {
      allowOut: ['api.allowed.test'], denyOut: [ALL_TRAFFIC],
      rules: { 'api.allowed.test': [{ transform: { headers: { Authorization: `Bearer ${secret}` } } }] },
    },
  })
  await sbx.files.write('/tmp/planted.txt', marker)
  // Trusting the system's roots (SSL_CERT_FILE, which cube-agent points at
  // the bundle holding the node's egress CA): the proxy's certificate.
  const r = await probe(sbx, 'get -timeout 5s https://api.allowed.test/inject')
  assert.equal(r.ok, true, JSON.stringify(r))
  const digest = createHash('sha256').update(`Bearer ${secret}`).digest('hex').slice(0, 16)
  assert.match(r.body, new RegExp(`auth=${digest}$`), 'the upstream echoes the digest of what it got')
  const got = (await seen()).filter((q) => q.path === '/inject')
  assert.ok(got.length >= 1 && got.every((q) => q.authorization === `Bearer ${secret}`), JSON.stringify(got))
  console.log(`  upstream saw Authorization: Bearer sk-e2e-… (digest ${digest})`)
  // A client that trusts only the world's CA refuses the proxy's certificate:
  // the connection was terminated with the node's egress CA.
  await refused('the injected host verified against the world CA only', get(sbx, 'https://api.allowed.test/'))
  const ev = await auditHas(sbx.sandboxId, { kind: 'connect', verdict: 'allowed', mode: 'terminated', name: 'api.allowed.test' })
  assert.deepEqual(ev.injected, ['Authorization'])
  assert.ok(!JSON.stringify(audit(sbx.sandboxId)).includes(secret), 'the audit log names headers, never values')

  // env, /proc/*/environ and files: the marker (the control) is found by
  // each search, the secret by none. The pattern is built by the shell
  // from two halves so that no file or environment the search reads holds
  // it (the searching process's arguments do, in memory only).
  const half = Math.floor(secret.length / 2)
  const search = async (needle) => {
    const a = needle.slice(0, half)
    const b = needle.slice(half)
    const cmd = `A='${a}'; B='${b}'; env | grep -c -F "$A$B"; cat /proc/[0-9]*/environ 2>/dev/null | tr '\\000' '\\n' | grep -c -F "$A$B"; ` +
      `grep -rlsF "$A$B" /bin /etc /home /root /tmp /usr /var /run 2>/dev/null | wc -l`
    const out = await sbx.commands.run(cmd, { user: 'root' }).catch((e) => e)
    return (out.stdout || '').trim().split('\n').map(Number)
  }
  const [envM, procM, filesM] = await search(marker)
  assert.ok(envM > 0 && procM > 0 && filesM > 0, `control: the marker is found by every search (${envM} ${procM} ${filesM})`)
  const [envS, procS, filesS] = await search(secret)
  assert.deepEqual([envS, procS, filesS], [0, 0, 0], 'the secret is in no env, environ or file')
  console.log(`  marker found (env ${envM}, environ ${procM}, files ${filesM}); secret found nowhere`)
  const info = JSON.stringify(await Sandbox.getInfo(sbx.sandboxId))
  assert.ok(!info.includes(secret), 'getInfo never returns the value')
})

test('the proxy killed: a domain-restricted sandbox cannot leave; an unrestricted one goes on per its policy', { skip: !proxyRows && 'the proxy rows run with runc' }, async () => {
  const api = ip['api.allowed.test']
  await answered('control: through the proxy before the kill', get(filtered, 'https://api.allowed.test/', `-connect ${api}:443`), 'api.allowed.test')
  const pid = readdirSync('/proc').filter((p) => /^\d+$/.test(p)).find((p) => {
    try { return readlinkSync(`/proc/${p}/exe`) === world.agent } catch { return false }
  })
  assert.ok(pid, `network-agent (${world.agent}) is running`)
  // The launcher restarts a dead daemon: keep its binary away meanwhile.
  renameSync(world.agent, `${world.agent}.off`)
  try {
    process.kill(Number(pid), 'SIGKILL')
    const before = (await seen()).length
    await refused('https api.allowed.test on its own address, proxy down', get(filtered, 'https://api.allowed.test/', `-connect ${api}:443`))
    await refused('http api.allowed.test, proxy down', get(filtered, 'http://api.allowed.test/', `-connect ${api}:80`))
    assert.equal((await seen()).length, before, 'the world received nothing from the restricted sandbox')
    await answered('an unrestricted sandbox, proxy down', get(open, `http://${api}/`))
  } finally {
    renameSync(`${world.agent}.off`, world.agent)
  }
  // The restarted agent attaches its listeners again.
  const end = Date.now() + 90_000
  for (;;) {
    const r = await fetch(`http://${world.agentHTTP}/egress/healthz`).catch(() => null)
    if (r?.status === 204) break
    if (Date.now() > end) assert.fail('the restarted network-agent did not report its egress proxy healthy')
    await new Promise((res) => setTimeout(res, 500))
  }
  await answered('after the restart, through the proxy again', get(filtered, 'https://api.allowed.test/', `-connect ${api}:443`), 'api.allowed.test')
})
