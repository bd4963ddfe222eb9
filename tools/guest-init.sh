#!/bin/busybox sh
# /init of the ksfs test and demo guest (copied into the initramfs by tools/build-guest).
# Loads the virtio modules, mounts the data disk at /data and runs an agent-like workload forever:
# transcript lines with increasing seq made durable at once, files written and deleted, some memory
# kept busy, a counter on the serial console, and (with ksfs.gateway=URL) model calls whose call
# number is kept on disk so a restored guest repeats the same call with the same idempotency key.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /run /data
mount -t tmpfs -o size=16m tmpfs /run

say() { echo "ksfs-guest: $*" > /dev/console; }

for m in $(cat /modules.order); do
  insmod "/modules/$m.ko" 2>/dev/null || say "insmod $m failed"
done

arg() { sed -n "s/.*[[:space:]]$1=\([^[:space:]]*\).*/\1/p; s/^$1=\([^[:space:]]*\).*/\1/p" /proc/cmdline | head -n 1; }
LINEAGE=$(arg ksfs.lineage)
GATEWAY=$(arg ksfs.gateway)
EVERY=$(arg ksfs.call_every); EVERY=${EVERY:-10}
# Per-domain facts from QEMU's fw_cfg, read afresh at every use: a restore or a fork sets them
# from its new definition, so a forked guest calls its own session's gateway with its own token.
fwcfg() { f=/sys/firmware/qemu_fw_cfg/by_name/opt/ksfs/$1/raw; [ -r "$f" ] && cat "$f"; }
gateway() { g=$(fwcfg gateway); echo "${g:-$GATEWAY}"; }
INTERVAL=$(arg ksfs.interval); INTERVAL=${INTERVAL:-0.3}

i=0
while [ ! -b /dev/vda ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
if ! mount -t ext4 /dev/vda /data; then
  say "cannot mount /dev/vda"; while true; do sleep 60; done
fi
mkdir -p /data/agent /data/work
# ksfs.transcript=PATH (in the disk's filesystem): a guest that keeps it elsewhere, as an adopted
# domain's may (`ksfs session adopt --transcript`)
T=/data/$(arg ksfs.transcript); [ "$T" = /data/ ] && T=/data/agent/transcript.jsonl
mkdir -p "${T%/*}"
touch "$T"

last=$(tail -n 20 "$T" | grep -o '"seq": *[0-9]*' | tail -n 1 | grep -o '[0-9]*$')
SEQ=${last:-0}
[ -f /data/agent/calls ] || { echo 0 > /data/agent/calls; sync /data/agent/calls; }

if [ -n "$(gateway)" ]; then
  ip link set lo up
  ip link set eth0 up
  ip addr add 10.0.2.15/24 dev eth0
  ip route add default via 10.0.2.2
fi

nonce() {  # host randomness (virtio-rng) when present: forks of one checkpoint diverge at once
  if [ -c /dev/hwrng ]; then
    head -c 4 /dev/hwrng 2>/dev/null | od -An -tx1 | tr -d ' \n'
  else
    head -c 4 /dev/urandom | od -An -tx1 | tr -d ' \n'
  fi
}

append() {  # append one transcript line and make it durable before going on
  SEQ=$((SEQ + 1))
  up=$(cut -d' ' -f1 /proc/uptime)
  line="{\"seq\": $SEQ, \"lineage\": \"$LINEAGE\", \"counter\": $SEQ, \"t\": $up"
  echo "$line, \"nonce\": \"$(nonce)\", $1}" >> "$T"
  sync "$T"
  echo "ksfs-counter $SEQ" > /dev/console
}

call_model() {  # one try at the current model call; the loop retries the same call next step
  n=$(cat /data/agent/calls)
  key="${LINEAGE:-guest}-call-$n"
  body="{\"model\": \"demo\", \"messages\": [{\"role\": \"user\", \"content\": \"call $n\"}]}"
  rm -f /run/answer
  token=$(fwcfg token)
  set -- --header "Idempotency-Key: $key" --header "Content-Type: application/json"
  [ -n "$token" ] && set -- "$@" --header "Authorization: Bearer $token"
  # A call open across a restore has no connection left on the host side: give up on it and
  # retry the same call (the gateway serves the retry from its store). Debian's busybox wget
  # crashes on its own -T, so timeout(1) bounds it.
  out=$(timeout 12 wget -q -S -O /run/answer "$@" --post-data "$body" \
    "$(gateway)/v1/chat/completions" 2>&1)
  status=$(echo "$out" | grep -o 'HTTP/[0-9.]* [0-9]*' | tail -n 1 | grep -o '[0-9]*$')
  if [ ! -s /run/answer ]; then
    say "call $n failed (${status:-no answer}); it is tried again next step"
    return 1
  fi
  append "\"op\": \"call\", \"call\": $n, \"status\": ${status:-0}"
  echo $((n + 1)) > /data/agent/calls.new
  sync /data/agent/calls.new
  mv /data/agent/calls.new /data/agent/calls
  sync /data/agent
}

append "\"op\": \"boot\""
# a few MiB of memory kept busy: a tmpfs file rewritten in rotating 256 KiB pieces
dd if=/dev/zero of=/run/busy bs=256k count=16 2>/dev/null
step=0
PENDING=0
while true; do
  step=$((step + 1))
  dd if=/dev/urandom of=/run/busy bs=256k count=1 seek=$((step % 16)) conv=notrunc 2>/dev/null
  f=/data/work/f$((step % 20))
  case $((step % 3)) in
    0) f=/data/work/f$(((step + 10) % 20)); rm -f "$f"; op=delete ;;
    *) head -c $((1024 * (step % 7 + 1))) /run/busy > "$f"; op=write ;;
  esac
  append "\"op\": \"$op\", \"file\": \"$f\""
  if { [ "$PENDING" = 1 ] || [ $((step % EVERY)) -eq 0 ]; } && [ -n "$(gateway)" ]; then
    if call_model; then PENDING=0; else PENDING=1; fi
  fi
  sleep "$INTERVAL"
done
