#!/usr/bin/env bash
# System packages the tests need beyond Python (.ci/run calls this before scripts/setup.sh):
# Debian's chromium, for the HTML report's headless screenshot test (tests/integration/test_report_html.py).
# Installs only what is missing; needs root (or sudo) when it does install.
set -euo pipefail

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "ci-system-deps: chromium is missing and this is not root; the HTML screenshot test will skip" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends chromium; }; then
    echo "ci-system-deps: could not install chromium; the HTML screenshot test will skip" >&2
fi
