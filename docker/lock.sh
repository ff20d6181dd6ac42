#!/usr/bin/env bash
# Resolves an image variant's dependencies once into docker/lock/VARIANT.txt, every file by its sha256 (pip-compile
# --generate-hashes); docker/build.sh --base debian installs exactly that, hash-checked (docs/container.md, "Pins").
usage() {
  cat <<'USAGE'
usage: bash docker/lock.sh cpu|gpu [PIP-COMPILE OPTION...]
Writes docker/lock/VARIANT.in (what the variant adds to setup.py's requirements) and docker/lock/VARIANT.txt (all of
it resolved for Python 3.11 on Linux x86_64, bookworm's Python, with the sha256 of every file), both whole or not at
all. pip-compile keeps the pins already in VARIANT.txt that still fit; pass --upgrade to resolve all afresh, or
--upgrade-package NAME for one.
  cpu   setup.py's requirements and its test extra, torch as .ci/run installs it (the README's CPU torch 2.13.0),
        setuptools and wheel (the build backend of the image's editable install)
  gpu   setup.py's requirements and verl's own pins for the extras recipe/stapo/REQUIRED_VERL.txt names, read from
        verl's wheel, without flash-attn (PyPI has only its sdist, which compiles CUDA kernels for hours)
It needs pip-compile (pip-tools; 7.6.2 wrote the committed locks: python3.11 -m pip install pip-tools) and reads pip's
own configuration (index, find-links: where torch's +cpu build comes from, e.g.
PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu). PYTHON names the Python (default python3),
STAPO_PIP_COMPILE the pip-compile (default: the one on PATH).
USAGE
}
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }
case ${1:-} in
  -h | --help) usage; exit 0 ;;
  cpu | gpu) variant=$1; shift ;;
  '') die "name a variant: bash docker/lock.sh cpu|gpu (--help says more)" ;;
  *) die "unknown variant '$1': bash docker/lock.sh cpu|gpu (--help says more)" ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
compile=${STAPO_PIP_COMPILE:-pip-compile}
command -v "$python" >/dev/null || die "$python is missing: set PYTHON=python3.11"
py=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$py" = 3.11 ] || die "the lock is for Debian bookworm's Python 3.11, $python is $py: set PYTHON=python3.11"
command -v "$compile" >/dev/null ||
  die "pip-compile is missing: $python -m pip install pip-tools (or set STAPO_PIP_COMPILE)"
cd "$root"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

{
  echo "# bash docker/lock.sh $variant: what the $variant image adds to setup.py's requirements"
  if [ "$variant" = cpu ]; then
    grep -o 'torch==[0-9.]*' .ci/run  # the README's CPU torch, as CI installs it
    printf '%s\n' setuptools wheel
  else
    spec=$(sed -n 's/^PIP_INSTALL="\(.*\)"$/\1/p' recipe/stapo/REQUIRED_VERL.txt)
    "$python" -m pip download --quiet --no-deps -d "$tmp" "${spec%%[*}==${spec##*==}" >&2
    "$python" - "$spec" "$tmp" <<'EOF'
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
    printf '%s\n' setuptools wheel
  fi
} >"$tmp/$variant.in"
mv "$tmp/$variant.in" "docker/lock/$variant.in"
[ ! -e "docker/lock/$variant.txt" ] || cp "docker/lock/$variant.txt" "$tmp/$variant.txt"  # the pins to keep
extra=()
[ "$variant" = gpu ] || extra=(--extra=test)
# --allow-unsafe: setuptools and wheel are pinned too; the header names this script, not the temporary output.
CUSTOM_COMPILE_COMMAND="bash docker/lock.sh $variant" "$compile" --quiet --generate-hashes --allow-unsafe \
  --strip-extras --no-emit-index-url --no-emit-find-links "${extra[@]}" --output-file="$tmp/$variant.txt" "$@" \
  setup.py "docker/lock/$variant.in"
mv "$tmp/$variant.txt" "docker/lock/$variant.txt"
echo "wrote docker/lock/$variant.in and docker/lock/$variant.txt ($(grep -c '^[A-Za-z0-9]' "docker/lock/$variant.txt")\
 pins)"
