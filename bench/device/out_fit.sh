# Sourced by env.sh (and tests/test_bench.py): kx_out_fit, run as a device script exits.
# The GPU machine returns at most 8 files of $OUT: past that, the results go into one
# archive (results.tar), the tables (*.md) beside it while they fit, device.log apart.
kx_out_fit() {
    [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -le 8 ] && return 0
    local keep='device\.log' list
    [ "$(find "$OUT" -maxdepth 1 -type f -name '*.md' | wc -l)" -le 6 ] && keep="$keep|.*\.md"
    list=$(mktemp)
    (cd "$OUT" && find . -maxdepth 1 -type f -printf '%f\n' | grep -vxE "$keep" > "$list" \
        && tar -cf results.tar -T "$list" && xargs rm -f < "$list" \
        && echo "$(wc -l < "$list") files in \$OUT/results.tar")
    rm -f "$list"
}
