#!/usr/bin/env bash
# Replace dashboard/static/plotly-cartesian.min.js by the cartesian partial bundle of the plotly.js
# version that the venv's plotly Python package bundles (from the npm registry).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
V=$("$PY" -c 'from plotly.offline import get_plotlyjs_version as v; print(v())')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "plotly.js-cartesian-dist-min@$V" >/dev/null && tar xzf ./*.tgz)
cp "$tmp/package/plotly-cartesian.min.js" dashboard/static/plotly-cartesian.min.js
cp "$tmp/package/LICENSE" dashboard/static/plotly-LICENSE.txt
echo "dashboard/static/plotly-cartesian.min.js is now plotly.js $V (cartesian)"
