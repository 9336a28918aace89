#!/usr/bin/env bash
# Prepares what tools/analysis/device_check.sh needs on the lent GPU machine (docs/device_check.md): the pinned
# pure-Python wheels of tools/analysis/device_wheels.txt for CPython 3.12 on x86-64 Linux, downloaded here (PyPI),
# and, with --authors-code, the authors' backbone files. Run it where PyPI is reachable:
#
#   bash tools/analysis/device_wheels.sh [--dir DIR] [--authors-code FAMILY=PATH ...]
#
# DIR (default .device_carry, ignored by git): DIR/wheels/*.whl and DIR/authors/FAMILY/<their backbone file at its
# path in their repository>. The wheels folder is emptied first, so it holds exactly the pinned set; the check
# at the end refuses a wheel that is not py*-none-any or cp312 manylinux x86_64, a pin with no or two wheels,
# and a total over MAX_MB (default 16) MiB. PINS: another pin file (tests), PYTHON: the python whose pip downloads.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PINS="${PINS:-$ROOT/tools/analysis/device_wheels.txt}"
DIR="$ROOT/.device_carry"
MAX_MB="${MAX_MB:-16}"
PY="${PYTHON:-python}"
AUTHORS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR="${2:?--dir DIR}"; shift 2 ;;
    --authors-code) shift
      while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do AUTHORS+=("$1"); shift; done ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "device_wheels.sh: unknown argument '$1' (allowed: --dir DIR, --authors-code FAMILY=PATH ...)" >&2
       exit 2 ;;
  esac
done

mapfile -t PKGS < <(grep -v '^\s*\(#\|$\)' "$PINS")
rm -rf "$DIR/wheels"
mkdir -p "$DIR/wheels"
echo "[device_wheels] ${#PKGS[@]} pinned wheels for CPython 3.12 x86-64 into $DIR/wheels: ${PKGS[*]}"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$DIR/wheels" "${PKGS[@]}"

"$PY" - "$DIR/wheels" "$MAX_MB" "${PKGS[@]}" <<'EOF'
import os, re, sys
folder, max_mb, pins = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
norm = lambda s: re.sub(r'[-_.]+', '_', s).lower()
wheels = sorted(f for f in os.listdir(folder) if f.endswith('.whl'))
bad = []
found = {}
for w in wheels:
    name, version, *_, py, abi, plat = w[:-4].split('-')
    found.setdefault((norm(name), version), []).append(w)
    pure = abi == 'none' and plat == 'any' and all(t.startswith('py3') or t == 'py2' for t in py.split('.'))
    cp312 = py == 'cp312' and abi in ('cp312', 'abi3') and re.fullmatch(r'manylinux(2014|_2_\d+)_x86_64', plat)
    if not (pure or cp312):
        bad.append(f'{w}: not a py3-none-any or cp312 manylinux x86_64 wheel')
want = {(norm(p.split('==')[0]), p.split('==')[1]) for p in pins}
bad += [f'{n}=={v}: no wheel' for n, v in sorted(want - set(found))]
bad += [f'{", ".join(found[k])}: not in tools/analysis/device_wheels.txt' for k in sorted(set(found) - want)]
bad += [f'{", ".join(ws)}: more than one wheel' for ws in found.values() if len(ws) > 1]
total = sum(os.path.getsize(os.path.join(folder, w)) for w in wheels) / 2**20
if total > max_mb:
    bad.append(f'{total:.1f} MiB of wheels, more than MAX_MB={max_mb:g}')
if bad:
    sys.exit('[device_wheels] refused:\n  ' + '\n  '.join(bad))
print(f'[device_wheels] {len(wheels)} wheels, {total:.2f} MiB: ' + ' '.join(wheels))
EOF

if [ ${#AUTHORS[@]} -gt 0 ]; then
  rm -rf "$DIR/authors"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$DIR/authors" "${AUTHORS[@]}" <<'EOF'
import os, shutil, sys
# only the table of the families' files: mmplugin_l2.analysis.authors imports torch, which is fine here
from mmplugin_l2.analysis.authors import FAMILIES, check_root, family_path
dest = sys.argv[1]
for arg in sys.argv[2:]:
    try:
        fam, root = family_path(arg)
        src = check_root(fam, root)
    except Exception as e:  # noqa: BLE001  (argparse / file errors: one line)
        sys.exit(f'[device_wheels] --authors-code: {e}')
    out = os.path.join(dest, fam, FAMILIES[fam][1])
    os.makedirs(os.path.dirname(out), exist_ok=True)
    shutil.copyfile(src, out)
    print(f'[device_wheels] {fam}: {src} -> {out}')
EOF
fi
du -sh "$DIR" | awk '{print "[device_wheels] carry " $2 ": " $1 " (run: carry [\"" "'"${DIR#$ROOT/}"'" "\"])"}'
