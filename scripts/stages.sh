# Sourced by scripts/test.sh and scripts/flashinfer_matrix.sh: runs named stages side by side.
#   stage NAME COMMAND [ARGS...]   queue a stage (a command or a shell function)
#   run_stages                     run them, at most CASCADE_JOBS at a time (default: the CPU
#                                  count, at most 4), in the order queued; returns 1 if any failed
# Every stage runs, whatever the others do. Each stage's output goes to a log of its own, printed
# whole when the stage ends (so the lines of two stages never interleave), with its exit status
# and wall time; a table of every stage's time closes the run. Stages inherit the environment,
# with OMP_NUM_THREADS defaulting to the CPUs per running stage (torch's threads would otherwise
# spin against each other's).
_stage_names=() _stage_cmds=()

stage() {
  _stage_names+=("$1")
  shift
  _stage_cmds+=("$(printf '%q ' "$@")")
}

run_stages() {
  local cpus jobs logs i=0 running=0 pid rc idx
  cpus=$(nproc)
  jobs=${CASCADE_JOBS:-$(( cpus < 4 ? cpus : 4 ))}
  logs=$(mktemp -d)
  local -A index_of=()
  local -a took=() status=()
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus / jobs > 0 ? cpus / jobs : 1 ))}
  local start=$SECONDS
  trap 'kill $(jobs -p) 2>/dev/null' EXIT
  while (( i < ${#_stage_names[@]} || running > 0 )); do
    while (( i < ${#_stage_names[@]} && running < jobs )); do
      echo "[stage] start: ${_stage_names[$i]}"
      took[$i]=$SECONDS
      eval "${_stage_cmds[$i]}" > "$logs/$i.log" 2>&1 < /dev/null &
      index_of[$!]=$i
      i=$(( i + 1 )) running=$(( running + 1 ))
    done
    rc=0
    wait -n -p pid || rc=$?
    running=$(( running - 1 ))
    idx=${index_of[$pid]}
    took[$idx]=$(( SECONDS - took[idx] ))
    status[$idx]=$rc
    echo "[stage] ===== ${_stage_names[$idx]} ====="
    cat "$logs/$idx.log"
    echo "[stage] ===== ${_stage_names[$idx]}: $( ((rc == 0)) && echo passed || echo "FAILED (exit status $rc)"), ${took[$idx]} s ====="
  done
  trap - EXIT
  rm -rf "$logs"
  echo "[stage] stage times (wall, $jobs at a time, OMP_NUM_THREADS=$OMP_NUM_THREADS):"
  local failed=0
  for i in "${!_stage_names[@]}"; do
    printf '[stage]   %5s s  %-7s %s\n' "${took[$i]}" \
      "$( ((status[i] == 0)) && echo passed || echo FAILED)" "${_stage_names[$i]}"
    (( status[i] == 0 )) || failed=1
  done
  echo "[stage] all stages: $(( SECONDS - start )) s"
  _stage_names=() _stage_cmds=()
  return "$failed"
}

pytest_run() {  # python, then pytest args: pytest's exit status; 5 (no test collected) fails too
  local python=$1 rc=0
  shift
  "$python" -m pytest "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "[test] pytest collected no tests: that is a failure" >&2
  fi
  return "$rc"
}
