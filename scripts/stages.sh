# Sourced by scripts/test.sh: times each stage of the test command and reports them at the
# end, with the slowest test binaries of the main run (from cargo's "Running" and "finished
# in" lines), so a slow CI says where its time went. The caller removes the two logs.
stages_log="$(mktemp)"
tests_log="$(mktemp)"

# stage NAME COMMAND...: runs COMMAND, noting its wall time under NAME; its exit status.
stage() {
    local name="$1" t0=$SECONDS rc=0
    shift
    "$@" || rc=$?
    echo "$((SECONDS - t0)) s  $name" >>"$stages_log"
    return "$rc"
}

# stage_tests NAME COMMAND...: as stage, keeping the output to find the slowest binaries.
stage_tests() {
    local name="$1" t0=$SECONDS rc=0
    shift
    "$@" 2>&1 | tee "$tests_log" || rc=$?
    echo "$((SECONDS - t0)) s  $name" >>"$stages_log"
    return "$rc"
}

stages_report() {
    echo "== time by stage"
    cat "$stages_log"
    echo "== slowest test binaries (seconds running)"
    awk '/^ *Running /{bin=$2} /^test result:/{for(i=1;i<=NF;i++) if($i=="in"){t=$(i+1); sub("s$","",t); print t, bin}}' \
        "$tests_log" | sort -rn | head -10
}
