// The unmodified E2B code-interpreter JS SDK (@e2b/code-interpreter, pinned
// in package.json) against a whole single-node cube with the
// code-interpreter template (Debian + Jupyter kernel + the template's
// server on port 49999, started as the template's service; see
// docs/templates.md). Run by test/e2e/node/system -code-interpreter, which
// imports the template as code-interpreter-v1 (the SDK's default) and sets
// CUBE_E2E_CODE_INTERPRETER.
//
//	go run ./test/e2e/node/system -code-interpreter -- npm --prefix test/e2e/node run test:codeinterpreter
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from '@e2b/code-interpreter'

assert.ok(process.env.CUBE_E2E_CODE_INTERPRETER && process.env.E2B_API_URL,
  'run through the system harness: go run ./test/e2e/node/system -code-interpreter -- npm --prefix test/e2e/node run test:codeinterpreter')

/** @type {Sandbox} */
let sbx
before(async () => {
  const t0 = performance.now()
  sbx = await Sandbox.create() // the SDK's default template, code-interpreter-v1
  console.log(`CODE-INTERPRETER create (kernel ready): ${(performance.now() - t0).toFixed(0)} ms, runtime ${process.env.CUBE_E2E_RUNTIME || 'runc'}`)
})
after(async () => { await sbx?.kill() })

test('runCode: stdout, stderr, the main result', async () => {
  const out = []
  const r = await sbx.runCode('import sys\nprint("hello")\nprint("oops", file=sys.stderr)\n40 + 2', { onStdout: (m) => out.push(m.line) })
  assert.deepEqual(r.logs.stdout, ['hello\n'])
  assert.deepEqual(r.logs.stderr, ['oops\n'])
  assert.deepEqual(out, ['hello\n'])
  assert.equal(r.text, '42')
  assert.equal(r.error, undefined)
})

test('runCode: variables persist between calls', async () => {
  await sbx.runCode('counter = 41\ndef bump():\n    global counter\n    counter += 1\n    return counter')
  assert.equal((await sbx.runCode('bump()')).text, '42')
  assert.equal((await sbx.runCode('counter')).text, '42')
})

test('runCode: a matplotlib chart comes back as PNG', async () => {
  const r = await sbx.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title("squares")\nplt.show()')
  const png = r.results.find((x) => x.png)
  assert.ok(png, `a PNG result, got ${JSON.stringify(r.results.map((x) => x.formats()))}`)
  const bytes = Buffer.from(png.png, 'base64')
  assert.deepEqual([...bytes.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a], 'PNG signature')
  assert.ok(bytes.length > 5000, `PNG of ${bytes.length} bytes`)
})

test('runCode: a DataFrame comes back as HTML', async () => {
  const r = await sbx.runCode('import pandas as pd\npd.DataFrame({"a": [1, 2], "b": ["x", "y"]})')
  assert.match(r.results[0].html, /<table[^>]*class="dataframe/)
  assert.match(r.text, /a\s+b/)
})

test('runCode: an exception returns its name, value and traceback', async () => {
  const errors = []
  const r = await sbx.runCode('def f():\n    return 1 / 0\nf()', { onError: (e) => errors.push(e) })
  assert.equal(r.error.name, 'ZeroDivisionError')
  assert.equal(r.error.value, 'division by zero')
  // IPython colours its tracebacks (ANSI escapes), as E2B's do.
  const tb = r.error.traceback.replace(/\x1b\[[0-9;]*m/g, '')
  assert.match(tb, /----> 3 f\(\)/)
  assert.match(tb, /----> 2\s+return 1 \/ 0/)
  assert.match(tb, /ZeroDivisionError: division by zero/)
  assert.equal(errors.length, 1)
  // The kernel keeps its state after an error.
  assert.equal((await sbx.runCode('counter')).text, '42')
})

test('contexts: separate state, list, restart, remove; envs per run', async () => {
  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  assert.equal(ctx.language, 'python')
  assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, "'/tmp'")
  const r = await sbx.runCode('counter', { context: ctx })
  assert.equal(r.error?.name, 'NameError', 'a new context does not see the default one')
  assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  await sbx.runCode('x = 1', { context: ctx })
  await sbx.restartCodeContext(ctx)
  assert.equal((await sbx.runCode('x', { context: ctx })).error?.name, 'NameError', 'a restart drops the state')
  await sbx.removeCodeContext(ctx)
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  assert.equal((await sbx.runCode('import os; os.environ.get("GREETING")', { envs: { GREETING: 'hi' } })).text, "'hi'")
  assert.equal((await sbx.runCode('import os; os.environ.get("GREETING")')).text, undefined, 'envs last one run')
})

test('code that ends the kernel gets an error, and a fresh kernel after', async () => {
  const ctx = await sbx.createCodeContext()
  await sbx.runCode('lost = 1', { context: ctx })
  const r = await sbx.runCode('import os; os._exit(1)', { context: ctx })
  assert.equal(r.error?.name, 'KernelDied')
  assert.equal((await sbx.runCode('lost', { context: ctx })).error?.name, 'NameError')
  assert.equal((await sbx.runCode('6 * 7', { context: ctx })).text, '42')
  await sbx.removeCodeContext(ctx)
})

test('the sandbox is an E2B sandbox too: commands and files', async () => {
  await sbx.runCode('open("/home/user/from-kernel.txt", "w").write("written by the kernel")')
  assert.equal(await sbx.files.read('/home/user/from-kernel.txt'), 'written by the kernel')
  assert.equal((await sbx.commands.run('python3 -c "import pandas; print(1)"')).stdout, '1\n')
})
