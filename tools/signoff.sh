#!/bin/sh
# commit-msg hook (as upstream's): add a DCO Signed-off-by line for the committer if missing.
msg="$1"
sob="Signed-off-by: $(git config user.name) <$(git config user.email)>"
grep -qs "^$sob" "$msg" || printf '\n%s\n' "$sob" >> "$msg"
