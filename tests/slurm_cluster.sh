#!/usr/bin/env bash
# A real Slurm cluster of several nodes on this one machine, for the tests and for trying the ladder
# without a cluster.
#
#   sudo tests/slurm_cluster.sh start     # install what is missing, start munged, MariaDB, slurmdbd, slurmctld,
#                                         # and a slurmd for each node (n1 to n8, nw1 and nw2)
#   export SLURM_CONF=/tmp/ddp-ladder-slurm/slurm.conf   # what start prints: the Slurm commands find the cluster
#   sbatch 05_ddp_slurm/submit.sh ...      # then use it like any cluster (see tests/README.md)
#   sudo tests/slurm_cluster.sh stop      # stop exactly what start started and undo its changes
#   tests/slurm_cluster.sh status
#
# Each slurmd runs in a network namespace of its own (its own hostname and address on a private bridge that
# exists only on this machine), so MASTER_ADDR resolution and cross-node rendezvous are exercised as on a real
# cluster. The nodes come in pairs, each pair with partitions of its own: low (the default) and high on n1 and
# n2, low1 and high1 on n3 and n4, and so on. A job of a high partition preempts the jobs of its pair's low one
# and no other, so that the tests can run side by side, each on its own pair (tests/README.md); its pair's cancel
# partition is low with PreemptMode=CANCEL. One more pair, nw1 and nw2 (partition wide), declares 4 CPUs a node,
# more than the machine has, so that 05's submit.sh runs as shipped, 4 tasks a node (unbound). Every node
# declares 4 GPUs as Slurm gres (character devices that stand in for them), as a GPU cluster's nodes do; a job
# that asks for none (--gpus-per-node=0) runs as on a CPU cluster. Accounting works as at real sites:
# slurmctld records every job through slurmdbd in a MariaDB server of its own, so sacct (and submitit, which
# polls it) sees the jobs. Needs root: namespaces, apt-get and /etc/hosts.
#
# Everything it names can be changed, so that two clusters can run side by side on one machine (a second one:
# SLURM_TEST_DIR=/tmp/c2 SLURM_TEST_NAME=c2 SLURM_TEST_SUBNET=10.214.0 SLURM_TEST_NODE_PREFIX=m
# SLURM_TEST_PORT=17817):
#   SLURM_TEST_DIR          state, logs, the database and slurm.conf (default /tmp/ddp-ladder-slurm); the Slurm
#                           commands find the cluster through SLURM_CONF=$SLURM_TEST_DIR/slurm.conf, and
#                           /etc/slurm is left alone
#   SLURM_TEST_NAME         prefix of the bridge (NAME-br0), the namespaces and their links (NAME-NODE); default
#                           ddpl
#   SLURM_TEST_SUBNET       private /24 of the bridge (default 10.213.0); change it if it clashes with yours
#   SLURM_TEST_NODE_PREFIX  the nodes' names: PREFIX1, PREFIX2, ... (default n)
#   SLURM_TEST_PAIRS        pairs of nodes (default 4: 8 nodes), one for each test that runs at the same time;
#                           the wide pair comes on top
#   SLURM_TEST_PORT         slurmctld's port; slurmdbd takes PORT + 2 and MariaDB PORT + 3 (default 16817)
# Start adds a line per node to /etc/hosts, marked with SLURM_TEST_DIR; stop removes those lines only, stops the
# daemons by the PIDs that start recorded, never by name, and removes $SLURM_TEST_DIR.
set -Eeuo pipefail  # -E: the ERR trap of start also fires inside the functions it calls

STATE=${SLURM_TEST_DIR:-/tmp/ddp-ladder-slurm}
NAME=${SLURM_TEST_NAME:-ddpl}
SUBNET=${SLURM_TEST_SUBNET:-10.213.0}
BRIDGE=$NAME-br0
NODE_PREFIX=${SLURM_TEST_NODE_PREFIX:-n}
PAIRS=${SLURM_TEST_PAIRS:-4}
NODES=()
for ((i = 1; i <= 2 * PAIRS; i++)); do NODES+=("$NODE_PREFIX$i"); done
# 2 CPUs a node, the machine's own two: tasks are bound to cores (task/affinity), so a node cannot declare cores
# the machine does not have. Every node's jobs share those two cores.
CPUS_PER_NODE=2
# One more pair, PREFIXw1 and PREFIXw2 (partition wide), declares WIDE_CPUS CPUs a node so that 05's submit.sh runs
# with its #SBATCH lines as shipped (4 tasks a node; cores overridden). slurmd takes the count from slurm.conf
# (SlurmdParameters=config_overrides), but task/affinity cannot bind 4 tasks to 2 cores (srun: "Unable to layout
# tasks on given cpus"): its tasks are not bound (CpuBind=none) and share the machine's cores.
WIDE_NODES=("${NODE_PREFIX}w1" "${NODE_PREFIX}w2")
WIDE_CPUS=4
NODES+=("${WIDE_NODES[@]}")
GPUS_PER_NODE=4
CTLD_PORT=${SLURM_TEST_PORT:-16817}  # the defaults 6817-6819 stay free for a site's own Slurm
DBD_PORT=$((CTLD_PORT + 2))          # slurmdbd
DB_PORT=$((CTLD_PORT + 3))           # MariaDB, on 127.0.0.1 only (not 3306, which a system MariaDB may hold)
MARK="# ddp-ladder Slurm test cluster ($STATE)"  # on its lines in /etc/hosts: ends with the folder
CONF=$STATE/slurm.conf
export SLURM_CONF=$CONF  # for this script's own sinfo, squeue, scancel and sacctmgr

log() { echo "slurm_cluster: $*" >&2; }
# Exits with the message; during a start, first undoes what the start did (as its ERR trap does).
die() {
  log "error: $*"
  [[ $(trap -p ERR) == *undo_start* ]] && undo_start
  exit 1
}
undo_start() { trap - ERR; log "start failed: undoing what it did"; stop; }

install_packages() {
  local missing=()
  for cmd in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge slurmdbd:slurmdbd \
    mariadbd:mariadb-server; do
    command -v "${cmd%%:*}" >/dev/null || missing+=("${cmd#*:}")
  done
  ((${#missing[@]} == 0)) && return
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq "${missing[@]}" >/dev/null
}

# Starts "$@" detached in its own session, records its PID under a name and waits for nothing.
spawn() {
  local name=$1; shift
  # From /, so that a daemon (and the job steps it starts) holds no folder of the caller's: a clone deleted
  # while the cluster runs would put "Unable to get current working directory" into every job's log.
  (cd / && exec setsid "$@" >>"$STATE/log/$name.out" 2>&1 </dev/null) &
  echo "$!" >"$STATE/pids/$name"
}

write_conf() {
  local host node nodes cpus i=0
  host=$(hostname -s)
  cat >"$STATE/slurm.conf" <<EOF
$MARK: written by tests/slurm_cluster.sh
ClusterName=ddpladder
SlurmctldHost=$host($SUBNET.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire=5, the smallest Slurm takes (4 falls back to 120): a requeued job may start again after 6 s
# (requeue + cred_expire + 1) instead of 121 s
AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# No cgroups here: track processes through /proc. Bind each task to its cores (sched_setaffinity), as
# real sites do.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
# Each job's CPU time in the accounting (sacct's TotalCPU): the suite's summary gives every Slurm test's, as it
# gives the others' from their own processes.
JobAcctGatherType=jobacct_gather/linux
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
# Fast turnaround for tests: finished jobs leave quickly (sbatch --wait polls every 2 s only while MinJobAge
# is small), the scheduler runs every second (a requeued job starts within a second of being eligible),
# cancelled processes get SIGKILL after 5 s (30 s by default; the tests' stops must fit), impossible requests
# are refused.
MinJobAge=4
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=0
KillWait=5
EnforcePartLimits=ALL
# Accounting: slurmctld sends every job's record to slurmdbd, on the bridge's address so that sacct
# works from this machine and from inside the nodes. Nothing is enforced: any user may run jobs.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=$SUBNET.1
AccountingStoragePort=$DBD_PORT
# With slurmdbd this names the munge socket for its connections (default /run/munge/munge.socket.2): ours.
AccountingStoragePass=$STATE/munge/munge.socket
# Preemption as many sites run it: a job of the partition "high" takes the nodes of a job of "low" (the default)
# at once. The low job's tasks get SIGTERM (no SIGUSR2 first: no preempt_send_user_signal), and GraceTime
# seconds later the job is killed and requeued, unless it left before: then it stays ended. GraceTime=30, as at
# the site measured in issue 14: a stop, its save and a slow rank's exit fit in it on a loaded machine (10 did not).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
# Every node has GPUS_PER_NODE GPUs as a GPU cluster's nodes declare them (gres.conf names their devices).
GresTypes=gpu
EOF
  for node in "${NODES[@]}"; do
    i=$((i + 1))
    if [[ " ${WIDE_NODES[*]} " == *" $node "* ]]; then cpus="$WIDE_CPUS CpuBind=none"; else cpus=$CPUS_PER_NODE; fi
    echo "NodeName=$node NodeAddr=$SUBNET.$((10 + i)) Port=$((17000 + i)) CPUs=$cpus" \
      "Gres=gpu:$GPUS_PER_NODE State=UNKNOWN" >>"$STATE/slurm.conf"
  done
  # Each pair of nodes has its own partitions: its high one preempts its low one and no other. The first pair's
  # are called low (the cluster's default) and high, the others' low1, high1, low2, ...
  local pair suffix default
  for ((pair = 0; pair < PAIRS; pair++)); do
    if ((pair == 0)); then suffix="" default=" Default=YES"; else suffix=$pair default=""; fi
    nodes=${NODES[2 * pair]},${NODES[2 * pair + 1]}
    echo "PartitionName=low$suffix Nodes=$nodes$default PriorityTier=1 PreemptMode=REQUEUE GraceTime=30" \
      "State=UP" >>"$STATE/slurm.conf"
    echo "PartitionName=high$suffix Nodes=$nodes PriorityTier=2 PreemptMode=OFF State=UP" >>"$STATE/slurm.conf"
    # As low, but a preempted job is cancelled, not requeued (PreemptMode=CANCEL, as some sites run it).
    echo "PartitionName=cancel$suffix Nodes=$nodes PriorityTier=1 PreemptMode=CANCEL GraceTime=30 State=UP" \
      >>"$STATE/slurm.conf"
  done
  echo "PartitionName=wide Nodes=${WIDE_NODES[0]},${WIDE_NODES[1]} PriorityTier=1 PreemptMode=OFF State=UP" \
    >>"$STATE/slurm.conf"
  # The GPUs: character devices with /dev/null's numbers stand in for /dev/nvidia0-3 (slurmd only checks that
  # they exist; no cgroup fences them off here).
  for ((i = 0; i < GPUS_PER_NODE; i++)); do
    [[ -e $STATE/gpu$i ]] || mknod "$STATE/gpu$i" c 1 3
  done
  echo "$MARK: written by tests/slurm_cluster.sh" >"$STATE/gres.conf"
  echo "Name=gpu File=$STATE/gpu[0-$((GPUS_PER_NODE - 1))]" >>"$STATE/gres.conf"
}

# slurmdbd reads slurmdbd.conf from the folder of $SLURM_CONF, so it stays in $STATE and /etc/slurm gets no
# copy. It holds the database password, so slurmdbd refuses it unless its mode is 600 and SlurmUser owns it.
write_dbd_conf() {
  local password=$1
  rm -f "$STATE/slurmdbd.conf"
  (umask 077 && cat >"$STATE/slurmdbd.conf" <<EOF
$MARK: written by tests/slurm_cluster.sh for the slurmdbd that it starts
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
# slurmdbd checks DbdHost against its own hostname; localhost always matches. It listens on DbdPort.
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
# The MariaDB server that start runs, over TCP; slurmdbd creates the database and its tables itself.
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$password
StorageLoc=slurm_acct_db
EOF
  )
  chown root: "$STATE/slurmdbd.conf"
}

# The MariaDB server's options, for mariadb-install-db and the server alike. --no-defaults: none of
# /etc/mysql, which belongs to a system MariaDB. The InnoDB sizes are the smallest that slurmdbd does not
# call "not recommended" in its log (half its advice); the buffer pool is mapped, not filled, at start.
DB_OPTIONS=(--no-defaults --user=mysql --datadir="$STATE/db/data" --innodb-buffer-pool-size=512M
  --innodb-log-file-size=32M --innodb-lock-wait-timeout=900)

# Initialises a database in $STATE/db, starts MariaDB on it (TCP on 127.0.0.1 only, no name lookups for the
# clients' addresses; it runs as mysql, so its log is in there too) and creates the user slurmdbd logs in as.
start_database() {
  local password=$1
  rm -rf "$STATE/db"  # a stopped cluster's database, kept with KEEP_LOGS=1: every start begins empty
  mkdir -p "$STATE/db"
  chown mysql: "$STATE/db"
  mariadb-install-db "${DB_OPTIONS[@]}" --skip-test-db --auth-root-authentication-method=socket \
    >"$STATE/log/mariadb-install-db.out" 2>&1 ||
    die "mariadb-install-db failed: $(tail -n 5 "$STATE/log/mariadb-install-db.out")"
  spawn mariadbd mariadbd "${DB_OPTIONS[@]}" --port="$DB_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
    --socket="$STATE/db/mysqld.sock" --pid-file="$STATE/db/mariadbd.pid" --log-error="$STATE/db/mariadbd.log"
  wait_until "MariaDB (see $STATE/db/mariadbd.log and $STATE/log/mariadbd.out)" \
    timeout 5 mariadb-admin --no-defaults --socket="$STATE/db/mysqld.sock" --silent ping
  # OS root logs in as the database's root through the socket (unix_socket authentication).
  printf '%s\n' "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$password';" \
    "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" |
    mariadb --no-defaults --socket="$STATE/db/mysqld.sock" -u root
}

# Runs "$@" (a command or function that returns within seconds) until it succeeds, for at most 20 s;
# fails with what it waited for otherwise.
wait_until() {
  local what=$1 deadline=$((SECONDS + 20)); shift
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || die "$what not ready after 20 s"
    sleep 0.2
  done
}

# slurmctld registers the cluster itself (slurmdbd adds a cluster it does not know); true once it has.
cluster_registered() {
  [[ $(timeout 5 sacctmgr -n -P show cluster ddpladder format=cluster,controlhost) == ddpladder\|?* ]]
}

remove_network() {
  local node
  for node in "${NODES[@]}"; do
    ip netns del "$NAME-$node" 2>/dev/null || true
    ip link del "$NAME-$node" 2>/dev/null || true  # the veth pair, if a process still holds the namespace
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  if grep -qF "$MARK" /etc/hosts; then
    # /etc/hosts may be a bind mount: rewrite it in place instead of replacing the file.
    grep -vF "$MARK" /etc/hosts >"$STATE/hosts.new" || true
    cat "$STATE/hosts.new" >/etc/hosts
    rm -f "$STATE/hosts.new"
  fi
}

setup_network() {
  local node i=0
  remove_network  # leftovers of a run that was killed before its stop
  ip link add "$BRIDGE" type bridge
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for node in "${NODES[@]}"; do
    i=$((i + 1))
    ip netns add "$NAME-$node"
    ip link add "$NAME-$node" type veth peer name eth0 netns "$NAME-$node"
    ip link set "$NAME-$node" master "$BRIDGE" up
    ip -n "$NAME-$node" addr add "$SUBNET.$((10 + i))/24" dev eth0
    ip -n "$NAME-$node" link set eth0 up
    ip -n "$NAME-$node" link set lo up
    echo "$SUBNET.$((10 + i)) $node $MARK" >>/etc/hosts
  done
}

start() {
  [[ $EUID == 0 ]] || die "needs root (network namespaces, apt-get, /etc/hosts)"
  [[ -d $STATE/pids ]] && { log "a previous cluster is recorded in $STATE: stopping it first"; stop; }
  install_packages
  mkdir -p "$STATE"/{pids,log,ctld,munge} "${NODES[@]/#/$STATE/spool/}"
  trap undo_start ERR
  # munged refuses a socket folder that others may write to; every user's sbatch must reach the socket.
  chown munge: "$STATE/munge"
  chmod 755 "$STATE/munge"
  spawn munged setpriv --reuid=munge --regid=munge --init-groups munged --foreground --force --socket="$STATE/munge/munge.socket" \
    --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/munge/munged.log" \
    --seed-file="$STATE/munge/munged.seed"
  write_conf
  setup_network
  for _ in $(seq 50); do [[ -S $STATE/munge/munge.socket ]] && break; sleep 0.1; done
  [[ -S $STATE/munge/munge.socket ]] || die "munged did not start: $(cat "$STATE/log/munged.out")"
  # The database password lives only in slurmdbd.conf; every start makes a new one.
  local password
  password=$(head -c 24 /dev/urandom | base64 | tr -dc A-Za-z0-9)
  start_database "$password"
  write_dbd_conf "$password"
  spawn slurmdbd slurmdbd -D
  wait_until "slurmdbd (see $STATE/log/slurmdbd.log)" timeout 5 sacctmgr -n show cluster
  spawn slurmctld slurmctld -D -f "$CONF"
  for node in "${NODES[@]}"; do
    # nsenter joins the node's network namespace, unshare gives it its own hostname; both exec,
    # so the recorded PID is slurmd's own.
    spawn "slurmd-$node" nsenter --net="/run/netns/$NAME-$node" unshare --uts -- \
      sh -c "hostname $node && exec slurmd -D -N $node -f $CONF"
  done
  local states=""
  for _ in $(seq 100); do
    states=$(sinfo -h -N -o '%N=%T' 2>/dev/null | sort -u | tr '\n' ' ')
    if [[ $(grep -o '=idle' <<<"$states" | wc -l) == "${#NODES[@]}" ]]; then
      wait_until "the cluster's registration in slurmdbd" cluster_registered
      trap - ERR
      log "up: $states"
      log "for the Slurm commands: export SLURM_CONF=$CONF"
      return
    fi
    sleep 0.2
  done
  trap - ERR
  log "nodes not idle after 20 s: ${states:-no answer}"
  tail -n 5 "$STATE"/log/*.log >&2 || true
  stop
  exit 1
}

# Sends TERM to the recorded PIDs, each only if it is still the process that start started, all at once
# (each daemon takes about 2 s to exit), waits up to 5 s for them, then sends KILL to any left.
stop_pids() {
  local file pid pids=()
  for file in "$@"; do
    [[ -f $file ]] || continue
    pid=$(cat "$file")
    rm -f "$file"
    [[ -d /proc/$pid && $(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline") == *"$(basename "$file" | cut -d- -f1)"* ]] ||
      continue
    kill -TERM "$pid" 2>/dev/null || true
    pids+=("$pid")
  done
  for _ in $(seq 50); do any_alive "${pids[@]}" || break; sleep 0.1; done
  for pid in "${pids[@]}"; do [[ -d /proc/$pid ]] && kill -KILL "$pid" 2>/dev/null || true; done
}

any_alive() {
  local pid
  for pid in "$@"; do [[ -d /proc/$pid ]] && return 0; done
  return 1
}

stop() {
  [[ $EUID == 0 ]] || die "needs root"
  if [[ -d $STATE/pids ]]; then
    # Cancel what still runs so no job step outlives its slurmd.
    if [[ -f $STATE/pids/slurmctld ]] && command -v scancel >/dev/null; then
      timeout 10 squeue -h -o %i 2>/dev/null | xargs -r timeout 10 scancel 2>/dev/null || true
      for _ in $(seq 50); do
        [[ -z $(timeout 5 squeue -h -t RUNNING,COMPLETING -o %i 2>/dev/null) ]] && break
        sleep 0.2
      done
    fi
    # The nodes, then slurmctld, then slurmdbd, which takes slurmctld's last records, then the database
    # (and munged, which no one needs any more).
    stop_pids "${NODES[@]/#/$STATE/pids/slurmd-}"
    stop_pids "$STATE/pids/slurmctld"
    stop_pids "$STATE/pids/slurmdbd"
    stop_pids "$STATE/pids/mariadbd" "$STATE/pids/munged"
  fi
  mkdir -p "$STATE"
  remove_network
  if [[ ${KEEP_LOGS:-0} == 1 ]]; then rm -rf "$STATE/pids"; else rm -rf "$STATE"; fi
  log "stopped"
}

status() {
  [[ -d $STATE/pids ]] || { echo "not running"; exit 1; }
  sinfo -N
  squeue
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
