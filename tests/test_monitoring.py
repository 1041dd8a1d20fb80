"""Prometheus metrics of a run (fedind.server.monitoring) and the code version in the audit trail."""

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedind.config import ConfigError, RunConfig
from fedind.server.monitoring import RunMonitor, code_version
from fedind.server.results import RoundRow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {
        sample.name + ("" if not sample.labels else str(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def row(n: int, sites: int = 3, failures: int = 0) -> RoundRow:
    return RoundRow(round=n, accuracy=0.5 + n / 10, loss=1.0 / n, uplink_bytes=1000 * n, downlink_bytes=2000,
                    sites=sites, failures=failures, seconds=2.5)


def test_metrics_port_zero_is_off_and_every_call_is_a_no_op():
    monitor = RunMonitor.start(RunConfig(), "run", 3)
    assert not monitor.active and monitor.port is None
    monitor.record_round(row(1))
    monitor.finish()
    monitor.close()


def test_round_metrics_are_served_and_the_port_is_freed_on_close():
    port = free_port()
    monitor = RunMonitor.start(RunConfig(metrics_port=port, num_server_rounds=5), "dwa-test", 3)
    try:
        monitor.record_round(row(1))
        monitor.record_round(row(2, sites=2, failures=1))
        values = scrape(port)
        assert values["fedind_rounds_planned"] == 5 and values["fedind_sites_expected"] == 3
        assert values["fedind_rounds_completed_total"] == 2 and values["fedind_round"] == 2
        assert values["fedind_global_accuracy"] == pytest.approx(0.7)
        assert values["fedind_round_sites"] == 2 and values["fedind_round_failed_sites"] == 1
        assert values["fedind_site_updates_total"] == 5 and values["fedind_site_failures_total"] == 1
        assert values["fedind_uplink_bytes_total"] == 3000 and values["fedind_downlink_bytes_total"] == 4000
        assert values["fedind_round_duration_seconds_count"] == 2
        assert values["fedind_round_duration_seconds_sum"] == pytest.approx(5.0)
        assert values["fedind_run_finished"] == 0
        info = [k for k in values if k.startswith("fedind_run_info")]
        assert len(info) == 1 and "dwa-test" in info[0] and code_version()["source_sha256"] in info[0]
        assert values["process_resident_memory_bytes"] > 0
        monitor.finish()
        assert scrape(port)["fedind_run_finished"] == 1
    finally:
        monitor.close()
    again = RunMonitor.start(RunConfig(metrics_port=port), "next", 3)  # a later run on the same port
    again.close()


def test_a_busy_port_fails_at_start_naming_the_key():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ConfigError, match="metrics-port"):
            RunMonitor.start(RunConfig(metrics_port=busy.getsockname()[1]), "run", 3)


@pytest.mark.parametrize("key, value", [("metrics-port", -1), ("metrics-port", 70000), ("metrics-address", " ")])
def test_invalid_metrics_settings_fail_at_start(key, value):
    with pytest.raises(ConfigError, match=key):
        RunConfig.from_flower({key: value})


def test_code_version_names_package_git_and_source_digest():
    version = code_version()
    assert version["fedind"] and len(version["source_sha256"]) == 64
    assert version["git"] is None or isinstance(version["git"], str)
    assert code_version() == version  # deterministic
