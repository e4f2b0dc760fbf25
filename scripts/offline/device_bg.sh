#!/usr/bin/env bash
# Run one long GPU job across several commands, where each command on the GPU host has a time limit (10
# minutes) but the host stays up between them: a process detached with setsid outlives the command.
# From the repo root:
#   bash scripts/offline/device_bg.sh start NAME CMD...   # copies the repo to $HOME/bg/NAME/repo, starts CMD
#                                                         # there with setsid (OUT=$HOME/bg/NAME/out), returns
#   bash scripts/offline/device_bg.sh wait NAME SECONDS   # waits until the job ends or SECONDS pass, prints the
#                                                         # log's tail, puts the log and a tarball of the job's
#                                                         # OUT (what it has so far) into this command's $OUT
# The copy keeps the job's imports stable while later commands re-sync the working tree. Exit status of `wait`:
# the job's when it ended, 99 while it still runs (call `wait` again before the host's idle timeout).
set -o pipefail
cmd=${1:?usage: device_bg.sh start NAME CMD... | wait NAME SECONDS}; name=${2:?job name}; shift 2
dir=$HOME/bg/$name
case "$cmd" in
  start)
    rm -rf "$dir"; mkdir -p "$dir/out"
    tar --exclude=./.git --exclude=./.stage --exclude=./.venv --exclude=__pycache__ -cf - . | (mkdir -p "$dir/repo" && tar -xf - -C "$dir/repo")
    # the whole subshell writes to the log (not to this call's stdout, which the caller may be waiting on)
    (cd "$dir/repo" && OUT=$dir/out exec setsid bash -c '"$@"; echo $? > '"$dir/rc" bash "$@") \
        > "$dir/log" 2>&1 < /dev/null &
    sleep 2; echo "[bg $name] started: $*"; tail -n 5 "$dir/log" ;;
  wait)
    limit=${1:?seconds}; t0=$(date +%s)
    while [ ! -f "$dir/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 2; done
    # two files back (a command may return only a few): the job's log and its $OUT as one tarball
    mkdir -p "${OUT:-/tmp/out}"; cp "$dir/log" "${OUT:-/tmp/out}/bg_$name.log"
    tar czf "${OUT:-/tmp/out}/bg_${name}_out.tgz" -C "$dir/out" .
    if [ -f "$dir/rc" ]; then
      echo "[bg $name] ended, exit $(cat "$dir/rc")"; cat "$dir/log" | tail -n 60; exit "$(cat "$dir/rc")"
    fi
    echo "[bg $name] still running after $limit s more"; tail -n 15 "$dir/log"; exit 99 ;;
  *) echo "unknown subcommand: $cmd (start | wait)"; exit 2 ;;
esac
