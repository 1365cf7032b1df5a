#!/usr/bin/env bash
# Mutation testing of the cost model and the policy with mutmut 2.5.1.
#
#   python3 -m venv /tmp/mutvenv && /tmp/mutvenv/bin/pip install mutmut==2.5.1
#   tools/reliability/mutation.sh [WORKDIR]            # default /tmp/mla-mutation
#
# mutmut rewrites the files it mutates, so it runs in WORKDIR, a copy of the tracked
# files as they are in the work tree (SOURCE=head: as committed at HEAD; SOURCE=REV:
# at that commit), never in the repo. The runner, forkrun.py, is always the work
# tree's.
# Its test command is the one in docs/reliability.md, run through forkrun.py (pytest
# forked from a process that has torch and SGLang imported, the project's modules
# imported afresh from the copy; --tb=no and -p no:cacheprovider change only what
# pytest prints and writes). Prints mutmut's results; the cache stays in
# WORKDIR/.mutmut-cache (`cd WORKDIR && /tmp/mutvenv/bin/mutmut show ID`).
set -euo pipefail
REPO=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
WORK=${1:-/tmp/mla-mutation}
MUTMUT=${MUTMUT:-/tmp/mutvenv/bin/mutmut}
PY=$REPO/.venv/bin/python
TESTS="test/registered/unit/mem_cache/test_mla_cost_model.py test/registered/unit/mem_cache/test_mla_aware_policy.py"
MUTATE=python/sglang/srt/mem_cache/mla_cost_model.py,python/sglang/srt/mem_cache/mla_aware_policy.py

rm -rf "$WORK"
mkdir -p "$WORK"
case "${SOURCE:-worktree}" in
    worktree) (cd "$REPO" && git ls-files -z | tar --null -T - -c) | tar -x -C "$WORK" ;;
    head) git -C "$REPO" archive HEAD | tar -x -C "$WORK" ;;
    *) git -C "$REPO" archive "$SOURCE" | tar -x -C "$WORK" ;;
esac
mkdir -p "$WORK/tools/reliability"
cp "$REPO/tools/reliability/forkrun.py" "$WORK/tools/reliability/forkrun.py"
ln -s "$REPO/.venv" "$WORK/.venv"
cd "$WORK"
REV=$(git -C "$REPO" rev-parse --short "$([ "${SOURCE:-worktree}" = worktree ] && echo HEAD || echo "${SOURCE/head/HEAD}")")
echo "mutmut $("$MUTMUT" version | awk '{print $NF}') on $REV (${SOURCE:-worktree})"

SOCK=$WORK/forkrun.sock
"$PY" tools/reliability/forkrun.py serve "$SOCK" "$WORK/python" >forkrun.log 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do [ -S "$SOCK" ] && break; sleep 1; done
[ -S "$SOCK" ] || { cat forkrun.log; exit 1; }

RUNNER="python3 tools/reliability/forkrun.py run $SOCK -- -x -q --tb=no -p no:cacheprovider $TESTS"
# The runner's exit status must be that of the plain command on the unmutated copy.
python3 tools/reliability/forkrun.py run "$SOCK" -- -x -q --tb=no -p no:cacheprovider $TESTS \
    || { echo "baseline failed"; exit 1; }
"$MUTMUT" run --paths-to-mutate "$MUTATE" --runner "$RUNNER" \
    --tests-dir test/registered/unit/mem_cache --simple-output --no-progress || true
"$MUTMUT" results
