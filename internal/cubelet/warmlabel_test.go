package cubelet_test

import (
	"testing"

	"github.com/cubesandbox/cube/internal/cubelet"
	"github.com/cubesandbox/cube/internal/runtime/vm"
)

// TestWarmTemplateLabelMatchesVM: the VM driver gives a sandbox shared,
// file-backed memory when it carries the label cubelet puts on the
// sandbox it boots to warm a template; the two packages may not import
// each other, so this ties the constants.
func TestWarmTemplateLabelMatchesVM(t *testing.T) {
	if cubelet.LabelWarmTemplate != vm.TemplateLabel {
		t.Fatalf("cubelet labels warm-up sandboxes %q, the VM driver looks for %q", cubelet.LabelWarmTemplate, vm.TemplateLabel)
	}
}
