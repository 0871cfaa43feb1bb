#!/usr/bin/env bash
# Set up, then run the main job: the passkey demo on the bundled model and text.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
sparda demo --method "${METHOD:-sparse}" "$@"
