package vm

import (
	"context"
	"crypto/sha256"
	"net"
	"strconv"
	"strings"
)

// Machine is the QEMU machine type with the options every VM uses:
//   - x-option-roms=off: no SeaBIOS option ROM scan (the kernel is loaded
//     directly), a few hundred ms under TCG;
//   - isa-serial=on: ttyS0 for the console log (the only ISA device left);
//   - rtc=on: the guest reads wall-clock time at boot (TLS, file times);
//   - acpi stays on (the default): the Debian cloud kernel is built without
//     CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES and finds the virtio-mmio devices
//     through ACPI only.
const Machine = "microvm,x-option-roms=off,isa-serial=on,rtc=on"

// tcgTBSizeMiB bounds TCG's translation cache (QEMU's default is 1 GiB of
// address space), so the QEMU overhead charged to the cgroup stays small.
// Not smaller: a clone's guest fills 26-30 MiB of it after a few commands,
// and a cache below that working set is flushed over and over
// (TestMeasureTCGKnobs: five commands took 9 s at 16 MiB and 16-17 s at
// 8 or 4 MiB, against 1.7 s at 64).
var tcgTBSizeMiB = 64

// qemuTCGEnv is a TCG QEMU's environment: none (glibc's malloc tunables
// bought nothing measurable, TestMeasureTCGKnobs); tests vary it.
var qemuTCGEnv []string

// qemuNoTHP: QEMU under TCG runs without transparent huge pages (QEMU
// madvises its translation cache and guest RAM for them): 2 MiB less of
// QEMU's own anonymous memory per idle clone, no measurable slowdown
// (TestMeasureTCGKnobs). Under KVM huge pages back guest RAM in the EPT
// and stay on.
var qemuNoTHP = true

// Shape is what a memory snapshot fixes about a VM: a restore must start
// QEMU with the same machine, CPU, memory, kernel and devices, or the
// incoming migration stream does not load. It is stored as vm.json in
// every checkpoint dir.
type Shape struct {
	MemoryMiB     int64  `json:"memory_mib"`
	VCPUs         int    `json:"vcpus"`
	Accel         string `json:"accel"`
	Machine       string `json:"machine"`
	CPU           string `json:"cpu"`
	Kernel        string `json:"kernel"`
	Initrd        string `json:"initrd,omitempty"`
	KernelVersion string `json:"kernel_version,omitempty"`
	KernelSHA256  string `json:"kernel_sha256"`
	Cmdline       string `json:"cmdline"`
	// Devices in command-line order: "virtio-blk", "virtio-serial",
	// "virtio-net", "vhost-vsock".
	Devices []string `json:"devices"`
	MAC     string   `json:"mac,omitempty"`
	// RAMObject: guest RAM is the memory backend object ramObject
	// (-machine memory-backend=ram0), which names the RAM block in the
	// migration stream; false: QEMU's default RAM (every snapshot taken
	// before templates had shared memory). A restore must match it.
	RAMObject bool `json:"ram_object,omitempty"`
	// SharedRAM: the RAM is a file mapped shared (a template VM, see
	// template.go); its snapshots hold RAMFile and a stream of device
	// state only, and restore as private mappings of that file.
	SharedRAM bool `json:"shared_ram,omitempty"`
}

func (s Shape) has(dev string) bool {
	for _, d := range s.Devices {
		if d == dev {
			return true
		}
	}
	return false
}

// paths are one VM's per-instance files, all in its bundle.
type paths struct {
	Disk, QMP, Agent, Console, Log, PIDFile string
	VsockCID                                uint32
	// FDs, when set, is a jailed QEMU's command line (jail.go): it
	// reaches no host path, so every file is a descriptor it inherits,
	// and it runs under QEMU's own seccomp sandbox. Unset, QEMU opens
	// the paths above itself and daemonizes (RawIncoming).
	FDs *qemuFDs
	// RAM is the file backing guest RAM when the shape has RAMObject:
	// "" for anonymous memory (memory-backend-ram); with FDs it is
	// ignored for FDs.RAM. ShareRAM maps it shared (a template VM), else
	// privately (a clone: copy on write).
	RAM      string
	ShareRAM bool
}

// qemuFDs are the descriptor numbers a jailed QEMU inherits; 0 = none.
type qemuFDs struct {
	Name                      string // -name: nameMarker(bundle)
	QMP, Agent, Disk, Console int
	Tap, VhostNet, Vsock      int
	// RAM is the guest RAM's file (a template's RAM file or a clone's
	// sealed memfd), opened by QEMU as /proc/self/fd/RAM.
	RAM int
}

// sandboxOpts is QEMU's seccomp filter: besides its default deny list
// (obsolete=deny), no set*uid/set*gid (elevateprivileges), no fork or
// exec (spawn: migration streams are descriptors the driver passes, never
// "exec:" URIs) and no scheduler or priority changes (resourcecontrol).
const sandboxOpts = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

// nameMarker is a jailed QEMU's -name: it names the bundle, so a pid is
// recognised as this VM's QEMU (alive) and as a leak under a test's dir.
func nameMarker(bundle string) string { return "cube-vm:" + escapeOpt(bundle) }

// cpuModel: TCG emulates "max" (every feature TCG can do); KVM passes the
// host CPU through. Both tie a snapshot to the host kind it was taken on,
// which restore checks through Shape.Accel.
func cpuModel(accel string) string {
	if accel == "kvm" {
		return "host"
	}
	return "max"
}

// macFor derives a locally administered unicast MAC from the sandbox ID,
// so a VM keeps its MAC across cubelet restarts without storing it.
func macFor(id string) string {
	h := sha256.Sum256([]byte(id))
	return net.HardwareAddr{0x02, h[0], h[1], h[2], h[3], h[4]}.String()
}

// ConsoleChardev is the serial console's chardev ID.
const ConsoleChardev = "console"

// consoleRing is what the console keeps once sealed.
const consoleRing = 64 << 10

// SealConsole stops id's serial console from writing to its file: from now
// on it goes to a 64 KiB ring buffer inside QEMU. cubelet calls it once the
// agent answers, so the file keeps the boot and a guest cannot grow it.
func (d *Driver) SealConsole(ctx context.Context, id string) error {
	st, err := d.load(id)
	if err != nil {
		return err
	}
	args := map[string]any{"id": ConsoleChardev, "backend": map[string]any{
		"type": "ringbuf", "data": map[string]any{"size": consoleRing}}}
	return d.execute(ctx, st, "chardev-change", args, nil)
}

// MAC is the NIC address of the VM with this ID. A clone restored from
// another VM's memory image still carries the original's until its agent
// is told this one (cubelet's reinit).
func (d *Driver) MAC(id string) string { return macFor(id) }

// vcpusFor: one vCPU per started 1000 milli-CPU, at least one.
func vcpusFor(milliCPU int64) int {
	if milliCPU <= 0 {
		return 1
	}
	return int((milliCPU + 999) / 1000)
}

// qemuArgs is QEMU's command line for a VM of shape s with files p;
// incoming adds "-incoming defer" for a restore. The VM always starts
// stopped (-S): the driver moves QEMU into the sandbox's cgroup before
// the first guest instruction runs, then sends "cont".
func qemuArgs(s Shape, p paths, incoming bool) []string {
	accel := "kvm"
	if s.Accel == "tcg" {
		accel = "tcg,tb-size=" + strconv.Itoa(tcgTBSizeMiB)
	}
	name, fds := "cube-vm", p.FDs
	if fds != nil {
		name = fds.Name
		s.Kernel, s.Initrd = jailKernel, jailInitrd
	}
	machine := s.Machine
	if s.RAMObject {
		machine += ",memory-backend=" + ramObject
	}
	a := []string{
		"-name", name,
		"-M", machine,
		"-accel", accel,
		"-cpu", s.CPU,
		"-smp", strconv.Itoa(s.VCPUs),
		"-m", strconv.FormatInt(s.MemoryMiB, 10) + "M",
	}
	if s.RAMObject {
		a = append(a, "-object", ramBackend(s, p))
	}
	if s.Accel == "tcg" {
		// The guest kernel calibrates its TSC against the PIT in a few
		// ms of guest time. Under TCG both follow the host clock, and on
		// a loaded host the vCPU thread is descheduled mid-calibration:
		// it fails ("Unable to calibrate against PIT"), and this kernel,
		// with no HPET or PM timer on microvm, then hangs with no clock.
		// With icount the guest's clocks advance with the instructions it
		// executes, and its TSC counts virtual nanoseconds (1 GHz), which
		// the guest is told (vmguest.TCGTSCParam) instead of measuring
		// it: even under icount the measurement against the PIT fails
		// now and then on a loaded host, and the kernel then spins for
		// good waiting for a timer tick. shift=auto keeps guest time
		// close to real time.
		a = append(a, "-icount", "shift=auto")
	}
	a = append(a, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-S")
	if fds != nil {
		// stderr is qemu.log already (QEMU is the driver's child, not a
		// daemon). The disk and the console are fd sets: QEMU opens
		// /dev/fdset/N by duplicating the descriptor of the right mode.
		a = append(a, "-sandbox", sandboxOpts,
			"-add-fd", "fd="+strconv.Itoa(fds.Disk)+",set=1,opaque=disk",
			"-add-fd", "fd="+strconv.Itoa(fds.Console)+",set=2,opaque=console")
		p.Disk, p.Console = "/dev/fdset/1", "/dev/fdset/2"
	} else {
		a = append(a,
			"-daemonize", "-pidfile", p.PIDFile,
			// With a log file QEMU keeps stderr (ours: qemu.log) after
			// daemonizing instead of pointing it at /dev/null, so a failed
			// incoming stream or a crash says why there. No -d items: they
			// would let the guest grow a host file at will.
			"-D", p.Log)
	}
	if loadsKernel(s, incoming) {
		a = append(a, "-kernel", s.Kernel)
		if s.Initrd != "" {
			a = append(a, "-initrd", s.Initrd)
		}
		a = append(a, "-append", s.Cmdline)
	}
	a = append(a,
		// The console is a file while the guest boots (what a failed
		// boot says), switched to a ring buffer once the agent answers
		// (SealConsole): guest root must not be able to fill the host's
		// disk through it.
		"-chardev", "file,id="+ConsoleChardev+",path="+escapeOpt(p.Console),
		"-serial", "chardev:"+ConsoleChardev,
	)
	if fds != nil {
		a = append(a, "-chardev", "socket,id=qmp,fd="+strconv.Itoa(fds.QMP)+",server=on,wait=off", "-mon", "chardev=qmp,mode=control")
	} else {
		a = append(a, "-qmp", "unix:"+p.QMP+",server=on,wait=off")
	}
	for _, dev := range s.Devices {
		switch dev {
		case "virtio-blk":
			// cache=writeback, aio=threads: the disk is a FICLONE'd file on
			// the pool; O_DIRECT (cache=none) fails on tmpfs and gains
			// nothing for short-lived sandboxes, while the page cache
			// shares a template's blocks between its clones. QEMU flushes
			// the disk on stop, so a paused VM's disk is consistent for a
			// snapshot's FICLONE.
			// auto-read-only=off: QEMU opens the image read-write at once
			// instead of probing it read-only first, so one read-write
			// descriptor serves (a read-only one in the set would keep
			// its lock and block the write lock a cont after a
			// migration takes again).
			drive := "id=root,file=" + escapeOpt(p.Disk) + ",format=raw,if=none,cache=writeback,aio=threads,discard=unmap"
			if fds != nil {
				drive += ",auto-read-only=off"
			}
			a = append(a, "-drive", drive, "-device", "virtio-blk-device,drive=root")
		case "virtio-serial":
			agent := "path=" + escapeOpt(p.Agent)
			if fds != nil {
				agent = "fd=" + strconv.Itoa(fds.Agent)
			}
			a = append(a,
				"-chardev", "socket,id=agent,"+agent+",server=on,wait=off",
				"-device", "virtio-serial-device",
				"-device", "virtserialport,chardev=agent,name=org.cube.agent")
		case "vhost-vsock":
			dev := "vhost-vsock-device,guest-cid=" + strconv.FormatUint(uint64(p.VsockCID), 10)
			if fds != nil {
				dev += ",vhostfd=" + strconv.Itoa(fds.Vsock)
			}
			a = append(a, "-device", dev)
		case "virtio-net":
			// vhost=off: QEMU aborts with vhost=on where /dev/vhost-net is
			// missing; Config.Vhost turns it on where it exists.
			netdev := "tap,id=net0,ifname=" + tapName + ",script=no,downscript=no,vhost=" + onOff(s.has("vhost-net"))
			if fds != nil {
				// The helper attached the TAP in the slot's namespace.
				netdev = "tap,id=net0,fd=" + strconv.Itoa(fds.Tap) + ",vhost=" + onOff(s.has("vhost-net"))
				if s.has("vhost-net") {
					netdev += ",vhostfd=" + strconv.Itoa(fds.VhostNet)
				}
			}
			a = append(a,
				"-netdev", netdev,
				"-device", "virtio-net-device,netdev=net0,mac="+s.MAC)
		}
	}
	if incoming {
		a = append(a, "-incoming", "defer")
	}
	return a
}

// ramBackend is the -object of a shape with RAMObject: a file mapped
// shared (template) or private (clone), or anonymous memory (a restore of
// a clone's own snapshot, whose stream carries all of its RAM).
func ramBackend(s Shape, p paths) string {
	size := ",size=" + strconv.FormatInt(s.MemoryMiB, 10) + "M"
	path := p.RAM
	if p.FDs != nil {
		path = ""
		if p.FDs.RAM > 0 {
			path = "/proc/self/fd/" + strconv.Itoa(p.FDs.RAM)
		}
	}
	if path == "" {
		return "memory-backend-ram,id=" + ramObject + size
	}
	return "memory-backend-file,id=" + ramObject + size + ",mem-path=" + escapeOpt(path) + ",share=" + onOff(p.ShareRAM)
}

// loadsKernel: QEMU keeps a copy of -kernel and -initrd in its own memory
// for the life of the VM (fw_cfg data for a reboot: 14 MiB with the Debian
// cloud kernel), though only a boot reads it and -no-reboot ends QEMU
// instead of rebooting. A clone restored from a template (a shape with
// RAMObject: the guest runs from its memory image, and fw_cfg contents are
// not part of the migration stream) leaves them out. Restores of
// snapshots from before keep the command line they were taken with.
func loadsKernel(s Shape, incoming bool) bool { return !incoming || !s.RAMObject }

func onOff(b bool) string {
	if b {
		return "on"
	}
	return "off"
}

// escapeOpt doubles commas, QEMU's escape inside an option value.
func escapeOpt(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// shellQuote quotes s for the /bin/sh QEMU runs "exec:" migration URIs with.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func cidFor(id string) uint32 {
	h := sha256.Sum256([]byte(id))
	// CIDs 0-2 are reserved; keep clear of the top of the range.
	return 3 + (uint32(h[0])<<16|uint32(h[1])<<8|uint32(h[2]))%0xFFFFF0
}

// Describe is the one-line summary nodes advertise next to the runtime's
// name: which accelerator VMs run on and the agent channel they use.
func (d *Driver) Describe() string {
	ch := "virtio-serial"
	if d.vsock {
		ch = "vsock"
	}
	return "accel=" + d.accel + " channel=" + ch
}
