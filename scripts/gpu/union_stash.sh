#!/bin/bash
# Dataset v2's parts together on the GPU machine, past its 64 MiB working tree (issue 14): the
# parts are sent in two device calls on the same warm machine, which keeps the checkout's ignored
# runs/ folder between calls. Call A (tree with data/h200_v2, without data/h200_v2_tp):
#   bash scripts/gpu/union_stash.sh
# copies the part to runs/stash/; call B, sent at once after it (the machine is given back when
# idle for a short while), has data/h200_v2_tp and not data/h200_v2, and runs
#   bash scripts/gpu/union_matrix.sh [DEADLINE_S] [JOB...]
# which merges the two into runs/h200_v2_whole and trains and scores the models on the union.
# With part 4 (data/h200_v2_link, 8 MiB) stashed too or in call B's tree, `PARTS="h200_v2
# h200_v2_tp h200_v2_link" UNION=h200_v2_all bash scripts/gpu/union_matrix.sh` joins all four.
set -e
mkdir -p runs/stash
for p in data/h200_v2 data/h200_v2_tp data/h200_v2_link; do
  # only a whole part (its datasheet there): the empty folder a part left on the warm machine
  # when it was moved out of the tree must not replace a stashed copy
  if [ -f "$p/datasheet.json" ]; then rm -rf "runs/stash/$(basename $p)"; cp -r "$p" runs/stash/; echo "stashed $p"; fi
done
du -sh runs/stash/* 2>/dev/null
