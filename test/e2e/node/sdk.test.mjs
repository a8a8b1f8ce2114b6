// The unmodified E2B JS SDK (the version pinned in package.json) against a
// real cube sandbox. Run by test/e2e/node/harness, which creates the
// sandbox and sets E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY and
// CUBE_SANDBOX_ID; see docs/envd.md.
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes, createHash } from 'node:crypto'
import {
  Sandbox,
  CommandExitError,
  FileNotFoundError,
  NotEnoughSpaceError,
  SandboxError,
  FilesystemEventType,
  FileType,
} from 'e2b'

const sandboxId = process.env.CUBE_SANDBOX_ID
assert.ok(sandboxId && process.env.E2B_SANDBOX_URL, 'run through the harness: go run ./test/e2e/node/harness -- npm --prefix test/e2e/node test')

/** @type {Sandbox} */
let sbx
const dir = `/home/user/e2e-${Date.now()}`

before(async () => {
  sbx = await Sandbox.connect(sandboxId)
  assert.equal(sbx.sandboxId, sandboxId)
  await sbx.files.makeDir(dir)
})

after(async () => {
  await sbx?.files.remove(dir, { user: 'root' })
})

const sha = (b) => createHash('sha256').update(b).digest('hex')
const until = async (what, cond, ms = 10000) => {
  const end = Date.now() + ms
  while (!(await cond())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`)
    await new Promise((r) => setTimeout(r, 25))
  }
}

test('commands.run: stdout, stderr, exit code', async () => {
  const r = await sbx.commands.run('echo hello; echo oops >&2')
  assert.equal(r.exitCode, 0)
  assert.equal(r.stdout, 'hello\n')
  assert.equal(r.stderr, 'oops\n')

  await assert.rejects(sbx.commands.run('echo partial; exit 3'), (err) => {
    assert.ok(err instanceof CommandExitError)
    assert.equal(err.exitCode, 3)
    assert.equal(err.stdout, 'partial\n')
    assert.match(err.error, /exit status 3/)
    return true
  })
})

test('commands.run: envs, cwd, user', async () => {
  const r = await sbx.commands.run('echo "$FOO|$PWD|$(id -un)|$CUBE_E2E"', { envs: { FOO: 'bar baz' }, cwd: '/tmp' })
  assert.equal(r.stdout, 'bar baz|/tmp|user|1\n')
  const root = await sbx.commands.run('id -u; pwd', { user: 'root' })
  assert.equal(root.stdout, '0\n/root\n')
  const home = await sbx.commands.run('pwd')
  assert.equal(home.stdout, '/home/user\n')
})

test('commands.run: streaming callbacks', async () => {
  const out = []
  const err = []
  const r = await sbx.commands.run('for i in 1 2 3; do echo $i; sleep 0.1; done; echo e >&2', {
    onStdout: (d) => out.push(d),
    onStderr: (d) => err.push(d),
  })
  assert.equal(out.join(''), '1\n2\n3\n')
  assert.ok(out.length >= 2, `output arrived in ${out.length} chunk(s), want streaming`)
  assert.equal(err.join(''), 'e\n')
  assert.equal(r.stdout, '1\n2\n3\n')
})

test('commands: background, list, connect, kill', async () => {
  const h = await sbx.commands.run('echo started; sleep 60', { background: true })
  assert.ok(h.pid > 0)
  const listed = await sbx.commands.list()
  const p = listed.find((x) => x.pid === h.pid)
  assert.ok(p, 'background command listed')
  assert.equal(p.cmd, '/bin/bash')
  await until('first output', () => h.stdout === 'started\n')
  await h.disconnect()

  const seen = []
  const again = await sbx.commands.connect(h.pid, { onStdout: (d) => seen.push(d) })
  assert.equal(again.pid, h.pid)
  assert.equal(await again.kill(), true)
  await assert.rejects(again.wait(), (err) => {
    assert.ok(err instanceof CommandExitError)
    assert.equal(err.exitCode, -1)
    assert.match(err.error, /signal: killed/)
    return true
  })
  assert.equal(await sbx.commands.kill(h.pid), false, 'killing a gone command reports false')
  assert.ok(!(await sbx.commands.list()).some((x) => x.pid === h.pid))
})

test('commands: stdin', async () => {
  const h = await sbx.commands.run('cat', { background: true, stdin: true })
  await sbx.commands.sendStdin(h.pid, 'hello ')
  await h.sendStdin('stdin')
  await h.closeStdin()
  const r = await h.wait()
  assert.equal(r.stdout, 'hello stdin')
})

test('pty: create, input, resize, kill', async () => {
  let out = ''
  const dec = new TextDecoder()
  const term = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { out += dec.decode(d) } })
  await sbx.pty.sendInput(term.pid, new TextEncoder().encode('/bin/busybox stty size; echo pty-$((40+2))\n'))
  await until('pty output', () => out.includes('pty-42'))
  assert.match(out, /24 80/)
  await sbx.pty.resize(term.pid, { cols: 120, rows: 40 })
  await sbx.pty.sendInput(term.pid, new TextEncoder().encode('/bin/busybox stty size; echo resized-$((1+1))\n'))
  await until('pty resize', () => out.includes('resized-2'))
  assert.match(out, /40 120/)
  assert.equal(await sbx.pty.kill(term.pid), true)
  await assert.rejects(term.wait(), CommandExitError)
})

test('files: write, read, list, exists, makeDir, rename, remove, getInfo', async () => {
  const info = await sbx.files.write(`${dir}/a/b/hello.txt`, 'hello world')
  assert.equal(info.path, `${dir}/a/b/hello.txt`)
  assert.equal(await sbx.files.read(`${dir}/a/b/hello.txt`), 'hello world')
  await sbx.files.write(`${dir}/a/b/hello.txt`, 'v2')
  assert.equal(await sbx.files.read(`${dir}/a/b/hello.txt`), 'v2')

  const st = await sbx.files.getInfo(`${dir}/a/b/hello.txt`)
  assert.equal(st.type, FileType.FILE)
  assert.equal(st.size, 2)
  assert.equal(st.owner, 'user')
  assert.equal(st.permissions, '-rw-r--r--')
  assert.ok(st.modifiedTime instanceof Date)

  assert.equal(await sbx.files.exists(`${dir}/a/b/hello.txt`), true)
  assert.equal(await sbx.files.exists(`${dir}/nope`), false)
  assert.equal(await sbx.files.makeDir(`${dir}/new`), true)
  assert.equal(await sbx.files.makeDir(`${dir}/new`), false)

  const names = (await sbx.files.list(dir)).map((e) => e.name).sort()
  assert.deepEqual(names, ['a', 'new'])
  const deep = (await sbx.files.list(dir, { depth: 3 })).map((e) => e.path.slice(dir.length + 1)).sort()
  assert.deepEqual(deep, ['a', 'a/b', 'a/b/hello.txt', 'new'])

  const moved = await sbx.files.rename(`${dir}/a/b/hello.txt`, `${dir}/new/moved.txt`)
  assert.equal(moved.path, `${dir}/new/moved.txt`)
  assert.equal(await sbx.files.exists(`${dir}/a/b/hello.txt`), false)
  await sbx.files.remove(`${dir}/new`)
  assert.equal(await sbx.files.exists(`${dir}/new/moved.txt`), false)

  const many = await sbx.files.write([
    { path: `${dir}/m/one.txt`, data: '1' },
    { path: `${dir}/m/two.txt`, data: '22' },
  ])
  assert.equal(many.length, 2)
  assert.equal(await sbx.files.read(`${dir}/m/two.txt`), '22')
})

test('files: large binary round trip, bytes and stream', async () => {
  const data = randomBytes(6 << 20)
  await sbx.files.write(`${dir}/big.bin`, data.buffer.slice(data.byteOffset, data.byteOffset + data.byteLength))
  const back = await sbx.files.read(`${dir}/big.bin`, { format: 'bytes' })
  assert.equal(back.length, data.length)
  assert.equal(sha(back), sha(data))
  // gzip both ways (octet-stream upload, gzip-encoded download).
  await sbx.files.write(`${dir}/big.gz.bin`, new Blob([data]), { gzip: true })
  const gz = await sbx.files.read(`${dir}/big.gz.bin`, { format: 'bytes', gzip: true })
  assert.equal(sha(gz), sha(data))
  const r = await sbx.commands.run(`wc -c < ${dir}/big.bin`)
  assert.equal(r.stdout.trim(), String(data.length))
})

test('files: watchDir (recursive)', async () => {
  const events = []
  const wdir = `${dir}/watched`
  await sbx.files.makeDir(`${wdir}/sub`)
  const handle = await sbx.files.watchDir(wdir, (e) => { events.push(e) }, { recursive: true })
  try {
    await sbx.files.write(`${wdir}/top.txt`, 'x')
    await sbx.files.write(`${wdir}/sub/deep.txt`, 'y')
    await sbx.files.remove(`${wdir}/top.txt`)
    const has = (name, type) => events.some((e) => e.name === name && e.type === type)
    await until('watch events', () => has('top.txt', FilesystemEventType.WRITE) &&
      has('sub/deep.txt', FilesystemEventType.CREATE) && has('top.txt', FilesystemEventType.REMOVE))
  } finally {
    await handle.stop()
  }
})

test('files: signed download and upload URLs', async () => {
  await sbx.files.write(`${dir}/signed.txt`, 'signed content')
  const url = await sbx.downloadUrl(`${dir}/signed.txt`)
  assert.match(url, /signature=v1_/)
  const res = await fetch(url)
  assert.equal(res.status, 200)
  assert.equal(await res.text(), 'signed content')
  const bad = await fetch(url.replace(/signature=[^&]+/, 'signature=v1_forged'))
  assert.equal(bad.status, 401)

  const up = await sbx.uploadUrl(`${dir}/via-url.txt`)
  const form = new FormData()
  form.append('file', new Blob(['uploaded']), 'via-url.txt')
  const put = await fetch(up, { method: 'POST', body: form })
  assert.equal(put.status, 200)
  assert.equal(await sbx.files.read(`${dir}/via-url.txt`), 'uploaded')
})

test('bad input: missing file, forbidden paths, full disk', async () => {
  await assert.rejects(sbx.files.read(`${dir}/missing.txt`), FileNotFoundError)
  await assert.rejects(sbx.files.getInfo(`${dir}/missing.txt`), FileNotFoundError)
  // /root is root's: the user may neither read nor write there.
  await assert.rejects(sbx.files.read('/root/.profile', { user: 'user' }), SandboxError)
  await assert.rejects(sbx.files.write('/root/planted.txt', 'x'), SandboxError)
  await assert.rejects(sbx.files.list('/root'), SandboxError)
  assert.equal(await sbx.files.exists('/root/planted.txt', { user: 'root' }), false)
  // More than the sandbox disk holds: 507, surfaced as NotEnoughSpaceError,
  // with nothing left behind.
  const huge = new Blob([new Uint8Array(128 << 20)])
  await assert.rejects(sbx.files.write(`${dir}/huge/huge.bin`, huge), NotEnoughSpaceError)
  assert.equal(await sbx.files.exists(`${dir}/huge`), false)
  // The agent keeps serving.
  assert.equal((await sbx.commands.run('echo still here')).stdout, 'still here\n')
})

test('figure: commands.run("true") round trip, median of 20', async (t) => {
  await sbx.commands.run('true') // warm the connection
  const ms = []
  for (let i = 0; i < 20; i++) {
    const t0 = performance.now()
    await sbx.commands.run('true')
    ms.push(performance.now() - t0)
  }
  ms.sort((a, b) => a - b)
  const median = (ms[9] + ms[10]) / 2
  const line = `figure: commands.run('true') via the e2b SDK: median ${median.toFixed(1)} ms (min ${ms[0].toFixed(1)}, max ${ms[19].toFixed(1)}, n=20)`
  t.diagnostic(line)
  console.log(line)
})
