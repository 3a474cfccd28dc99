# Sourced by setup.sh (bash, also macOS's bash 3.2): find_python prints the path of a Python >= 3.10.
#
# A stock Mac's `python3` is Apple's 3.9 (Command Line Tools), which torch no longer supports, so the
# first `python3` on PATH is not good enough. Order: $PYTHON if set (and then only it: an explicit
# choice that is too old is an error, not a reason to pick another), python3.13 .. python3.10, python3.
# Uses shell builtins only, so it works with any PATH. On failure it says what to install and returns 1.

FIND_PYTHON_MIN_MINOR=10

# "3.12" for a working interpreter, nothing (and status 1) otherwise.
_python_version() {
  local out
  out=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || return 1
  case $out in
    [0-9]*.[0-9]*) printf '%s\n' "$out" ;;
    *) return 1 ;;
  esac
}

# Status 0 when "MAJOR.MINOR" is at least 3.10.
_python_new_enough() {
  local major=${1%%.*} minor=${1#*.}
  minor=${minor%%.*}
  [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge "$FIND_PYTHON_MIN_MINOR" ]; }
}

_python_install_hint() {
  printf '%s\n' "Install Python 3.10 or newer, then run this again:" \
    "  macOS with Homebrew:  brew install python@3.12" \
    "  macOS without it:     the installer from https://www.python.org/downloads/macos/" \
    "  Linux:                your distribution's python3.12 (or python3.11, python3.10) package" \
    "or point PYTHON at one: PYTHON=/path/to/python3.12 bash scripts/setup.sh" >&2
}

find_python() {
  local cand path version tried=""
  if [ -n "${PYTHON:-}" ]; then
    path=$(command -v "$PYTHON") || { echo "setup: PYTHON=$PYTHON: no such program" >&2; return 1; }
    if version=$(_python_version "$path") && _python_new_enough "$version"; then
      printf '%s\n' "$path"
      return 0
    fi
    echo "setup: PYTHON=$PYTHON is Python ${version:-of unknown version}; torch-thunderbolt needs 3.10 or newer" >&2
    _python_install_hint
    return 1
  fi
  for cand in python3.13 python3.12 python3.11 python3.10 python3; do
    path=$(command -v "$cand") || continue
    if version=$(_python_version "$path"); then
      if _python_new_enough "$version"; then
        printf '%s\n' "$path"
        return 0
      fi
      tried="$tried $path ($version),"
    fi
  done
  if [ -n "$tried" ]; then
    echo "setup: torch-thunderbolt needs Python 3.10 or newer; found only:${tried%,}" >&2
  else
    echo "setup: torch-thunderbolt needs Python 3.10 or newer; no python3 found on PATH" >&2
  fi
  _python_install_hint
  return 1
}
