package templatebuild

import (
	"archive/tar"
	"bytes"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"

	"github.com/cubesandbox/cube/internal/errdefs"
)

func TestCacheKeys(t *testing.T) {
	base := BaseKey("t", "sha256:aaaa")
	run := Step{Type: "RUN", Args: []string{"apt-get install -y jq", "root"}}
	cp := Step{Type: "COPY", Args: []string{"app", "/app", "", ""}, FilesHash: strings.Repeat("a", 64)}
	k1 := NextKey(base, run)
	k2 := NextKey(k1, cp)
	cases := []struct {
		name string
		key  string
		same bool
	}{
		{"same chain", NextKey(NextKey(BaseKey("t", "sha256:aaaa"), run), cp), true},
		{"force is not part of the key", NextKey(NextKey(base, Step{Type: run.Type, Args: run.Args, Force: true}), cp), true},
		{"another team", NextKey(NextKey(BaseKey("u", "sha256:aaaa"), run), cp), false},
		{"another base", NextKey(NextKey(BaseKey("t", "sha256:bbbb"), run), cp), false},
		{"a changed earlier step", NextKey(NextKey(base, Step{Type: "RUN", Args: []string{"apt-get install -y curl", "root"}}), cp), false},
		{"another user", NextKey(NextKey(base, Step{Type: "RUN", Args: []string{"apt-get install -y jq", "user"}}), cp), false},
		{"other files", NextKey(k1, Step{Type: cp.Type, Args: cp.Args, FilesHash: strings.Repeat("b", 64)}), false},
		{"args that join the same", NextKey(NextKey(base, Step{Type: "RUN", Args: []string{"apt-get install -y jq root"}}), cp), false},
	}
	for _, c := range cases {
		if got := c.key == k2; got != c.same {
			t.Errorf("%s: key equal to the original = %v, want %v", c.name, got, c.same)
		}
		t.Logf("%s: %s (original %s)", c.name, c.key[:16], k2[:16])
	}
}

func TestSpecValidate(t *testing.T) {
	ok := Spec{FromImage: "debian:stable", StartCmd: "sleep 1", ReadyCmd: "true", Steps: []Step{
		{Type: "RUN", Args: []string{"true"}}, {Type: "ENV", Args: []string{"A", "1"}}, {Type: "WORKDIR", Args: []string{"/app"}},
		{Type: "USER", Args: []string{"user"}}, {Type: "COPY", Args: []string{"a", "/a", "", "0755"}, FilesHash: strings.Repeat("0", 64)},
	}}
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid spec: %v", err)
	}
	bad := map[string]Spec{
		"no base":         {},
		"two bases":       {FromImage: "a", FromTemplate: "b"},
		"registry creds":  {FromImage: "a", FromImageRegistry: []byte(`{"type":"registry"}`)},
		"ready w/o start": {FromImage: "a", ReadyCmd: "true"},
		"unknown step":    {FromImage: "a", Steps: []Step{{Type: "ADD", Args: []string{"x"}}}},
		"copy w/o hash":   {FromImage: "a", Steps: []Step{{Type: "COPY", Args: []string{"a", "/a"}}}},
		"odd env":         {FromImage: "a", Steps: []Step{{Type: "ENV", Args: []string{"A"}}}},
		"bad env name":    {FromImage: "a", Steps: []Step{{Type: "ENV", Args: []string{"A=B", "1"}}}},
		"empty run":       {FromImage: "a", Steps: []Step{{Type: "RUN", Args: []string{" "}}}},
	}
	for name, s := range bad {
		err := s.Validate()
		if !errdefs.IsInvalidArgument(err) {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
	var se *StepError
	us := bad["unknown step"]
	if err := us.Validate(); !errors.As(err, &se) || se.StepName() != "1" {
		t.Errorf("unknown step: %v, want step 1", err)
	}
}

func TestStateApply(t *testing.T) {
	var s State
	for _, st := range []Step{
		{Type: "ENV", Args: []string{"A", "1", "B", "2"}}, {Type: "ENV", Args: []string{"A", "3"}},
		{Type: "WORKDIR", Args: []string{"/app"}}, {Type: "WORKDIR", Args: []string{"sub"}}, {Type: "USER", Args: []string{"user"}},
	} {
		s.Apply(st)
	}
	if !slices.Equal(s.Env, []string{"A=3", "B=2"}) || s.Workdir != "/app/sub" || s.User != "user" {
		t.Fatalf("state %+v", s)
	}
}

func TestCompareListings(t *testing.T) {
	before, err := ParseListing([]byte("1.0 /\x001.0 /etc\x001.0 /etc/a\x001.0 /old\x001.0 /old/x\x001.0 /old/y\x001.0 /keep\x00"))
	if err != nil {
		t.Fatal(err)
	}
	after, err := ParseListing([]byte("2.0 /\x002.0 /etc\x002.0 /etc/a\x002.0 /etc/new\x001.0 /keep\x00"))
	if err != nil {
		t.Fatal(err)
	}
	d := Compare(before, after)
	if !slices.Equal(d.Changed, []string{"etc", "etc/a", "etc/new"}) {
		t.Errorf("changed %q", d.Changed)
	}
	if !slices.Equal(d.Removed, []string{"/old"}) {
		t.Errorf("removed %q (a removed tree is one whiteout)", d.Removed)
	}
	if _, err := ParseListing([]byte("garbage")); err == nil {
		t.Error("a malformed listing parsed")
	}
}

func TestLayerRoundTrip(t *testing.T) {
	var in bytes.Buffer
	tw := tar.NewWriter(&in)
	_ = tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: "etc/", Mode: 0o755})
	_ = tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "etc/new", Mode: 0o644, Size: 2})
	_, _ = tw.Write([]byte("hi"))
	_ = tw.Close()
	var layer bytes.Buffer
	if err := WriteLayer(&layer, bytes.NewReader(in.Bytes()), []string{"/old", "/etc/gone"}); err != nil {
		t.Fatal(err)
	}
	var names []string
	tr := tar.NewReader(bytes.NewReader(layer.Bytes()))
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		names = append(names, h.Name)
	}
	if !slices.Equal(names, []string{".wh.old", "etc/.wh.gone", "etc/", "etc/new"}) {
		t.Fatalf("layer entries %q", names)
	}
	var out bytes.Buffer
	removed, err := SplitLayer(bytes.NewReader(layer.Bytes()), &out)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(removed, []string{"/old", "/etc/gone"}) {
		t.Fatalf("removed %q", removed)
	}
	// A step that makes a file named like a whiteout is refused, not
	// turned into a deletion.
	var evil bytes.Buffer
	tw = tar.NewWriter(&evil)
	_ = tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: "etc/.wh.passwd", Mode: 0o644})
	_ = tw.Close()
	if err := WriteLayer(io.Discard, &evil, nil); err == nil {
		t.Fatal("a .wh. file from the step was written into the layer")
	}
}
