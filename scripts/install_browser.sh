#!/bin/sh
# Installs headless Chromium and its WebDriver from the OS packages (Debian/Ubuntu), for the chat
# page's browser test (tests/test_serve_page.py). Run by `make test` when either is missing; the
# test skips, saying why, where neither this nor a browser is available.
set -e
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_browser.sh: no apt-get here; install chromium and chromedriver yourself" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "install_browser.sh: not root and no sudo; the browser test will skip" >&2
        exit 0
    fi
fi
$SUDO apt-get update -q || true
# Debian names them chromium / chromium-driver; Ubuntu's chromium-browser is a snap shim.
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver \
    || echo "install_browser.sh: could not install chromium; the browser test will skip" >&2
