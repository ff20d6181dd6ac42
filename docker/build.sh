#!/usr/bin/env bash
# Builds the recipe's image from docker/Dockerfile with Docker, Podman or buildah (docs/container.md).
#   bash docker/build.sh [--tool docker|podman|buildah] [--base verl|debian] [--variant cpu|gpu] [--tag NAME] ...
usage() {
  cat <<'USAGE'
usage: bash docker/build.sh [--tool docker|podman|buildah] [--base verl|debian] [--variant cpu|gpu] [--tag NAME]
                            [--work DIR] [--verl-image REF] [--debian-mirror URL | --debian-snapshot STAMP]
Builds the recipe's image from docker/Dockerfile, labelled with the commit it was built from.
  --base verl     verl's image (the default; GPU only): the checkout is the build context and pip takes what the
                  image lacks from the package index.
  --base debian   Debian bookworm made here by mmdebstrap, with exactly docker/lock/VARIANT.txt installed from a
                  wheelhouse that pip downloads here (every file checked against the lock's sha256, again inside
                  the build) and no index inside the build: --variant cpu is CPU torch (the README's
                  torch==2.13.0) and the test extra; --variant gpu is verl's [vllm,fsdp,math] pins
                  (recipe/stapo/REQUIRED_VERL.txt) but flash-attn, which has no wheel.
  --tool T        docker, podman or buildah (default: the first of buildah, podman, docker that works here)
  --variant V     cpu or gpu (default gpu)
  --tag NAME      the image's name (default stapo-verl:latest for verl's base, stapo-verl:VARIANT for Debian's)
  --work DIR      base tarball, wheelhouse and build context for --base debian (default /var/tmp/stapo-container)
  --verl-image R  verl's image for --base verl (default verlai/verl:vllm024.latest, a moving tag: pin it by digest,
                  verlai/verl@sha256:..., docs/container.md says how to learn it)
  --debian-mirror URL    the archive mmdebstrap reads (default http://deb.debian.org/debian, the live one)
  --debian-snapshot STAMP  the archive as it was at STAMP (20260101T000000Z): snapshot.debian.org's copy, the same
                  packages on every build
  -h, --help      this text
With podman or buildah, a RUN step that no OCI runtime can start here (a cgroup set-up crun refuses, say) is found
before the build by a RUN of `true` in the base, and the build then uses BUILDAH_ISOLATION=chroot, saying so; set
BUILDAH_ISOLATION yourself to skip that check. CONTAINERS_STORAGE_CONF names a storage.conf with driver "vfs" where
overlay does not work; PYTHON names the wheelhouse's Python (default python3).
It installs nothing and starts no service: a missing tool stops it with the package that provides it.
USAGE
}
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }
tool= base=verl variant=gpu tag= work=/var/tmp/stapo-container verl_image=verlai/verl:vllm024.latest
debian_mirror= debian_snapshot=
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --tool | --base | --variant | --tag | --work | --verl-image | --debian-mirror | --debian-snapshot)
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (bash docker/build.sh --help)"
      name=${1#--}; declare "${name//-/_}=$2"; shift 2 ;;
    *) die "unknown argument '$1' (bash docker/build.sh --help lists the options)" ;;
  esac
done
case $base:$variant in
  verl:gpu | debian:cpu | debian:gpu) ;;
  verl:cpu) die "--variant cpu needs --base debian (verl's image is the GPU one)" ;;
  *) die "--base $base --variant $variant: use --base verl|debian and --variant cpu|gpu" ;;
esac
[ -z "$debian_mirror" ] || [ -z "$debian_snapshot" ] || die "--debian-mirror and --debian-snapshot: give one of them"
if [ -n "$debian_snapshot" ]; then
  [[ $debian_snapshot =~ ^[0-9]{8}T[0-9]{6}Z$ ]] ||
    die "--debian-snapshot $debian_snapshot: use snapshot.debian.org's form, e.g. 20260101T000000Z"
fi
[ ! -e "$work" ] || [ -d "$work" ] || die "--work $work is not a folder: name a folder (or a path to make one at)"
root=$(cd "$(dirname "$0")/.." && pwd)
need() {  # COMMAND PACKAGE: stop in one line when COMMAND is missing
  command -v "$1" >/dev/null || die "$1 is missing: apt-get install $2"
}
docker_works() { docker info >/dev/null 2>&1; }
if [ -z "$tool" ]; then
  for candidate in buildah podman docker; do
    command -v $candidate >/dev/null || continue
    [ $candidate != docker ] || docker_works || continue
    tool=$candidate; break
  done
  [ -n "$tool" ] || die "no container builder here: apt-get install buildah (or podman, or docker.io with its engine)"
fi
case $tool in
  docker) need docker docker.io
    docker_works ||
      die "docker reaches no Docker engine (docker info fails): start dockerd, or use --tool podman|buildah" ;;
  podman | buildah) need $tool $tool ;;
  *) die "--tool $tool: use docker, podman or buildah" ;;
esac
need git git
git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1 || die "$root is not a git checkout (the image is \
labelled with its commit, and the context is its tracked and untracked, not ignored, files)"

step() { echo "stapo: $* ($(date +%T))"; }
layers=()  # buildah reuses no layer unless told (podman and Docker do): the dependencies' layer outlives a source edit
[ $tool != buildah ] || layers=(--layers)

provenance() {  # the OCI labels' and STAPO_COMMIT's build arguments (python -m stapo.tools.version prints it)
  local revision
  revision=$(git -C "$root" rev-parse HEAD)
  # a context with changes not committed is not that commit: the revision says so
  [ -z "$(git -C "$root" status --porcelain)" ] || revision=$revision-dirty
  build_args=(--build-arg "REVISION=$revision"
    --build-arg "SOURCE=$(git -C "$root" config --get remote.origin.url || true)"
    --build-arg "VERSION=$(sed -n 's/^ *version="\([^"]*\)",$/\1/p' "$root/setup.py")"
    --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)")
  step "revision $revision"
}

# --- can a RUN step start here? (buildah and podman: the default OCI isolation needs a runtime that can) -----------
# Answers crun 1.8.1 (Debian 12's) on a host whose cgroup controllers are mounted as v1 beside a v2 hierarchy: it
# refuses with "cgroups in hybrid mode not supported, drop all controllers from cgroupv2" (crun's
# src/libcrun/cgroup.c; a mode its maintainers do not mean to support: containers/podman#3439). Chroot isolation
# needs no runtime and no cgroup.
image_exists() {
  if [ $tool = buildah ]; then buildah inspect --type image "$1"; else $tool image inspect "$1"; fi >/dev/null 2>&1
}
run_true() {  # IMAGE: a RUN of `true` in IMAGE with this environment's isolation; its errors on stderr
  if [ $tool = buildah ]; then
    local ctr status=0
    ctr=$(buildah from --pull=never "$1" 2>/dev/null) || { echo "buildah from $1 failed" >&2; return 1; }
    buildah run "$ctr" -- true || status=$?
    buildah rm "$ctr" >/dev/null
    return $status
  fi
  local probe status=0
  probe=$(mktemp -d)
  printf 'FROM %s\nRUN true\n' "$1" >"$probe/Containerfile"
  podman build --pull=never --layers=false --iidfile "$probe/id" "$probe" >/dev/null || status=$?
  [ ! -s "$probe/id" ] || podman rmi "$(cat "$probe/id")" >/dev/null 2>&1 || true
  rm -rf "$probe"
  return $status
}
choose_isolation() {  # IMAGE (present here): keep the default isolation if a RUN starts, else chroot
  [ $tool != docker ] && [ -z "${BUILDAH_ISOLATION:-}" ] || return 0
  local error
  if error=$(run_true "$1" 2>&1 >/dev/null); then return 0; fi
  # the runtime's own words (crun: ..., runc: ...), else the last line
  error=$(printf '%s\n' "$error" | grep -m1 -E 'crun|runc|runtime' ||
    printf '%s\n' "$error" | grep -v '^\s*$' | tail -1)
  if BUILDAH_ISOLATION=chroot run_true "$1" >/dev/null 2>&1; then
    export BUILDAH_ISOLATION=chroot
    step "no OCI runtime can start a RUN step here ($error); building with BUILDAH_ISOLATION=chroot"
  else
    die "no RUN step starts in $1 here, with the default isolation ($error) nor with BUILDAH_ISOLATION=chroot"
  fi
}

if [ $base = verl ]; then
  tag=${tag:-stapo-verl:latest}
  case $verl_image in
    *@sha256:*) ;;
    *) step "$verl_image is a moving tag: for an image a reproduction can name, pin it by digest with --verl-image \
verlai/verl@sha256:... (docs/container.md, \"Pins\")" ;;
  esac
  if [ $tool != docker ]; then
    image_exists "$verl_image" || $tool pull "$verl_image" >/dev/null ||
      die "cannot pull $verl_image (above): is its registry reachable from here?"
    choose_isolation "$verl_image"
  fi
  provenance
  exec $tool build "${layers[@]}" -f "$root/docker/Dockerfile" --build-arg "BASE=$verl_image" "${build_args[@]}" \
    -t "$tag" "$root"
fi

# --- Debian bookworm base, wheelhouse and build context (outside the checkout) ---------------------------------------
tag=${tag:-stapo-verl:$variant}
python=${PYTHON:-python3}
need "$python" python3
"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip: apt-get install python3-pip"
py=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# The wheels' tags must fit bookworm's Python inside the image.
[ "$py" = 3.11 ] || die "the wheelhouse for Debian bookworm (Python 3.11) needs Python 3.11 here, $python is $py: \
set PYTHON=python3.11"
lock=$root/docker/lock/$variant.txt
[ -s "$lock" ] || die "docker/lock/$variant.txt is missing: bash docker/lock.sh $variant writes it"
base_image=localhost/stapo-base:bookworm
image_exists $base_image || [ -s "$work/bookworm.tar" ] || need mmdebstrap mmdebstrap
mkdir -p "$work" 2>/dev/null || die "--work $work: cannot make that folder here; name one you can write to"
log=$work/build-$variant.log
: >"$log"
quiet() {  # COMMAND...: its output to the log, the log's end when it fails
  "$@" >>"$log" 2>&1 || { tail -20 "$log" >&2; die "failed: $* (all of it in $log)"; }
}

if ! image_exists $base_image; then
  if [ ! -s "$work/bookworm.tar" ]; then
    mirror=${debian_mirror:-http://deb.debian.org/debian}
    options=()
    if [ -n "$debian_snapshot" ]; then
      mirror=http://snapshot.debian.org/archive/debian/$debian_snapshot
      # a snapshot's Release file is past its Valid-Until (mmdebstrap(1), --aptopt)
      options=(--aptopt='Acquire::Check-Valid-Until "false"')
    fi
    # SOURCE_DATE_EPOCH: the same tarball from the same archive content (mmdebstrap(1)); the commit's time, and
    # without the host's resolv.conf and hostname, which mmdebstrap copies in
    step "Debian bookworm base with python3, venv and pip (mmdebstrap, $mirror) -> $work/bookworm.tar"
    rm -rf "$work/bookworm.tar.part"  # what a build stopped half-way left
    SOURCE_DATE_EPOCH=$(git -C "$root" log -1 --format=%ct) quiet mmdebstrap --variant=minbase --format=tar \
      --include=python3,python3-venv,python3-pip "${options[@]}" \
      --customize-hook='rm -f "$1"/etc/resolv.conf "$1"/etc/hostname' bookworm "$work/bookworm.tar.part" "$mirror"
    mv "$work/bookworm.tar.part" "$work/bookworm.tar"
  fi
  # The base's packages against the committed list (docker/lock/bookworm.txt): the live archive moves at each point
  # release; a snapshot does not.
  tar -xOf "$work/bookworm.tar" ./var/lib/dpkg/status >"$work/bookworm.status" 2>/dev/null ||
    die "$work/bookworm.tar has no ./var/lib/dpkg/status: delete it, and build.sh makes it again"
  awk '
    /^Package: / {p = $2} /^Architecture: / {a = $2} /^Version: / {v = $2}
    /^$/ {if (p) print p " " v " " a; p = ""} END {if (p) print p " " v " " a}' "$work/bookworm.status" |
    sort >"$work/bookworm.txt"
  grep -v '^#' "$root/docker/lock/bookworm.txt" >"$work/bookworm.lock" 2>/dev/null || true
  if cmp -s "$work/bookworm.txt" "$work/bookworm.lock"; then
    step "the base's $(wc -l <"$work/bookworm.txt") packages are docker/lock/bookworm.txt's"
  else
    step "the base's packages differ from docker/lock/bookworm.txt in $(diff "$work/bookworm.lock" \
"$work/bookworm.txt" | grep -c '^[<>]' || true) lines ($work/bookworm.txt): the archive moved since the lock; \
--debian-snapshot pins it, or put that list in the lock to accept it"
  fi
  step "importing it as $base_image"
  case $tool in
    docker | podman) quiet $tool import "$work/bookworm.tar" $base_image ;;
    buildah)  # buildah has no import: a container from scratch with the tarball's files, committed
      ctr=$(buildah from scratch)
      quiet buildah add "$ctr" "$work/bookworm.tar" /
      quiet buildah config --cmd bash "$ctr"
      quiet buildah commit "$ctr" $base_image
      buildah rm "$ctr" >/dev/null ;;
  esac
fi
choose_isolation $base_image

context=$work/context-$variant wheels=$work/wheels-$variant
step "build context: the checkout's tracked and untracked files -> $context"
rm -rf "$context" "$wheels" && mkdir -p "$context" "$wheels"
(cd "$root" && git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"  # a tracked file deleted in the work tree is not in the image either
done | tar --null -T - -cf -) | tar -xf - -C "$context"

step "wheelhouse: docker/lock/$variant.txt ($(grep -c '^[A-Za-z0-9]' "$lock") pins), each file checked against its \
sha256 -> $wheels"
# As the lock names them, no more: wheels where there are, the sdist where there is none (built in the image from
# the file whose hash the lock names). torch's +cpu build comes from pip's configured index (PyPI has the CUDA one):
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where no other index has it.
"$python" -m pip download --no-deps --require-hashes -d "$wheels" -r "$lock" >>"$log" 2>&1 || {
  tail -20 "$log" >&2
  die "pip could not fetch docker/lock/$variant.txt as locked (all of it in $log): for torch's +cpu build, \
PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
}
cp -al "$wheels" "$context/wheels" 2>/dev/null || cp -a "$wheels" "$context/wheels"
provenance
step "$tool build $tag from $base_image ($(du -sh "$wheels" | cut -f1) of wheels)"
$tool build "${layers[@]}" -f "$context/docker/Dockerfile" --build-arg BASE=$base_image --build-arg LOCK=$variant \
  "${build_args[@]}" -t "$tag" "$context"
step "built $tag; run the tests in it: docs/container.md"
