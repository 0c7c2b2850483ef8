#!/usr/bin/env bash
# Boots systemd as PID 1 over an overlay of / for tests/fixtures_systemd.py; nothing it writes reaches the host.
#
#   systemd_boot.sh outer WORK CGROUP_PROCS...   joins the given cgroups (the test's own, made for this boot),
#                                                then runs "inner" in new pid/mount/uts/ipc/cgroup namespaces,
#                                                so systemd's cgroup root is those cgroups, not the host's
#   systemd_boot.sh inner WORK                   builds WORK/root and execs systemd in it
#   systemd_boot.sh probe WORK                   the same in new namespaces, but exits instead of booting
#
# WORK/cgroups lists the cgroup file systems to mount in the new root, one "FSTYPE DIR OPTIONS" per line
# (DIR relative to /sys/fs/cgroup, "." for a cgroup2-only host).
#
# THE TRAP (shared/FEASIBILITY.md "Real systemd"): booted over the host's real /, systemd's boot units
# emptied the host's /tmp. So the root is an overlay whose writes go to a tmpfs, in a private mount
# namespace, and every mount is checked before systemd is exec'ed. The network namespace stays the host's
# (the test's mosquitto is reached on 127.0.0.1): units that would listen or change the host are masked.
set -euo pipefail

stage=${1:?stage} work=${2:?work dir}
case $work in /*) ;; *) echo "WORK must be absolute: $work" >&2; exit 2 ;; esac
ns="--pid --fork --mount --mount-proc --propagation private --uts --ipc --cgroup"

case $stage in
outer)
    shift 2
    for procs in "$@"; do echo $$ >"$procs"; done
    # --kill-child: should unshare die (the test killed, its parent-death signal), PID 1 and with it the
    # whole namespace die too.
    # shellcheck disable=SC2086  # $ns is a list of options
    exec unshare $ns --kill-child=SIGKILL -- bash "$0" inner "$work" "$(readlink /proc/self/ns/mnt)"
    ;;
probe)
    # shellcheck disable=SC2086
    exec unshare $ns -- bash "$0" check "$work" "$(readlink /proc/self/ns/mnt)"
    ;;
inner | check) host_mnt_ns=${3:?host mount namespace} ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac

die() { echo "systemd_boot: $*" >&2; exit 1; }
[ "$(readlink /proc/self/ns/mnt)" != "$host_mnt_ns" ] || die "not in a mount namespace of its own"

L=$work/layers R=$work/root
mkdir -p "$L" "$R"
mount -t tmpfs -o mode=755 tmpfs "$L"
mkdir -p "$L/upper" "$L/work"
mount -t overlay overlay -o "lowerdir=/,upperdir=$L/upper,workdir=$L/work" "$R"

# API file systems: a fresh proc of the new pid namespace; /sys and /proc/sys read-only (nothing to tune
# on the host's kernel; systemd-sysctl and friends skip themselves); a /dev of its own with the usual nodes.
mount -t proc proc "$R/proc"
for p in sys sysrq-trigger; do
    [ -e "$R/proc/$p" ] || continue  # no sysrq-trigger in kernels without magic SysRq
    mount --bind "$R/proc/$p" "$R/proc/$p"
    mount -o remount,bind,ro "$R/proc/$p"
done
mount --bind /sys "$R/sys"
mount -t tmpfs -o mode=755 tmpfs "$R/sys/fs/cgroup"
while read -r fstype dir options; do
    target=$R/sys/fs/cgroup/$dir
    [ "$dir" = . ] && umount "$R/sys/fs/cgroup"
    mkdir -p "$target"
    mount -t "$fstype" -o "$options" "$fstype" "$target"  # in the new cgroup namespace: its root only
done <"$work/cgroups"
mount -o remount,bind,ro "$R/sys"
mount -t tmpfs -o mode=755 tmpfs "$R/dev"
for node in null zero full random urandom tty; do touch "$R/dev/$node"; mount --bind "/dev/$node" "$R/dev/$node"; done
mkdir "$R/dev/pts" "$R/dev/shm"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=1777 tmpfs "$R/dev/shm"
ln -s /proc/self/fd "$R/dev/fd"
# systemd writes its boot messages to the console: a file of the test's.
touch "$work/console.log" "$R/dev/console"
mount --bind "$work/console.log" "$R/dev/console"
mount -t tmpfs -o mode=755 tmpfs "$R/run"
mount -t tmpfs -o mode=1777 tmpfs "$R/tmp"

# Checked, not assumed: the root and what systemd's boot cleans are private.
fs() { findmnt -n -o FSTYPE -M "$1"; }
opts() { findmnt -n -o OPTIONS -M "$1"; }
[ "$(fs "$L")" = tmpfs ] || die "$L is not a tmpfs"
[ "$(fs "$R")" = overlay ] || die "$R is not the overlay"
[[ "$(opts "$R")" == *"upperdir=$L/upper"* ]] || die "$R does not write to $L/upper"
for d in run tmp dev; do [ "$(fs "$R/$d")" = tmpfs ] || die "$R/$d is not a tmpfs"; done
for d in sys proc/sys; do [[ "$(opts "$R/$d")" == ro,* ]] || die "$R/$d is not read-only"; done
[ "$(readlink -f "$R")" != / ] || die "the root is /"

# Units that would reach the host through the shared network namespace or kernel, or only cost time.
units=$R/etc/systemd/system
for unit in mosquitto.service postgresql.service systemd-networkd.service systemd-networkd.socket \
    systemd-timesyncd.service systemd-journald-audit.socket systemd-modules-load.service \
    systemd-binfmt.service proc-sys-fs-binfmt_misc.automount timers.target getty.target \
    e2scrub_reap.service remote-fs.target; do
    ln -sf /dev/null "$units/$unit"
done
# Booted into a target of its own: basic.target (what every service needs), not multi-user.target's extras.
cat >"$units/edge-agent-test.target" <<'EOF'
[Unit]
Description=edge-agent test system (tests/systemd_boot.sh)
Requires=basic.target
After=basic.target
AllowIsolate=yes
EOF

[ "$stage" = check ] && exit 0
exec chroot "$R" /usr/bin/env -i container=other /lib/systemd/systemd --system --unit=edge-agent-test.target
