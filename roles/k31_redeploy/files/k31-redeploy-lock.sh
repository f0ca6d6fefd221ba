#!/bin/sh
# k31 redeploy's lock (k31deploy/oncall/recover.py says why): take | renew | release, atomically under flock.
# take writes K31_LOCK_NEW only if the lock still reads K31_LOCK_EXPECT (what the controller judged free or
# stale); renew and release act only on a lock whose record carries this run's K31_LOCK_ID.
set -eu
lock=${K31_LOCK_FILE:-/run/k31/redeploy.lock}
mkdir -p "$(dirname "$lock")"
exec 9>"$lock.flock"
flock -w 10 9
current=$(cat "$lock" 2>/dev/null || true)
case "$1" in
  take)
    if [ "$current" != "${K31_LOCK_EXPECT:-}" ]; then
      echo "another run took the redeploy lock meanwhile: $current"
      exit 3
    fi ;;
  renew|release)
    case "$current" in
      *"\"id\": \"$K31_LOCK_ID\""*) ;;
      *) echo "the redeploy lock is no longer this run's: ${current:-none}"; exit 3 ;;
    esac ;;
  *) echo "usage: $0 take|renew|release"; exit 2 ;;
esac
if [ "$1" = release ]; then
  rm -f "$lock"
else
  printf '%s\n' "$K31_LOCK_NEW" > "$lock.tmp"
  mv "$lock.tmp" "$lock"
fi
