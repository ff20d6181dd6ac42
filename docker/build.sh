#!/usr/bin/env bash
# Builds the recipe's image from docker/Dockerfile with Docker, Podman or buildah (docs/container.md).
#   bash docker/build.sh [--tool docker|podman|buildah] [--base verl|debian] [--variant cpu|gpu] [--tag NAME]
usage() {
  cat <<'USAGE'
usage: bash docker/build.sh [--tool docker|podman|buildah] [--base verl|debian] [--variant cpu|gpu] [--tag NAME]
                            [--work DIR]
Builds the recipe's image from docker/Dockerfile.
  --base verl     verl's image verlai/verl:vllm024.latest (the default; GPU only): the checkout is the build context
                  and pip takes what the image lacks from the package index.
  --base debian   Debian bookworm made here by mmdebstrap, with everything installed from a wheelhouse that pip
                  makes here (python3.11, bookworm's Python), and no index inside the build (air-gapped clusters
                  build it the same way): --variant cpu is CPU torch (the README's torch==2.13.0) and the test
                  extra; --variant gpu is verl's [vllm,fsdp,math] pins (recipe/stapo/REQUIRED_VERL.txt) but
                  flash-attn, which has no wheel (the recipe runs without it).
  --tool T        docker, podman or buildah (default: the first of buildah, podman, docker that works here)
  --variant V     cpu or gpu (default gpu)
  --tag NAME      the image's name (default stapo-verl:latest for verl's base, stapo-verl:VARIANT for Debian's)
  --work DIR      base tarball, wheelhouse and build context for --base debian (default /var/tmp/stapo-container)
  -h, --help      this text
Podman and buildah read BUILDAH_ISOLATION (chroot where no OCI runtime can start containers, as on the machine of
docs/container.md) and CONTAINERS_STORAGE_CONF (a storage.conf with driver "vfs" where overlay does not work) from
the environment; PYTHON names the wheelhouse's Python (default python3).
It installs nothing and starts no service: a missing tool stops it with the package that provides it.
USAGE
}
set -euo pipefail
tool= base=verl variant=gpu tag= work=/var/tmp/stapo-container
while [ $# -gt 0 ]; do
  case $1 in
    -h | --help) usage; exit 0 ;;
    --tool | --base | --variant | --tag | --work)
      [ $# -ge 2 ] || { usage >&2; exit 2; }
      declare "${1#--}=$2"; shift 2 ;;
    *) usage >&2; exit 2 ;;
  esac
done
die() { echo "error: $*" >&2; exit 2; }
case $base:$variant in
  verl:gpu | debian:cpu | debian:gpu) ;;
  verl:cpu) die "--variant cpu needs --base debian (verl's image is the GPU one)" ;;
  *) die "--base $base --variant $variant: use --base verl|debian and --variant cpu|gpu" ;;
esac
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

if [ $base = verl ]; then
  tag=${tag:-stapo-verl:latest}
  exec $tool build -f "$root/docker/Dockerfile" -t "$tag" "$root"
fi

# --- Debian bookworm base, wheelhouse and build context (outside the checkout) ---------------------------------------
tag=${tag:-stapo-verl:$variant}
python=${PYTHON:-python3}
need git git
need "$python" python3
"$python" -m pip --version >/dev/null 2>&1 || die "$python has no pip: apt-get install python3-pip"
py=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# The wheels' tags must fit bookworm's Python inside the image.
[ "$py" = 3.11 ] || die "the wheelhouse for Debian bookworm (Python 3.11) needs Python 3.11 here, $python is $py: \
set PYTHON=python3.11"
image_exists() {
  if [ $tool = buildah ]; then buildah inspect --type image "$1"; else $tool image inspect "$1"; fi >/dev/null 2>&1
}
base_image=localhost/stapo-base:bookworm
image_exists $base_image || [ -s "$work/bookworm.tar" ] || need mmdebstrap mmdebstrap
git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1 || die "$root is not a git checkout (the context is \
its tracked and untracked, not ignored, files)"
mkdir -p "$work"
log=$work/build-$variant.log
: >"$log"
step() { echo "stapo: $* ($(date +%T))"; }
quiet() {  # COMMAND...: its output to the log, the log's end when it fails
  "$@" >>"$log" 2>&1 || { tail -20 "$log" >&2; die "failed: $* (all of it in $log)"; }
}

if ! image_exists $base_image; then
  if [ ! -s "$work/bookworm.tar" ]; then
    step "Debian bookworm base with python3, venv and pip (mmdebstrap) -> $work/bookworm.tar"
    quiet mmdebstrap --variant=minbase --include=python3,python3-venv,python3-pip bookworm "$work/bookworm.tar"
  fi
  step "importing it as $base_image"
  case $tool in
    docker | podman) quiet $tool import "$work/bookworm.tar" $base_image ;;
    buildah)  # buildah has no import: a container from scratch with the tarball's files, committed
      ctr=$(buildah from scratch)
      quiet buildah add "$ctr" "$work/bookworm.tar" /
      quiet buildah commit "$ctr" $base_image
      buildah rm "$ctr" >/dev/null ;;
  esac
fi

context=$work/context-$variant wheels=$work/wheels-$variant
step "build context: the checkout's tracked and untracked files -> $context"
rm -rf "$context" && mkdir -p "$context" "$wheels"
(cd "$root" && git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do
  [ -e "$f" ] && printf '%s\0' "$f"  # a tracked file deleted in the work tree is not in the image either
done | tar --null -T - -cf -) | tar -xf - -C "$context"

if [ $variant = cpu ]; then
  extras=test
  grep -o 'torch==[0-9.]*' "$root/.ci/run" >"$wheels/requirements.txt"  # the README's CPU torch, as CI installs it
else
  # verl's own pins for the extras REQUIRED_VERL.txt names, read from verl's wheel, without flash-attn: PyPI has only
  # its sdist, which compiles CUDA kernels against a CUDA torch (nvcc, hours on few cores); without it the recipe
  # uses PyTorch's varlen attention (README, "Install on GPU nodes"). The recipe's own extras then stay empty.
  extras=
  spec=$(sed -n 's/^PIP_INSTALL="\(.*\)"$/\1/p' "$root/recipe/stapo/REQUIRED_VERL.txt")
  quiet "$python" -m pip download --no-deps -d "$wheels" "${spec%%[*}==${spec##*==}"
  "$python" - "$spec" "$wheels" >"$wheels/requirements.txt" <<'EOF'
import re, sys, zipfile
from pathlib import Path

name, extras, version = re.fullmatch(r"([\w.-]+)\[([\w,-]+)\]==(\S+)", sys.argv[1]).groups()
wheel = next(Path(sys.argv[2]).glob(f"{name}-{version}-*.whl"))
metadata = zipfile.ZipFile(wheel).read(f"{name}-{version}.dist-info/METADATA").decode()
by_extra = {}
for line in metadata.splitlines():
    found = re.fullmatch(r'Requires-Dist: (.+?)\s*;\s*extra == "(.+)"', line)
    if found:
        by_extra.setdefault(found[2], []).append(found[1])


def expand(extra):
    for requirement in by_extra[extra]:
        nested = re.fullmatch(rf"{name}\[(.+)\]", requirement)
        if nested:
            yield from (r for e in nested[1].split(",") for r in expand(e))
        elif not re.match(r"flash[-_]attn\b", requirement):
            yield requirement


print(f"{name}=={version}", *sorted({r for e in extras.split(",") for r in expand(e)}), sep="\n")
EOF
fi
step "wheelhouse for --variant $variant: $(paste -sd' ' "$wheels/requirements.txt") and the recipe${extras:+[$extras]}\
 -> $wheels"
# setuptools and wheel: the build backend of the recipe's editable install and of any sdist, inside the image.
quiet "$python" -m pip download -d "$wheels" setuptools wheel
quiet "$python" -m pip wheel -w "$wheels" --find-links "$wheels" -r "$wheels/requirements.txt" \
  "$context${extras:+[$extras]}"
rm -f "$wheels"/stapo_verl-*.whl  # pip wheel builds the recipe too; the image installs it from its source
cp -al "$wheels" "$context/wheels" 2>/dev/null || cp -a "$wheels" "$context/wheels"
step "$tool build $tag from $base_image ($(du -sh "$wheels" | cut -f1) of wheels)"
$tool build -f "$context/docker/Dockerfile" --build-arg BASE=$base_image --build-arg EXTRAS="$extras" -t "$tag" \
  "$context"
step "built $tag; run the tests in it: docs/container.md"
