#!/usr/bin/env bash
# On the GPU machine, from the root of the carried work tree:
#   bash tests/gpu/run_tree.sh COMMIT STEP...          (or a copy of it carried beside the tree)
# The tree to test travels as DIR/tree.tgz (DIR: TREE_DIR, default .dev/head), made here with
#   git archive --format=tar.gz -o .dev/head/tree.tgz COMMIT
# It is unpacked into /tmp/w once per commit (later runs of the same commit reuse it, with the
# results of the runs before), COURSE_COMMIT is set, and tests/gpu/h200_session.sh runs the steps
# there; OUT and DEADLINE pass through.
set -u
commit=${1:?usage: run_tree.sh COMMIT STEP...}; shift
dir=${TREE_DIR:-.dev/head}
if [ "$(cat /tmp/w/.commit 2>/dev/null)" != "$commit" ]; then
  rm -rf /tmp/w && mkdir -p /tmp/w && tar xzf "$dir/tree.tgz" -C /tmp/w \
    && echo "$commit" > /tmp/w/.commit || { echo "no tree at $dir/tree.tgz"; exit 1; }
fi
cd /tmp/w
export COURSE_COMMIT=$commit
bash tests/gpu/h200_session.sh "$@"
