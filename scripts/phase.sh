# `phase NAME CMD...`: runs CMD and adds its seconds to
# target/test-times/phases.tsv (scripts/test.sh prints the table). Sourced
# by scripts/test.sh and scripts/python_tests.sh from the repository root.
# Returns CMD's status (a failing phase still has its seconds recorded).
mkdir -p target/test-times
phase() {
  local name=$1 t0=$SECONDS rc=0
  shift
  "$@" || rc=$?
  printf '%s\t%s\n' "$((SECONDS - t0))" "$name" >> target/test-times/phases.tsv
  return $rc
}
