# Shared by scripts/setup-bench.sh and scripts/setup-vllm.sh (sourced, not run): a side virtual
# environment that borrows torch, numpy and the editable omni_pcache from .venv, and a stamp of
# the package list it was last installed with, so a second run takes a second.

# side_venv NAME DIR: creates the venv DIR if missing and makes .venv's packages visible in it
# through a .pth file (a venv made from another venv's interpreter with --system-site-packages
# sees the base Python, not .venv). Sets $site to DIR's site-packages.
side_venv() {
    local name=$1 venv=$2 base_site
    base_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [ ! -x "$venv/bin/python" ]; then
        echo "$name: creating $venv"
        .venv/bin/python -m venv "$venv"  # (.venv's Python: the torch it borrows is built for it)
    fi
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # addsitedir (not a plain path line) so .venv's own .pth files (the editable omni_pcache) apply.
    echo "import site; site.addsitedir('$base_site')" > "$site/zz_dotvenv.pth"
}

# side_venv_stale DIR LIST: true when DIR was not yet installed with the package list LIST
# (sets $stamp_want; call side_venv_stamp DIR after installing).
side_venv_stale() {
    stamp_want=$(printf '%s\n' "$2" | sha256sum | cut -d' ' -f1)
    [ "$(cat "$1/.packages.sha256" 2>/dev/null || true)" != "$stamp_want" ]
}

side_venv_stamp() {
    echo "$stamp_want" > "$1/.packages.sha256"
}
