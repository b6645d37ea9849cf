#!/usr/bin/env bash
# Debian's `prometheus` package (Prometheus + promtool) for the ops tests (tests/ops/test_ops_*.py),
# where apt is available and we are root; elsewhere those tests skip and say why. Only the
# binaries are wanted: the package's own daemon is stopped and disabled (the tests start their
# own Prometheus on a free loopback port).
set -euo pipefail
if ! command -v apt-get >/dev/null || [ "$(id -u)" != 0 ]; then
    command -v promtool >/dev/null ||
        echo "install_prometheus: no apt-get or not root; skipping (the Prometheus tests skip)" >&2
    exit 0
fi
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
apt-get update -qq
# policy-rc.d exit 101: the package's maintainer scripts may not start its service
policy=/usr/sbin/policy-rc.d
had_policy=0
[ -e "$policy" ] && had_policy=1
if [ "$had_policy" = 0 ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy"
fi
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus
if [ "$had_policy" = 0 ]; then rm -f "$policy"; fi
fi
# In case a service manager started it anyway: stop and disable it.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    systemctl disable --now prometheus >/dev/null 2>&1 || true
elif [ -x /etc/init.d/prometheus ]; then
    /etc/init.d/prometheus stop >/dev/null 2>&1 || true
    update-rc.d prometheus disable >/dev/null 2>&1 || true
fi
