# Sourced by the GPU stage scripts (run.sh, tp.sh) from the repository root: where results
# go, what Python sees, and the commit the results record.
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 KVFLOW_NO_PROGRESS=1
# The machine gets the working tree without git history: the commit comes along in a file
# (write it with `git rev-parse HEAD > .git-commit` and carry it).
[ -f .git-commit ] && export KVFLOW_GIT_COMMIT=$(cat .git-commit)
KV="python -m kvflow.cli"
