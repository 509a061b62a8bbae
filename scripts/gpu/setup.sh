# Install what the GPU image lacks (carried wheels) and this checkout; source it from a device call.
set -e
python3 -m pip install -q --no-deps --no-index wheels/cupti_python-*cp312*.whl wheels/msgspec-*cp312*.whl 2>&1 | grep -v "WARNING: Running pip" || true
python3 -c "import drain3" 2>/dev/null || python3 -m pip install -q --no-deps --no-index wheels/drain3-*.whl wheels/cachetools-*.whl wheels/jsonpickle-*.whl 2>&1 | grep -v "WARNING: Running pip" || true
# xgboost (the experts `teller rca train` fits after its epochs) is not in the image: carry
# wheels/xgboost_cpu-*-manylinux_2_28_x86_64.whl (numpy and scipy, which it needs, are there);
# without it training skips the experts and `teller rca experts` fits them later.
python3 -c "import xgboost" 2>/dev/null || ! ls wheels/xgboost*.whl >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-index wheels/xgboost*.whl 2>&1 | grep -v "WARNING: Running pip" || true
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "WARNING: Running pip" || true
export PYTHONUNBUFFERED=1
set +e
