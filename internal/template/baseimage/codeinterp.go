package baseimage

import (
	_ "embed" // the code interpreter's server
	"slices"
)

//go:embed codeinterp/server.py
var codeInterpreterServer []byte

// Code interpreter template: base plus Debian's Jupyter kernel stack and
// the server the E2B code-interpreter SDKs talk to (codeinterp/server.py)
// on CodeInterpreterPort, started in every sandbox as the template's
// service (labels template.LabelStartCmd and LabelReadyCmd).
const (
	CodeInterpreterName = "code-interpreter-oci"
	CodeInterpreterPort = 49999
	// CodeInterpreterTemplate is the template name the SDKs create by
	// default (their DEFAULT_TEMPLATE).
	CodeInterpreterTemplate   = "code-interpreter-v1"
	codeInterpreterServerPath = "usr/local/lib/cube/code-interpreter/server.py"
)

// CodeInterpreterPackages are added to DefaultPackages: the kernel,
// its client, and the libraries results are shown with (matplotlib
// charts as PNG, pandas DataFrames as HTML).
var CodeInterpreterPackages = []string{"python3-ipykernel", "python3-jupyter-client", "python3-matplotlib", "python3-pandas"}

// CodeInterpreter returns o set up to build the code interpreter image
// (in the same cache directory as base, under its own name).
func CodeInterpreter(o Options) Options {
	o.Name = CodeInterpreterName
	o.Packages = DefaultPackages
	o.Install = slices.Clone(CodeInterpreterPackages)
	o.Files = map[string]File{codeInterpreterServerPath: {Mode: 0o644, Data: codeInterpreterServer}}
	// Matplotlib's font cache, built as the user that runs the kernels:
	// otherwise the first chart of every sandbox pays for it.
	o.Run = []string{`su user -c "python3 -c 'import matplotlib.pyplot'"`}
	// The image labels' names are template.LabelStartCmd and
	// LabelReadyCmd (this package does not import the importer).
	o.Labels = map[string]string{
		"dev.cube.start-cmd": "exec python3 /" + codeInterpreterServerPath + " >>/tmp/code-interpreter.log 2>&1",
		"dev.cube.ready-cmd": "curl -sf --max-time 2 -o /dev/null http://127.0.0.1:49999/health",
	}
	return o
}
