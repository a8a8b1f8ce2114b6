// Package envd_test pins our envd protos to the wire contract of the E2B
// SDK they were written from: every message, field, enum value and RPC the
// SDK knows must exist here with the same number, type and shape.
package envd_test

import (
	"bufio"
	"encoding/base64"
	"fmt"
	"os"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/cubesandbox/cube/api/envd/filesystem"
	"github.com/cubesandbox/cube/api/envd/process"
)

// sdkDescriptors reads the descriptors embedded in the pinned npm package.
func sdkDescriptors(t *testing.T) map[string]*descriptorpb.FileDescriptorProto {
	t.Helper()
	f, err := os.Open("testdata/e2b-2.51.0.fdesc")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]*descriptorpb.FileDescriptorProto{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		raw, err := base64.RawStdEncoding.DecodeString(strings.TrimRight(line, "="))
		if err != nil {
			t.Fatal(err)
		}
		var fd descriptorpb.FileDescriptorProto
		if err := proto.Unmarshal(raw, &fd); err != nil {
			t.Fatal(err)
		}
		out[fd.GetPackage()] = &fd
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// shape flattens a file descriptor into comparable lines: one per field,
// enum value and method, keyed by fully qualified name.
func shape(fd *descriptorpb.FileDescriptorProto) map[string]string {
	out := map[string]string{}
	pkg := fd.GetPackage()
	var msg func(prefix string, m *descriptorpb.DescriptorProto)
	msg = func(prefix string, m *descriptorpb.DescriptorProto) {
		name := prefix + "." + m.GetName()
		out[name] = fmt.Sprintf("message map_entry=%v", m.GetOptions().GetMapEntry())
		for _, f := range m.Field {
			oneof := ""
			if f.OneofIndex != nil {
				oneof = m.OneofDecl[f.GetOneofIndex()].GetName()
			}
			out[name+"."+f.GetName()] = fmt.Sprintf("field %d %s %s %s oneof=%s optional=%v",
				f.GetNumber(), f.GetLabel(), f.GetType(), f.GetTypeName(), oneof, f.GetProto3Optional())
		}
		for _, n := range m.NestedType {
			msg(name, n)
		}
		for _, e := range m.EnumType {
			enum(out, name, e)
		}
	}
	for _, m := range fd.MessageType {
		msg(pkg, m)
	}
	for _, e := range fd.EnumType {
		enum(out, pkg, e)
	}
	for _, s := range fd.Service {
		for _, m := range s.Method {
			out[pkg+"."+s.GetName()+"/"+m.GetName()] = fmt.Sprintf("rpc %s %s client_stream=%v server_stream=%v",
				m.GetInputType(), m.GetOutputType(), m.GetClientStreaming(), m.GetServerStreaming())
		}
	}
	return out
}

func enum(out map[string]string, prefix string, e *descriptorpb.EnumDescriptorProto) {
	for _, v := range e.Value {
		out[prefix+"."+e.GetName()+"."+v.GetName()] = fmt.Sprintf("enum value %d", v.GetNumber())
	}
}

func TestProtosMatchPinnedSDK(t *testing.T) {
	sdk := sdkDescriptors(t)
	ours := map[string]protoreflect.FileDescriptor{
		"process":    process.File_envd_process_process_proto,
		"filesystem": filesystem.File_envd_filesystem_filesystem_proto,
	}
	for pkg, fd := range ours {
		want, ok := sdk[pkg]
		if !ok {
			t.Fatalf("SDK descriptors lack package %q", pkg)
		}
		got := shape(protodesc.ToFileDescriptorProto(fd))
		exp := shape(want)
		for k, v := range exp {
			if got[k] != v {
				t.Errorf("%s: SDK has %q, ours %q", k, v, got[k])
			}
		}
		for k := range got {
			if _, ok := exp[k]; !ok {
				t.Errorf("%s: ours only, not in the SDK", k)
			}
		}
	}
}
