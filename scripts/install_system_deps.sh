#!/bin/sh
# Installs the system libraries gmlx uses on Linux: the threaded OpenBLAS that mlx's
# CPU matmuls go through (gmlx loads it before mlx; see gmlx/platform/blas.py).
# Debian/Ubuntu: apt-get, as root or through sudo. Elsewhere: prints what to install.
# Idempotent, and quick when everything is already there. Always exits 0.
set -u

PKG=libopenblas0-pthread

case "$(uname -s)" in
    Darwin) echo "macOS: nothing to install (mlx uses Accelerate)."; exit 0 ;;
    Linux) ;;
    *) echo "$(uname -s): gmlx's system dependencies are for Linux; nothing done."; exit 0 ;;
esac

if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-query >/dev/null 2>&1; then
    echo "Not a Debian/Ubuntu system. Install a threaded OpenBLAS with your package manager:"
    echo "  Fedora/RHEL: dnf install openblas-threads     Arch: pacman -S openblas"
    echo "  openSUSE: zypper install libopenblas_pthreads0"
    echo "or set GMLX_BLAS_LIB to the path of a libopenblas.so."
    exit 0
fi

if [ "$(dpkg-query -W -f='${Status}' "$PKG" 2>/dev/null)" = "install ok installed" ]; then
    echo "$PKG is already installed."
    exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
    SUDO=""
elif command -v sudo >/dev/null 2>&1; then
    SUDO="sudo"
else
    echo "Run as root (or install sudo) to install $PKG:  apt-get install -y $PKG"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
# Refresh the package lists only when apt does not know the package yet.
if ! apt-cache show "$PKG" >/dev/null 2>&1; then
    $SUDO apt-get update || echo "apt-get update failed; trying the install anyway"
fi
if $SUDO apt-get install -y --no-install-recommends "$PKG"; then
    echo "$PKG installed."
else
    echo "Could not install $PKG; install it by hand: apt-get install -y $PKG"
fi
exit 0
