"""What the API server said when, as this process saw it: a watch in a thread that keeps
every version of the objects it follows with the wall-clock time it arrived.

The controllers' own timestamps (conditions' ``lastTransitionTime``) have one-second
resolution; durations between one controller's act and our world are measured here
instead, on one clock, as a watcher in the cluster would see them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes.client
from kubernetes import watch

from devkit.waiting import wait_for

Seen = tuple[float, str, dict[str, Any]]
"""(arrival wall time, event type, object)"""


class Timeline:
    """Every watch event of one list call (``list_method(*args, **kwargs)``), kept."""

    def __init__(self, list_method: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._list = list_method
        self._args = args
        self._kwargs = kwargs
        self._seen: list[Seen] = []
        self._lock = threading.Condition()
        self._stopped = threading.Event()
        self._watch = watch.Watch()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        version = "0"  # replays the current objects first
        while not self._stopped.is_set():
            try:
                for event in self._watch.stream(
                    self._list, *self._args, resource_version=version, timeout_seconds=30,
                    **self._kwargs,
                ):  # fmt: skip
                    obj = event["raw_object"]
                    version = obj["metadata"]["resourceVersion"]
                    with self._lock:
                        self._seen.append((time.time(), event["type"], obj))
                        self._lock.notify_all()
            except Exception:  # a 410 or a reconnect: go on from the start again
                version = "0"
                if self._stopped.wait(0.2):
                    return

    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def first(self, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> Seen:
        """The first event whose object satisfies ``predicate`` (waiting for it)."""

        def found() -> Seen | None:
            return next((seen for seen in self.seen() if predicate(seen[2])), None)

        return wait_for(found, timeout, what, interval=0.05, max_interval=0.25)

    def stop(self) -> None:
        self._stopped.set()
        self._watch.stop()
        self._thread.join(10)


def custom(
    api: kubernetes.client.ApiClient, group: str, version: str, namespace: str, plural: str
) -> Timeline:
    """A timeline of one kind of custom object in ``namespace``."""
    objects = kubernetes.client.CustomObjectsApi(api)
    return Timeline(objects.list_namespaced_custom_object, group, version, namespace, plural)


def pods(api: kubernetes.client.ApiClient, namespace: str, selector: str = "") -> Timeline:
    core = kubernetes.client.CoreV1Api(api)
    return Timeline(core.list_namespaced_pod, namespace, label_selector=selector)
