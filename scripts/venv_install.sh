# Sourced by the install scripts. venv_install PYTHON ARGS...: `pip install ARGS...` into the environment of
# PYTHON, through uv where the calling environment has it (scripts/setup.sh installs it there), given the indexes,
# find-links folders and constraint files of pip's own configuration (scripts/uv_args.py): uv resolves in
# seconds where pip reads every large index page for half a minute, and downloads in parallel. Like pip it
# compiles the bytecode as it installs (where PYTHONDONTWRITEBYTECODE is set, a package installed without it is
# compiled again by every process that imports it: seconds per torch import). pip does it where uv is missing
# or fails, asked for errors only (-qq: a pip configuration naming local indexes that lack a package warns
# once per package and index). PIP_* variables, such as PIP_UPGRADE_STRATEGY, reach pip only.
venv_install() {
    local target=$1
    shift
    local host=${PYTHON:-python3} line
    local options=() variables=()
    if "$host" -m uv --version >/dev/null 2>&1; then
        while IFS= read -r line; do
            case $line in
                SSL_CERT_FILE=*) variables+=("$line") ;;
                *) options+=("$line") ;;
            esac
        done < <("$host" "$(dirname "${BASH_SOURCE[0]}")/uv_args.py")
        if env "${variables[@]}" "$host" -m uv pip install --quiet --compile-bytecode --python "$target" "${options[@]}" "$@"; then
            return 0
        fi
        echo "uv could not install $* into $target: pip does" >&2
    fi
    "$target" -m pip install -qq --disable-pip-version-check "$@"
}
