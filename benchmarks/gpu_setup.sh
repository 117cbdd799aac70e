# Source this on the (offline) GPU machine from the repository root:
#
#     source benchmarks/gpu_setup.sh
#     python -m pytest -q -n 8 tests        # or: python benchmarks/gpu.py --out $OUT/gpu.json
#
# It installs, once, the wheels in .whl/ (downloaded on a machine with internet; see the list
# below) into $SUPO_JAX_SITE (default /tmp/site) without touching the system site-packages,
# and exports PYTHONPATH=$SUPO_JAX_SITE:$PWD so that `import supo_jax` and the extra packages
# resolve. What .whl/ holds (cp312 manylinux x86_64 / pure python), for what is missing there:
#   gguf, tensorflow-datasets (+ array_record, dm-tree, immutabledict, promise, simple_parsing,
#   docstring_parser, tensorflow-metadata, googleapis-common-protos, termcolor, toml, einops),
#   bm25s, tensorboardX, and for tests/test_notebook.py nbclient, nbformat, ipykernel with
#   their closure (jupyter_client/core, pyzmq, tornado, traitlets, ipython, jedi, parso, ...).
# pyarrow (a declared tensorflow-datasets dependency, 40 MB) is left out: the array_record
# data sources this repo uses never import it.
# Re-running the script is cheap: it reinstalls only when the set of wheels changed.

_supo_site="${SUPO_JAX_SITE:-/tmp/site}"
_supo_root="$(cd "$(dirname "${BASH_SOURCE[0]:-$0}")/.." && pwd)"
if ! ls "$_supo_root"/.whl/*.whl >/dev/null 2>&1; then
    echo "gpu_setup: no wheels in $_supo_root/.whl" >&2
else
    _supo_stamp="$(ls "$_supo_root"/.whl/*.whl | xargs -n1 basename | sort | md5sum | cut -c1-32)"
    if [ "$(cat "$_supo_site/.supo_jax_wheels" 2>/dev/null)" != "$_supo_stamp" ]; then
        echo "gpu_setup: installing $(ls "$_supo_root"/.whl/*.whl | wc -l) wheels into $_supo_site" >&2
        if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$_supo_site" "$_supo_root"/.whl/*.whl; then
            echo "$_supo_stamp" > "$_supo_site/.supo_jax_wheels"
        else
            echo "gpu_setup: pip install failed" >&2
        fi
    fi
    unset _supo_stamp
fi
export PYTHONPATH="$_supo_site:$_supo_root${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu_setup: PYTHONPATH=$PYTHONPATH" >&2
unset _supo_site _supo_root
