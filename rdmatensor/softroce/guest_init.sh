#!/bin/sh
# Stage 2 inside a SoftRoCE VM: bring up the network and an rxe device, run
# the job's command with the caller's environment, record its exit status and
# power off. $rdt_job and $rdt_index come from the kernel command line; the
# rest from $rdt_job/vm-$rdt_index.env, written by the host.
set -u
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
job="$rdt_job"
. "$job/vm-$rdt_index.env"   # RDT_INDEX, RDT_ADDR, RDT_MTU, RDT_IFNAME, RDMATENSOR_VM_*
idx="$RDT_INDEX"

say() { echo "guest$idx: $*" >> "$job/guest-$idx.log"; }
fail() { say "setup failed: $*"; echo 125 > "$job/rc-$idx"; sync; poweroff -f; }

mkdir -p /dev/pts /dev/shm /run
mount -t devpts devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=0755 tmpfs /run
hostname "rdt-host$idx"
ip link set lo up
modprobe rdma_rxe || fail "modprobe rdma_rxe"

# rxe_on DEVICE IFNAME ADDR: the NIC up and addressed, an rxe device on it, ACTIVE.
rxe_on() {
  ip link set "$2" mtu "$RDT_MTU" up || fail "cannot set $2 up with mtu $RDT_MTU"
  ip addr add "$3/24" dev "$2" || fail "cannot address $2"
  rdma link add "$1" type rxe netdev "$2" || fail "rdma link add $1"
  i=0
  until grep -q ACTIVE "/sys/class/infiniband/$1/ports/1/state" 2>/dev/null; do
    i=$((i + 1)); [ $i -gt 100 ] && fail "$1 port 1 not ACTIVE after 10 s"
    sleep 0.1
  done
  say "$1 ACTIVE on $2 $3 mtu $RDT_MTU"
}
rxe_on rxe0 "$RDT_IFNAME" "$RDT_ADDR"
# A second rail: its own NIC, subnet and rxe device.
[ -z "${RDT_RAIL_IFNAME:-}" ] || rxe_on rxe1 "$RDT_RAIL_IFNAME" "$RDT_RAIL_ADDR"
ulimit -l unlimited
if [ -d "$job/ssh" ]; then
  # The job's client configuration, in this VM's overlay only.
  mkdir -p /run/sshd
  cp "$job/ssh/ssh_config" /etc/ssh/ssh_config || fail "cannot install the job's ssh_config"
  "$(cat "$job/ssh/sshd_path")" -f "$job/ssh/sshd_config-$idx" -E "$job/sshd-$idx.log" || fail "sshd did not start"
  say "sshd listening"
fi
# ready, stamped with this guest's clock (the host compares it with the file's
# time on its own clock: a proof of the job token is good within 300 s of it)
date +%s.%N > "$job/ready-$idx.tmp" && mv "$job/ready-$idx.tmp" "$job/ready-$idx"

# The caller's environment and working directory, then the command itself.
. "$job/cmd.env"
. "$job/vm-$idx.env"
cd "$RDT_CWD" 2>/dev/null || cd /
cmd="$job/cmd-$idx.sh"; [ -e "$cmd" ] || cmd="$job/cmd.sh"
sh "$cmd" > "$job/out-$idx" 2> "$job/err-$idx" < /dev/null
rc=$?
date +%s.%N > "$job/clock-$idx"
echo $rc > "$job/rc-$idx"
sync
poweroff -f
