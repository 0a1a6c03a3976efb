#!/usr/bin/env bash
# A real one-node OpenPBS on this machine, for the tests of `channelsmith build --scheduler pbs`:
# pbs_server (with its PostgreSQL datastore), pbs_sched, pbs_comm and pbs_mom, built from OpenPBS's
# upstream source (a tarball in the channelsmith cache, never in the repository) and run as one node.
#
#   bash scripts/pbs-local.sh build    # compile and install OpenPBS from the cached tarball (once per source hash)
#   bash scripts/pbs-local.sh start    # build if needed, start the node; prints `export ...` lines on stdout (eval them)
#   bash scripts/pbs-local.sh status   # the same lines when the server answers, exit 1 when it does not
#   bash scripts/pbs-local.sh installed  # exit 0 when the cached source is built and installed, else says why
#   bash scripts/pbs-local.sh stop     # stops the daemons and removes the run folder
#
# Why a namespace: OpenPBS refuses to run on a host name that resolves to a loopback address (its
# name lookups skip all of 127.0.0.0/8: "Could not find any usable IP address for host"), and no
# other address of this machine may carry the test traffic. So the daemons run in network, UTS and
# mount namespaces of their own: a host name of their own, a private address on the namespace's own
# loopback interface (only 127.0.0.0/8 is refused), and a hosts file bind-mounted over /etc/hosts there. The file
# system is the machine's (a build directory under /tmp is seen by the jobs, as a shared file system
# would be), except PBS_HOME: PBS refuses to run when a folder on the way to its files is writable by
# others ("Security violation ... resolves to /tmp" in server_logs, and the server stops right after
# its start), so $dir/home is bind-mounted to /var/spool/pbs, on a tmpfs over /var/spool that only the
# namespace sees. PostgreSQL's socket folder (/run/postgresql) is the namespace's own too: two
# of these nodes at once (two test sessions) would otherwise take each other's datastore socket. The
# client commands (qsub, qstat, qdel, qmgr, pbsnodes, ...) enter the same namespaces through wrappers
# in $dir/bin, which `start` puts first on PATH: from the tests' side they are a login node's commands.
# docs/records/pbs-one-node-cpu.md records every step and what it solved.
#
# Environment: CHANNELSMITH_CACHE (default ~/.cache/channelsmith): the tarball is
# $CHANNELSMITH_CACHE/src_cache/pbs/openpbs-*.tar.gz (made with `git archive` from OpenPBS's
# repository; docs/records/pbs-one-node-cpu.md says how), the install goes to $CHANNELSMITH_CACHE/pbs/<hash>.
# CHANNELSMITH_PBS_DIR (default ${TMPDIR:-/tmp}/channelsmith-pbs): the run folder (PBS_HOME, the
# configuration file, logs, the wrappers). Everything meant for people goes to stderr; stdout carries
# only the export lines.
set -euo pipefail

cache="${CHANNELSMITH_CACHE:-${HOME}/.cache/channelsmith}"
dir="${CHANNELSMITH_PBS_DIR:-${TMPDIR:-/tmp}/channelsmith-pbs}"
# The node's name and address inside its namespace (a private range nothing outside it routes).
node=pbsnode
address=10.250.0.1
start_timeout=60

say() { printf 'pbs-local: %s\n' "$*" >&2; }

# Debian packages OpenPBS's INSTALL names for building it on Debian (plus PostgreSQL's server, which
# runs the datastore, and libcjson-dev, which main of 2026 needs); `build` installs the missing ones.
build_packages=(gcc g++ make libtool autoconf automake libhwloc-dev libx11-dev libxt-dev libedit-dev libical-dev
  libncurses-dev perl postgresql postgresql-contrib postgresql-server-dev-all python3-dev tcl-dev tk-dev swig
  libexpat1-dev libssl-dev libxext-dev libxft-dev libcjson-dev)

tarball() {
  local found
  found="$(find "$cache/src_cache/pbs" -maxdepth 1 -name 'openpbs-*.tar.gz' 2>/dev/null | sort | tail -n 1)"
  if [ -z "$found" ]; then
    say "no OpenPBS source in $cache/src_cache/pbs (openpbs-*.tar.gz); docs/records/pbs-one-node-cpu.md says how to make one"
    exit 2
  fi
  printf '%s\n' "$found"
}

# The install folder of a tarball: keyed by the tarball's hash, so another source builds afresh.
install_dir() {
  local hash
  hash="$(sha256sum "$1" | cut -c1-16)"
  printf '%s\n' "$cache/pbs/$hash"
}

build() {
  local source prefix missing=() pkg work
  source="$(tarball)"
  prefix="$(install_dir "$source")"
  if [ -f "$prefix/.complete" ]; then
    say "OpenPBS from $(basename "$source") is installed in $prefix"
    return 0
  fi
  for pkg in "${build_packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$pkg")
    fi
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
      say "missing Debian packages: ${missing[*]}; install them as root (apt-get install ${missing[*]})"
      exit 2
    fi
    say "installing Debian packages: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
  work="$(mktemp -d)"
  # shellcheck disable=SC2064  # the folder is known now
  trap "rm -rf '$work'" EXIT
  # Measured on 2 cores: 1 min 55 s idle; 408 s (issue 56) and 337 s (load 7-9) beside other work.
  say "building $(basename "$source") into $prefix (2 to 7 minutes on 2 cores, by their load)"
  tar -xzf "$source" -C "$work" --strip-components=1
  rm -rf "$prefix"
  (
    cd "$work"
    ./autogen.sh
    ./configure --prefix="$prefix"
    make -j "$(nproc)"
    make install
  ) >"$work/build.log" 2>&1 || {
    tail -n 40 "$work/build.log" >&2
    say "the build failed (the lines above are the end of its log)"
    exit 1
  }
  touch "$prefix/.complete"
  say "installed in $prefix"
}

# The namespaces' holder: a process that only sleeps; the daemons and the wrappers enter its namespaces.
ns_pid() { live_pid "$dir/ns.pid"; }

live_pid() {
  local file="$1" pid
  [ -s "$file" ] || return 0
  pid="$(cat "$file")"
  if kill -0 "$pid" 2>/dev/null; then printf '%s\n' "$pid"; fi
}

# Runs a command inside the node's namespaces, with its configuration file.
in_ns() {
  local pid
  pid="$(ns_pid)"
  [ -n "$pid" ] || return 1
  nsenter --target "$pid" --net --uts --mount --wd="$PWD" -- env PBS_CONF_FILE="$dir/pbs.conf" "$@"
}

exports() {
  printf 'export PBS_CONF_FILE=%q\n' "$dir/pbs.conf"
  # shellcheck disable=SC2016  # $PATH is expanded by the shell that evaluates the line
  printf 'export PATH=%q:"$PATH"\n' "$dir/bin"
}

# Whether the server answers and the node takes jobs.
node_ready() {
  local state
  [ -f "$dir/pbs.conf" ] || return 1
  state="$(in_ns "$(conf_value PBS_EXEC)/bin/pbsnodes" "$node" 2>/dev/null | awk '$1 == "state" {print $3}')"
  [ "$state" = free ] || [ "$state" = job-busy ]
}

conf_value() { sed -n "s/^$1=//p" "$dir/pbs.conf"; }

write_files() {
  local prefix="$1" tool
  printf '127.0.0.1 localhost\n%s %s\n' "$address" "$node" >"$dir/hosts"
  # PBS_DATA_SERVICE_USER: Debian's postgresql package creates this user; PostgreSQL refuses to run as root.
  cat >"$dir/pbs.conf" <<CONF
PBS_EXEC=$prefix
PBS_HOME=/var/spool/pbs
PBS_SERVER=$node
PBS_START_SERVER=1
PBS_START_SCHED=1
PBS_START_COMM=1
PBS_START_MOM=1
PBS_DATA_SERVICE_USER=postgres
CONF
  mkdir -p "$dir/bin"
  # The client commands, run inside the node's namespaces (where its host name resolves).
  for tool in qsub qstat qdel qselect qmgr qalter qhold qrls qsig pbsnodes tracejob; do
    cat >"$dir/bin/$tool" <<WRAPPER
#!/bin/sh
# Generated by scripts/pbs-local.sh: OpenPBS's $tool inside the one-node PBS's namespaces.
pid="\$(cat '$dir/ns.pid' 2>/dev/null)"
[ -n "\$pid" ] && kill -0 "\$pid" 2>/dev/null || { echo "$tool: the local PBS is not running (bash scripts/pbs-local.sh start)" >&2; exit 2; }
exec nsenter --target "\$pid" --net --uts --mount --wd="\$PWD" -- env PBS_CONF_FILE="\${PBS_CONF_FILE:-$dir/pbs.conf}" '$prefix/bin/$tool' "\$@"
WRAPPER
    chmod 755 "$dir/bin/$tool"
  done
}

# The namespaces: the node's own host name, its address on the namespace's loopback interface (any
# address outside 127.0.0.0/8 does: PBS skips only those), and the hosts file that names it.
start_namespace() {
  # shellcheck disable=SC2016  # expanded by the inner bash, from its arguments
  unshare --net --uts --mount --propagation private --fork -- bash -c '
    set -euo pipefail
    hostname "$1"
    ip link set lo up
    ip addr add "$2/32" dev lo
    mount --bind "$3/hosts" /etc/hosts
    mount -t tmpfs -o mode=755 channelsmith-pbs /var/spool
    mkdir /var/spool/pbs
    mount --bind "$3/home" /var/spool/pbs
    # The datastore'"'"'s socket and lock file, which another PBS of this script would share otherwise.
    mkdir -p /run/postgresql
    mount -t tmpfs -o mode=2775,uid=postgres,gid=postgres channelsmith-pbs /run/postgresql
    # Its own pid, not unshare'"'"'s: unshare ignores SIGTERM while it waits for this child.
    echo $$ >"$3/ns.pid.partial"
    mv "$3/ns.pid.partial" "$3/ns.pid"
    exec sleep infinity' pbs-namespace "$node" "$address" "$dir" </dev/null >"$dir/log/namespace.log" 2>&1 &
  local unshare_pid=$! waited=0
  until [ -s "$dir/ns.pid" ]; do
    if [ "$waited" -ge 50 ] || ! kill -0 "$unshare_pid" 2>/dev/null; then
      say "the namespace did not come up: $(cat "$dir/log/namespace.log")"
      exit 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
}

start() {
  local source prefix exec_dir
  if node_ready; then
    say "already running ($dir/pbs.conf)"
    exports
    return 0
  fi
  source="$(tarball)"
  prefix="$(install_dir "$source")"
  if [ ! -f "$prefix/.complete" ]; then
    build
  fi
  stop_daemons
  rm -rf "$dir"
  # PostgreSQL runs as its own user and must reach the datastore below PBS_HOME.
  mkdir -p "$dir/log" "$dir/home"
  chmod 755 "$dir" "$dir/home"
  write_files "$prefix"
  start_namespace
  exec_dir="$prefix"
  # pbs_habitat makes PBS_HOME (pbs_postinstall), initialises the datastore, starts the server once
  # with `-t create`, creates the queue workq and the node, and stops the server again: 15-20 s,
  # the same result every time (PBS_HOME is /var/spool/pbs and the node pbsnode in every namespace).
  # So its PBS_HOME is kept beside the install, and later starts unpack it.
  local template="$exec_dir/home-template.tar"
  if [ -f "$template" ]; then
    tar -xpf "$template" -C "$dir/home"
  elif in_ns "$exec_dir/libexec/pbs_habitat" >"$dir/log/habitat.log" 2>&1; then
    # pgsql.forupgrade: PostgreSQL's binaries, which pbs_habitat copies for a later upgrade (50 MB).
    tar -cpf "$template.partial" --exclude=./pgsql.forupgrade -C "$dir/home" .
    mv "$template.partial" "$template"
  else
    cat "$dir/log/habitat.log" >&2
    say "pbs_habitat failed (above)"
    stop_daemons
    exit 1
  fi
  # MoM copies output files with cp where they are on this host (no rcp/scp).
  # shellcheck disable=SC2016  # $clienthost and $usecp are MoM's words, not variables
  printf '$clienthost %s\n$usecp *:/ /\n' "$node" >"$dir/home/mom_priv/config"
  # In the order of PBS's init script. Their stdio goes to a file: a daemon holding the caller's pipe
  # would keep a caller that reads our stdout (the tests) waiting for ever.
  local daemon
  for daemon in pbs_comm pbs_mom pbs_sched pbs_server; do
    if ! in_ns "$exec_dir/sbin/$daemon" </dev/null >>"$dir/log/daemons.log" 2>&1; then
      cat "$dir/log/daemons.log" >&2
      say "$daemon did not start (above; its log is below $dir/home/*_logs)"
      stop_daemons
      exit 1
    fi
  done
  # In tenths of a second: the node is free about a second after the server starts.
  local waited=0
  until node_ready; do
    if [ "$waited" -ge $((start_timeout * 10)) ]; then
      say "the node did not come up within ${start_timeout} s; logs below $dir/home/*_logs"
      tail -n 20 "$dir"/home/server_logs/* "$dir"/home/mom_logs/* >&2 || say "(no logs)"
      stop_daemons
      exit 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
  # Finished jobs stay in `qstat -x` (how channelsmith tells a failed job from a completed one);
  # root may submit jobs (PBS refuses root's jobs unless acl_roots names it).
  in_ns "$exec_dir/bin/qmgr" -c "set server job_history_enable = True" >&2
  in_ns "$exec_dir/bin/qmgr" -c "set server acl_roots = root" >&2
  say "running: node $node ($address in its own namespace), queue workq, configuration $dir/pbs.conf"
  exports
}

# Stops the daemons, their jobs and the datastore: every process in the node's network namespace is
# one this script started there (ending the namespace's holder alone would leave them running). The
# run folder is removed afterwards, so nothing needs an orderly shutdown (qterm took 10 s).
stop_daemons() {
  local pid members=()
  pid="$(ns_pid)"
  [ -n "$pid" ] || return 0
  mapfile -t members < <(ns_members "$pid")
  stop_pids "${members[@]}"
  kill "$pid"
}

# The processes in the network namespace of process $1, other than $1 itself.
ns_members() {
  local holder="$1" target proc
  target="$(readlink "/proc/$holder/ns/net")"
  for proc in /proc/[0-9]*; do
    [ "${proc#/proc/}" != "$holder" ] || continue
    if [ "$(readlink "$proc/ns/net" 2>/dev/null)" = "$target" ]; then printf '%s\n' "${proc#/proc/}"; fi
  done
}

# SIGTERM to each pid given, up to 2 s to end, then SIGKILL.
stop_pids() {
  local pids=("$@") pid waited=0
  [ "${#pids[@]}" -gt 0 ] || return 0
  kill "${pids[@]}" 2>/dev/null || say "some of ${pids[*]} had ended already"
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 20 ]; do
      sleep 0.1
      waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || say "$pid ended meanwhile"; fi
  done
}

stop() {
  if [ -n "$(ns_pid)" ]; then
    stop_daemons
    say "stopped"
  else
    say "not running (no node in $dir); nothing to stop"
  fi
  rm -rf "$dir"
}

status() {
  if node_ready; then
    say "running ($dir/pbs.conf)"
    exports
  else
    say "not running"
    return 1
  fi
}

# Whether the cached source is built; the reason on stderr when not (the tests' skip message).
installed() {
  local source prefix
  source="$(tarball)"
  prefix="$(install_dir "$source")"
  if [ ! -f "$prefix/.complete" ]; then
    say "$(basename "$source") is not built yet: bash scripts/pbs-local.sh build (or bash .ci/pbs.sh)"
    exit 1
  fi
  printf '%s\n' "$prefix"
}

case "${1:-}" in
  build) build ;;
  installed) installed ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  *)
    say "usage: $0 build|start|stop|status|installed"
    exit 2
    ;;
esac
