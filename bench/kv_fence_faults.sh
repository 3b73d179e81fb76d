#!/usr/bin/env bash
# The KV-fence fault tests at the issue's full counts (issue 14): 200 abort-mid-transfer rounds,
# 200 more with notifications dropped / delayed, 1,000 cancellations at random stages, the
# checksum and killed-connection cases. Prints one "[kv-fence] ..." line per measurement.
# CI runs the same tests with few rounds. About 10-15 minutes on 2 cores; run it under
# /work/bin/heavy (it loads two engines and a router in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
PDSERVE_FAULT_ROUNDS=full exec "${PYTHON:-python}" -m pytest tests/test_kv_fence.py -q -s -p no:cacheprovider "$@"
