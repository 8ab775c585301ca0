"""A Prometheus server of its own for a test: the distribution's package, unpacked into the
cache by ``hack/tools.sh prometheus`` (never installed), listening on 127.0.0.1, its
storage in a directory the caller owns, stopped by PID."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from devkit import paths, processes
from devkit.waiting import wait_for

SCRAPE_INTERVAL = "1s"
"""Short enough that a job of a few seconds leaves several samples of every change."""


def binary(tool: str = "prometheus") -> Path:
    """The prometheus (or promtool) binary, fetched and unpacked by hack/tools.sh the first
    time."""
    found = subprocess.run(
        [str(paths.REPO / "hack" / "tools.sh"), tool],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(found.stdout.strip())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def has_data(result: Sequence[Mapping[str, Any]]) -> bool:
    """Whether an instant query's answer holds a series with a number (a quantile of no
    observations answers NaN: a series, but nothing a panel can draw)."""
    return any(math.isfinite(float(series["value"][1])) for series in result)


class Prometheus:
    """``prometheus`` scraping ``targets`` (job name -> host:port list) every
    :data:`SCRAPE_INTERVAL` and evaluating the rules of ``rules`` (a rule file's content:
    ``groups``) as often; a context manager that starts and stops it."""

    def __init__(
        self,
        binary: Path,
        directory: Path,
        targets: Mapping[str, Sequence[str]],
        rules: Mapping[str, Any] | None = None,
    ) -> None:
        self.binary = binary
        self.directory = directory
        self.targets = targets
        self.rules = rules
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": list(addresses)}]}
                for job, addresses in self.targets.items()
            ],
        }
        if self.rules is not None:
            rule_file = self.directory / "rules.yml"
            rule_file.write_text(json.dumps(self.rules))
            config["rule_files"] = [str(rule_file)]
        config_file = self.directory / "prometheus.yml"
        config_file.write_text(json.dumps(config))  # JSON is YAML
        self.port = _free_port()
        with (self.directory / "prometheus.log").open("ab") as log:
            self._process = subprocess.Popen(
                [
                    str(self.binary),
                    f"--config.file={config_file}",
                    f"--storage.tsdb.path={self.directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self._ready, 30, f"prometheus ready at {self.url} (log: {self.log_tail()})")

    def _ready(self) -> bool:
        assert self._process is not None
        if self._process.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def stop(self, timeout: float = 15) -> None:
        processes.terminate(self._process, timeout)

    def __enter__(self) -> Prometheus:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        return processes.log_tail(self.directory / "prometheus.log", lines)

    def _get(self, path: str, **params: str | Sequence[str]) -> Any:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=10) as answer:
            body = json.load(answer)
        if body.get("status") != "success":
            raise AssertionError(f"prometheus refused {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's series (``/api/v1/query``, evaluated now)."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] != "vector":
            raise AssertionError(f"{expr}: a {data['resultType']}, not a vector")
        return list(data["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        """A range query's series (``/api/v1/query_range``), as a panel draws them."""
        data = self._get(
            "/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(step)
        )
        return list(data["result"])

    def firing(self) -> set[str]:
        """The names of the alerts firing now."""
        return {
            alert["labels"]["alertname"]
            for alert in self._get("/api/v1/alerts")["alerts"]
            if alert["state"] == "firing"
        }

    def label_values(self, label: str, match: str) -> list[str]:
        """The values of ``label`` on the series ``match`` selects (Grafana's
        ``label_values(match, label)``)."""
        return list(self._get(f"/api/v1/label/{label}/values", **{"match[]": [match]}))
