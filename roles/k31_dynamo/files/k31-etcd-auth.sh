#!/bin/sh
# Turn on etcd's authentication for Dynamo: users root and $1 (role $1: read/write on every key), then
# `auth enable`. The two passwords come on stdin, one a line (never in argv). Run while auth is off.
set -eu
user=$1
IFS= read -r root_pw
IFS= read -r user_pw
export ETCDCTL_API=3
printf '%s\n%s\n' "$root_pw" "$root_pw" | etcdctl user add root >/dev/null 2>&1
printf '%s\n%s\n' "$user_pw" "$user_pw" | etcdctl user add "$user" >/dev/null 2>&1
etcdctl role add "$user" >/dev/null
etcdctl role grant-permission "$user" --prefix=true readwrite "" >/dev/null
etcdctl user grant-role "$user" "$user" >/dev/null
etcdctl user grant-role root root >/dev/null
etcdctl auth enable
