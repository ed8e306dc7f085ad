# Sourced by the GPU round scripts: `step NAME LIMIT COMMAND...` runs the command under a time limit, keeps its output
# in $OUT/NAME.log and prints its exit code, the seconds since the script began, and its last lines (TAIL, default
# 14) without XLA's warnings.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
t0=$(date +%s)
step() {
  local name=$1 limit=$2; shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "## $name rc=$? t=$(( $(date +%s) - t0 )) s"
  grep -viE '^W[0-9]{4} |warn' "$OUT/$name.log" | grep -v '^\s*$' | tail -"${TAIL:-14}"
}
