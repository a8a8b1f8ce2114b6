// A node:test reporter that appends one line per top-level test to the
// file $CUBE_E2E_RESULTS (sdk, version, suite, runtime, case, result,
// tab-separated), from which test/e2e/compat writes
// docs/compatibility.md. hack/test.sh adds it through NODE_OPTIONS; it
// prints nothing itself.
import { appendFileSync, readFileSync } from 'node:fs'
import { basename, dirname, join } from 'node:path'
import { fileURLToPath } from 'node:url'

const here = dirname(fileURLToPath(import.meta.url))
// The version of pkg that the test file imports: node_modules nearest to
// it (test/e2e/compat/run-js.sh runs suites next to another version's).
const version = (pkg, file) => {
  for (let dir = file ? dirname(file.startsWith('file:') ? fileURLToPath(file) : file) : here; ; dir = dirname(dir)) {
    try {
      return JSON.parse(readFileSync(join(dir, 'node_modules', pkg, 'package.json'), 'utf8')).version
    } catch {}
    if (dirname(dir) === dir) return '?'
  }
}
const suites = {
  'sdk.test.mjs': ['e2b (JS)', 'e2b', 'envd'],
  'controlplane.test.mjs': ['e2b (JS)', 'e2b', 'control plane'],
  'tenancy.test.mjs': ['e2b (JS)', 'e2b', 'tenancy'],
  'volumes.test.mjs': ['e2b (JS)', 'e2b', 'volumes'],
  'codeinterpreter.test.mjs': ['@e2b/code-interpreter (JS)', '@e2b/code-interpreter', 'code interpreter'],
  'domain.test.mjs': ['e2b (JS)', 'e2b', 'domain (E2B_DOMAIN only)'],
}

export default async function * compatReporter (source) {
  const out = process.env.CUBE_E2E_RESULTS
  for await (const ev of source) {
    if (!out || (ev.type !== 'test:pass' && ev.type !== 'test:fail') || ev.data.nesting !== 0) continue
    const s = suites[basename(ev.data.file || '')]
    // Left out by --test-name-pattern: not run here, not a skip.
    if (!s || ev.data.skip === 'test name does not match pattern') continue
    const result = ev.type === 'test:fail' ? 'fail' : ev.data.skip ? 'skip' : 'pass'
    const name = ev.data.name.replace(/[\t\n]/g, ' ')
    appendFileSync(out, [s[0], version(s[1], ev.data.file), s[2], process.env.CUBE_E2E_RUNTIME || 'runc', name, result].join('\t') + '\n')
  }
}
