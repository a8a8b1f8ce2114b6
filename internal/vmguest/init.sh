#!/bin/busybox sh
# cube initramfs /init: load the virtio drivers, mount the root disk and
# hand PID 1 over to cube-agent. Any failure exits, which panics the
# kernel; with panic=-1 and QEMU's -no-reboot the VM stops at once and the
# message below is the last line of the console log.
export PATH=/bin
fail() { echo "cube-init: $*"; exit 1; }

mount -t proc proc /proc || fail "mount /proc"
mount -t sysfs sysfs /sys || fail "mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "mount /dev"

root=/dev/vda fstype=ext4 mode=rw init=/usr/local/bin/cube-agent
for arg in $(cat /proc/cmdline); do
	case "$arg" in
	root=*) root="${arg#root=}" ;;
	rootfstype=*) fstype="${arg#rootfstype=}" ;;
	ro) mode=ro ;;
	rw) mode=rw ;;
	cube.init=*) init="${arg#cube.init=}" ;;
	esac
done

while read -r m; do
	[ -n "$m" ] && { insmod "/lib/modules/$m.ko" || fail "insmod $m"; }
done < /etc/modules

# virtio_blk probes synchronously, so the disk is normally there already;
# wait up to 5 s for slow (TCG) hosts.
i=0
while [ ! -b "$root" ]; do
	i=$((i + 1))
	[ $i -gt 500 ] && fail "root device $root did not appear"
	usleep 10000
done
mount -t "$fstype" -o "$mode" "$root" /newroot || fail "mount $root ($fstype, $mode)"
[ -x "/newroot$init" ] || fail "$init: not found or not executable on $root"

umount /proc /sys /dev
exec switch_root /newroot "$init" --vm
