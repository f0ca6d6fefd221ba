# A tree fan-out copy job, one host's (k31_model_fanout=tree, k31_image_fanout=tree; run as `sh -c` by the roles'
# tree.yml, nothing is installed on the host):
#   SSH_COMMAND SOURCE AFTER VERIFY TIMEOUT STATE_FILE [SRC DEST MANIFEST STAMP]...
# SOURCE is the source host's address ('' copies locally: the seed's own copy). AFTER lists (space-separated) the
# addresses of the hosts to wait for first, in one SSH session each, until their STATE_FILE is written: the source
# where it is staged in this run (its state must say ok: its copy verified), and the host the source served
# before this one (the source's link is then free). Then each SRC is rsynced to DEST as rsync takes them (`DIR/`
# for a directory's contents, a plain path for one file; --partial: an interrupted copy resumes) and checked:
# VERIFY=sha256 runs `sha256sum --check MANIFEST` in DEST (SRC/) or DEST's directory (one file) and records
# the manifest's hash in STAMP; size compares sizes with the source. STATE_FILE says `ok` only after every check
# passed, else `failed: why`.
set -u
ssh_command=$1 source=$2 after=$3 verify=$4 limit=$5 state=$6
shift 6
fail() {
  echo "failed: $*" > "$state"
  echo "$*" >&2
  exit 1
}
mkdir -p "$(dirname "$state")" || fail "cannot write $(dirname "$state")"
for host in $after; do
  # shellcheck disable=SC2086  # the SSH command's words, as rsync -e splits them
  got=$(timeout "$limit" $ssh_command "$host" \
        "while [ ! -s '$state' ]; do sleep 0.5; done; cat '$state'") || fail "no answer from $host, staged before it"
  if [ "$host" = "$source" ] && [ "$got" != ok ]; then
    fail "its source $source has no verified copy ($got)"
  fi
done
while [ $# -ge 4 ]; do
  src=$1 dest=$2 manifest=$3 stamp=$4
  shift 4
  # a directory item (SRC/) is checked in DEST, one file in DEST's directory; rsync would put a file into a directory
  # that stands where it goes, so that is refused
  case $src in
    */) where=$dest ;;
    *) [ ! -d "$dest" ] || fail "$dest is a directory, where the file $src goes; remove it"
       where=$(dirname "$dest") ;;
  esac
  if [ -n "$source" ]; then
    from="$source:$src"
    rsync -ai --partial --mkpath -e "$ssh_command" "$from" "$dest" || fail "rsync from $from failed"
  else
    from=$src
    rsync -ai --partial --mkpath "$from" "$dest" || fail "rsync from $from failed"
  fi
  case $verify in
    sha256)
      (cd "$where" && sha256sum --quiet --check "$manifest") || fail "$dest does not match $manifest"
      mkdir -p "$(dirname "$stamp")" && sha256sum < "$manifest" > "$stamp" || fail "cannot write $stamp"
      ;;
    size)
      if [ -n "$source" ]; then
        differ=$(rsync -ain --size-only -e "$ssh_command" "$from" "$dest" | grep -E '^[<>ch.]f')
      else
        differ=$(rsync -ain --size-only "$from" "$dest" | grep -E '^[<>ch.]f')
      fi
      [ -z "$differ" ] || fail "$dest differs in size from $from: $differ"
      ;;
  esac
done
echo ok > "$state"
