#!/usr/bin/env bash
# Set up pkb in ./.venv. Safe to run again.
#
# torch: the one the active Python environment already has is reused (a CUDA build in a venv or conda
# env, or the system Python's), without network; only where none is found is torch==2.13.0 installed.
# pkb itself: installed editable with its test extras from the package index; with no index
# reachable, pkb is linked into .venv from this checkout (and whatever extras the environment
# already has stay usable), so an offline GPU node can still run `.venv/bin/pkb`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${PKB_TORCH_SPEC:-torch==2.13.0}"
PIP_QUIET=(--quiet --disable-pip-version-check --retries 1 --timeout 15)

if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv --system-site-packages .venv
fi
SITE_PACKAGES=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

# A venv or conda env that holds torch: `python -m venv` builds on the base interpreter and would not
# see it, so its site directories are added to .venv (a .pth line that runs site.addsitedir, which
# also reads that environment's own .pth files).
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1 && "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    "$PYTHON" - "$SITE_PACKAGES/_pkb_active_env.pth" <<'EOF'
import site, sys
dirs = [d for d in site.getsitepackages() + [site.getusersitepackages()] if d]
with open(sys.argv[1], "w") as pth:
    pth.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in dirs) + "\n")
EOF
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install "${PIP_QUIET[@]}" "$TORCH_SPEC"
fi

if ! .venv/bin/python -m pip install "${PIP_QUIET[@]}" -e ".[test]" 2>.venv/pip-install.log; then
    echo "setup: the package index is not reachable (pip's words: .venv/pip-install.log); linking pkb from this" \
         "checkout instead (extras that this environment lacks stay missing: tests need pytest, reports pyarrow)" >&2
    echo "$PWD" > "$SITE_PACKAGES/_pkb_checkout.pth"
    printf '#!%s\nimport sys\nfrom pkb.cli import main\nsys.exit(main())\n' "$PWD/.venv/bin/python" > .venv/bin/pkb
    chmod +x .venv/bin/pkb
fi
.venv/bin/python -c "import torch, pkb; print(f'pkb {pkb.__version__} with torch {torch.__version__} ready in .venv')"
