#!/usr/bin/env bash
# End-to-end check of the two cluster launchers on this one machine, without GPUs (run as root on Debian):
#   bash scripts/check_launchers.sh [--yes] [--image DIR]      (--help: what it does and changes)
# (a) a local Ray head (`ray start --head`): scripts/ray_job.sh submits a run that must reach the training's
#     preflight inside the cluster ("needs N GPUs; the Ray cluster at ... has 0"), and its error paths;
# (b) a one-node Slurm (slurm-wlm and munge, installed with apt-get if missing; /etc/slurm/slurm.conf written for
#     this machine if there is none): scripts/slurm.sbatch starts Ray, waits for the node, and reaches the same line;
# (c) two Slurm nodes simulated on this machine (a second, private Slurm with two slurmd, Slurm's "multiple slurmd"):
#     slurm.sbatch --nodes=2 starts Ray on both, waits for both, reaches the line with trainer.nnodes=2, stops Ray;
# (d) with --image: (c) again with STAPO_CONTAINER, Ray and the recipe in the recipe's image (Charliecloud's ch-run);
# (e) a run longer than its job, under (b)'s Slurm, with the stand-in trainer (tests/standins.py, which saves and stops
#     with the recipe's own stapo.train.deadline): a job whose --time ends mid-run saves before the limit, requeues
#     itself and finishes; the same on `scancel --signal=USR1 --batch`; a job whose training is killed (SIGKILL) and
#     that is requeued resumes from the last periodic checkpoint; so does one whose run lost a Ray node (status 4),
#     requeued by the job itself; with STAPO_MAX_REQUEUES=0 it saves, is not requeued.
# Tiny local data and model files stand in for the real ones, so that only the GPU check fails. Prints PASS/FAIL per
# check, exits 1 on any failure; stops the Ray heads and the Slurm daemons it started and removes its files.
usage() {
  cat <<'USAGE'
usage: bash scripts/check_launchers.sh [--yes] [--image DIR] [--only PARTS]
Checks scripts/ray_job.sh against a local Ray head and scripts/slurm.sbatch under a one-node Slurm, on this machine,
without GPUs, and a run longer than its Slurm job (requeue, signal, kill); prints PASS/FAIL per check and exits 1 on
any failure.
It changes the system (as root, on Debian): installs slurm-wlm and munge with apt-get if they are missing, writes
/etc/slurm/slurm.conf if there is none, creates /etc/munge/munge.key if there is none, and starts munged, slurmctld
and slurmd (those it started are stopped at the end; packages and files stay). For (c) it also starts a private
two-node Slurm under /tmp (its own munged socket, ports and state; stopped and removed at the end). It lists these and
asks first.
  --yes        do not ask (CI, scripts)
  --image DIR  (d): slurm.sbatch on the two simulated nodes with STAPO_CONTAINER="ch-run ... DIR --", from a host PATH
               without Ray; DIR is the recipe's image as a folder (docker/Dockerfile, unpacked: docs/container.md);
               installs charliecloud-runtime with apt-get if ch-run is missing
  --only PARTS some of a, b, c, e (d comes with --image), e.g. --only e (it brings up (b)'s Slurm); default: all
  -h, --help   this text
USAGE
}
assume_yes= image= only=abce
while [ $# -gt 0 ]; do
  case $1 in
    --yes | -y) assume_yes=1; shift ;;
    --image) [ $# -ge 2 ] || { usage >&2; exit 2; }; image=$(realpath "$2"); shift 2 ;;
    --only) [[ ${2-} =~ ^[abce]+$ ]] || { usage >&2; exit 2; }; only=$2; shift 2 ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
if [ -n "$image" ] && [ ! -x "$image/opt/stapo/venv/bin/python" ]; then
  echo "error: --image $image is not the recipe's image as a folder (no /opt/stapo/venv/bin/python in it)" >&2; exit 2
fi
set -uo pipefail
cd "$(dirname "$0")/.."
[ -n "${VIRTUAL_ENV-}" ] || [ ! -f .venv/bin/activate ] || source .venv/bin/activate
[ "$(id -u)" = 0 ] || { echo "FAIL: run as root (installs and starts Slurm)"; exit 1; }
failed=0 started=() ray_head= sim= t0=$SECONDS
tmp=$(mktemp -d /tmp/cl.XXXX)  # short: Ray's socket paths under it must stay below 108 characters
stale_before=$([ -e /tmp/ray/ray_current_cluster ] && echo yes)
result() {  # ok? name...
  if [ "$1" = 0 ]; then echo "PASS  $2 ($((SECONDS - t0)) s)"; else echo "FAIL  $2 ($((SECONDS - t0)) s)"; failed=1; fi
  t0=$SECONDS; [ "$1" = 0 ]
}
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
ours() { pgrep -f "$1" || true; }  # pids of the processes whose command line names our files or ports
wait_gone() {  # pid... : up to 60 s
  for _ in $(seq 120); do kill -0 "$@" 2>/dev/null || return 0; sleep 0.5; done; return 1
}
cleanup() {
  if [ -n "$ray_head" ]; then kill -TERM "$ray_head" 2>/dev/null; wait "$ray_head" 2>/dev/null; fi
  [ -n "$sim" ] && sim_down  # (c)'s job too
  [ -n "${job-}" ] && scancel "$job" 2>/dev/null
  local name pid
  for name in slurmd slurmctld munged; do  # only those this script started, in reverse order
    [[ " ${started[*]} " == *" $name "* ]] || continue
    pid=$(pgrep -x $name) && kill $pid && wait_gone $pid
    pgrep -x $name >/dev/null && { echo "FAIL  $name still running"; failed=1; }
  done
  started=()
  rm -rf "$tmp"
}
trap cleanup EXIT

slurm_common() {  # the settings of (b)'s and (c)'s slurm.conf alike: root daemons, munge, no cgroups or accounting
  cat <<'CONF'
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
CONF
}

slurm_conf() {  # one node (this machine, its CPUs and memory, no GPUs), one partition
  local host; host=$(hostname -s)
  cat <<CONF
ClusterName=local
SlurmctldHost=$host
$(slurm_common)
EnforcePartLimits=ALL
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
$(slurmd -C | head -1) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

sim_conf() {  # (c): two nodes of this host, n1 and n2, each with its own slurmd port (SlurmdParameters: no hardware
  # check, so both may declare the same CPUs), everything else private to $sim
  local host; host=$(hostname -s)
  cat <<CONF
ClusterName=sim2
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$(free_port)
$(slurm_common)
AuthInfo=socket=$sim/munge.socket
SlurmdParameters=config_overrides
FirstJobId=$(( $(date +%s) % 800000 + 100000 ))
StateSaveLocation=$sim/ctld
SlurmdSpoolDir=$sim/d-%n
SlurmctldPidFile=$sim/slurmctld.pid
SlurmdPidFile=$sim/slurmd-%n.pid
SlurmctldLogFile=$sim/slurmctld.log
SlurmdLogFile=$sim/slurmd-%n.log
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=2 CoresPerSocket=2 RealMemory=4000
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$(free_port) CPUs=2 CoresPerSocket=2 RealMemory=4000
PartitionName=sim Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
}

sim_up() {  # (c): munged on its own socket, slurmctld, slurmd -N n1, slurmd -N n2; 0 once a two-node step runs
  sim=$(mktemp -d /tmp/cl-sim.XXXX) && chmod 755 "$sim" && chown munge:munge "$sim" || return 1
  sim_conf >"$sim/slurm.conf" || return 1
  runuser -u munge -- /usr/sbin/munged --socket="$sim/munge.socket" --pid-file="$sim/munged.pid" \
    --log-file="$sim/munged.log" --seed-file="$sim/munged.seed" || return 1
  SLURM_CONF=$sim/slurm.conf slurmctld && SLURM_CONF=$sim/slurm.conf slurmd -N n1 &&
    SLURM_CONF=$sim/slurm.conf slurmd -N n2 || return 1
  for _ in $(seq 30); do
    SLURM_CONF=$sim/slurm.conf timeout 10 srun --immediate=5 --time=1 --nodes=2 true 2>/dev/null && return 0
    sleep 1
  done
  SLURM_CONF=$sim/slurm.conf sinfo -N; return 1
}

sim_down() {  # (c): cancel its jobs (an interrupted sbatch --wait leaves one), wait for their steps, stop its daemons
  # by their pid files (slurmd, slurmctld, munged) and remove its files; 1 if a daemon stays
  local f pid left=0
  if SLURM_CONF=$sim/slurm.conf scancel --user=root 2>/dev/null; then
    for _ in $(seq 60); do
      [ -z "$(SLURM_CONF=$sim/slurm.conf squeue --noheader 2>/dev/null)" ] && break; sleep 1
    done
  fi
  for f in "$sim"/slurmd-n2.pid "$sim"/slurmd-n1.pid "$sim"/slurmctld.pid "$sim"/munged.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null; wait_gone "$pid" || { echo "FAIL  $(basename "$f" .pid) ($pid) still running"; left=1; }
  done
  rm -rf "$sim"; sim=
  return $left
}

system_changes() {  # what slurm_up will change on this machine, one line each (nothing: no output)
  command -v slurmctld slurmd sbatch munged >/dev/null || echo "  apt-get install slurm-wlm munge"
  [ -f /etc/slurm/slurm.conf ] || echo "  write /etc/slurm/slurm.conf (one node: this machine, no GPUs)"
  [ -s /etc/munge/munge.key ] || echo "  create /etc/munge/munge.key"
  local name
  for name in munged slurmctld slurmd; do pgrep -x $name >/dev/null || echo "  start $name (stopped at the end)"; done
  echo "  for (c): start munged, slurmctld and two slurmd of a private Slurm under /tmp (stopped, removed at the end)"
  [ -z "$image" ] || command -v ch-run >/dev/null || echo "  for (d): apt-get install charliecloud-runtime"
}

confirm_changes() {  # 0 if there is nothing to change, --yes was given, or the user agrees
  local changes; changes=$(system_changes)
  [ -z "$changes" ] || [ -n "$assume_yes" ] && return 0
  printf 'For parts (b) and (c) this script will change the system:\n%s\n' "$changes"
  [ -t 0 ] || { echo "FAIL  not asked (no terminal): run with --yes to allow these changes"; return 1; }
  local answer; read -r -p "Proceed? [y/N] " answer
  [[ $answer == [yY]* ]]
}

slurm_up() {  # install, configure and start munged, slurmctld, slurmd (no systemd); 0 once a job step runs
  local name
  for name in munged slurmctld slurmd; do  # not running yet: stop it at the end, even if apt-get starts it
    pgrep -x $name >/dev/null || started+=($name)
  done
  if ! command -v slurmctld slurmd sbatch munged >/dev/null; then
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm munge; } >"$tmp/apt.log" 2>&1 ||
      { tail -5 "$tmp/apt.log"; return 1; }
  fi
  [ -s /etc/munge/munge.key ] || { mungekey --create && chown munge:munge /etc/munge/munge.key; } || return 1
  [ -f /etc/slurm/slurm.conf ] || { mkdir -p /etc/slurm && slurm_conf >/etc/slurm/slurm.conf; } || return 1
  mkdir -p /run/munge /var/log/munge /var/lib/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged || return 1
  munge -n | unmunge >/dev/null || return 1
  pgrep -x slurmctld >/dev/null || slurmctld || return 1
  pgrep -x slurmd >/dev/null || slurmd || return 1
  for _ in $(seq 30); do
    timeout 10 srun --immediate=5 --time=1 true 2>/dev/null && return 0
    scontrol update nodename="$(hostname -s)" state=resume 2>/dev/null  # a node left DOWN/DRAIN by an earlier run
    sleep 1
  done
  sinfo -R; return 1
}

confirm_changes || { echo "FAIL  stopped before any check: the system was not to be changed"; exit 1; }

# Tiny stand-ins: a one-problem verl parquet for data.train_files/val_files, a model folder with a config.json.
echo '{"problem": "What is 1+1?", "answer": "2", "id": "1"}' >"$tmp/aime24.jsonl"
mkdir "$tmp/model" && echo '{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}' >"$tmp/model/config.json"
python3 -m stapo.tools.data eval --src "$tmp/aime24.jsonl" --out "$tmp" --partial >"$tmp/data.log" 2>&1
result $? "tiny data and model files in $tmp"
overrides=(data.train_files="$tmp/aime24.parquet" data.val_files="$tmp/aime24.parquet"
  actor_rollout_ref.model.path="$tmp/model")
gpu_line='error: trainer\.n_gpus_per_node=[0-9]+ x trainer\.nnodes=1 needs [0-9]+ GPUs?; the Ray cluster at [0-9.:]+ has 0'
needs='needs [0-9]+ GPUs?.*has 0'

wants() { [[ $only == *$1* ]]; }  # --only

# --- (a) scripts/ray_job.sh against a local Ray head -------------------------------------------------------------
if wants a; then  # (to the fi before (b))
one_line_exit2() {  # expected-text log rc
  [ "$3" = 2 ] && [ "$(wc -l <"$2")" = 1 ] && grep -q -- "$1" "$2" || { echo "  rc=$3:"; sed 's/^/  | /' "$2"; return 1; }
}
bash scripts/ray_job.sh >"$tmp/o" 2>&1; one_line_exit2 '^usage:' "$tmp/o" $?
result $? "(a) ray_job.sh without arguments: usage line, exit 2"
bash scripts/ray_job.sh stapo no_such_size >"$tmp/o" 2>&1; one_line_exit2 "^error: unknown size 'no_such_size'" "$tmp/o" $?
result $? "(a) ray_job.sh with an unknown size: one line naming it, exit 2"
env -u RAY_ADDRESS bash scripts/ray_job.sh stapo qwen3_1.7b >"$tmp/o" 2>&1
one_line_exit2 'RAY_ADDRESS=http://' "$tmp/o" $?
result $? "(a) ray_job.sh without RAY_ADDRESS: one line, exit 2"
dead=http://127.0.0.1:$(free_port)
RAY_ADDRESS=$dead bash scripts/ray_job.sh stapo qwen3_1.7b >"$tmp/o" 2>&1; one_line_exit2 "$dead" "$tmp/o" $?
result $? "(a) ray_job.sh with an unreachable RAY_ADDRESS: one line naming it, exit 2"

export RAY_AUTH_MODE=disabled  # as in slurm.sbatch: the head would turn token auth on if ~/.ray/auth_token exists
port=$(free_port) dash=$(free_port) client=$(free_port) agent=$(free_port)
# started from $tmp, not the repository: the job runs in the head's working directory and must not need scripts/;
# every port free, the dashboard agent's too (its default 52365 is another Ray head's on this machine, and without
# its agent the head takes no job: "No available agent to submit job")
(cd "$tmp" && exec env RAY_TMPDIR="$tmp" ray start --head --port="$port" --dashboard-port="$dash" \
  --ray-client-server-port="$client" --dashboard-agent-listen-port="$agent" --num-cpus=2 --num-gpus=0 --block) \
  >"$tmp/head.log" 2>&1 &
ray_head=$!
for _ in $(seq 300); do
  curl -sf -m 2 "http://127.0.0.1:$dash/api/version" >/dev/null && break
  kill -0 $ray_head 2>/dev/null || break
  sleep 1
done
curl -sf -m 2 "http://127.0.0.1:$dash/api/version" >/dev/null
result $? "(a) Ray head started (GCS port $port, dashboard $dash)"
RAY_ADDRESS=http://127.0.0.1:$dash timeout 600 bash scripts/ray_job.sh stapo qwen3_1.7b "${overrides[@]}" \
  >"$tmp/job_a.log" 2>&1
rc=$?
grep -Eq "$gpu_line" "$tmp/job_a.log" && grep -q "Job '.*' failed" "$tmp/job_a.log" && [ $rc = 1 ] ||
  { echo "  rc=$rc:"; tail -20 "$tmp/job_a.log" | sed 's/^/  | /'; false; }
result $? "(a) ray_job.sh: the job reached the training preflight in the cluster: $(grep -Eom1 "$needs" "$tmp/job_a.log")"
kill -TERM $ray_head; wait $ray_head; ray_head=
wait_gone $(ours "$tmp/|:$port\b") && [ -z "$(ours "$tmp/|:$port\b")" ]
result $? "(a) Ray head stopped, none of its processes left"
fi

# --- (b) scripts/slurm.sbatch under a one-node Slurm --------------------------------------------------------------
if wants b || wants e; then
  slurm_up
  result $? "(b) Slurm up (started here: ${started[*]:-none})" || exit 1
fi
unset RAY_AUTH_MODE  # slurm.sbatch's default
if wants b; then  # (to the fi before (c))
# Free ports: another Ray head on this machine may hold 6379. The job passes Slurm's trainer.n_gpus_per_node=0 (the
# preflight refuses 0); trainer.n_gpus_per_node=1 after it makes the preflight ask the Ray cluster for its GPUs.
job=$(RAY_PORT=$(free_port) RAY_DASHBOARD_PORT=$(free_port) RAY_DASHBOARD_AGENT_PORT=$(free_port) \
  timeout 600 sbatch --wait --parsable --nodes=1 \
  --cpus-per-task=2 --gpus-per-node=0 --output="$tmp/slurm-%j.log" scripts/slurm.sbatch stapo qwen3_1.7b \
  "${overrides[@]}" trainer.n_gpus_per_node=1)
rc=$?
log=$tmp/slurm-$job.log
state=$(scontrol show job "$job" 2>/dev/null | grep -o 'JobState=[A-Z]*\|ExitCode=[0-9:]*' | xargs)
[ -s "$log" ]
result $? "(b) sbatch --wait scripts/slurm.sbatch ...: job $job ended, sbatch rc=$rc ($state)"
grep -q "^stapo: Ray head up on $(hostname -s)" "$log"
result $? "(b) the job started the Ray head"
grep -q "^stapo: Ray cluster at .*: all 1 node(s) joined: $(hostname -s)" "$log"
result $? "(b) the node joined the Ray cluster"
grep -Eq "$gpu_line" "$log" && grep -q "^stapo: RAY_ADDRESS=.* trainer.nnodes=1 trainer.n_gpus_per_node=0" "$log" ||
  { sed 's/^/  | /' "$log" | grep -v 'INFO\|^  | *$' | tail -30; false; }
result $? "(b) the job reached the training preflight in the cluster: $(grep -Eom1 "$needs" "$log")"
grep -q "^stapo: Ray stopped" "$log" && [ -z "$(ours "/tmp/ray_$job/")" ] && [ "$rc" = 1 ] && [[ $state == *FAILED* ]]
result $? "(b) Ray stopped at the end; the job's exit status is the training's (1)"
rm -rf "/tmp/ray_$job"; job=
fi

# --- (c) scripts/slurm.sbatch on two Slurm nodes simulated on this machine -----------------------------------------
# Node names n1 and n2 differ from the host name Ray reports for both: slurm.sbatch asks each node for its host name
# (srun hostname -s) and waits for two Ray nodes of that host; each node's `ray start` has its own pid file.
if wants c || [ -n "$image" ]; then  # (to the fi after sim_down)
sim_up
result $? "(c) two simulated Slurm nodes up (n1, n2 on $(hostname -s); private Slurm in $sim)" || exit 1
job=$(SLURM_CONF=$sim/slurm.conf RAY_PORT=$(free_port) RAY_DASHBOARD_PORT=$(free_port) \
  RAY_DASHBOARD_AGENT_PORT=$(free_port) timeout 600 sbatch --wait \
  --parsable --nodes=2 --cpus-per-task=2 --gpus-per-node=0 --output="$tmp/sim-%j.log" scripts/slurm.sbatch stapo \
  qwen3_1.7b "${overrides[@]}" trainer.n_gpus_per_node=1)
rc=$?
log=$tmp/sim-$job.log
[ -s "$log" ] && grep -q "^stapo: Ray head up on n1" "$log"
result $? "(c) sbatch --nodes=2 scripts/slurm.sbatch ...: job $job started the Ray head on n1 (sbatch rc=$rc)"
grep -q "^stapo: Ray cluster at .*: all 2 node(s) joined: $(hostname -s)" "$log" ||
  { sed 's/^/  | /' "$log" | grep -v 'INFO\|^  | *$' | tail -20; false; }
result $? "(c) both nodes joined the Ray cluster"
grep -Eq 'error: trainer\.n_gpus_per_node=1 x trainer\.nnodes=2 needs 2 GPUs; the Ray cluster at [0-9.:]+ has 0' "$log"
result $? "(c) the job reached the training preflight with trainer.nnodes=2: $(grep -Eom1 "$needs" "$log")"
grep -q "^stapo: Ray stopped on n1 n2" "$log" && ! grep -q "CANCELLED\|Killed" "$log" &&
  [ -z "$(ours "/tmp/ray_$job/")" ]
result $? "(c) Ray stopped on both nodes by SIGTERM (no step killed), none of its processes left"
rm -rf "/tmp/ray_$job"; job=

# --- (d) the same two nodes with Ray and the recipe in the recipe's image -----------------------------------------
# ch-run (Charliecloud, Debian's charliecloud-runtime) shares the node's network, process ids and /tmp and passes the
# environment, as Apptainer does; inside, PATH is the image's. The job gets a PATH without Ray or the recipe's venv,
# so that each `ray start`, check and training that works ran in the image. ch-run 0.31 refuses to start without USER.
if [ -n "$image" ]; then
  command -v ch-run >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y charliecloud-runtime \
    >"$tmp/apt-ch.log" 2>&1 || tail -5 "$tmp/apt-ch.log"
  command -v ch-run >/dev/null
  result $? "(d) ch-run installed: $(USER=${USER:-root} ch-run --version 2>&1)"
  container="ch-run --set-env=PATH=/opt/stapo/venv/bin:/usr/bin:/bin $image --"
  job=$(env -u VIRTUAL_ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin USER="${USER:-root}" STAPO_CONTAINER="$container" \
    SLURM_CONF=$sim/slurm.conf RAY_PORT=$(free_port) RAY_DASHBOARD_PORT=$(free_port) \
    RAY_DASHBOARD_AGENT_PORT=$(free_port) timeout 600 sbatch --wait --parsable --nodes=2 --cpus-per-task=2 \
    --gpus-per-node=0 --output="$tmp/img-%j.log" scripts/slurm.sbatch stapo qwen3_1.7b "${overrides[@]}" \
    trainer.n_gpus_per_node=1)
  rc=$?
  log=$tmp/img-$job.log
  ! PATH=/usr/sbin:/usr/bin:/sbin:/bin command -v ray >/dev/null && [ -s "$log" ] &&
    grep -qF "stapo: in a container: $container" "$log" && grep -q "^stapo: Ray head up on n1" "$log"
  result $? "(d) job $job (sbatch rc=$rc), no Ray on the job's PATH: the Ray head started in the image on n1"
  grep -q "^stapo: Ray cluster at .*: all 2 node(s) joined: $(hostname -s)" "$log" && grep -Eq \
    'error: trainer\.n_gpus_per_node=1 x trainer\.nnodes=2 needs 2 GPUs; the Ray cluster at [0-9.:]+ has 0' "$log" ||
    { sed 's/^/  | /' "$log" | grep -v 'INFO\|^  | *$' | tail -20; false; }
  result $? "(d) both nodes joined and the training in the image reached the preflight: $(grep -Eom1 "$needs" "$log")"
  grep -q "^stapo: Ray stopped on n1 n2" "$log" && ! grep -q "CANCELLED\|Killed" "$log" &&
    [ -z "$(ours "/tmp/ray_$job/")" ]
  result $? "(d) Ray stopped on both nodes by SIGTERM, none of its processes left"
  rm -rf "/tmp/ray_$job"; job=
fi
sim_down
result $? "(c) the simulated Slurm's daemons are stopped and its files removed"
fi

# --- (e) a run longer than its job, under (b)'s Slurm, with the stand-in trainer ---------------------------------
# The job's PATH starts with a python3 that runs tests/standins.py's trainer for `-m stapo.train` (verl's needs a
# GPU) and the real one for everything else: Ray, the node check, the preflight. The stand-in trains a tiny model's
# checkpoint format and logs verl's metrics; it saves and stops with the recipe's own stapo.train.deadline code.
if wants e; then
  mkdir -p "$tmp/bin"
  real=$(command -v python3)
  printf '#!/bin/sh
if [ "$1" = -m ] && [ "$2" = stapo.train ]; then shift 2; exec %s %s train "$@"; fi
exec %s "$@"
' \
    "$real" "$PWD/tests/standins.py" "$real" >"$tmp/bin/python3"
  chmod +x "$tmp/bin/python3"
  python3 -c 'import sys; from pathlib import Path; from stapo.quickstart.run import build
_, paths, model = build(Path(sys.argv[1]), 0, 48, 8, hidden_size=32, num_layers=1); print(model, paths["train"], paths["validation"])' \
    "$tmp/e-task" >"$tmp/e-task.txt" 2>"$tmp/e-task.log"
  read -r e_model e_train e_val < <(tail -1 "$tmp/e-task.txt")
  [ -f "$e_model/config.json" ]
  result $? "(e) a tiny model and task for the stand-in trainer in $tmp/e-task"
  e_submit() {  # CASE STEP_S STEPS SAVE_FREQ SBATCH_OPTION...: the job id; its folder is $tmp/e-CASE
    local dir=$tmp/e-$1 step_s=$2 steps=$3 save_freq=$4; shift 4
    mkdir -p "$dir"
    PATH="$tmp/bin:$PATH" STANDIN_STEP_S=$step_s VERL_FILE_LOGGER_PATH="$dir/metrics.jsonl" RAY_PORT=$(free_port) \
      RAY_DASHBOARD_PORT=$(free_port) RAY_DASHBOARD_AGENT_PORT=$(free_port) sbatch --parsable --nodes=1 \
      --cpus-per-task=2 --gpus-per-node=0 --output="$dir/slurm.log" "$@" scripts/slurm.sbatch stapo smollm2_135m \
      actor_rollout_ref.model.path="$e_model" data.train_files="$e_train" data.val_files="$e_val" \
      trainer.total_training_steps="$steps" trainer.save_freq="$save_freq" trainer.test_freq=-1 \
      trainer.val_before_train=False trainer.default_local_dir="$dir/ckpt" stapo.deadline_margin=0 \
      trainer.n_gpus_per_node=1
  }
  e_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
  e_wait() {  # JOB SECONDS: until the job has ended for good (a requeued one runs again first)
    local state deadline=$((SECONDS + $2))
    while [ $SECONDS -lt $deadline ]; do
      state=$(e_state "$1")
      case $state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) echo "$state"; return 0 ;; esac
      sleep 3
    done
    echo "still $(e_state "$1") after $2 s"; return 1
  }
  e_until() {  # FILE PATTERN SECONDS: until FILE has a line matching PATTERN
    local deadline=$((SECONDS + $3))
    until grep -q "$2" "$1" 2>/dev/null; do [ $SECONDS -lt $deadline ] || return 1; sleep 1; done
  }
  e_steps() {  # DIR: the steps the run logged, over all its segments, once each ("1 2 3 ...")
    python3 -c 'import sys; from stapo.tools.curves import read_metrics
print(*sorted(read_metrics(sys.argv[1])["actor/entropy"]))' "$1/metrics.jsonl" 2>/dev/null
  }
  e_restarts() { scontrol show job "$1" 2>/dev/null | grep -o 'Restarts=[0-9]*' | cut -d= -f2; }
  e_verdict() {  # CASE JOB STEPS: every step logged once over the segments, Ray stopped in each, none of it left
    local dir=$tmp/e-$1 log=$tmp/e-$1/slurm.log
    [ "$(e_steps "$dir")" = "$(seq -s ' ' 1 "$3")" ] && [ "$(grep -c '^stapo: Ray stopped' "$log")" -ge 2 ] &&
      [ -z "$(ours "/tmp/ray_$2/")" ] ||
      { echo "  steps: $(e_steps "$dir")"; grep -v 'INFO\|^ *$\|Loading weights\|Warning\|warn' "$log" | tail -25 | sed 's/^/  | /'; false; }
  }

  # (e1) the time limit: 2 minutes, 8 steps of 6 s; the deadline (Slurm's end time) or SIGUSR1 60 s before it
  job=$(e_submit 1 6 8 -1 --time=2 --signal=B:USR1@60)
  state=$(e_wait "$job" 900)
  log=$tmp/e-1/slurm.log
  saved=$(grep -om1 '^STAPO: saved step [0-9]* in [^ ]* ([^)]*' "$log")
  [ "$state" = COMPLETED ] && [ "$(e_restarts "$job")" -ge 1 ] && grep -q "^stapo: requeued job $job (1 of 20)" "$log" &&
    [ -n "$saved" ] && e_verdict 1 "$job" 8
  result $? "(e1) --time=2 ends mid-run: saved before the limit (${saved#STAPO: }), requeued $(e_restarts "$job") time(s), finished: $state"
  rm -rf "/tmp/ray_$job"; job=

  # (e2) scancel --signal=USR1 --batch after step 3 of a job with time to spare
  job=$(e_submit 2 3 8 -1 --time=30)
  e_until "$tmp/e-2/slurm.log" '^step:3 ' 300 && scancel --signal=USR1 --batch "$job"
  state=$(e_wait "$job" 600)
  log=$tmp/e-2/slurm.log
  saved=$(grep -om1 '^STAPO: saved step [0-9]* in [^ ]* (SIGUSR1' "$log")
  [ "$state" = COMPLETED ] && grep -q '^stapo: USR1 received' "$log" && [ -n "$saved" ] && e_verdict 2 "$job" 8
  result $? "(e2) scancel --signal=USR1 --batch after step 3: ${saved#STAPO: }), requeued, finished: $state"
  rm -rf "/tmp/ray_$job"; job=

  # (e3) the training killed (SIGKILL, as a crash or a lost node ends it) after step 5, with a checkpoint every 3
  # steps; the job fails, and requeued (as Slurm requeues a job whose node failed) it resumes after step 3, steps 4-5
  # logged again from their checkpoint's state
  job=$(e_submit 3 3 8 3 --time=30)
  e_until "$tmp/e-3/slurm.log" '^step:5 ' 300 && pkill -KILL -f "standins.py train .*$tmp/e-3/ckpt"
  state=$(e_wait "$job" 300)
  scontrol requeue "$job" && state2=$(e_wait "$job" 600)
  log=$tmp/e-3/slurm.log
  [ "$state" = FAILED ] && [ "$state2" = COMPLETED ] && [ "$(grep -c '^step:4 ' "$log")" = 2 ] &&
    [ "$(grep -c '^step:3 ' "$log")" = 1 ] && e_verdict 3 "$job" 8
  result $? "(e3) the training killed after step 5 ($state), requeued: resumed from the checkpoint of step 3, finished: $state2"
  rm -rf "/tmp/ray_$job"; job=

  # (e5) a lost Ray node: the driver's line and status 4 (stapo.train.nodes; the stand-in ends so after step 5, tests/
  # test_nodes.py kills a real node) with a checkpoint every 3 steps; the job requeues itself and resumes after step 3
  job=$(STANDIN_LOSE_NODE_AT=5 e_submit 5 3 8 3 --time=30)
  state=$(e_wait "$job" 600)
  log=$tmp/e-5/slurm.log
  [ "$state" = COMPLETED ] && [ "$(e_restarts "$job")" = 1 ] && grep -q '^STAPO: Ray node .* was lost at ' "$log" &&
    grep -q "^stapo: requeued job $job (1 of 20): it resumes from the last checkpoint" "$log" &&
    [ "$(grep -c '^step:4 ' "$log")" = 2 ] && [ "$(grep -c '^step:3 ' "$log")" = 1 ] && e_verdict 5 "$job" 8
  result $? "(e5) a Ray node lost after step 5: status 4, requeued, resumed from the checkpoint of step 3, finished: $state"
  rm -rf "/tmp/ray_$job"; job=

  # (e4) the bound: STAPO_MAX_REQUEUES=0 saves on SIGUSR1 and ends with status 3, saying how to go on
  job=$(STAPO_MAX_REQUEUES=0 e_submit 4 3 8 -1 --time=30)
  e_until "$tmp/e-4/slurm.log" '^step:2 ' 300 && scancel --signal=USR1 --batch "$job"
  state=$(e_wait "$job" 300)
  log=$tmp/e-4/slurm.log
  [ "$state" = FAILED ] && [ "$(e_restarts "$job")" = 0 ] &&
    grep -q "^stapo: saved; not requeued: job $job ran 1 times (STAPO_MAX_REQUEUES=0). To go on, from .*: sbatch --dependency=afterany:$job " "$log" &&
    scontrol show job "$job" | grep -q 'ExitCode=3:0'
  result $? "(e4) STAPO_MAX_REQUEUES=0: saved, not requeued, exit status 3 ($state), the chain command printed"
  rm -rf "/tmp/ray_$job"; job=
fi

[ -n "$stale_before" ] || [ ! -e /tmp/ray/ray_current_cluster ]
result $? "no /tmp/ray/ray_current_cluster left behind"
stopped=("${started[@]}")
cleanup; trap - EXIT
left=$(for name in "${stopped[@]}"; do pgrep -x "$name" >/dev/null && echo "$name"; done)
[ -z "$left" ]
result $? "(b) the Slurm daemons started here are stopped (${stopped[*]:-none})"
[ $failed = 0 ] && echo "PASS  all checks" || echo "FAIL  see above"
exit $failed
