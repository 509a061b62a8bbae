# Sourced by union_matrix.sh and nested_matrix.sh (call B of union_stash.sh): merges the parts of
# dataset v2 named by PARTS into runs/$UNION, each from data/ in this call's tree or from
# runs/stash/ (union_stash.sh). Expects T0 and OUT; returns non-zero when a part is missing or the
# merge fails.
# PARTS: the dataset parts to join (default parts 1-3; "h200_v2 h200_v2_tp h200_v2_link" with part 4,
# then UNION=h200_v2_all), each from data/ in this call's tree or from runs/stash/ (union_stash.sh)
PARTS=${PARTS:-h200_v2 h200_v2_tp}
UNION=${UNION:-h200_v2_whole}
parts=()
for p in $PARTS; do
  # a part is a folder with its datasheet: a tracked part moved out of the tree leaves an empty
  # folder behind on the warm machine, which must not hide the stashed copy
  if [ -f "data/$p/datasheet.json" ]; then parts+=("data/$p"); elif [ -f "runs/stash/$p/datasheet.json" ]; then parts+=("runs/stash/$p"); fi
done
want=$(echo $PARTS | wc -w)
if [ ${#parts[@]} -ne "$want" ]; then echo "need the parts $PARTS (found: ${parts[*]}); run union_stash.sh first" >&2; return 2; fi
python3 -m teller.cli dataset merge "${parts[@]}" -o runs/$UNION --force > "$OUT/merge.log" 2>&1 || { tail -5 "$OUT/merge.log"; return 3; }
echo "merged after $(( $(date +%s) - T0 )) s"
